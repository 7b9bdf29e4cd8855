"""The per-worker BatchNorm arithmetic of hsbn.torch, one backend per device kind.

Every statistic stays on the input's device, as float64 tensors; only a round's packed payload
crosses to the host (see _function.py). A backend computes, for input x of shape (N, C, *):
  stat_dtype(x)          -> the dtype of the statistics normalize and backward take
  local_moments(x, eps)  -> (count, packed): count an int (N * prod(spatial), known on the
                            host), packed a (2, C) float64 tensor on x's device: mean, m2
  normalize(x, mean, invstd, w, b, eps) -> y = (x - mean) * invstd * w + b, mean and invstd
                            (C,) tensors of stat_dtype(x) on x's device; saved = (mean, invstd)
  backward_reduce(dy, x, saved, w, need_w, need_b) -> (packed, grad_w, grad_b): packed a (2, C)
                            float64 tensor on x's device: sum_dy, sum_dy_xmu over this worker's
                            batch
  backward_elemt(dy, x, saved, w, sums, count) -> dx, from the scope's sums (sum_dy, sum_dy_xmu:
                            (C,) tensors of stat_dtype(x)) and count

Backends:
  CpuOps     CPU tensors: plain torch ops in the input's dtype (float32 for float16/bfloat16),
             statistics and per-channel coefficients in float64 (float32 input: per-plane sums
             in float32, combined in float64), as torch's CPU BatchNorm does.
  CudaOps    CUDA tensors on GPUs where hsbn's kernels have not passed the GPU device check
             (CHECKED_CAPABILITIES): torch's own SyncBatchNorm kernels
             (torch.batch_norm_stats / _elemt / _backward_reduce / _backward_elemt) on the
             current stream, statistics in float32 (float64 for float64 input).
  KernelOps  hsbn's own kernels (kernels/include/hsbn/bn_kernels_c.h, exported by libhsbn.so
             when built in), float64 statistics, on the current stream. The default for CUDA
             tensors on the GPUs where they passed the device check
             (bench/kernels/run_gpu_checks.sh); HSBN_TORCH_CUDA_OPS, set_cuda_ops or
             hsbn.torch.set_cuda_ops(..., module=m) choose either op set anywhere;
             HSBN_TORCH_CPU_OPS=kernels for CPU tensors.
Outputs keep the input's dtype and memory format (channels-last stays channels-last). No
backend reads a device value on the host.
"""

import contextlib
import ctypes

import torch

from .. import _lib
from .. import env as _env
from ..errors import ConfigurationError

F64 = torch.float64


def _reduce_dims(x):
    return [0] + list(range(2, x.dim()))


def _bcast(v, x):
    """A per-channel vector shaped to broadcast against x: (1, C, 1, ...)."""
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


def _keep_layout(x, y):
    """y with exactly x's strides (torch's elementwise ops usually keep them already)."""
    if y.stride() == x.stride():
        return y
    out = torch.empty_like(x, dtype=y.dtype)  # preserve_format: same strides as x
    out.copy_(y)
    return out


def _channel_sums(t):
    """Per-channel sums of t (N, C, *) as a float64 (C,) tensor. float32 input is summed over
    each (sample, channel) plane in float32 (torch's cascade summation) and the N * C partials
    in float64: torch.sum(t, dtype=float64) on the CPU would first copy all of t to float64."""
    if t.dtype == F64:
        return t.sum(_reduce_dims(t))
    if t.dim() > 2:
        t = t.sum(list(range(2, t.dim())))
    return t.to(F64).sum(0)


def _zeros2(c, x):
    return torch.zeros(2, c, dtype=F64, device=x.device)


