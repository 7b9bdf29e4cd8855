"""The per-worker BatchNorm arithmetic of hsbn.torch, one backend per device kind.

A backend computes, for input x of shape (N, C, *):
  local_moments(x, eps)          -> (count, mean[C], m2[C]) as float64 numpy arrays
  normalize(x, mean, var, w, b, eps) -> (y, saved): y = (x - mean) / sqrt(var + eps) * w + b,
                                      with mean and var the (reduced) float64 statistics
  backward_reduce(dy, x, saved, w, need_w, need_b) -> (sum_dy[C], sum_dy_xmu[C] as float64 numpy,
                                      grad_w, grad_b) over this worker's batch only
  backward_elemt(dy, x, saved, w, sum_dy, sum_dy_xmu, count) -> dx, from the scope's sums

CpuOps works in float64 with plain torch ops (any input dtype, any memory format). CudaOps
uses torch's SyncBatchNorm kernels (torch.batch_norm_stats / _elemt / _backward_reduce /
_backward_elemt) on the current stream, with statistics in float32 (float64 for float64 input).
Outputs keep the input's dtype and memory format (channels-last stays channels-last).
"""

import numpy as np
import torch


def _reduce_dims(x):
    return [0] + list(range(2, x.dim()))


def _bcast(v, x):
    """A per-channel vector shaped to broadcast against x: (1, C, 1, ...)."""
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


def _like(x, y):
    """y with x's dtype and exactly x's memory layout."""
    out = torch.empty_like(x)  # preserve_format: same strides as x
    out.copy_(y)
    return out


def _np64(t):
    return t.detach().to(device="cpu", dtype=torch.float64).numpy().copy()


class CpuOps:
    """float64 reference arithmetic for CPU tensors."""

    name = "cpu-float64"

    def local_moments(self, x, eps):
        c = x.shape[1]
        count = x.numel() // c if c else 0
        if count == 0:
            return 0, np.zeros(c), np.zeros(c)
        xd = x.detach().to(torch.float64)
        dims = _reduce_dims(x)
        mean = xd.mean(dims)
        # Two passes: m2 = sum((x - mean)^2), no E[x^2] - E[x]^2 cancellation.
        m2 = (xd - _bcast(mean, xd)).pow_(2).sum(dims)
        return count, mean.numpy().copy(), m2.numpy().copy()

    def normalize(self, x, mean, var, weight, bias, eps):
        mean_t = torch.from_numpy(np.asarray(mean, dtype=np.float64))
        invstd_t = torch.from_numpy(1.0 / np.sqrt(np.asarray(var, dtype=np.float64) + eps))
        saved = (mean_t, invstd_t)
        if x.numel() == 0:
            return torch.empty_like(x), saved
        scale = invstd_t if weight is None else invstd_t * weight.detach().to(torch.float64)
        xd = x.detach().to(torch.float64)
        y = (xd - _bcast(mean_t, xd)) * _bcast(scale, xd)
        if bias is not None:
            y += _bcast(bias.detach().to(torch.float64), xd)
        return _like(x, y), saved

    def backward_reduce(self, dy, x, saved, weight, need_w, need_b):
        mean_t, invstd_t = saved
        c = x.shape[1]
        if x.numel() == 0:
            sum_dy = torch.zeros(c, dtype=torch.float64)
            sum_dy_xmu = torch.zeros(c, dtype=torch.float64)
        else:
            dims = _reduce_dims(x)
            dyd = dy.to(torch.float64)
            xd = x.to(torch.float64)
            sum_dy = dyd.sum(dims)
            sum_dy_xmu = (dyd * (xd - _bcast(mean_t, xd))).sum(dims)
        grad_w = grad_b = None
        if need_w:
            grad_w = (sum_dy_xmu * invstd_t).to(weight.dtype)
        if need_b:
            grad_b = sum_dy.to(weight.dtype if weight is not None else dy.dtype)
        return sum_dy.numpy().copy(), sum_dy_xmu.numpy().copy(), grad_w, grad_b

    def backward_elemt(self, dy, x, saved, weight, sum_dy, sum_dy_xmu, count):
        mean_t, invstd_t = saved
        if x.numel() == 0:
            return torch.empty_like(x)
        mean_dy = torch.from_numpy(np.asarray(sum_dy) / count)
        mean_dy_xmu = torch.from_numpy(np.asarray(sum_dy_xmu) / count)
        scale = invstd_t if weight is None else invstd_t * weight.detach().to(torch.float64)
        dyd = dy.to(torch.float64)
        xd = x.to(torch.float64)
        xmu = xd - _bcast(mean_t, xd)
        dx = (dyd - _bcast(mean_dy, xd) - xmu * _bcast(invstd_t * invstd_t * mean_dy_xmu, xd))
        dx *= _bcast(scale, xd)
        return _like(x, dx)


