"""The per-worker BatchNorm arithmetic of hsbn.torch, one backend per device kind.

A backend computes, for input x of shape (N, C, *):
  local_moments(x, eps)          -> (count, mean[C], m2[C]) as float64 numpy arrays
  normalize(x, mean, var, w, b, eps) -> (y, saved): y = (x - mean) / sqrt(var + eps) * w + b,
                                      with mean and var the (reduced) float64 statistics
  backward_reduce(dy, x, saved, w, need_w, need_b) -> (sum_dy[C], sum_dy_xmu[C] as float64 numpy,
                                      grad_w, grad_b) over this worker's batch only
  backward_elemt(dy, x, saved, w, sum_dy, sum_dy_xmu, count) -> dx, from the scope's sums

Backends:
  KernelOps  hsbn's own kernels (kernels/include/hsbn/bn_kernels_c.h, exported by libhsbn.so
             when built in): float64 statistics; on CUDA tensors they run on the current stream.
             Used for CUDA tensors whenever the library has them and sees a GPU.
  CudaOps    the fallback for CUDA tensors: torch's SyncBatchNorm kernels
             (torch.batch_norm_stats / _elemt / _backward_reduce / _backward_elemt) on the
             current stream, statistics in float32 (float64 for float64 input).
  CpuOps     CPU tensors: float64 arithmetic with plain torch ops (any input dtype). The
             environment variable HSBN_TORCH_CPU_OPS=kernels (or set_cpu_ops("kernels"))
             selects hsbn's CPU kernels instead; HSBN_TORCH_CUDA_OPS=torch|kernels (or
             set_cuda_ops) forces a CUDA backend.
Outputs keep the input's dtype and memory format (channels-last stays channels-last).
"""

import contextlib
import ctypes
import os

import numpy as np
import torch

from .. import _lib


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


_BN_DTYPES = {torch.float16: _lib.BN_F16, torch.bfloat16: _lib.BN_BF16,
              torch.float32: _lib.BN_F32, torch.float64: _lib.BN_F64}


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class KernelOps:
    """hsbn's BatchNorm kernels through their C ABI, on CPU or CUDA tensors."""

    def __init__(self, device_code):
        self.device_code = device_code
        self.name = "hsbn-kernels-" + ("cuda" if device_code == _lib.BN_CUDA else "cpu")

    def _k(self):
        k = _lib.bn_kernels()
        if k is None:
            raise RuntimeError("%s does not export the hsbn_bn_ kernels" % _lib.library_path())
        return k

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError("hsbn kernel %s failed (code %d): %s" % (
                what, rc, self._k().hsbn_bn_last_error().decode("utf-8", "replace")))

    @staticmethod
    def _layout(x):
        """x in a layout the kernels take, and the (format, layout code, n, c, s) describing it."""
        n, c = x.shape[0], x.shape[1]
        s = 1
        for d in x.shape[2:]:
            s *= d
        if not x.is_contiguous():
            if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
                return x, (torch.channels_last, _lib.BN_CHANNELS_LAST, n, c, s)
            if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
                return x, (torch.channels_last_3d, _lib.BN_CHANNELS_LAST, n, c, s)
            x = x.contiguous()
        return x, (torch.contiguous_format, _lib.BN_NCHW, n, c, s)

    def _args(self, x, desc):
        if x.dtype not in _BN_DTYPES:
            raise TypeError("hsbn kernels take float16, bfloat16, float32 or float64, not %s"
                            % x.dtype)
        _, layout, n, c, s = desc
        return (self.device_code, _BN_DTYPES[x.dtype], layout, n, c, s)

    def _stream(self, x):
        if self.device_code == _lib.BN_CUDA:
            return ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        return None

    def _on(self, x):
        if self.device_code == _lib.BN_CUDA:
            return torch.cuda.device(x.device)
        return contextlib.nullcontext()

    def _workspace(self, x, args):
        size = ctypes.c_size_t()
        self._check(self._k().hsbn_bn_workspace_size(*args, ctypes.byref(size)),
                    "workspace_size")
        if size.value == 0:
            return None, 0
        return torch.empty(size.value, dtype=torch.uint8, device=x.device), size.value

    def _f64(self, a, x):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(x.device)

    def local_moments(self, x, eps):
        c = x.shape[1]
        if x.numel() == 0:
            return 0, np.zeros(c), np.zeros(c)
        x, desc = self._layout(x.detach())
        args = self._args(x, desc)
        mean = torch.empty(c, dtype=torch.float64, device=x.device)
        m2 = torch.empty(c, dtype=torch.float64, device=x.device)
        count = ctypes.c_int64()
        with self._on(x):
            ws, ws_bytes = self._workspace(x, args)
            self._check(self._k().hsbn_bn_moments(*args, _ptr(x), ctypes.byref(count), _ptr(mean),
                                                  _ptr(m2), _ptr(ws), ws_bytes, self._stream(x)),
                        "moments")
            return count.value, _np64(mean), _np64(m2)

    def normalize(self, x, mean, var, weight, bias, eps):
        mean_t = self._f64(mean, x)
        invstd_t = self._f64(1.0 / np.sqrt(np.asarray(var, dtype=np.float64) + eps), x)
        saved = (mean_t, invstd_t)
        if x.numel() == 0:
            return torch.empty_like(x), saved
        x, desc = self._layout(x.detach())
        y = torch.empty_like(x)
        w = None if weight is None else weight.detach().contiguous()
        b = None if bias is None else bias.detach().contiguous()
        pdt = _BN_DTYPES[w.dtype] if w is not None else _lib.BN_F32
        with self._on(x):
            self._check(self._k().hsbn_bn_normalize(
                *self._args(x, desc), _ptr(x), _ptr(y), _ptr(mean_t), _ptr(invstd_t),
                _lib.BN_F64, _lib.BN_INVSTD, 0.0, 0, _ptr(w), _ptr(b), pdt, 0, self._stream(x)),
                "normalize")
        return y, saved

    def backward_reduce(self, dy, x, saved, weight, need_w, need_b):
        mean_t, invstd_t = saved
        c = x.shape[1]
        gdt = weight.dtype if weight is not None else torch.float32
        grad_w = torch.zeros(c, dtype=gdt, device=x.device) if need_w else None
        grad_b = torch.zeros(c, dtype=gdt, device=x.device) if need_b else None
        if x.numel() == 0:
            return np.zeros(c), np.zeros(c), grad_w, grad_b
        x, desc = self._layout(x)
        dy = dy.contiguous(memory_format=desc[0])
        args = self._args(x, desc)
        sum_dy = torch.empty(c, dtype=torch.float64, device=x.device)
        sum_dy_xmu = torch.empty(c, dtype=torch.float64, device=x.device)
        with self._on(x):
            ws, ws_bytes = self._workspace(x, args)
            self._check(self._k().hsbn_bn_backward_reduce(
                *args, _ptr(dy), _ptr(x), _ptr(mean_t), _ptr(invstd_t), _lib.BN_F64,
                _lib.BN_INVSTD, 0.0, 0, _ptr(sum_dy), _ptr(sum_dy_xmu), _ptr(grad_w),
                _ptr(grad_b), _BN_DTYPES[gdt], _ptr(ws), ws_bytes, self._stream(x)),
                "backward_reduce")
            return _np64(sum_dy), _np64(sum_dy_xmu), grad_w, grad_b

    def backward_elemt(self, dy, x, saved, weight, sum_dy, sum_dy_xmu, count):
        mean_t, invstd_t = saved
        if x.numel() == 0:
            return torch.empty_like(x)
        x, desc = self._layout(x)
        dy = dy.contiguous(memory_format=desc[0])
        dx = torch.empty_like(x)
        w = None if weight is None else weight.detach().contiguous()
        pdt = _BN_DTYPES[w.dtype] if w is not None else _lib.BN_F32
        sum_dy_t, sum_dy_xmu_t = self._f64(sum_dy, x), self._f64(sum_dy_xmu, x)
        with self._on(x):
            self._check(self._k().hsbn_bn_backward_elemt(
                *self._args(x, desc), _ptr(dy), _ptr(x), _ptr(mean_t), _ptr(invstd_t),
                _lib.BN_F64, _lib.BN_INVSTD, 0.0, 0, _ptr(w), pdt, _ptr(sum_dy_t),
                _ptr(sum_dy_xmu_t), int(count), _ptr(dx), self._stream(x)), "backward_elemt")
        return dx


