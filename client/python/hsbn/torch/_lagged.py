"""Scope "lagged" (issue #41): both passes with the job's statistics, the other nodes' share one
call old, for the price of node rounds.

The service (docs/PROTOCOL.md, "Lagged scope") answers each forward and backward round with the
node's statistics at once and delivers the job's later (client.global_stats / global_sums).
This module is the layer's arithmetic, all of it in float64 on the host from values that are
the same bits on every rank of a node (node answers, late results), so every rank of a node
computes the same bits.

Forward of call s (a node round): the node's fresh (n_k, m_k, M_k) merged (Chan) with the other
nodes' share of the layer's previous lagged forward p < s: from the job's (N', mu', M2') of p
and this node's answer (n_k', m_k', M_k') of p,

    n_o = N' - n_k'     m_o = mu' + n_k' (mu' - m_k') / n_o
    M_o = M2' - M_k' - n_k' n_o / N' (m_k' - m_o)^2          (clamped at 0)

then normalization with the merged mean mu and invstd = 1 / sqrt(M / N + eps).

Backward of call s (a node round): each rank's sums are taken around the saved mean c and
re-centred on the device to the node answer's mean m_k (the protocol's contract: sum dy (x - m_k)
= sum dy (x - c) + (c - m_k) sum dy). With the node's answer (D_k, S_k around m_k), and the
other nodes' share of the layer's last lagged backward b (the job's (D', S' around mu_b) minus
this node's answer of b, re-centred on the other nodes' mean of b):

    D = D_k + D_o       S = S_k + (m_k - mu) D_k + S_o(m_o_b) + (m_o_b - mu) D_o

and dx = w invstd (dy - D / N - (x - mu) invstd^2 S / N): the exact BatchNorm gradient of the
batch the forward normalized (this node fresh, the others one call old). With damping
lambda < 1 the dx is lambda times that plus (1 - lambda) times the node-local one,
w invstd (dy - D_k / n_k - (x - m_k) S_k / (M_k + n_k eps)) (node BatchNorm's projection,
which sums to zero over the node's batch, at the layer's scale), folded into the same (sums,
count) form, so one elementwise pass computes it.

Exact calls. A call with no earlier lagged forward of the layer (the first, and the first
`warmup` calls), or one the guard sends to global (LaggedState.exact), waits for its own late
result and normalizes with the job's exact statistics; its backward waits for the job's sums of
its own round: a global round, both passes. A lagged backward with no earlier backward record
does the same for its backward.

Running statistics take the job's exact statistics of every training call (not of
recomputations) once: an exact call's own at once, a lagged call's at the next call (one call
late), so every rank of the job holds the same bits.

Activation checkpointing: a recomputation in backward makes its node round again (a lagged
round of its own seq) and reuses the first pass's merged statistics, found by its node answer
among the layer's last RECOMPUTE_WINDOW calls; it waits for nothing and updates nothing.
"""

import collections
import math
import time

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from ..client import op_label
from ..errors import ConfigurationError
from ._function import F64, _NUMPY_DTYPES, _count, _update_running, _upload, exchange
from ._ops import ops_for
from ._renorm import RecomputeError, _digest