class CpuOps:
    """torch ops in the input's dtype on CPU tensors; float64 statistics."""

    name = "cpu-torch"

    @staticmethod
    def stat_dtype(x):
        return F64

    @staticmethod
    def _compute(t):
        """t as the dtype the arithmetic runs in: its own for float32/float64, else float32."""
        return t if t.dtype in (torch.float32, F64) else t.float()

    def local_moments(self, x, eps):
        c = x.shape[1]
        count = x.numel() // c if c else 0
        if count == 0:
            return 0, _zeros2(c, x)
        xc = self._compute(x.detach())
        out = torch.empty(2, c, dtype=F64)
        mean = _channel_sums(xc).div_(count)
        # Second pass around the mean rounded to the compute dtype (pivot p): sum((x - p)^2) =
        # m2 + count * (mean - p)^2, so m2 needs no E[x^2] - E[x]^2.
        pivot = mean.to(xc.dtype)
        s2 = _channel_sums((xc - _bcast(pivot, xc)).square_())
        shift = mean - pivot.to(F64)
        out[0] = mean
        torch.sub(s2, shift.square_().mul_(count), out=out[1])
        out[1].clamp_(min=0.0)
        return count, out

    def normalize(self, x, mean, invstd, weight, bias, eps):
        if x.numel() == 0:
            return torch.empty_like(x)
        xc = self._compute(x.detach())
        cd = xc.dtype
        scale = invstd if weight is None else invstd * weight.detach().to(F64)
        xmu = xc - _bcast(mean.to(cd), xc)
        if bias is None:
            y = xmu.mul_(_bcast(scale.to(cd), xc))
        else:
            y = torch.addcmul(_bcast(bias.detach().to(cd), xc), xmu, _bcast(scale.to(cd), xc))
        return _keep_layout(x, y.to(x.dtype))

    def backward_reduce(self, dy, x, saved, weight, need_w, need_b):
        mean, invstd = saved
        c = x.shape[1]
        packed = torch.empty(2, c, dtype=F64)
        if x.numel() == 0:
            packed.zero_()
        else:
            xc, dyc = self._compute(x), self._compute(dy)
            packed[0] = _channel_sums(dyc)
            packed[1] = _channel_sums((xc - _bcast(mean.to(xc.dtype), xc)).mul_(dyc))
        gdt = weight.dtype if weight is not None else dy.dtype
        grad_w = (packed[1] * invstd).to(gdt) if need_w else None
        grad_b = packed[0].to(gdt) if need_b else None
        return packed, grad_w, grad_b

    def backward_elemt(self, dy, x, saved, weight, sums, count):
        mean, invstd = saved
        if x.numel() == 0:
            return torch.empty_like(x)
        # dx = (dy - mean_dy - (x - mean) * invstd^2 * mean_dy_xmu) * invstd * w
        #    = dy * k + (x - mean) * g + b, with k, g, b per channel in float64 (as coeffs.h).
        k = invstd if weight is None else invstd * weight.detach().to(F64)
        g = (invstd * invstd).mul_(sums[1]).div_(count).mul_(k).neg_()
        b = (sums[0] / count).mul_(k).neg_()
        xc, dyc = self._compute(x), self._compute(dy)
        cd = xc.dtype
        dx = (xc - _bcast(mean.to(cd), xc)).mul_(_bcast(g.to(cd), xc)).add_(_bcast(b.to(cd), xc))
        dx.addcmul_(dyc, _bcast(k.to(cd), xc))
        return _keep_layout(x, dx.to(x.dtype))


INT32_MAX = (1 << 31) - 1


def count_entries(count):
    """`count` as int32 entries that sum to it: torch's batch_norm_backward_elemt takes the
    scope's count as a vector of int32 per-worker counts and sums them in int64, so a count of
    2^31 or more goes in as several entries."""
    if count < 0:
        raise ValueError("count %d is negative" % count)
    full, rest = divmod(int(count), INT32_MAX)
    return [INT32_MAX] * full + ([rest] if rest or not full else [])


def count_tensor(count, device):
    """count_entries(count) as an int32 tensor on `device`, filled there (a tensor built from a
    list would be a blocking host-to-device copy)."""
    entries = count_entries(count)
    t = torch.full((len(entries),), INT32_MAX, dtype=torch.int32, device=device)
    if entries[-1] != INT32_MAX:
        t[-1].fill_(entries[-1])
    return t


