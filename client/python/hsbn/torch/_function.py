"""The autograd function of a synchronized BatchNorm: one forward round, one backward round.

Forward: local (count, mean, m2) -> forward round -> the scope's (count, mean, m2); normalize
with them and update the running statistics from them. Backward: local (sum_dy, sum_dy_xmu)
around the scope's mean -> backward round -> the scope's sums -> input gradient. The weight and
bias gradients are this worker's share (sums over its own batch): added over the scope's
workers (which is what DDP's gradient all-reduce does, up to its 1/world_size averaging) they
are BatchNorm's gradients over the scope's batch.

A round crosses the host once each way (exchange()): the (2, C) float64 payload is copied into
one pinned host buffer, the host waits on an event recorded after that copy (not on the device
or the stream); from the client's result the host computes what the device needs next (after
a forward round: mean and invstd in the op set's statistics dtype and the running statistics'
blend values; after a backward round: the sums in that dtype), and it goes up in one pinned
buffer with non_blocking. Parameters and running statistics stay on the device; nothing reads
a device value on the host. sync_stats() counts the copies and waits.
"""

import dataclasses
import threading

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from ..client import op_label
from ._ops import ops_for

F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """Host<->device traffic of hsbn.torch's rounds in this process (sync_stats()).

    rounds: rounds exchanged (forward and backward).
    downloads: payload copies to the host, one per round (on CPU tensors the payload is read
      in place and still counted, so CPU tests see the same counts as a GPU run).
    uploads: result copies back to the tensor's device, one per round (the same).
    device_waits: host waits for the device: one event wait per round of a CUDA tensor, none
      for CPU tensors. hsbn.torch waits on the device nowhere else.
    Scope "renorm" (docs/PYTORCH.md, "Renorm scope"):
    renorm_calls: training forward calls of renorm layers (recomputations not included).
    renorm_global_uses: those that used global statistics (the others: warm-up, seq < lag).
    renorm_waits: those whose global statistics had not arrived when asked for
      (client.global_stats_ready was false), so the call blocked for them.
    renorm_wait_seconds: wall time spent in client.global_stats, every fetch.
    renorm_recomputes: recomputations in backward (activation checkpointing) that reused
      their first pass's r and d.
    Scope "lagged" (docs/PYTORCH.md, "Lagged scope"):
    lagged_calls: training forward calls of lagged layers (recomputations not included).
    lagged_exact: those that were exact global calls (warm-up, or sent there by the trip
      guard): they waited for their own job statistics.
    lagged_trips: times a layer's trip guard tripped (each sends it exact global for its
      lagged_trip_calls next calls; a trip while already exact only extends them).
    lagged_exact_backward: backward calls that waited for their own job sums (exact calls,
      and a first backward with no earlier one to take the other nodes' share from).
    lagged_waits: fetches of late results (statistics or sums) that had not arrived when
      asked for, so the call blocked for them.
    lagged_wait_seconds: wall time spent in client.global_stats / global_sums, every fetch.
    lagged_recomputes: recomputations in backward that reused their first pass's statistics.
    """
    rounds: int = 0
    downloads: int = 0
    uploads: int = 0
    device_waits: int = 0
    renorm_calls: int = 0
    renorm_global_uses: int = 0
    renorm_waits: int = 0
    renorm_wait_seconds: float = 0.0
    renorm_recomputes: int = 0
    lagged_calls: int = 0
    lagged_exact: int = 0
    lagged_exact_backward: int = 0
    lagged_trips: int = 0
    lagged_waits: int = 0
    lagged_wait_seconds: float = 0.0
    lagged_recomputes: int = 0

    @property
    def renorm_wait_share(self):
        """renorm_waits / renorm_calls: the share of renorm forward calls that had to wait
        for the root (0.0 without calls)."""
        return self.renorm_waits / self.renorm_calls if self.renorm_calls else 0.0


_stats_lock = threading.Lock()
_stats = {f.name: f.default for f in dataclasses.fields(SyncStats)}


def _count(**add):
    with _stats_lock:
        for k, v in add.items():
            _stats[k] += v


def sync_stats():
    """SyncStats since the process started or the last reset_sync_stats()."""
    with _stats_lock:
        return SyncStats(**_stats)


def reset_sync_stats():
    with _stats_lock:
        for f in dataclasses.fields(SyncStats):
            _stats[f.name] = f.default


def opaque_to_dynamo(fn):
    """fn, which torch.compile (dynamo) runs as it is, never traced: torch.compiler.disable
    (torch 2.1+), torch._dynamo.disable (2.0), or fn itself on a torch without dynamo."""
    compiler = getattr(torch, "compiler", None)
    disable = getattr(compiler, "disable", None)
    if disable is None:
        try:
            from torch._dynamo import disable
        except ImportError:
            return fn
    return disable(fn)


def capturing(x):
    """True when x is a CUDA tensor and its device's current stream is capturing a CUDA graph."""
    if x.device.type != "cuda":
        return False
    is_capturing = getattr(torch.cuda, "is_current_stream_capturing", None)
    if is_capturing is None:
        return False
    with torch.cuda.device(x.device):
        return bool(is_capturing())


def refuse_capture(label, scope):
    """The error of a training-mode layer whose round needs the host, met during CUDA graph
    capture (the round's event wait would invalidate the capture)."""
    return RuntimeError(
        "hsbn: %s (scope %r) cannot be captured in a CUDA graph in training mode: each forward "
        "and backward exchanges statistics through the host. Capture the parts of the model "
        "around it instead (torch.cuda.make_graphed_callables on the other submodules), or "
        "capture it in eval mode or with scope='local', which need no exchange"
        % (label, scope))


_TORCH_DTYPES = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}
_NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32}