# The defaults, the one place to change them. damping: lambda, the weight of the lagged input
# gradient against the node-local one (1.0: plain lagged). ema: the other nodes' share an
# exponential average over the layer's earlier training calls (weight ema on the older average;
# 0: their last call's alone), in both passes alike. damping 1.0 with ema 0.8 from issue #41's
# one-process study (docs/results/COMPARISON.md, "The stale share averaged in both passes"):
# with the guards below they recovered 94-99 % of the node-to-global gap in every cell but the
# learning-rate spike's (59 %, above node), against 45-93 % for damping 0.5 without the
# average; the average alone makes plain lagged stable in the fast cell (78 % instead of -80 %)
# and in both passes, not the backward's alone, is what pays. warmup: the layer's
# first calls that are exact global (>= 1: the first call has no earlier statistics). 20 from
# the same study ("Warm-up: the first calls exact"): on ResNet-18's 75-step cell the first
# calls, from random weights at the highest learning rate, are where lagged breaks (1 call:
# 12 % of the gap; 10: 68 %; 20: 80 %), and 20 exact calls changed nothing measurable in the
# 4-layer CNN's fast and 1,200-step cells (they are 2 % of the latter's calls).
# trip, trip_rel, trip_calls: the trip guard. Before each training call a layer computes v, how
# far its exact global statistics moved between its last two calls (trip_drift); v > trip, or
# v > trip_rel times the layer's level of v (an exponential average of its earlier v, weight
# TRIP_DECAY on the older level, from its TRIP_HISTORY-th v on), sends it exact global (both
# passes) for its next trip_calls calls; a trip while exact extends them. 0 turns a form off.
# The defaults are the one-process study's (docs/results/COMPARISON.md, "The trip guard").
TRIP_DECAY = 0.9
TRIP_HISTORY = 5
# trip_rel 4 with 30 calls: catches a learning-rate spike within 2-3 calls at about 1 % of calls
# exact global in normal runs; the absolute trip (off) trades 20-37 % exact calls for accuracy.
DEFAULTS = {"damping": 1.0, "warmup": 20, "trip": 0.0, "trip_rel": 4.0, "trip_calls": 30,
            "ema": 0.8}

# Records kept per layer (first passes for recomputation, forward records for the backward).
RECOMPUTE_WINDOW = 32

_KEYWORDS = {"damping": "lagged_damping", "warmup": "lagged_warmup", "trip": "lagged_trip",
             "trip_rel": "lagged_trip_rel", "trip_calls": "lagged_trip_calls",
             "ema": "lagged_ema"}


def lagged_options(damping=None, warmup=None, trip=None, trip_calls=None, trip_rel=None,
                   ema=None, where=""):
    """{option: value} with DEFAULTS for the ones given as None; ConfigurationError naming the
    keyword of a bad one."""
    out = dict(DEFAULTS)
    if damping is not None:
        if (isinstance(damping, bool) or not isinstance(damping, (int, float))
                or not math.isfinite(damping) or not 0.0 <= damping <= 1.0):
            raise ConfigurationError("lagged_damping%s must be a number in [0, 1] (1: plain "
                                     "lagged backward, 0: node-local), not %r" % (where, damping))
        out["damping"] = float(damping)
    if warmup is not None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ConfigurationError("lagged_warmup%s must be an int >= 1 (calls), not %r"
                                     % (where, warmup))
        out["warmup"] = warmup
    for key, value, unit in (("trip", trip, "standard deviations per call"),
                             ("trip_rel", trip_rel, "times the layer's level")):
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0):
            raise ConfigurationError("lagged_%s%s must be a number >= 0 (%s; 0: off), not %r"
                                     % (key, where, unit, value))
        out[key] = float(value)
    if trip_calls is not None:
        if isinstance(trip_calls, bool) or not isinstance(trip_calls, int) or trip_calls < 1:
            raise ConfigurationError("lagged_trip_calls%s must be an int >= 1 (calls), not %r"
                                     % (where, trip_calls))
        out["trip_calls"] = trip_calls
    if ema is not None:
        if (isinstance(ema, bool) or not isinstance(ema, (int, float)) or not math.isfinite(ema)
                or not 0.0 <= ema < 1.0):
            raise ConfigurationError("lagged_ema%s must be a number in [0, 1) (the weight of "
                                     "the older average; 0: the last call only), not %r"
                                     % (where, ema))
        out["ema"] = float(ema)
    return out


