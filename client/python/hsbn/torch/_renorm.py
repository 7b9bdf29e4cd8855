"""Scope "renorm": Batch Renormalization (Ioffe 2017) with the job's global statistics as the
population statistics.

A training forward makes one node round (scope "renorm": answered with the node's statistics
at once; the sidecar also sends the node partial to the root). With (mu_B, sigma_B) the node's
mean and sqrt(biased var + eps), and (mu, sigma) the global statistics of this layer's forward
round `lag` calls earlier (seq - lag), optionally averaged over calls:

    r = clip(sigma_B / sigma, 1/r_max, r_max)     d = clip((mu_B - mu) / sigma, -d_max, d_max)
    y = gamma * ((x - mu_B) / sigma_B * r + d) + beta

r and d carry no gradient. It runs as node-scope normalization with weight gamma * r and bias
gamma * d + beta (r and d computed on the host in float64), so the op sets are reused as they
are. Backward makes one node round; dx is node BatchNorm's with weight gamma * r, and
d gamma = r * sum(dy * xhat_B) + d * sum(dy) over this worker's batch (its share, as the other
scopes return).

Calls with seq < max(warmup, lag) use r = 1, d = 0 (node scope, bit for bit) and wait for
nothing; r_max and d_max then grow linearly from 1 and 0 over `ramp` calls. Running statistics
are updated from the global statistics of seq - lag only, at the calls that use them.

A recomputation in backward (activation checkpointing) reuses the r and d of the first pass,
found by the node statistics of the recomputed input, and never waits for the root; when they
are not found it raises (RecomputeError).
"""

import collections
import hashlib
import math
import os
import sys
import time

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from ..client import op_label
from ..errors import ConfigurationError
from ._function import (F64, _NUMPY_DTYPES, _count, _update_running, exchange)
from ._ops import ops_for

# The defaults, the one place to change them. lag: calls between a global round and its use;
# momentum: the newest global statistics' weight in their average over calls (1.0: no
# averaging); warmup: calls with r = 1, d = 0; r_max, d_max: the clipping limits after the
# ramp; ramp: calls over which they grow from 1 and 0. warmup, ramp, r_max and d_max were
# chosen by examples/compare/measured/renorm-tuning/ (the sweep's default cell, seeds 10-12,
# not the reported 0-4): of 11 settings, tight limits scored best (r_max 1.1, d_max 0.25:
# renorm - (node + 0.8 (global - node)) +0.09 points; the paper's 3 and 5: -3.6 with this
# warm-up and ramp), warm-up 0 or 5 made no difference; lag and momentum were not tuned.
DEFAULTS = {"lag": 1, "momentum": 1.0, "warmup": 5, "r_max": 1.1, "d_max": 0.25, "ramp": 20}

# A recomputation must come within this many training calls of its layer after its first
# pass: the first passes' r and d are kept that long (two float64 arrays of C each per call).
RECOMPUTE_WINDOW = 32

_KEYWORDS = {"lag": "renorm_lag", "momentum": "renorm_momentum", "warmup": "renorm_warmup",
             "r_max": "renorm_r_max", "d_max": "renorm_d_max", "ramp": "renorm_ramp"}


class RecomputeError(RuntimeError):
    """A renorm layer recomputed in backward without a matching first pass."""


def renorm_options(lag=None, momentum=None, warmup=None, r_max=None, d_max=None, ramp=None,
                   where=""):
    """{option: value} with DEFAULTS for the ones given as None; ConfigurationError naming the
    keyword of a bad one."""
    given = {"lag": lag, "momentum": momentum, "warmup": warmup, "r_max": r_max,
             "d_max": d_max, "ramp": ramp}
    out = dict(DEFAULTS)
    for k, v in given.items():
        if v is None:
            continue
        kw = _KEYWORDS[k]
        if k in ("lag", "warmup", "ramp"):
            low = 1 if k == "lag" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigurationError("%s%s must be an int >= %d (calls), not %r"
                                         % (kw, where, low, v))
        else:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigurationError("%s%s must be a finite number, not %r" % (kw, where, v))
            v = float(v)
            bad = {"momentum": not 0.0 < v <= 1.0, "r_max": v < 1.0, "d_max": v < 0.0}[k]
            if bad:
                need = {"momentum": "in (0, 1] (1: no averaging)", "r_max": ">= 1",
                        "d_max": ">= 0"}[k]
                raise ConfigurationError("%s%s must be %s, not %r" % (kw, where, need, v))
        out[k] = v
    return out


