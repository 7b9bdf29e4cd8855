"""The autograd function of a synchronized BatchNorm: one forward round, one backward round.

Forward: local (count, mean, m2) -> forward round -> the scope's (count, mean, m2); normalize
with them and update the running statistics from them. Backward: local (sum_dy, sum_dy_xmu)
around the scope's mean -> backward round -> the scope's sums -> input gradient. The weight and
bias gradients are this worker's share (sums over its own batch): added over the scope's
workers (which is what DDP's gradient all-reduce does, up to its 1/world_size averaging) they
are BatchNorm's gradients over the scope's batch.
"""

import torch
from torch.autograd.function import once_differentiable

from ..client import op_label
from ._ops import ops_for


class SyncBatchNormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, client, op, seq,
                scope):
        ops = ops_for(x)
        count, mean, m2 = ops.local_moments(x, eps)
        total, mean, m2 = client.forward(op, seq, scope, count, mean, m2)
        if total <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got %d in scope %r "
                "(%s, op=%d, input of size %s on this worker)"
                % (total, scope, op_label(op), op, list(x.shape)))
        var = m2 / total
        if running_mean is not None:
            # torch.nn.BatchNorm's update, with the unbiased variance of the scope's batch.
            unbiased = m2 / (total - 1)
            with torch.no_grad():
                rm = running_mean.to(torch.float64).cpu().numpy()
                rv = running_var.to(torch.float64).cpu().numpy()
                rm = (1.0 - factor) * rm + factor * mean
                rv = (1.0 - factor) * rv + factor * unbiased
                running_mean.copy_(torch.from_numpy(rm))
                running_var.copy_(torch.from_numpy(rv))
        y, saved = ops.normalize(x, mean, var, weight, bias, eps)
        ctx.save_for_backward(x, weight, *saved)
        ctx.hsbn = (client, op, seq, scope, count, total)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, *saved = ctx.saved_tensors
        client, op, seq, scope, count, total = ctx.hsbn
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ops = ops_for(x)
        sum_dy, sum_dy_xmu, grad_w, grad_b = ops.backward_reduce(dy, x, saved, weight, need_w,
                                                                 need_b)
        grad_x = None
        if need_x:
            # Every worker runs the same layers with the same requires_grad pattern, so either
            # all of them take part in this round or none does.
            _, sum_dy, sum_dy_xmu = client.backward(op, seq, scope, count, sum_dy, sum_dy_xmu)
            grad_x = ops.backward_elemt(dy, x, saved, weight, sum_dy, sum_dy_xmu, total)
        return (grad_x, grad_w, grad_b) + (None,) * 8