def trip_drift(old, new):
    """The trip guard's v: how far a layer's exact global statistics moved from one call to the
    next, old and new each the job's (N, mean, m2) float64: the rms over channels of
    sqrt(((mean1 - mean0) / sd0)^2 + log(sd1 / sd0)^2), sd = sqrt(m2 / N + 1e-5). The same as
    the one-process study's (examples/compare/hsbncmp/oneproc.py, trip_drift)."""
    (n0, m0, q0), (n1, m1, q1) = old, new
    if n0 <= 0 or n1 <= 0 or m0.shape != m1.shape or m0.size == 0:
        return 0.0
    sd0 = np.sqrt(q0 / n0 + 1e-5)
    sd1 = np.sqrt(q1 / n1 + 1e-5)
    move = np.square((m1 - m0) / sd0) + np.square(np.log(sd1 / sd0))
    v = float(np.sqrt(np.mean(move)))
    return v if math.isfinite(v) else math.inf


class LaggedState:
    """One lagged layer's host-side state. Every rank goes through the same updates with bits
    that are the same on every rank of a node (the job's for the running statistics), so the
    state is too. Not in the state_dict: a resumed run starts with its warm-up again.

    The guards of issue #41 plug in here: damping(seq) and exact(seq) are the only decisions,
    and observe() sees every late result the layer uses (the same bits on every rank), so a
    guard that sets them from what it observed decides alike on every rank. The trip guard
    (check_trip) is one: it reads only the job's statistics of the layer's own calls."""

    def __init__(self, options):
        self.options = dict(options)
        self.lam = self.options["damping"]
        self.calls = 0          # training calls (first passes) so far
        self.fwd = collections.OrderedDict()   # seq -> {"node": (n, m, M), "glob": ...}
        self.last_fwd = None    # seq of the last lagged forward round (recomputations too)
        self.last_bwd = None    # (seq, D_k, S_k around m_k) of the last backward
        self.pending = None     # seq of a lagged call whose global stats still go into running
        self.recent = collections.OrderedDict()  # node digest -> first pass's rows
        self.seen = collections.OrderedDict()    # seq -> the job's (N, mean, m2), observed
        self.train_seqs = collections.deque(maxlen=2)  # round seqs of the last training calls
        self.exact_until = 0    # trip guard: training calls below this count are exact
        self.trips = []         # trip guard: (training call, round seq, v) of each trip
        self.checks = 0         # trip guard: v computed so far
        self.level = 0.0        # trip guard, relative form: the level of v before this call
        # ema: the other nodes' averaged share and the round seq last folded into it;
        # forward (n_o of the last call, mean, variance), backward (sum dy, sum dy (x - c), c)
        self.avg_fwd = self.avg_fwd_seq = None
        self.avg_bwd = self.avg_bwd_seq = None

    # --- the guard's decisions (plain: the options) -----------------------------------------
    def damping(self, seq):
        return self.lam

    def exact(self, seq):
        """Whether call `seq` waits for its own job statistics (a global call)."""
        return (self.calls < self.options["warmup"] or self.last_fwd is None
                or self.calls < self.exact_until)

    def observe(self, what, seq, values):
        """Called with every late result used ("stats" or "sums"); for a guard."""
        if what == "stats":
            self.seen[seq] = values
            self._trim(self.seen)

    def check_trip(self, client, op, seq):
        """The trip guard, before a training call decides exact(): v between the layer's last
        two training calls (not recomputations: those repeat their first pass's statistics).
        Fetching the last round's statistics first costs no wait the call would not have: a
        lagged call merges them, an exact one waits for its own, which come after them."""
        o = self.options
        if not (o["trip"] or o["trip_rel"]) or len(self.train_seqs) < 2:
            return
        before, prev = self.train_seqs
        new = self.glob(client, op, prev)
        if before not in self.seen:
            return
        v = trip_drift(self.seen[before], new)
        self.checks += 1
        over = not math.isfinite(v) or (o["trip"] > 0 and v > o["trip"])
        if o["trip_rel"] and math.isfinite(v):
            over = over or (self.checks > TRIP_HISTORY and v > o["trip_rel"] * self.level)
            self.level = (v if self.checks == 1
                          else TRIP_DECAY * self.level + (1.0 - TRIP_DECAY) * v)
        if not over:
            return
        new_trip = self.calls >= self.exact_until
        self.exact_until = self.calls + o["trip_calls"]
        if new_trip:
            self.trips.append((self.calls, seq, v))
            _count(lagged_trips=1)
            report = getattr(client, "report_lagged_trip", None)
            if report is not None:   # for the sidecar's Status and metrics
                report(op, seq, v, o["trip_calls"])

    # --- the averaged share (ema) ----------------------------------------------------------
    def fold_forward(self, client, op, seq):
        """Folds the other nodes' share of training call `seq` into the forward's average once
        (its statistics come before those of any later call, so this adds no wait)."""
        if seq is None or seq == self.avg_fwd_seq:
            return
        rec = self.fwd.get(seq)
        if rec is None:
            raise ValueError("%s: no record of its lagged call with round seq %d to average"
                             % (op_label(op), seq))
        n_o, m_o, m2_o = self.other(client, op, seq)
        self.avg_fwd_seq = seq
        if n_o == 0:
            return
        v_o = m2_o / n_o
        b = self.options["ema"]
        if self.avg_fwd is None or self.avg_fwd[1].shape != m_o.shape:
            self.avg_fwd = (n_o, m_o, v_o)
            return
        _, a_m, a_v = self.avg_fwd
        # The average of (mean, mean of x^2), kept centred: no difference of large squares.
        with np.errstate(invalid="ignore", over="ignore"):
            m = b * a_m + (1.0 - b) * m_o
            v = b * (a_v + np.square(a_m - m)) + (1.0 - b) * (v_o + np.square(m_o - m))
        m, v = _finite_fold((a_m, a_v), (m_o, v_o), (m, v))
        self.avg_fwd = (n_o, m, v)

    def averaged_share(self):
        """(n_o, m_o, M_o) of the forward's average, (0, None, None) before any."""
        if self.avg_fwd is None:
            return 0, None, None
        n_o, m, v = self.avg_fwd
        return n_o, m, v * n_o

    def fold_backward(self, seq, d_o, s_o, m_o):
        """Folds the other nodes' backward share of call `seq` (sum dy, sum dy (x - m_o)) into
        the average once."""
        if seq == self.avg_bwd_seq:
            return
        self.avg_bwd_seq = seq
        b = self.options["ema"]
        if self.avg_bwd is None or self.avg_bwd[0].shape != d_o.shape:
            self.avg_bwd = (d_o, s_o, m_o)
            return
        a_d, a_s, a_c = self.avg_bwd
        with np.errstate(invalid="ignore", over="ignore"):
            c = b * a_c + (1.0 - b) * m_o
            new = (b * a_d + (1.0 - b) * d_o,
                   b * (a_s + (a_c - c) * a_d) + (1.0 - b) * (s_o + (m_o - c) * d_o), c)
        self.avg_bwd = _finite_fold((a_d, a_s, a_c), (d_o, s_o, m_o), new)

    # --- records --------------------------------------------------------------------------
    def _trim(self, d):
        while len(d) > RECOMPUTE_WINDOW:
            d.popitem(last=False)

    def record_forward(self, seq, node):
        self.fwd[seq] = {"node": node, "glob": None}
        self._trim(self.fwd)
        self.last_fwd = seq

    def glob(self, client, op, seq):
        """The job's (N, mean, m2) of forward round seq (fetched once, kept)."""
        rec = self.fwd.get(seq)
        if rec is not None and rec["glob"] is not None:
            return rec["glob"]
        ready = bool(client.global_stats_ready(op, seq))
        t0 = time.perf_counter()
        total, mean, m2 = client.global_stats(op, seq)
        _count(lagged_waits=0 if ready else 1, lagged_wait_seconds=time.perf_counter() - t0)
        g = (int(total), np.asarray(mean, dtype=np.float64), np.asarray(m2, dtype=np.float64))
        if rec is not None:
            rec["glob"] = g
        self.observe("stats", seq, g)
        return g

    def other(self, client, op, seq):
        """other_share of forward round seq (computed once, kept); its record must be here."""
        rec = self.fwd[seq]
        if rec.get("other") is None:
            rec["other"] = other_share(self.glob(client, op, seq), rec["node"])
        return rec["other"]

    def remember(self, key, rows):
        self.recent[key] = rows
        self.recent.move_to_end(key)
        self._trim(self.recent)

    def recall(self, key, op, seq):
        if key not in self.recent:
            raise RecomputeError(
                "hsbn: %s (scope 'lagged') is being recomputed in backward (activation "
                "checkpointing, round seq %d), but none of its last %d training calls saw the "
                "node statistics of this recomputation, so the statistics of its first pass are "
                "unknown. The recomputed input differs from the first pass (nondeterministic "
                "ops, or checkpoint(..., preserve_rng_state=False) with random ops), or more "
                "than %d calls of the layer ran between the first pass and its recomputation."
                % (op_label(op), seq, RECOMPUTE_WINDOW, RECOMPUTE_WINDOW))
        return self.recent[key]