class CudaOps:
    """torch's CUDA SyncBatchNorm kernels, on the current stream."""

    name = "cuda-torch"

    @staticmethod
    def stat_dtype(x):
        return F64 if x.dtype == F64 else torch.float32

    @staticmethod
    def _memory_format(x):
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
        return torch.contiguous_format

    def _param(self, p, x):
        return None if p is None else p.detach().to(self.stat_dtype(x))

    def local_moments(self, x, eps):
        c = x.shape[1]
        count = x.numel() // c if c else 0
        if count == 0:
            return 0, _zeros2(c, x)
        x = x.detach().contiguous(memory_format=self._memory_format(x))
        # batch_norm_stats returns the biased variance as invstd = 1/sqrt(var + eps); undo it in
        # float64. With eps > 0 there is no division by zero; the absolute error it leaves on
        # var is far below eps, which normalization adds back.
        mean, invstd = torch.batch_norm_stats(x, eps)
        packed = torch.empty(2, c, dtype=F64, device=x.device)
        packed[0].copy_(mean)
        torch.mul(invstd.to(F64).pow_(-2).sub_(eps).clamp_(min=0.0), count, out=packed[1])
        return count, packed

    def normalize(self, x, mean, invstd, weight, bias, eps):
        if x.numel() == 0:
            return torch.empty_like(x)
        fmt = self._memory_format(x)
        x = x.contiguous(memory_format=fmt)
        y = torch.batch_norm_elemt(x, self._param(weight, x), self._param(bias, x), mean, invstd,
                                   eps)
        return y.contiguous(memory_format=fmt)

    def backward_reduce(self, dy, x, saved, weight, need_w, need_b):
        mean_t, invstd_t = saved
        c = x.shape[1]
        if x.numel() == 0:
            gdt = weight.dtype if weight is not None else self.stat_dtype(x)
            gw = torch.zeros(c, device=x.device, dtype=gdt) if need_w else None
            gb = torch.zeros(c, device=x.device, dtype=gdt) if need_b else None
            return _zeros2(c, x), gw, gb
        fmt = self._memory_format(x)
        x = x.contiguous(memory_format=fmt)
        dy = dy.contiguous(memory_format=fmt)
        sum_dy, sum_dy_xmu, gw, gb = torch.batch_norm_backward_reduce(
            dy, x, mean_t, invstd_t, self._param(weight, x), True, bool(need_w), bool(need_b))
        packed = torch.empty(2, c, dtype=F64, device=x.device)
        packed[0].copy_(sum_dy)
        packed[1].copy_(sum_dy_xmu)
        if gw is not None and weight is not None:
            gw = gw.to(weight.dtype)
        if gb is not None and weight is not None:
            gb = gb.to(weight.dtype)
        return packed, (gw if need_w else None), (gb if need_b else None)

    def backward_elemt(self, dy, x, saved, weight, sums, count):
        mean_t, invstd_t = saved
        if x.numel() == 0:
            return torch.empty_like(x)
        sd = self.stat_dtype(x)
        fmt = self._memory_format(x)
        x = x.contiguous(memory_format=fmt)
        dy = dy.contiguous(memory_format=fmt)
        count_t = count_tensor(count, x.device)
        dx = torch.batch_norm_backward_elemt(dy, x, mean_t, invstd_t, self._param(weight, x),
                                             sums[0].to(sd), sums[1].to(sd), count_t)
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

    @staticmethod
    def stat_dtype(x):
        return F64

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

    def local_moments(self, x, eps):
        c = x.shape[1]
        if x.numel() == 0:
            return 0, _zeros2(c, x)
        x, desc = self._layout(x.detach())
        args = self._args(x, desc)
        packed = torch.empty(2, c, dtype=F64, device=x.device)
        count = ctypes.c_int64()  # the kernels compute it on the host: N * S
        with self._on(x):
            ws, ws_bytes = self._workspace(x, args)
            self._check(self._k().hsbn_bn_moments(*args, _ptr(x), ctypes.byref(count),
                                                  _ptr(packed[0]), _ptr(packed[1]), _ptr(ws),
                                                  ws_bytes, self._stream(x)), "moments")
        return count.value, packed

    def normalize(self, x, mean, invstd, weight, bias, eps):
        mean_t = mean.contiguous()
        invstd_t = invstd.contiguous()
        if x.numel() == 0:
            return torch.empty_like(x)
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
        return y

    def backward_reduce(self, dy, x, saved, weight, need_w, need_b):
        mean_t, invstd_t = saved
        c = x.shape[1]
        gdt = weight.dtype if weight is not None else torch.float32
        grad_w = torch.zeros(c, dtype=gdt, device=x.device) if need_w else None
        grad_b = torch.zeros(c, dtype=gdt, device=x.device) if need_b else None
        if x.numel() == 0:
            return _zeros2(c, x), grad_w, grad_b
        x, desc = self._layout(x)
        dy = dy.contiguous(memory_format=desc[0])
        args = self._args(x, desc)
        packed = torch.empty(2, c, dtype=F64, device=x.device)
        with self._on(x):
            ws, ws_bytes = self._workspace(x, args)
            self._check(self._k().hsbn_bn_backward_reduce(
                *args, _ptr(dy), _ptr(x), _ptr(mean_t), _ptr(invstd_t), _lib.BN_F64,
                _lib.BN_INVSTD, 0.0, 0, _ptr(packed[0]), _ptr(packed[1]), _ptr(grad_w),
                _ptr(grad_b), _BN_DTYPES[gdt], _ptr(ws), ws_bytes, self._stream(x)),
                "backward_reduce")
        return packed, grad_w, grad_b

    def backward_elemt(self, dy, x, saved, weight, sums, count):
        mean_t, invstd_t = saved
        if x.numel() == 0:
            return torch.empty_like(x)
        x, desc = self._layout(x)
        dy = dy.contiguous(memory_format=desc[0])
        dx = torch.empty_like(x)
        w = None if weight is None else weight.detach().contiguous()
        pdt = _BN_DTYPES[w.dtype] if w is not None else _lib.BN_F32
        sum_dy, sum_dy_xmu = sums[0].contiguous(), sums[1].contiguous()
        with self._on(x):
            self._check(self._k().hsbn_bn_backward_elemt(
                *self._args(x, desc), _ptr(dy), _ptr(x), _ptr(mean_t), _ptr(invstd_t),
                _lib.BN_F64, _lib.BN_INVSTD, 0.0, 0, _ptr(w), pdt, _ptr(sum_dy),
                _ptr(sum_dy_xmu), int(count), _ptr(dx), self._stream(x)), "backward_elemt")
        return dx