class CudaOps:
    """torch's CUDA SyncBatchNorm kernels, on the current stream."""

    name = "cuda-torch"

    @staticmethod
    def _stat_dtype(x):
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    @staticmethod
    def _memory_format(x):
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
        return torch.contiguous_format

    def _param(self, p, x):
        return None if p is None else p.detach().to(self._stat_dtype(x))

    def local_moments(self, x, eps):
        c = x.shape[1]
        count = x.numel() // c if c else 0
        if count == 0:
            return 0, np.zeros(c), np.zeros(c)
        x = x.detach().contiguous(memory_format=self._memory_format(x))
        # batch_norm_stats returns the biased variance as invstd = 1/sqrt(var + eps); undo it in
        # float64. With eps > 0 there is no division by zero; the absolute error it leaves on
        # var is far below eps, which normalization adds back.
        mean, invstd = torch.batch_norm_stats(x, eps)
        mean = _np64(mean)
        var = np.maximum(1.0 / np.square(_np64(invstd)) - eps, 0.0)
        return count, mean, var * count

    def normalize(self, x, mean, var, weight, bias, eps):
        sd = self._stat_dtype(x)
        invstd = 1.0 / np.sqrt(np.asarray(var, dtype=np.float64) + eps)
        mean_t = torch.from_numpy(np.asarray(mean, dtype=np.float64)).to(x.device, sd)
        invstd_t = torch.from_numpy(invstd).to(x.device, sd)
        saved = (mean_t, invstd_t)
        if x.numel() == 0:
            return torch.empty_like(x), saved
        fmt = self._memory_format(x)
        x = x.contiguous(memory_format=fmt)
        y = torch.batch_norm_elemt(x, self._param(weight, x), self._param(bias, x), mean_t,
                                   invstd_t, eps)
        return y.contiguous(memory_format=fmt), saved

    def backward_reduce(self, dy, x, saved, weight, need_w, need_b):
        mean_t, invstd_t = saved
        c = x.shape[1]
        if x.numel() == 0:
            z = np.zeros(c)
            sd = self._stat_dtype(x)
            gw = torch.zeros(c, device=x.device, dtype=weight.dtype) if need_w else None
            gb = (torch.zeros(c, device=x.device, dtype=weight.dtype if weight is not None
                              else sd) if need_b else None)
            return z, z.copy(), gw, gb
        fmt = self._memory_format(x)
        x = x.contiguous(memory_format=fmt)
        dy = dy.contiguous(memory_format=fmt)
        sum_dy, sum_dy_xmu, gw, gb = torch.batch_norm_backward_reduce(
            dy, x, mean_t, invstd_t, self._param(weight, x), True, bool(need_w), bool(need_b))
        if gw is not None and weight is not None:
            gw = gw.to(weight.dtype)
        if gb is not None and weight is not None:
            gb = gb.to(weight.dtype)
        return _np64(sum_dy), _np64(sum_dy_xmu), (gw if need_w else None), \
            (gb if need_b else None)

    def backward_elemt(self, dy, x, saved, weight, sum_dy, sum_dy_xmu, count):
        mean_t, invstd_t = saved
        if x.numel() == 0:
            return torch.empty_like(x)
        sd = self._stat_dtype(x)
        fmt = self._memory_format(x)
        x = x.contiguous(memory_format=fmt)
        dy = dy.contiguous(memory_format=fmt)
        sum_dy_t = torch.from_numpy(np.asarray(sum_dy, dtype=np.float64)).to(x.device, sd)
        sum_dy_xmu_t = torch.from_numpy(np.asarray(sum_dy_xmu, dtype=np.float64)).to(x.device, sd)
        # The kernel divides by the sum of this tensor: one entry holding the scope's count.
        count_t = torch.tensor([count], dtype=torch.int32, device=x.device)
        dx = torch.batch_norm_backward_elemt(dy, x, mean_t, invstd_t, self._param(weight, x),
                                             sum_dy_t, sum_dy_xmu_t, count_t)
        return dx.contiguous(memory_format=fmt)


_CPU = CpuOps()
_CUDA = CudaOps()


def ops_for(x):
    """The backend for a tensor's device."""
    if x.device.type == "cpu":
        return _CPU
    if x.device.type == "cuda":
        return _CUDA
    raise NotImplementedError("hsbn.torch.SyncBatchNorm supports CPU and CUDA tensors, not %s"
                              % x.device.type)