def _layout(rows):
    """(bytes, offsets) of the 1-D arrays `rows` packed one after another at 8-byte offsets."""
    offsets, size = [], 0
    for r in rows:
        offsets.append(size)
        size += (r.nbytes + 7) // 8 * 8
    return size, offsets


def _fill(h, offsets, rows):
    """Writes `rows` into the uint8 numpy array h at `offsets`."""
    for o, r in zip(offsets, rows):
        h[o:o + r.nbytes].view(r.dtype)[:] = r


def _views(buf, offsets, rows):
    """The tensors `rows` were packed into in the uint8 tensor buf, with their dtypes."""
    return [buf[o:o + r.nbytes].view(_TORCH_DTYPES[r.dtype]) for o, r in zip(offsets, rows)]


def _upload(rows, device):
    """The 1-D host arrays `rows` (float64 or float32) as tensors on `device`, in one copy: on
    CUDA packed into one pinned buffer, copied up with non_blocking and viewed back with their
    dtypes (the caching host allocator keeps the buffer until the copy has run)."""
    if device.type != "cuda":
        return [torch.from_numpy(np.array(r)) for r in rows]  # copies: rows may be borrowed
    size, offsets = _layout(rows)
    host = torch.empty(max(size, 8), dtype=torch.uint8, pin_memory=True)
    _fill(host.numpy(), offsets, rows)
    return _views(host.to(device, non_blocking=True), offsets, rows)


def exchange(call, op, seq, scope, count, packed, finish=None):
    """Sends the (2, C) float64 payload `packed` (on any device) through `call` (client.forward
    or client.backward). finish(total, row0, row1) computes, on the host, the 1-D float64 or
    float32 arrays the caller needs from the scope's result (default: the two rows); returns
    (scope count, those arrays as tensors on packed's device). One download, one event wait
    (CUDA only), one non_blocking upload."""
    if capturing(packed):
        raise refuse_capture(op_label(op), scope)
    if packed.device.type == "cuda":
        host = torch.empty(packed.shape, dtype=F64, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(packed.device))
        done.synchronize()
        waits = 1
    else:
        host = packed if packed.is_contiguous() else packed.contiguous()
        waits = 0
    h = host.numpy()
    total, a, b = call(op, seq, scope, count, h[0], h[1])
    total = int(total)
    rows = [np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)]
    if finish is not None:
        rows = finish(total, rows[0], rows[1])
    result = _upload(rows, packed.device)
    _count(rounds=1, downloads=1, uploads=1, device_waits=waits)
    return total, result


def forward_rows(sd, eps, track, factor):
    """finish() of a forward round: [mean, invstd] in the stat dtype `sd` (what normalization
    and backward use), then, with running statistics, the values their update blends in:
    factor * mean and factor * unbiased variance, or for momentum=None (factor a tensor, read
    only on the device) the mean and unbiased variance themselves, in float64."""
    npd = _NUMPY_DTYPES[sd]

    def finish(total, mean, m2):
        if total <= 1:
            return []  # the caller raises
        with np.errstate(divide="ignore", invalid="ignore"):  # inf and NaN are data (eps=0)
            invstd = 1.0 / np.sqrt(m2 / total + eps)
        rows = [mean.astype(npd), invstd.astype(npd)]
        if track:
            unbiased = m2 / (total - 1)
            if torch.is_tensor(factor):
                rows += [mean, unbiased]
            else:
                rows += [mean * factor, unbiased * factor]
        return rows
    return finish


def _update_running(running, value, factor):
    """running = (1 - factor) * running + factor * value, in float64 on the device. factor a
    float: `value` is factor * value already (forward_rows). factor num_batches_tracked (a
    tensor, momentum=None): factor 1/n, taken on the device."""
    if torch.is_tensor(factor):
        f = factor.to(device=running.device, dtype=F64).reciprocal()
        running.copy_(running.to(F64) * (1.0 - f) + value * f)
    else:
        running.copy_(torch.add(value, running, alpha=1.0 - factor))


class SyncBatchNormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, client, op, seq,
                scope, cuda_ops=None):
        """factor: momentum (a float), or the layer's num_batches_tracked tensor when momentum
        is None. cuda_ops: "torch", "kernels" or None (the process's choice)."""
        ops = ops_for(x, cuda_ops)
        count, packed = ops.local_moments(x, eps)
        track = running_mean is not None
        total, rows = exchange(client.forward, op, seq, scope, count, packed,
                               forward_rows(ops.stat_dtype(x), eps, track, factor))
        if total <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got %d in scope %r "
                "(%s, op=%d, input of size %s on this worker)"
                % (total, scope, op_label(op), op, list(x.shape)))
        mean, invstd = rows[0], rows[1]
        if track:
            # torch.nn.BatchNorm's update, with the unbiased variance of the scope's batch.
            with torch.no_grad():
                _update_running(running_mean, rows[2], factor)
                _update_running(running_var, rows[3], factor)
        y = ops.normalize(x, mean, invstd, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.hsbn = (client, op, seq, scope, count, total, cuda_ops)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, *saved = ctx.saved_tensors
        client, op, seq, scope, count, total, cuda_ops = ctx.hsbn
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ops = ops_for(x, cuda_ops)
        packed, grad_w, grad_b = ops.backward_reduce(dy, x, saved, weight, need_w, need_b)
        grad_x = None
        if need_x:
            # Every worker runs the same layers with the same requires_grad pattern, so either
            # all of them take part in this round or none does.
            npd = _NUMPY_DTYPES[ops.stat_dtype(x)]
            _, sums = exchange(client.backward, op, seq, scope, count, packed,
                               lambda total, a, b: [a.astype(npd), b.astype(npd)])
            grad_x = ops.backward_elemt(dy, x, saved, weight, sums, total)
        return (grad_x, grad_w, grad_b) + (None,) * 9
