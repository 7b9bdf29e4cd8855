"""hsbn.torch: synchronized BatchNorm through hsbn's aggregators, as a drop-in for
torch.nn.SyncBatchNorm.

    import hsbn.torch
    model = hsbn.torch.convert_sync_batchnorm(model, scope="global")
    ...
    model = hsbn.torch.revert_sync_batchnorm(model)   # back to torch.nn.BatchNorm*d
    hsbn.torch.stats(model).total.blocked_seconds   # time spent blocked in rounds
    hsbn.torch.sync_running_stats(model, "global")  # pool running statistics over the job
    hsbn.torch.precise_bn(model, batches)           # recompute them over batches of every rank
    print(hsbn.torch.diagnose(model, batches))      # is a multi-GPU gap BatchNorm's fault?

Works with any PyTorch that has torch.batch_norm_stats (1.13 and 2.x), on CPU and CUDA tensors;
it binds hsbn's C ABI only, never PyTorch's C++ ABI.
"""

from ._keys import SCOPES, next_op, op_for_name
from ._layer_check import LayerMismatchError
from .modules import SyncBatchNorm, use_custom_ops, custom_ops_in_use, custom_ops_on_cuda
from ._convert import convert_sync_batchnorm, revert_sync_batchnorm
from ._inspect import model_client, stats, divergence, scopes, auto_decisions
from ._function import SyncBatchNormFunction, SyncStats, sync_stats, reset_sync_stats
from ._renorm import RenormFunction, RecomputeError
from ._lagged import LaggedFunction
from ._population import sync_running_stats, precise_bn
from ._diagnose import diagnose
from . import _ops


def set_cuda_ops(which, module=None):
    """Which arithmetic synchronized layers use on CUDA tensors: "torch" (PyTorch's own
    SyncBatchNorm kernels) or "kernels" (hsbn's CUDA kernels). Unset, each GPU gets hsbn's
    kernels where they passed the GPU device check (compute capability 9.0) and torch's
    elsewhere (docs/KERNELS.md). With `module`, sets it for every hsbn SyncBatchNorm in
    `module` (None there returns them to the process's choice); without, for the process
    (None returns to HSBN_TORCH_CUDA_OPS, or the default)."""
    if module is None:
        _ops.set_cuda_ops(which)
        return
    if which is not None:
        _ops._check_choice(which, "set_cuda_ops")
    for m in module.modules():
        if isinstance(m, SyncBatchNorm):
            m.cuda_ops = which


def cuda_ops():
    """("torch" or "kernels", why) for CUDA tensors on the current device of layers without
    their own choice."""
    return _ops.cuda_ops_choice()


__all__ = ["SyncBatchNorm", "use_custom_ops", "custom_ops_in_use", "custom_ops_on_cuda", "convert_sync_batchnorm", "revert_sync_batchnorm",
           "LayerMismatchError", "SyncBatchNormFunction", "SCOPES", "next_op", "op_for_name",
           "model_client", "stats", "divergence", "scopes", "auto_decisions", "set_cuda_ops", "cuda_ops", "SyncStats", "sync_stats",
           "reset_sync_stats", "sync_running_stats", "precise_bn", "diagnose", "RenormFunction",
           "RecomputeError"]