_CPU = CpuOps()
_CUDA = CudaOps()
_KERNELS_CPU = KernelOps(_lib.BN_CPU)
_KERNELS_CUDA = KernelOps(_lib.BN_CUDA)
_cpu_choice = os.environ.get("HSBN_TORCH_CPU_OPS", "torch")
_cuda_choice = os.environ.get("HSBN_TORCH_CUDA_OPS", "auto")
_cuda_kernels = None  # "auto": decided at the first CUDA tensor


def set_cpu_ops(which):
    """Selects the CPU backend: "torch" (float64 torch ops, the default) or "kernels"."""
    global _cpu_choice
    if which not in ("torch", "kernels"):
        raise ValueError("set_cpu_ops takes 'torch' or 'kernels', not %r" % (which,))
    _cpu_choice = which


def set_cuda_ops(which):
    """Selects the CUDA backend: "auto" (hsbn's kernels when libhsbn.so has them and sees a
    GPU, else torch's; the default), "kernels" or "torch"."""
    global _cuda_choice
    if which not in ("auto", "torch", "kernels"):
        raise ValueError("set_cuda_ops takes 'auto', 'torch' or 'kernels', not %r" % (which,))
    _cuda_choice = which


def ops_for(x):
    """The backend for a tensor's device."""
    global _cuda_kernels
    if x.device.type == "cpu":
        if _cpu_choice == "kernels":
            if _lib.bn_kernels() is None:
                raise RuntimeError("HSBN_TORCH_CPU_OPS=kernels, but %s does not export the "
                                   "hsbn_bn_ kernels" % _lib.library_path())
            return _KERNELS_CPU
        return _CPU
    if x.device.type == "cuda":
        if _cuda_choice == "torch":
            return _CUDA
        if _cuda_choice == "kernels":
            k = _lib.bn_kernels()
            if k is None or not k.hsbn_bn_cuda_available():
                raise RuntimeError("HSBN_TORCH_CUDA_OPS=kernels, but %s has no usable CUDA "
                                   "kernels (built without CUDA, or no GPU visible)"
                                   % _lib.library_path())
            return _KERNELS_CUDA
        if _cuda_kernels is None:
            k = _lib.bn_kernels()
            _cuda_kernels = bool(k is not None and k.hsbn_bn_cuda_available())
        return _KERNELS_CUDA if _cuda_kernels else _CUDA
    raise NotImplementedError("hsbn.torch.SyncBatchNorm supports CPU and CUDA tensors, not %s"
                              % x.device.type)
