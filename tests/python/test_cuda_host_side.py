"""The host side of hsbn.torch's CUDA path, checked without a GPU: what it hands torch's CUDA
kernels, how it refuses CUDA graph capture, and what torch.compile sees. The kernels themselves
run only on a GPU (test_cuda.py, bench/kernels/run_gpu_checks.sh)."""

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