def _finite_fold(old, value, blended):
    """Per channel: the blend where the old average and the call's value are finite, the value
    where only it is, else the old average. A call with a NaN or Inf (an overflowing backward
    under GradScaler, which skips that step) so leaves the average as it was, instead of
    poisoning every later call of the layer; plain lagged is non-finite for one call only."""
    if np.isfinite(np.concatenate(old + value)).all():   # the common case, in one check
        return blended
    ok_old = np.logical_and.reduce([np.isfinite(a) for a in old])
    ok_new = np.logical_and.reduce([np.isfinite(a) for a in value])
    return tuple(np.where(ok_old & ok_new, bl, np.where(ok_new, v, a))
                 for a, v, bl in zip(old, value, blended))


def other_share(g, node):
    """(n_o, m_o, M_o): the job's (N, mu, M2) of a round without this node's (n, m, M) of it,
    float64; n_o == 0 gives (0, None, None)."""
    big_n, mu, m2 = g
    n, m, mk = node
    n_o = big_n - n
    if n_o <= 0:
        return 0, None, None
    with np.errstate(divide="ignore", invalid="ignore"):
        m_o = mu + (n / n_o) * (mu - m)
        m2_o = m2 - mk - (n * (n_o / big_n)) * np.square(m - m_o)
    return n_o, m_o, np.maximum(m2_o, 0.0)


