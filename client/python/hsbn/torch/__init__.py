"""hsbn.torch: synchronized BatchNorm through hsbn's aggregators, as a drop-in for
torch.nn.SyncBatchNorm.

    import hsbn.torch
    model = hsbn.torch.convert_sync_batchnorm(model, scope="global")
    ...
    model = hsbn.torch.revert_sync_batchnorm(model)   # back to torch.nn.BatchNorm*d
    hsbn.torch.stats(model).total.blocked_seconds   # time spent blocked in rounds

Works with any PyTorch that has torch.batch_norm_stats (1.13 and 2.x), on CPU and CUDA tensors;
it binds hsbn's C ABI only, never PyTorch's C++ ABI.
"""

from .modules import (SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm,
                      LayerMismatchError, next_op, op_for_name, model_client, stats, SCOPES)
from ._function import SyncBatchNormFunction

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm",
           "LayerMismatchError", "SyncBatchNormFunction", "SCOPES", "next_op", "op_for_name",
           "model_client", "stats"]
