"""The host side of hsbn.torch's CUDA path, checked without a GPU: what it hands torch's CUDA
kernels, how it refuses CUDA graph capture, and what torch.compile sees. The kernels themselves
run only on a GPU (test_cuda.py, bench/kernels/run_gpu_checks.sh)."""

import importlib

import pytest
import torch

from hsbn.torch import _ops

INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("count,entries", [
    (37, [37]),
    (INT32_MAX, [INT32_MAX]),
    (2**31, [INT32_MAX, 1]),
    (2 * INT32_MAX, [INT32_MAX, INT32_MAX]),
    (1024 * 2 * 128**3, [INT32_MAX, INT32_MAX, 2]),  # 1024 ranks of 2 x 128^3 volumes
])
def test_a_count_becomes_int32_entries_that_sum_to_it(count, entries):
    assert _ops.count_entries(count) == entries


def test_a_count_past_int32_is_an_int32_tensor_whose_int64_sum_is_the_count():
    count = 3 * 2**31 + 12345
    t = _ops.count_tensor(count, torch.device("cpu"))
    assert t.dtype == torch.int32
    assert t.tolist() == [INT32_MAX] * 3 + [count - 3 * INT32_MAX]
    assert int(t.sum(dtype=torch.int64)) == count


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="count -1 is negative"):
        _ops.count_entries(-1)


def test_torchs_backward_gets_the_scope_count_split_over_int32_entries(monkeypatch):
    """CudaOps.backward_elemt with a scope count past 2^31: torch's kernel (replaced here by a
    recorder, it needs a GPU) gets an int32 vector whose int64 sum is that count."""
    seen = {}

    def recorder(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        seen["count"] = count
        return dy.clone()
    monkeypatch.setattr(torch, "batch_norm_backward_elemt", recorder)
    x = torch.randn(2, 3, 4)
    saved = (torch.zeros(3), torch.ones(3))
    sums = torch.zeros(2, 3, dtype=torch.float64)
    total = 2**31 + 7
    _ops.CudaOps().backward_elemt(x.clone(), x, saved, None, sums, total)
    assert seen["count"].dtype == torch.int32
    assert seen["count"].tolist() == [INT32_MAX, 8]
    assert int(seen["count"].sum(dtype=torch.int64)) == total


def _layer(scope="global"):
    import hsbn.torch
    return hsbn.torch.SyncBatchNorm(3, scope=scope, name="encoder.bn1")


def test_capture_of_a_training_layer_is_refused_before_any_state_changes(monkeypatch):
    """A training-mode layer whose round needs the host, under CUDA graph capture (reported by
    a stand-in: capture needs a GPU): a clear error naming the layer and what to do, raised
    before the layer counts the call (every rank keeps the same round numbers)."""
    from hsbn.torch import modules
    monkeypatch.setattr(modules, "capturing", lambda x: True)
    layer = _layer().train()
    with pytest.raises(RuntimeError) as e:
        layer(torch.randn(4, 3, 2))
    text = str(e.value)
    assert "layer 'encoder.bn1' (scope 'global') cannot be captured in a CUDA graph" in text
    assert "make_graphed_callables" in text and "eval mode or with scope='local'" in text
    assert (layer._seq, layer.samples_seen, int(layer.num_batches_tracked)) == (0, 0, 0)
    assert torch.equal(layer.running_mean, torch.zeros(3))


@pytest.mark.parametrize("mode", ["eval", "local"])
def test_eval_mode_and_local_scope_need_no_round_and_run_under_capture(monkeypatch, mode):
    from hsbn.torch import modules
    monkeypatch.setattr(modules, "capturing", lambda x: True)
    layer = _layer("local" if mode == "local" else "global")
    layer.train(mode == "local")
    ref = torch.nn.BatchNorm1d(3).train(mode == "local")
    x = torch.randn(4, 3, 2)
    assert torch.equal(layer(x), ref(x))
    assert torch.equal(layer.running_mean, ref.running_mean)


def test_a_round_under_capture_is_refused_before_it_reaches_the_client(monkeypatch):
    from hsbn.torch import _function
    monkeypatch.setattr(_function, "capturing", lambda x: True)
    calls = []
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        _function.exchange(lambda *a: calls.append(a), 7, 0, "node", 8,
                           torch.zeros(2, 3, dtype=torch.float64))
    assert calls == []


def test_capturing_is_false_for_cpu_tensors():
    from hsbn.torch import _function
    assert _function.capturing(torch.zeros(1)) is False


class _Namespace:
    pass


def test_opaque_to_dynamo_uses_torch_compiler_disable_where_torch_has_it(monkeypatch):
    from hsbn.torch import _function
    fake = _Namespace()
    fake.disable = lambda fn: ("disabled", fn)
    monkeypatch.setattr(torch, "compiler", fake, raising=False)
    assert _function.opaque_to_dynamo(len) == ("disabled", len)


def test_opaque_to_dynamo_is_the_function_itself_on_a_torch_without_dynamo(monkeypatch):
    import sys
    from hsbn.torch import _function
    monkeypatch.setattr(torch, "compiler", _Namespace(), raising=False)
    monkeypatch.setitem(sys.modules, "torch._dynamo", None)  # import fails
    assert _function.opaque_to_dynamo(len) is len


def test_the_layer_forward_is_opaque_to_dynamo_where_torch_has_dynamo():
    from hsbn.torch import SyncBatchNorm
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        try:
            importlib.import_module("torch._dynamo")
            has_dynamo = True
        except ImportError:
            has_dynamo = False
    else:
        has_dynamo = True
    # torch's disable marks what it wraps; without dynamo forward is the plain function.
    assert getattr(SyncBatchNorm.forward, "_torchdynamo_disable", False) == has_dynamo
    assert has_dynamo or SyncBatchNorm.forward.__qualname__ == "SyncBatchNorm.forward"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_precise_bn_accumulates_batch_moments_exactly_as_one_batch(dtype, tol):
    """precise_bn's accumulator (now fed by the op set's local_moments, not float64 copies of
    the inputs) gives the mean and sum of squared deviations of all batches together."""
    from hsbn.torch import SyncBatchNorm
    from hsbn.torch._population import _Moments
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(n, 3, 4, 5, generator=g, dtype=torch.float64) * (1 + i) + 3 * i
               for i, n in enumerate((2, 5, 1, 3))]
    layer = SyncBatchNorm(3, scope="local")
    acc = _Moments()
    for i, b in enumerate(batches):
        x = b.to(dtype)
        acc.add(layer, x.contiguous(memory_format=torch.channels_last) if i % 2 else x)
    v = torch.cat([b.to(dtype).double() for b in batches]).transpose(0, 1).reshape(3, -1)
    assert acc.n == v.shape[1]
    mean = v.mean(1)
    m2 = (v - mean[:, None]).pow(2).sum(1)
    assert acc.mean.dtype == acc.m2.dtype == torch.float64
    assert torch.allclose(acc.mean, mean, rtol=tol, atol=tol)
    assert torch.allclose(acc.m2, m2, rtol=tol, atol=0)
