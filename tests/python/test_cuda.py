"""CUDA tensors: both CUDA backends (hsbn's kernels through their C ABI, torch's SyncBatchNorm
kernels) against torch.nn.BatchNorm*d on the concatenated batch, with the in-process rounds of
test_autograd_math. Needs a CUDA GPU; on a machine without one these tests are reported as
skipped, with that reason.

The ranks are threads of this process on one GPU, each with autograd's multithreading off: by
default PyTorch runs every CUDA backward node of a device on one shared autograd thread, where
the first rank's backward round would wait for ranks queued behind it (docs/PYTORCH.md)."""


import pytest
import torch

import hsbn
from bnref import assert_group_matches, make_spec
from hsbn.torch import _ops
from test_autograd_math import run_threads as _run_threads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_threads(spec, data):
    """test_autograd_math.run_threads with each rank's backward on its own thread."""
    no_multithreading = getattr(torch.autograd, "set_multithreading_enabled", None)
    if no_multithreading is None:
        pytest.fail("torch %s has no torch.autograd.set_multithreading_enabled (2.0+): ranks "
                    "as threads of one process cannot run CUDA backward rounds"
                    % torch.__version__)
    return _run_threads(spec, data, per_thread=lambda: no_multithreading(False))  # thread-local


@pytest.fixture(params=["torch", "kernels"])
def cuda_ops(request):
    if request.param == "kernels":
        k = hsbn._lib.bn_kernels()
        if k is None or not k.hsbn_bn_cuda_available():
            pytest.skip("%s was built without hsbn's CUDA kernels" % hsbn.library_path())
    _ops.set_cuda_ops(request.param)
    yield request.param
    _ops.set_cuda_ops(None)


@pytest.mark.parametrize("spatial,channels_last", [((4, 5), False), ((4, 5), True), ((7,), False),
                                                   ((2, 3, 2), True)])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_cuda_layer_equals_batchnorm_over_the_concatenated_batch(cuda_ops, spatial,
                                                                 channels_last, dtype, tol):
    spec, data = make_spec("global", dtype, spatial=spatial, channels_last=channels_last,
                           seed=21, device="cuda")
    results = run_threads(spec, data)
    assert_group_matches(results, spec, data, [[0, 1, 2, 3]], tol)
    if channels_last:
        assert all(r["channels_last"] == [(True, True)] * 2
                   for r, n in zip(results, (3, 5, 0, 2)) if n)


def test_cuda_half_input_keeps_its_dtype_and_float32_statistics(cuda_ops):
    spec, data = make_spec("global", "float16", seed=22, steps=1, param_dtype="float32",
                           device="cuda")
    results = run_threads(spec, data)
    ref_spec = dict(spec, dtype="float64", param_dtype="float64")
    rounded = [[(torch.from_numpy(x).half().double().numpy(),
                 torch.from_numpy(g).half().double().numpy()) for x, g in steps]
               for steps in data]
    assert_group_matches(results, ref_spec, rounded, [[0, 1, 2, 3]], 3e-3)
    assert all(r["y_dtype"] == "torch.float16" and r["running_dtype"] == "torch.float32"
               for r in results)