def recomputing():
    """True while autograd's engine runs this thread's code in backward: the recomputation of
    activation checkpointing. torch >= 2.0 says so (its current graph task); older torch is
    asked through the frames of torch.utils.checkpoint's recomputation (reentrant: its
    CheckpointFunction.backward; non-reentrant: its unpack hook)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is not None:
        return task() != -1
    tail = os.path.join("torch", "utils", "checkpoint.py")
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("backward", "unpack") and code.co_filename.endswith(tail):
            return True
        frame = frame.f_back
    return False


def _digest(total, mean, m2):
    h = hashlib.blake2b(digest_size=16)
    h.update(int(total).to_bytes(8, "little", signed=True))
    h.update(np.ascontiguousarray(mean, dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(m2, dtype=np.float64).tobytes())
    return h.digest()


class RenormState:
    """One renorm layer's host-side state: its options, the average of the global statistics
    (momentum < 1) and the r, d of its last RECOMPUTE_WINDOW first passes. Every rank goes
    through the same updates with the same bits, so every rank holds the same state. Not in
    the state_dict: a resumed run starts again with warm-up and ramp (docs/PYTORCH.md)."""

    def __init__(self, options):
        self.options = dict(options)
        self.average = None   # (mean, biased var) float64, with momentum < 1
        self.recent = collections.OrderedDict()  # node-statistics digest -> (r, d) or None
        self.first_seq = None  # the round seq of the first of this layer's renorm calls in a row
        self.last_seq = None

    def note_call(self, seq):
        """Records this layer's renorm call with round seq `seq` (every call, recomputations
        too), before uses_global. Warm-up counts from the first of the layer's consecutive
        renorm calls of its op: where the op's previous rounds had another scope (the layer's
        scope switched to renorm mid-run, or a model rebuilt in the same process under the same
        layer names), no call waits for the global statistics of a round that had none."""
        last = getattr(self, "last_seq", None)  # absent in states pickled before it existed
        if last is None or seq != last + 1:
            self.first_seq = seq
        self.last_seq = seq

    def _calls_before(self, seq):
        first = getattr(self, "first_seq", None)
        return seq if first is None else seq - first

    def uses_global(self, seq):
        """Whether the call with round seq `seq` is corrected with global statistics."""
        o = self.options
        return self._calls_before(seq) >= max(o["warmup"], o["lag"])

    def limits(self, seq):
        """(r_max, d_max) at call `seq` (one that uses global statistics)."""
        o = self.options
        ramp = o["ramp"]
        done = (1.0 if ramp <= 0 else
                min(1.0, (self._calls_before(seq) - max(o["warmup"], o["lag"]) + 1) / ramp))
        return 1.0 + (o["r_max"] - 1.0) * done, o["d_max"] * done

    def population(self, g_mean, g_var):
        """(mean, biased var) the correction uses: the global ones, or their average."""
        a = self.options["momentum"]
        if a == 1.0:
            return g_mean, g_var
        if self.average is None:
            self.average = (g_mean.copy(), g_var.copy())
        else:
            m, v = self.average
            self.average = (m * (1.0 - a) + g_mean * a, v * (1.0 - a) + g_var * a)
        return self.average

    def remember(self, key, rd):
        self.recent[key] = rd
        self.recent.move_to_end(key)
        while len(self.recent) > RECOMPUTE_WINDOW:
            self.recent.popitem(last=False)

    def recall(self, key, op, seq):
        if key not in self.recent:
            raise RecomputeError(
                "hsbn: %s (scope 'renorm') is being recomputed in backward (activation "
                "checkpointing, round seq %d), but none of its last %d training calls saw the "
                "node statistics of this recomputation, so the r and d of its first pass are "
                "unknown. The recomputed input differs from the first pass (nondeterministic "
                "ops, or checkpoint(..., preserve_rng_state=False) with random ops), or more "
                "than %d calls of the layer ran between the first pass and its recomputation. "
                "A renorm layer does not wait for the root in backward."
                % (op_label(op), seq, RECOMPUTE_WINDOW, RECOMPUTE_WINDOW))
        return self.recent[key]


def correction(count_b, mean_b, m2_b, mean, var, eps, r_max, d_max):
    """(r, d) per channel, float64: sigma_B = sqrt(m2_B / count_B + eps), sigma =
    sqrt(var + eps), r = clip(sigma_B / sigma, 1/r_max, r_max), d = clip((mu_B - mu) / sigma,
    -d_max, d_max)."""
    with np.errstate(divide="ignore", invalid="ignore"):  # inf and NaN are data
        sigma_b = np.sqrt(m2_b / count_b + eps)
        sigma = np.sqrt(var + eps)
        r = np.clip(sigma_b / sigma, 1.0 / r_max, r_max)
        d = np.clip((mean_b - mean) / sigma, -d_max, d_max)
    return r, d


def fetch_global(client, op, seq):
    """The global (count, mean, biased var) of round (op, seq), float64; counts the fetch in
    sync_stats() (renorm_global_uses, renorm_waits when it was not there yet, and the seconds
    spent)."""
    ready = bool(client.global_stats_ready(op, seq))
    t0 = time.perf_counter()
    total, mean, m2 = client.global_stats(op, seq)
    waited = time.perf_counter() - t0
    _count(renorm_global_uses=1, renorm_waits=0 if ready else 1, renorm_wait_seconds=waited)
    total = int(total)
    mean = np.asarray(mean, dtype=np.float64)
    m2 = np.asarray(m2, dtype=np.float64)
    if total <= 1:
        raise ValueError("the global statistics of %s, round seq %d, have %d values per "
                         "channel; renorm needs more than 1" % (op_label(op), seq, total))
    return total, mean, m2


class RenormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, client, op, seq,
                state, recompute, cuda_ops=None):
        """factor: momentum (a float), or num_batches_tracked when momentum is None (the module
        counts only the calls that update the running statistics). recompute: this call
        recomputes a first pass in backward (recomputing())."""
        ops = ops_for(x, cuda_ops)
        npd = _NUMPY_DTYPES[ops.stat_dtype(x)]
        count, packed = ops.local_moments(x, eps)
        track = running_mean is not None
        lag = state.options["lag"]

        def finish(total, mean_b, m2_b):
            if total <= 1:
                return []  # raised below
            with np.errstate(divide="ignore", invalid="ignore"):
                invstd = 1.0 / np.sqrt(m2_b / total + eps)
            rows = [mean_b.astype(npd), invstd.astype(npd)]
            key = _digest(total, mean_b, m2_b)
            if recompute:
                rd = state.recall(key, op, seq)
                _count(renorm_recomputes=1)
            else:
                _count(renorm_calls=1)
                rd = None
                if state.uses_global(seq):
                    g_total, g_mean, g_m2 = fetch_global(client, op, seq - lag)
                    if g_mean.shape != mean_b.shape:
                        raise ValueError("the global statistics of %s, round seq %d, have %d "
                                         "channels, the node's %d"
                                         % (op_label(op), seq - lag, g_mean.shape[0],
                                            mean_b.shape[0]))
                    g_var = g_m2 / g_total
                    mu, var = state.population(g_mean, g_var)
                    rd = correction(total, mean_b, m2_b, mu, var, eps, *state.limits(seq))
                    if track:
                        unbiased = g_m2 / (g_total - 1)
                        if torch.is_tensor(factor):
                            rows_run = [g_mean, unbiased]
                        else:
                            rows_run = [g_mean * factor, unbiased * factor]
                state.remember(key, rd)
            if rd is not None:
                rows += list(rd)
                if track and not recompute:
                    rows += rows_run
            return rows

        total, rows = exchange(client.forward, op, seq, "renorm", count, packed, finish)
        if total <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got %d in scope "
                "'renorm' (the node's batch; %s, op=%d, input of size %s on this worker)"
                % (total, op_label(op), op, list(x.shape)))
        mean, invstd = rows[0], rows[1]
        r = d = w_eff = None
        b_eff = bias
        if len(rows) > 2:
            r, d = rows[2], rows[3]
            if weight is None:
                w_eff, b_eff = r, d
            else:
                w = weight.detach().to(F64)
                w_eff = w * r
                b_eff = torch.addcmul(bias.detach().to(F64), w, d)
            if len(rows) > 4:
                with torch.no_grad():
                    _update_running(running_mean, rows[4], factor)
                    _update_running(running_var, rows[5], factor)
        y = ops.normalize(x, mean, invstd, weight if r is None else w_eff, b_eff, eps)
        ctx.save_for_backward(x, weight, w_eff, mean, invstd, r, d)
        ctx.hsbn = (client, op, seq, count, total, cuda_ops)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, w_eff, mean, invstd, r, d = ctx.saved_tensors
        client, op, seq, count, total, cuda_ops = ctx.hsbn
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ops = ops_for(x, cuda_ops)
        w = weight if r is None else w_eff
        packed, grad_w, grad_b = ops.backward_reduce(dy, x, (mean, invstd), w, need_w, need_b)
        if need_w and r is not None:
            # grad_w is sum(dy * xhat_B): d gamma = r * that + d * sum(dy).
            grad_w = torch.addcmul(grad_w.to(F64) * r, packed[0], d).to(weight.dtype)
        if grad_b is not None and r is not None:
            grad_b = grad_b.to(weight.dtype)  # reduced with w_eff, which is float64
        grad_x = None
        if need_x:
            npd = _NUMPY_DTYPES[ops.stat_dtype(x)]
            _, sums = exchange(client.backward, op, seq, "renorm", count, packed,
                               lambda total, a, b: [a.astype(npd), b.astype(npd)])
            grad_x = ops.backward_elemt(dy, x, (mean, invstd), w, sums, total)
        return (grad_x, grad_w, grad_b) + (None,) * 10
