"""The kinks of a forward pass: the discrete decisions a ReLU (does the input pass?) and a
max-pool (which element of the window wins?) take. The gradient is discontinuous there: an
input within round-off of a ReLU's 0, or two near-equal elements of a max-pool window, can
land on either side in float32, and the gradient then flows differently. Behind BatchNorm,
whose backward couples every item of a channel, one such flip moves every gradient upstream
of it (ResNet-18 on 28x28 items: by 2e-3 to 8e-3 of the whole gradient), which is not
round-off of the arithmetic but a different branch of the same function.

`Kinks` records the decisions of one forward pass (in call order) and, with `replay`, forces
recorded ones onto another pass, so that the check can compute the float64 gradient on the
branch a float32 run took. `flips` says where two records differ and how far the float64 input
was from the kink there (in units of the channel's scale): round-off can only flip decisions
whose margin is of round-off size.
"""

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

# torch functions (by __name__) that are a ReLU, with the positional index of `inplace`.
_RELU = {"relu": 1, "relu_": None}
_MAXPOOL = {"max_pool2d", "_max_pool2d", "max_pool2d_with_indices"}


def _channel_scale(x):
    """Root mean square of each channel (dim 1) over the other dims, broadcastable to x."""
    dims = [d for d in range(x.dim()) if d != 1]
    return x.pow(2).mean(dim=dims, keepdim=True).sqrt() if dims else x.abs()


class Kinks(TorchFunctionMode):
    """Within `with Kinks() as k:` every ReLU (F.relu, torch.relu, relu_) and 2-d max-pool
    (F.max_pool2d) call appends its decision to k.decisions: ("relu", bool array: input > 0)
    or ("maxpool", int64 array: the winning element of each window, as
    F.max_pool2d(return_indices=True) gives it). With keep_inputs, k.inputs holds each call's
    input (numpy) and the channel scale, for `flips`. With replay=decisions (a record of the
    same model on the same batch) each call takes the recorded decision instead of its own:
    a ReLU multiplies by the recorded mask, a max-pool gathers the recorded element, so the
    values differ from the pass's own only where the decision was within round-off, and the
    gradient flows the recorded way."""

    def __init__(self, replay=None, keep_inputs=False):
        super().__init__()
        self.replay = replay
        self.keep_inputs = keep_inputs
        self.decisions = []
        self.inputs = []

    def _next(self, kind, shape):
        i = len(self.decisions)
        if self.replay is None:
            return None
        if i >= len(self.replay) or self.replay[i][0] != kind \
                or tuple(self.replay[i][1].shape) != tuple(shape):
            raise ValueError("kink %d (%s %s) does not match the recorded forward pass"
                             % (i, kind, tuple(shape)))
        return self.replay[i][1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _RELU and args and isinstance(args[0], torch.Tensor):
            return self._relu(func, name, args, kwargs)
        if name in _MAXPOOL and args and isinstance(args[0], torch.Tensor) \
                and args[0].dim() == 4:
            return self._maxpool(func, name, args, kwargs)
        return func(*args, **kwargs)

    def _relu(self, func, name, args, kwargs):
        x = args[0]
        inplace = name == "relu_" or bool(kwargs.get("inplace", False)) or (
            _RELU[name] is not None and len(args) > _RELU[name] and bool(args[_RELU[name]]))
        with torch.no_grad():
            own = (x > 0).cpu().numpy()
        if self.keep_inputs:
            with torch.no_grad():
                self.inputs.append((x.detach().cpu().double().numpy().copy(),
                                    _channel_scale(x.detach().double()).cpu().numpy()))
        forced = self._next("relu", own.shape)
        self.decisions.append(("relu", own if forced is None else forced))
        if forced is None:
            return func(*args, **kwargs)
        mask = torch.from_numpy(np.ascontiguousarray(forced)).to(x.device, x.dtype)
        return x.mul_(mask) if inplace else x * mask

    def _maxpool(self, func, name, args, kwargs):
        x = args[0]
        kw = dict(kwargs)
        want_indices = name == "max_pool2d_with_indices" or bool(kw.pop("return_indices", False))
        pos = list(args[1:])
        # F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
        if len(pos) >= 6:
            want_indices = want_indices or bool(pos[5])
            pos = pos[:5]
        out, idx = torch.nn.functional.max_pool2d_with_indices(x, *pos, **kw)
        if self.keep_inputs:
            with torch.no_grad():
                self.inputs.append((x.detach().cpu().double().numpy().copy(),
                                    _channel_scale(x.detach().double()).cpu().numpy()))
        own = idx.cpu().numpy()
        forced = self._next("maxpool", own.shape)
        self.decisions.append(("maxpool", own if forced is None else forced))
        if forced is not None:
            idx = torch.from_numpy(np.ascontiguousarray(forced)).to(x.device)
            n, c = idx.shape[:2]
            out = x.reshape(n, c, -1).gather(2, idx.reshape(n, c, -1)).reshape(idx.shape)
        return (out, idx) if want_indices else out


def concat(records):
    """One record of the whole batch from per-worker records of the same model (each worker's
    part of the batch, in rank order): every call's decisions concatenated along the batch."""
    if len({len(r) for r in records}) > 1:
        raise ValueError("the workers' forward passes took different numbers of kinks")
    out = []
    for calls in zip(*records):
        kinds = {k for k, _ in calls}
        if len(kinds) != 1:
            raise ValueError("the workers' forward passes took different kinks")
        out.append((calls[0][0], np.concatenate([d for _, d in calls], axis=0)))
    return out


def flips(record, truth):
    """Where `record` (a run's decisions) differs from `truth` (a float64 Kinks with
    keep_inputs, on the same model and batch): {"count": decisions that differ, "margin":
    the largest distance of the float64 input from the kink among them, in units of the
    channel's root mean square (0 when none differ)}. For a ReLU the distance is |x|; for a
    max-pool, the window's maximum minus the element the run chose."""
    if len(record) != len(truth.decisions):
        raise ValueError("the records have %d and %d kinks" % (len(record), len(truth.decisions)))
    count, margin = 0, 0.0
    for (kind, mine), (kind64, ref), (x, scale) in zip(record, truth.decisions, truth.inputs):
        if kind != kind64 or mine.shape != ref.shape:
            raise ValueError("the records took different kinks")
        diff = mine != ref
        n = int(diff.sum())
        if not n:
            continue
        count += n
        scale = np.broadcast_to(scale, x.shape)
        if kind == "relu":
            m = np.abs(x[diff]) / np.maximum(scale[diff], 1e-300)
        else:
            nn_, c = x.shape[:2]
            flat = x.reshape(nn_, c, -1)
            s = scale.reshape(nn_, c, -1)[:, :, 0]
            best = np.take_along_axis(flat, ref.reshape(nn_, c, -1), 2).reshape(ref.shape)
            chosen = np.take_along_axis(flat, mine.reshape(nn_, c, -1), 2).reshape(mine.shape)
            m = (best - chosen)[diff] / np.maximum(
                np.broadcast_to(s.reshape(nn_, c, *([1] * (mine.ndim - 2))), mine.shape)[diff],
                1e-300)
        margin = max(margin, float(np.max(m)))
    return {"count": count, "margin": margin}