def merge(a, b):
    """Chan's merge of (n, mean, m2) a and b (b may be (0, None, None)), float64."""
    na, ma, sa = a
    nb, mb, sb = b
    if nb == 0:
        return na, ma, sa
    n = na + nb
    delta = mb - ma
    return n, ma + delta * (nb / n), sa + sb + np.square(delta) * (na * (nb / n))


def _running_rows(g, factor):
    total, mean, m2 = g
    unbiased = m2 / (total - 1) if total > 1 else np.full_like(m2, np.nan)
    if torch.is_tensor(factor):
        return [mean, unbiased]
    return [mean * factor, unbiased * factor]


class LaggedFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, eps,
                momentum, client, op, seq, state, recompute, cuda_ops=None):
        """momentum: the layer's (None: the cumulative average, counted by num_batches_tracked,
        which this function advances once per running-statistics update). recompute: this call
        recomputes a first pass in backward."""
        ops = ops_for(x, cuda_ops)
        npd = _NUMPY_DTYPES[ops.stat_dtype(x)]
        count, packed = ops.local_moments(x, eps)
        track = running_mean is not None
        blends = []   # the job's statistics that go into the running statistics now
        info = {}

        def finish(n_k, m_k, mk2):
            node = (int(n_k), m_k.copy(), mk2.copy())
            key = _digest(n_k, m_k, mk2)
            if recompute:
                rows = state.recall(key, op, seq)
                state.record_forward(seq, node)
                info["exact"] = rows[3]
                info["merged"] = tuple(rows[4:7])
                _count(lagged_recomputes=1)
                return rows[:3]
            state.check_trip(client, op, seq)
            averaging = state.options["ema"] > 0
            if averaging:   # every training call's share, exact ones too
                state.fold_forward(client, op, state.train_seqs[-1] if state.train_seqs
                                   else None)
            state.train_seqs.append(seq)
            exact = state.exact(seq)
            if track and state.pending is not None:
                blends.append(state.glob(client, op, state.pending))
                state.pending = None
            prev = state.last_fwd
            state.record_forward(seq, node)
            if exact:
                g = state.glob(client, op, seq)
                total, mean, m2 = g
                if track:
                    blends.append(g)
                _count(lagged_exact=1)
            else:
                g = state.glob(client, op, prev)
                prev_node = state.fwd[prev]["node"] if prev in state.fwd else None
                if prev_node is None or g[1].shape != m_k.shape:
                    raise ValueError("%s: no record of its previous lagged call (round seq %d) "
                                     "with %d channels" % (op_label(op), prev, m_k.shape[0]))
                total, mean, m2 = merge(node, state.averaged_share() if averaging
                                        else other_share(g, prev_node))
                if track:
                    state.pending = seq
            if total <= 1:
                info["total"] = total
                return []
            with np.errstate(divide="ignore", invalid="ignore"):
                invstd = 1.0 / np.sqrt(m2 / total + eps)
            mean_s = mean.astype(npd)
            # The backward's sums are taken around mean_s; the node round wants them around m_k.
            shift = mean_s.astype(np.float64) - m_k
            rows = [mean_s, invstd.astype(npd), shift]
            state.remember(key, rows + [exact, total, mean, m2])
            info["exact"] = exact
            info["merged"] = (total, mean, m2)
            _count(lagged_calls=1)
            return rows

        n_k, rows = exchange(client.forward, op, seq, "lagged", count, packed, finish)
        if not rows:
            raise ValueError(
                "Expected more than 1 value per channel when training, got %d in scope "
                "'lagged' (%s, op=%d, input of size %s on this worker)"
                % (info.get("total", n_k), op_label(op), op, list(x.shape)))
        if not recompute:
            state.calls += 1
        total, mean_f, m2_f = info["merged"]
        mean, invstd, shift = rows
        if blends:
            up = []
            for g in blends:
                up += _running_rows(g, num_batches_tracked if momentum is None else momentum)
            dev = _upload(up, running_mean.device)
            with torch.no_grad():
                for i in range(len(blends)):
                    if num_batches_tracked is not None:
                        num_batches_tracked.add_(1)
                    factor = (num_batches_tracked if momentum is None else momentum)
                    _update_running(running_mean, dev[2 * i], factor)
                    _update_running(running_var, dev[2 * i + 1], factor)
        y = ops.normalize(x, mean, invstd, weight, bias, eps)
        ctx.running_updates = len(blends)   # for the custom op's caller (_custom_op.py)
        ctx.save_for_backward(x, weight, mean, invstd, shift)
        ctx.hsbn = (client, op, seq, count, state, info["exact"], int(n_k), int(total),
                    mean_f, m2_f, eps, cuda_ops)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd, shift = ctx.saved_tensors
        (client, op, seq, count, state, exact, n_k, total, mu, m2, eps,
         cuda_ops) = ctx.hsbn
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ops = ops_for(x, cuda_ops)
        saved = (mean, invstd)
        packed, grad_w, grad_b = ops.backward_reduce(dy, x, saved, weight, need_w, need_b)
        grad_x = None
        if need_x:
            npd = _NUMPY_DTYPES[ops.stat_dtype(x)]
            # Around the node's mean m_k, as the protocol wants: S(m_k) = S(c) + (c - m_k) D.
            packed = packed.clone()
            packed[1].add_(packed[0] * shift.to(device=packed.device, dtype=F64))
            node_f = state.fwd.get(seq, {}).get("node")

            def finish(nb, d_k, s_k):
                if node_f is None:
                    raise ValueError("%s: no record of forward round seq %d for its backward"
                                     % (op_label(op), seq))
                _, m_k, mk2 = node_f
                prev = state.last_bwd
                state.last_bwd = (seq, d_k.copy(), s_k.copy())
                lam = 1.0
                averaging = state.options["ema"] > 0
                if prev is not None and prev[0] in state.fwd and (averaging or not exact):
                    d_o, s_o, m_o = _other_sums(client, op, state, prev)
                    if averaging:   # every call's share, exact ones too
                        state.fold_backward(prev[0], d_o, s_o, m_o)
                        d_o, s_o, m_o = state.avg_bwd
                if exact or prev is None or prev[0] not in state.fwd:
                    # The job's own sums of this round, around mu (the job's mean: exact) or
                    # re-centred on the merged mean.
                    g_n, g_mu, _ = state.glob(client, op, seq)
                    cnt, g_d, g_s = _fetch_sums(client, op, seq)
                    state.observe("sums", seq, (cnt, g_d, g_s))
                    d = g_d
                    s = g_s + (g_mu - mu) * g_d
                    _count(lagged_exact_backward=1)
                else:
                    d = d_k + d_o
                    s = s_k + (m_k - mu) * d_k + (s_o + (m_o - mu) * d_o)
                    lam = state.damping(seq)
                if lam != 1.0:
                    d, s = _damped(d, s, d_k, s_k, lam, total, n_k, m_k, mk2, mu, m2, eps)
                return [d.astype(npd), s.astype(npd)]

            _, sums = exchange(client.backward, op, seq, "lagged", count, packed, finish)
            grad_x = ops.backward_elemt(dy, x, saved, weight, sums, total)
        return (grad_x, grad_w, grad_b) + (None,) * 11


