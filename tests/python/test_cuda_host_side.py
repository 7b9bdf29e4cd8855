"""The host side of hsbn.torch's CUDA path, checked without a GPU: what it hands torch's CUDA
kernels, how it refuses CUDA graph capture, and what torch.compile sees. The kernels themselves
run only on a GPU (test_cuda.py, bench/kernels/run_gpu_checks.sh)."""

import importlib

import numpy as np
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
    import hsbn.torch
    path = hsbn.torch.custom_ops_in_use()
    if path:
        # (the forward dynamo traces through to the ops: always with HSBN_TORCH_CUSTOM_OPS=1,
        # where traced by default from torch 2.4; the function path they fall back to is the
        # opaque one checked below)
        assert SyncBatchNorm.forward is (SyncBatchNorm._forward_selecting if path is True
                                         else SyncBatchNorm._forward_traced)
    # torch's disable marks what it wraps; without dynamo forward is the plain function.
    assert getattr(SyncBatchNorm._forward_function, "_torchdynamo_disable",
                   False) == has_dynamo
    assert has_dynamo or SyncBatchNorm._forward_function.__qualname__ == "SyncBatchNorm.forward"


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


def test_a_forward_rounds_result_becomes_what_the_device_needs_computed_on_the_host():
    """forward_rows: mean and invstd in the op set's statistics dtype, and the running
    statistics' blend values (factor * value, or the values for momentum=None), from the
    round's float64 result, on the host."""
    from hsbn.torch import _function
    mean = np.array([1.5, -2.0, 0.25])
    m2 = np.array([8.0, 0.0, 3.5])
    total, eps = 9, 1e-3
    rows = _function.forward_rows(torch.float32, eps, True, 0.1)(total, mean, m2)
    assert [r.dtype for r in rows] == [np.float32, np.float32, np.float64, np.float64]
    assert rows[0].tolist() == mean.astype(np.float32).tolist()
    assert rows[1].tolist() == (1.0 / np.sqrt(m2 / total + eps)).astype(np.float32).tolist()
    assert rows[2].tolist() == (mean * 0.1).tolist()
    assert rows[3].tolist() == (m2 / (total - 1) * 0.1).tolist()
    cumulative = _function.forward_rows(torch.float64, eps, True, torch.tensor(4))(total, mean, m2)
    assert [r.tolist() for r in cumulative[2:]] == [mean.tolist(), (m2 / 8).tolist()]
    assert len(_function.forward_rows(torch.float64, eps, False, 0.1)(total, mean, m2)) == 2
    assert _function.forward_rows(torch.float64, eps, True, 0.1)(1, mean, m2) == []


def test_the_running_update_blends_in_float64_as_torch_batchnorm_does():
    from hsbn.torch import _function
    running = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float32)
    value = np.array([0.5, 4.0, 1.0])
    want = (running.double() * 0.9 + torch.from_numpy(value) * 0.1).float()
    _function._update_running(running, torch.from_numpy(value * 0.1), 0.1)
    assert torch.equal(running, want)
    tracked = torch.tensor(4)  # momentum=None: factor 1/4, taken on the tensor's device
    running = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64)
    _function._update_running(running, torch.from_numpy(value), tracked)
    assert running.tolist() == [0.875, 2.5, -2.0]


def test_rows_of_both_dtypes_pack_into_one_buffer_and_come_back_bitwise():
    """The one upload after a round: the rows at 8-byte offsets of one buffer (here a CPU
    tensor stands in for the device copy), viewed back with their dtypes."""
    from hsbn.torch import _function
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(3).astype(np.float32), rng.standard_normal(3),
            rng.standard_normal(5).astype(np.float32), rng.standard_normal(3)]
    size, offsets = _function._layout(rows)
    assert offsets == [0, 16, 40, 64] and size == 88
    h = np.zeros(size, dtype=np.uint8)
    _function._fill(h, offsets, rows)
    back = _function._views(torch.from_numpy(h), offsets, rows)
    assert [t.dtype for t in back] == [torch.float32, torch.float64, torch.float32, torch.float64]
    assert all(np.array_equal(t.numpy(), r) for t, r in zip(back, rows))


def test_zero_variance_without_eps_gives_an_infinite_invstd_without_a_warning():
    import warnings
    from hsbn.torch import _function
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = _function.forward_rows(torch.float64, 0.0, False, 0.1)(
            4, np.array([1.0, np.nan]), np.array([0.0, np.nan]))
    assert rows[1][0] == np.inf and np.isnan(rows[1][1])


def test_torch_compile_runs_the_layer_eagerly_and_compiles_the_rest_once():
    """Where torch has torch.compile (2.x): a compiled model with an hsbn layer on its function
    path (the autograd.Function, opaque to dynamo: the default before torch 2.4, and with
    HSBN_TORCH_CUSTOM_OPS=0 or use_custom_ops(False)) computes what the eager model computes, and
    its per-call Python state (samples_seen here) causes no recompilation: whatever is compiled
    is compiled at the first call only. Under torch 2.6 that is nothing for an nn.Sequential:
    the layer's graph break inside Sequential.forward makes dynamo skip the whole frame
    (docs/PYTORCH.md; the custom ops, the default from torch 2.4, trace it whole:
    test_compile.py)."""
    import hsbn.torch
    if not hasattr(torch, "compile"):
        pytest.skip("torch %s has no torch.compile" % torch.__version__)
    before = hsbn.torch.custom_ops_in_use()
    if before:
        hsbn.torch.use_custom_ops(False)
    try:
        _compile_with_the_function_path()
    finally:
        if before:
            hsbn.torch.use_custom_ops(before)


def _compile_with_the_function_path():
    import copy
    import hsbn.torch
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1),
                                hsbn.torch.SyncBatchNorm(4, scope="local", name="compiled.bn"),
                                torch.nn.ReLU()).train()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    after_first = None
    for step in range(4):
        x = torch.randn(2, 3, 5, 5)
        assert torch.equal(compiled(x), eager(x)), step
        if after_first is None:
            after_first = len(graphs)
    assert len(graphs) == after_first, (after_first, len(graphs))
    assert model[1].samples_seen == eager[1].samples_seen == 4 * 2 * 25
    assert torch.equal(model[1].running_mean, eager[1].running_mean)