_CPU = CpuOps()
_CUDA = CudaOps()
_KERNELS_CPU = KernelOps(_lib.BN_CPU)
_KERNELS_CUDA = KernelOps(_lib.BN_CUDA)

CHOICES = ("torch", "kernels")
# The GPUs (compute capability) on which hsbn's CUDA kernels passed the GPU device check
# (bench/kernels/run_gpu_checks.sh, results in bench/kernels/measured/): they are the CUDA
# default there. On any other GPU their code has not run, so torch's ops stay the default.
CHECKED_CAPABILITIES = {(9, 0): "NVIDIA H200, 2026-12-04, bench/kernels/measured/h200-2026-12-04"}
_cuda_defaults = {}  # device index -> (choice, why)


def _checked_list():
    return ", ".join("%d.%d (%s)" % (cap + (what.split(",")[0],))
                     for cap, what in sorted(CHECKED_CAPABILITIES.items()))


def cuda_default(device=None):
    """("torch" or "kernels", why): the default op set for CUDA tensors on `device` (a
    torch.device, an index, or None for the current one)."""
    if not torch.cuda.is_available():
        return "torch", ("default: no CUDA device visible (hsbn's CUDA kernels are the default on "
                         "GPUs where they passed the GPU device check: compute capability %s)"
                         % _checked_list())
    if isinstance(device, int):
        index = device
    elif device is None or device.index is None:
        index = torch.cuda.current_device()
    else:
        index = device.index
    if index in _cuda_defaults:
        return _cuda_defaults[index]
    cap = tuple(torch.cuda.get_device_capability(index))
    k = _lib.bn_kernels()
    if k is None or not k.hsbn_bn_cuda_available():
        choice = ("torch", "default: %s has no usable CUDA kernels (built without CUDA)"
                  % _lib.library_path())
    elif cap in CHECKED_CAPABILITIES:
        choice = ("kernels", "default: hsbn's CUDA kernels passed the GPU device check on compute "
                  "capability %d.%d (%s); HSBN_TORCH_CUDA_OPS=torch selects PyTorch's"
                  % (cap + (CHECKED_CAPABILITIES[cap],)))
    else:
        choice = ("torch", "default: hsbn's CUDA kernels have passed the GPU device check only on "
                  "compute capability %s, not on this GPU's %d.%d "
                  "(bench/kernels/run_gpu_checks.sh); HSBN_TORCH_CUDA_OPS=kernels selects them"
                  % ((_checked_list(),) + cap))
    _cuda_defaults[index] = choice
    return choice