def _other_sums(client, op, state, prev):
    """The other nodes' (sum dy, sum dy (x - m_o), m_o) of the backward record prev = (seq,
    D_k, S_k): the job's late sums of seq less this node's answer, around the other nodes'
    mean m_o of that call's forward (zeros where this node is the job)."""
    pseq, pd_k, ps_k = prev
    pg = state.glob(client, op, pseq)
    pnode = state.fwd[pseq]["node"]
    cnt, g_d, g_s = _fetch_sums(client, op, pseq)
    state.observe("sums", pseq, (cnt, g_d, g_s))
    n_o, m_o, _ = state.other(client, op, pseq)
    if n_o == 0:
        return np.zeros_like(pd_k), np.zeros_like(ps_k), np.zeros_like(pd_k)
    pm_k = pnode[1]
    # The job's sums around m_o, less this node's (around its m_k'):
    return g_d - pd_k, (g_s + (pg[1] - m_o) * g_d) - (ps_k + (pm_k - m_o) * pd_k), m_o


def _fetch_sums(client, op, seq):
    ready = bool(client.global_sums_ready(op, seq))
    t0 = time.perf_counter()
    cnt, d, s = client.global_sums(op, seq)
    _count(lagged_waits=0 if ready else 1, lagged_wait_seconds=time.perf_counter() - t0)
    return int(cnt), np.asarray(d, dtype=np.float64), np.asarray(s, dtype=np.float64)


def _damped(d, s, d_k, s_k, lam, total, n_k, m_k, mk2, mu, m2, eps):
    """(D, S) that make backward_elemt (with count `total`, mean mu, invstd of (m2 / total +
    eps)) compute lam * lagged dx + (1 - lam) * node-local dx (module docstring)."""
    var = m2 / total + eps                      # 1 / invstd^2
    with np.errstate(divide="ignore", invalid="ignore"):
        b_node = s_k / (mk2 + n_k * eps)           # the node's coefficient of (x - m_k)
        a_node = d_k / n_k + (mu - m_k) * b_node   # ... moved to (x - mu)
        a = lam * (d / total) + (1.0 - lam) * a_node
        b = lam * (s / (total * var)) + (1.0 - lam) * b_node
    return a * total, b * (total * var)