_cpu_choice = None   # None: HSBN_TORCH_CPU_OPS, read at use
_cuda_choice = None  # None: HSBN_TORCH_CUDA_OPS, read at use


def _check_choice(which, what):
    if which not in CHOICES:
        raise ValueError("%s takes 'torch' or 'kernels', not %r" % (what, which))
    return which


def _env_choice(name):
    """The variable's value, parsed by the library's environment table (hsbn.env)."""
    try:
        return _env.get(name)
    except ConfigurationError as e:
        raise ConfigurationError("%s takes 'torch' or 'kernels' (%s)" % (name, e)) from None


def cpu_ops_choice():
    """("torch" or "kernels", where it came from) for CPU tensors."""
    if _cpu_choice is not None:
        return _cpu_choice, "set_cpu_ops"
    if _env.is_set("HSBN_TORCH_CPU_OPS"):
        return _env_choice("HSBN_TORCH_CPU_OPS"), "HSBN_TORCH_CPU_OPS"
    return "torch", "default"


def cuda_ops_choice(device=None):
    """("torch" or "kernels", where it came from) for CUDA tensors on `device` (None: the
    current one) of layers without their own choice."""
    if _cuda_choice is not None:
        return _cuda_choice, "set_cuda_ops"
    if _env.is_set("HSBN_TORCH_CUDA_OPS"):
        return _env_choice("HSBN_TORCH_CUDA_OPS"), "HSBN_TORCH_CUDA_OPS"
    return cuda_default(device)


def set_cpu_ops(which):
    """Selects the CPU backend of this process: "torch" (the default) or "kernels"; None
    returns to HSBN_TORCH_CPU_OPS (or the default)."""
    global _cpu_choice
    _cpu_choice = None if which is None else _check_choice(which, "set_cpu_ops")


def set_cuda_ops(which):
    """Selects the CUDA backend of this process's layers that have no choice of their own:
    "torch" or "kernels"; None returns to HSBN_TORCH_CUDA_OPS (or the default, cuda_default)."""
    global _cuda_choice
    _cuda_choice = None if which is None else _check_choice(which, "set_cuda_ops")


def ops_for(x, cuda_ops=None):
    """The backend for a tensor's device; `cuda_ops` ("torch", "kernels" or None for the
    process's choice) is a layer's own choice for CUDA tensors."""
    if x.device.type == "cpu":
        if cpu_ops_choice()[0] == "kernels":
            if _lib.bn_kernels() is None:
                raise RuntimeError("HSBN_TORCH_CPU_OPS=kernels, but %s does not export the "
                                   "hsbn_bn_ kernels" % _lib.library_path())
            return _KERNELS_CPU
        return _CPU
    if x.device.type == "cuda":
        which = cuda_ops_choice(x.device)[0] if cuda_ops is None else cuda_ops
        if which == "kernels":
            k = _lib.bn_kernels()
            if k is None or not k.hsbn_bn_cuda_available():
                raise RuntimeError("hsbn's CUDA kernels were asked for (HSBN_TORCH_CUDA_OPS or "
                                   "set_cuda_ops), but %s has none usable (built without CUDA, "
                                   "or no GPU visible)" % _lib.library_path())
            return _KERNELS_CUDA
        return _CUDA
    raise NotImplementedError("hsbn.torch.SyncBatchNorm supports CPU and CUDA tensors, not %s"
                              % x.device.type)
