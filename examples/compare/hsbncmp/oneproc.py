"""hsbn_compare.py --one-process: the comparison's scopes simulated in one process (issue #41).

Every rank of a cell (NODES x WORKERS_PER_NODE workers, BATCH items each) runs in one model:
the workers' batches concatenated in rank order, the same initial weights (cli.initial_state),
data plan (data.make_plan), optimizer (SGD, momentum 0.9, cosine-decayed learning rate) and
loss (cross-entropy over the global batch, which is what DDP's average of the workers' mean
losses is) as the distributed runs. Every BatchNorm is replaced by SimBatchNorm, whose forward
and backward are written out below in float64, per scope:

  local    each worker's own batch
  node     each node's batch (hsbn scope "node")
  group    GROUP_NODES consecutive nodes
  global   the whole job's batch
  renorm   hsbn's scope "renorm" (client/python/hsbn/torch/_renorm.py): normalized with the
           node's statistics, times r = clip(sigma_B / sigma, 1/r_max, r_max) plus d =
           clip((mu_B - mu) / sigma, +-d_max), (mu, sigma) the job's exact statistics of the
           layer's previous call; node-local backward with weight gamma * r; warm-up calls are
           node scope and do not update the running statistics; r_max and d_max ramp up;
           running statistics from the previous call's global statistics
  lagged   issue #41's proposal: forward with this node's fresh partial merged (Chan) with the
           other nodes' partials of the previous call; backward with the job's sum(dy) and
           sum(dy * (x - mu)) re-expressed on this node's mean, the other nodes' share one
           call old; running statistics from the previous call's exact global statistics;
           the first WARMUP calls (default 1) are exact global
  lagged-fwd        lagged forward, node-local backward: Batch Renormalization's, with the
                    lagged statistics as its population ones (no clipping)
  lagged-damped:L   lagged forward, dx = L * lagged dx + (1 - L) * node-local dx
  lagged-guard      lagged forward, damped backward with L chosen per layer and per call
                    by the guard (Guard below) from what every rank knows one call later;
                    with drift=K, by the drift guard instead: L from how fast the layer's
                    exact global statistics moved over the K calls before; with step=K, by
                    the step guard: L from how fast the layer's weight moved
A mode takes options after a colon: lagged-damped:0.25, lagged:warmup=75,
lagged-guard:tau=1,hold=0.9,delay=2, lagged-guard:drift=16,kappa=0.01,model=1,
lagged-guard:step=16,kstep=2.5e-4. Two more options of the lagged family change its backward's
stale share: ema=B averages the other nodes' sum dy and sum dy x over their past calls
(weight B on the older average; exact calls' too) instead of taking their last call's, and
with ema_fwd=1 the forward's share too (their mean and mean of x^2): hsbn.torch's
lagged_ema=B; ef=F is error feedback: the error the stale share put into a call's dx (known one call later) is taken F times back out
of the next call's dx. exact_bwd=1 keeps the lagged forward and gives the backward the job's
fresh sums (no stale share; a global round a call), to see what the backward's staleness costs.
Two more say where lagged's loss comes from: only=K runs lagged in the model's K-th BatchNorm
(1-based, module order) and every other one exact global, both passes; stop=W runs calls W and
later exact global (lagged only before; warmup=W is the converse).
Two oracles split the stale share's error into its two causes (neither is buildable: each
needs a second pass over a batch): oracle=1 recomputes the other nodes' partials of their
previous batch at this step's weights (no weight drift, the batch one call old: the bound of
any weight-change compensation, Cross-Iteration BN's among them); oracle=2 computes them from
this step's batch at the previous step's weights (the batch fresh, the weights one step old).
Each runs that pass (forward and backward, every layer exact global) before the step;
oracle=3 is oracle=1 with the next step's batch instead of the previous one (at this step's
weights: a batch of the same age as oracle=1's, but one no step has trained on yet; the last
step, which has no next batch, keeps plain lagged's share);
oracle_bwd=0 takes only the forward's partials from it (the backward's stale share stays the
previous call's, as Cross-Iteration BN compensates the statistics of the forward only).

What each rank's running statistics hold is simulated per rank (rank 0's: the headline metric;
their pooled average, hsbn.torch.sync_running_stats with equal weights: the second one).
"""

import csv
import fcntl
import json
import math
import multiprocessing
import os
import sys
import time

import numpy as np

from . import cli, data, models, train

F64 = None  # torch.float64, set on import of torch
LOCK_NAME = ".oneproc.lock"  # in --out, held while a run writes there
EPS = 1e-5
BN_MOMENTUM = 0.1
RENORM = {"warmup": 5, "ramp": 20, "r_max": 1.1, "d_max": 0.25}   # hsbn.torch's defaults
# trip: the trip guard (issue #41, and hsbn.torch's lagged_trip): a layer whose exact global
# statistics moved more than `trip` between its last two known calls (v below, in units of the
# older call's standard deviation) runs its next `trip_calls` calls exact global, both passes;
# 0: off. Every rank knows v alike from late results at the call it decides (no extra delay).
# trip_rel: the relative form: v > trip_rel times the layer's level of v (an exponential
# average over its calls before, weight TRIP_DECAY on the older level; trips from its
# (trip_hist + 1)-th value on, trip_hist TRIP_HISTORY unless given). trip_lam=L: a trip sets the
# backward's damping to L for the trip_calls calls instead of running them exact global (no
# global round: the forward stays lagged). trip_fwd=1: a trip's calls are exact global in the
# forward only, their backward lagged (one global round per call instead of two).
# trip_model=1: a trip of any layer sends every lagged layer of the model exact global for
# trip_calls calls (the layers after it from this call, the ones before it from the next).
LAGGED = {"warmup": 1, "trip": 0.0, "trip_calls": 8, "trip_rel": 0.0}
TRIP_DECAY = 0.9
TRIP_HISTORY = 5
# tau 8: in the default cell's fast regime plain lagged's signal s is 6-60 per layer (median
# over calls; 7-9 in the last two layers), where lambda 0.25-0.5 worked best (issue #41), so
# tau / s lands there; the slow regime is meant to show s below tau (trust).
# delay: the call whose signal sets lambda, counted back from the call that uses it. 1 is the
# simulation's ideal; the service can do no better than 2: a call's sum dx exists only after
# its backward round, so it travels with the next call's partials and comes back in that
# call's late result.
GUARD = {"warmup": 1, "tau": 8.0, "hold": 0.9, "lam_min": 0.0, "delay": 1, "drift": 0,
         "kappa": 0.015, "model": 0, "step": 0, "kstep": 1e-3, "trip": 0.0, "trip_calls": 8,
         "trip_rel": 0.0}
DEFAULT_MODES = ["node", "global", "renorm", "lagged", "lagged-damped:0.25",
                 "lagged-damped:0.5", "lagged-guard"]
BASE_MODES = ("local", "node", "group", "global", "renorm", "lagged", "lagged-fwd",
              "lagged-damped", "lagged-guard")


def parse_mode(text):
    """'lagged-damped:0.25' -> ('lagged-damped', {'lam': 0.25}); 'lagged:warmup=5' ->
    ('lagged', {'warmup': 5}). ValueError on an unknown mode or option."""
    base, _, rest = text.strip().partition(":")
    if base not in BASE_MODES:
        raise ValueError("unknown one-process mode %r; choose from %s"
                         % (base, ", ".join(BASE_MODES)))
    opts = {}
    if base == "renorm":
        opts.update(RENORM)
    elif base.startswith("lagged"):
        opts.update(GUARD if base == "lagged-guard" else LAGGED)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            if base != "lagged-damped":
                raise ValueError("%s: option %r is not KEY=VALUE" % (text, item))
            key, value = "lam", key
        opts[key.strip()] = float(value)
    if base == "lagged-damped" and "lam" not in opts:
        raise ValueError("lagged-damped needs its lambda: lagged-damped:0.5")
    if opts.get("drift") and opts.get("step"):
        raise ValueError("%s: drift and step are two guards; choose one" % text)
    for key in ("drift", "step"):
        if key in opts and (opts[key] != int(opts[key]) or opts[key] < 0):
            raise ValueError("%s: %s must be a whole number of calls" % (text, key))
    if "delay" in opts:
        if opts["delay"] != int(opts["delay"]) or opts["delay"] < 1:
            raise ValueError("%s: delay must be a whole number of calls >= 1" % text)
        opts["delay"] = int(opts["delay"])
    for key in ("trip_calls", "trip_hist"):
        if key in opts:
            if opts[key] != int(opts[key]) or opts[key] < 1:
                raise ValueError("%s: %s must be a whole number of calls >= 1" % (text, key))
            opts[key] = int(opts[key])
    for key in ("trip", "trip_rel"):
        if opts.get(key, 0) < 0:
            raise ValueError("%s: %s must be >= 0 (0: off)" % (text, key))
    if "trip_lam" in opts and not 0.0 <= opts["trip_lam"] <= 1.0:
        raise ValueError("%s: trip_lam must be in [0, 1]" % text)
    if "ema" in opts and not 0.0 <= opts["ema"] < 1.0:
        raise ValueError("%s: ema must be in [0, 1)" % text)
    if "ema_fwd" in opts and (opts["ema_fwd"] not in (0.0, 1.0) or "ema" not in opts):
        raise ValueError("%s: ema_fwd is 0 or 1, with ema" % text)
    if "ef" in opts and not 0.0 <= opts["ef"] <= 1.0:
        raise ValueError("%s: ef must be in [0, 1]" % text)
    for key in ("only", "stop"):
        if key in opts:
            if not base.startswith("lagged"):
                raise ValueError("%s: %s is an option of the lagged family" % (text, key))
            if opts[key] != int(opts[key]) or opts[key] < 1:
                raise ValueError("%s: %s must be a whole number >= 1" % (text, key))
            opts[key] = int(opts[key])
    if "trip_model" in opts and (opts["trip_model"] not in (0.0, 1.0)
                                 or not base.startswith("lagged")):
        raise ValueError("%s: trip_model is 0 or 1, in the lagged family" % text)
    if "oracle" in opts:
        if opts["oracle"] not in (1.0, 2.0, 3.0) or not base.startswith("lagged"):
            raise ValueError("%s: oracle is 1 (fresh weights), 2 (fresh batch) or 3 (an unseen "
                             "batch at fresh weights), in the lagged family" % text)
        opts["oracle"] = int(opts["oracle"])
    if "oracle_bwd" in opts and (opts["oracle_bwd"] not in (0.0, 1.0) or "oracle" not in opts):
        raise ValueError("%s: oracle_bwd is 0 or 1, with oracle" % text)
    if "exact_bwd" in opts and opts["exact_bwd"] not in (0.0, 1.0):
        raise ValueError("%s: exact_bwd is 0 or 1" % text)
    if "wfix" in opts:
        if opts["wfix"] not in (1.0, 2.0):
            raise ValueError("%s: wfix is 1 (this step) or 2 (the next step)" % text)
        opts["wfix"] = int(opts["wfix"])
    if "wfix_mean" in opts and (opts["wfix_mean"] not in (0.0, 1.0) or "wfix" not in opts):
        raise ValueError("%s: wfix_mean is 0 or 1, with wfix" % text)
    if "ema" in opts and "oracle" in opts:
        raise ValueError("%s: ema averages the calls' own partials, an oracle replaces them; "
                         "choose one" % text)
    if ({"ema", "ef", "exact_bwd", "wfix"} & set(opts)) and not base.startswith("lagged"):
        raise ValueError("%s: ema, ef, exact_bwd and wfix are options of the lagged family"
                         % text)
    if "warmup" in opts:
        opts["warmup"] = int(opts["warmup"])
        if base.startswith("lagged") and opts["warmup"] < 1:
            raise ValueError("%s: warmup must be >= 1 (the first call has no previous one)"
                             % text)
    return base, opts


def parse_spike(text):
    """'60:20:3' -> [60, 20.0, 3] (from step 60, the learning rate times 20 for 3 steps);
    None -> None. ValueError naming what is wrong."""
    if text is None:
        return None
    parts = text.split(":")
    try:
        step, factor, length = int(parts[0]), float(parts[1]), int(parts[2])
    except (ValueError, IndexError):
        raise ValueError("%r is not STEP:FACTOR:STEPS, e.g. 60:20:3" % text) from None
    if len(parts) != 3 or step < 0 or length < 1 or not math.isfinite(factor) or factor <= 0:
        raise ValueError("%r: STEP >= 0, FACTOR > 0 and STEPS >= 1 are needed" % text)
    return [step, factor, length]


def split_modes(text):
    """'node,lagged-guard:tau=1,hold=0.9,global' -> ['node', 'lagged-guard:tau=1,hold=0.9',
    'global']: a comma starts a new mode only where a mode's name follows; otherwise what
    follows is one more option of the mode before."""
    modes = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if modes and item.partition(":")[0] not in BASE_MODES:
            modes[-1] += "," + item
        else:
            modes.append(item)
    return modes


class Topology:
    def __init__(self, nodes, workers_per_node, group_nodes=2):
        self.nodes = nodes
        self.wpn = workers_per_node
        self.world = nodes * workers_per_node
        self.group_nodes = group_nodes


def _rows(x, r):
    """x (N, C, *) float64 -> (R, N/R * prod(spatial), C): the items of each of R contiguous
    units (workers, nodes, groups, the job) as one sample axis."""
    n, c = x.shape[0], x.shape[1]
    return x.reshape(r, n // r, c, -1).transpose(2, 3).reshape(r, -1, c)


def _unrows(t, shape):
    n, c = shape[0], shape[1]
    r = t.shape[0]
    rest = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    return t.reshape(r, n // r, rest, c).transpose(2, 3).reshape(shape)


def _moments(xr):
    """Per row: (count, mean (R, C), m2 (R, C)), float64, two-pass."""
    mean = xr.mean(1)
    m2 = ((xr - mean[:, None]) ** 2).sum(1)
    return xr.shape[1], mean, m2


def _merge(counts, means, m2s):
    """Chan's merge of per-part (count, mean, m2) (lists of (C,) tensors) -> (n, mean, m2)."""
    n = sum(counts)
    mean = sum(c * m for c, m in zip(counts, means)) / n
    m2 = sum(m2s) + sum(c * (m - mean) ** 2 for c, m in zip(counts, means))
    return n, mean, m2


class LayerSim:
    """One BatchNorm layer's simulated state across every rank: the scope, its per-rank running
    statistics, the partials of the previous call (renorm, lagged) and the guard's state."""

    def __init__(self, mode, opts, topo, c, name=""):
        import torch
        self.mode, self.opts, self.topo, self.name = mode, dict(opts), topo, name
        self.seq = 0
        self.running_mean = torch.zeros(topo.world, c, dtype=torch.float64)
        self.running_var = torch.ones(topo.world, c, dtype=torch.float64)
        self.prev_fwd = None    # per node: (count, mean (nodes, C), m2 (nodes, C))
        self.prev_global = None  # exact (count, mean, m2) of the previous call
        self.prev_bwd = None    # per node: (sum dy, sum dy (x - c_n), c_n) each (nodes, C)
        self.lam = 1.0 if mode == "lagged" else opts.get("lam", 0.0)
        self.signal = []        # guard: s per call
        self.lams = []          # lambda used per call (lagged family)
        self.hold = 0.0
        self.pending = []       # guard: signals not yet acted on (its delay)
        self.history = []       # drift guard: (mean, sd) of exact global statistics; step: gamma
        self.drift = []         # drift or step guard: v per call (reported as drift_median)
        self.model_drift = None  # drift guard, model=1: {layer: {call: v}}, one per model
        self.updates_running = True
        self.prev_global2 = None  # trip guard: exact statistics of the call before prev_global
        self.exact_until = 0    # trip guard: calls below this seq are exact global
        self.lam_until = 0      # trip guard with trip_lam: calls below this seq use it
        self.trips = []         # trip guard: the seqs at which it tripped
        self.exact_calls = 0    # lagged family: calls that ran exact global
        self.trip_v = []        # trip guard: v per call
        self.trip_level = 0.0   # trip guard, relative form: the level of v before this call
        self.model_trip = None  # trip_model=1: {"until": seq}, one dict per model
        self.always_exact = False  # only=K: a layer other than the K-th, exact global throughout
        self.ef_prev = None     # error feedback: (c1, c2) of the previous call, (R, C) each
        self.ema_bwd = None     # ema: the averaged (sum dy, sum dy x) per node, (R, C) each
        self.ema_fwd = None     # ema_fwd: the averaged (mean, mean of x^2) per node, (R, C) each
        self.conv = None        # wfix: the Conv2d right before the layer, its input this call,
        self.conv_in = None     # and the corrections of its weight gradient (this step's,
        self.wfix_new = None    # the previous step's)
        self.wfix_old = None
        self.recording = False  # oracle: the pass that makes the stale share is running

    # -- running statistics --------------------------------------------------------------------
    def _update(self, mean_rows, var_rows):
        """mean_rows, var_rows: (world, C) the value each rank blends in (unbiased var)."""
        self.running_mean.mul_(1 - BN_MOMENTUM).add_(BN_MOMENTUM * mean_rows)
        self.running_var.mul_(1 - BN_MOMENTUM).add_(BN_MOMENTUM * var_rows)

    def _per_rank(self, mean, var, r):
        """(R, C) per unit -> (world, C) per rank."""
        return mean.repeat_interleave(self.topo.world // r, 0), var.repeat_interleave(
            self.topo.world // r, 0)


def _make_function():
    import torch

    class SimBNFunction(torch.autograd.Function):

        @staticmethod
        def forward(ctx, x, weight, bias, sim):
            return _forward(ctx, x, weight, bias, sim)

        @staticmethod
        def backward(ctx, dy):
            return _backward(ctx, dy) + (None,)

    return SimBNFunction


_FN = None


def _fn():
    global _FN
    if _FN is None:
        _FN = _make_function()
    return _FN


def _forward(ctx, x, weight, bias, sim):
    import torch
    topo = sim.topo
    mode, o = sim.mode, sim.opts
    x64 = x.detach().to(torch.float64)
    shape = x64.shape
    c = shape[1]
    w = weight.detach().to(torch.float64)
    b = bias.detach().to(torch.float64)
    nodes = topo.nodes
    # Exact statistics of every unit the scopes need.
    xn = _rows(x64, nodes)
    cn, mean_n, m2_n = _moments(xn)
    g_n, g_mean, g_m2 = _merge([cn] * nodes, list(mean_n), list(m2_n))
    if sim.recording:
        # The oracle's pass: exact global, both passes; it leaves the per-node partials as the
        # stale share and touches no other state (running statistics, guards, call count).
        sim.prev_fwd = (cn, mean_n.clone(), m2_n.clone())
        mean = g_mean[None].expand(nodes, c).clone()
        invstd = (1.0 / torch.sqrt(g_m2 / g_n + EPS))[None].expand(nodes, c).clone()
        y = (xn - mean[:, None]) * invstd[:, None] * w[None, None] + b[None, None]
        ctx.sim, ctx.shape, ctx.dtype, ctx.wdtype = sim, shape, x.dtype, weight.dtype
        ctx.recording = True
        ctx.save_for_backward(xn, mean, invstd, w[None].expand(nodes, c), w, torch.ones(0),
                              torch.ones(0))
        return _unrows(y, shape).to(x.dtype, copy=True)   # not a view: ReLU works in place
    r_eff = d_eff = None
    exact_global_now = False
    if mode in ("local", "node", "group", "global"):
        r = {"local": topo.world, "node": nodes, "group": nodes // topo.group_nodes,
             "global": 1}[mode]
        xr = _rows(x64, r)
        cnt, mean, m2 = _moments(xr)
        var = m2 / cnt
        rm, rv = sim._per_rank(mean, m2 / (cnt - 1), r)
        sim._update(rm, rv)
    elif mode == "renorm":
        r = nodes
        xr, cnt, mean, var = xn, cn, mean_n, m2_n / cn
        if sim.seq >= max(o["warmup"], 1) and sim.prev_global is not None:
            pg_n, pg_mean, pg_m2 = sim.prev_global
            done = 1.0 if o["ramp"] <= 0 else min(1.0, (sim.seq - max(o["warmup"], 1) + 1)
                                                  / o["ramp"])
            r_max, d_max = 1.0 + (o["r_max"] - 1.0) * done, o["d_max"] * done
            sigma_b = torch.sqrt(var + EPS)
            sigma = torch.sqrt(pg_m2 / pg_n + EPS)
            r_eff = torch.clamp(sigma_b / sigma, 1.0 / r_max, r_max)
            d_eff = torch.clamp((mean - pg_mean) / sigma, -d_max, d_max)
            rm, rv = sim._per_rank(pg_mean[None], (pg_m2 / (pg_n - 1))[None], 1)
            sim._update(rm, rv)
    else:  # the lagged family
        r = nodes
        xr, cnt = xn, cn
        if sim.prev_global2 is not None:   # v is recorded with the trip off too
            v = trip_drift(sim.prev_global2, sim.prev_global)
            sim.trip_v.append(v)
        if (o.get("trip") or o.get("trip_rel")) and sim.prev_global2 is not None:
            over = bool(o.get("trip")) and v > o["trip"]
            if o.get("trip_rel"):
                over = over or (len(sim.trip_v) > o.get("trip_hist", TRIP_HISTORY)
                                and v > o["trip_rel"] * sim.trip_level)
                sim.trip_level = (v if len(sim.trip_v) == 1 else
                                  TRIP_DECAY * sim.trip_level + (1 - TRIP_DECAY) * v)
            until = sim.lam_until if "trip_lam" in o else sim.exact_until
            if over and sim.seq >= until:
                sim.trips.append(sim.seq)
            if over:
                if "trip_lam" in o:   # no global round: the backward's damping instead
                    sim.lam_until = sim.seq + o["trip_calls"]
                else:
                    sim.exact_until = sim.seq + o["trip_calls"]
                    if sim.model_trip is not None:
                        sim.model_trip["until"] = max(sim.model_trip["until"], sim.exact_until)
        if sim.model_trip is not None:
            sim.exact_until = max(sim.exact_until, sim.model_trip["until"])
        if (sim.seq < o["warmup"] or sim.seq < sim.exact_until or sim.always_exact
                or sim.seq >= o.get("stop", math.inf)):
            exact_global_now = True
            sim.exact_calls += 1
            mean = g_mean[None].expand(nodes, c).clone()
            var = (g_m2 / g_n)[None].expand(nodes, c).clone()
        else:
            pc, pmean, pm2 = sim.prev_fwd
            if o.get("ema_fwd"):
                # ema_fwd=1: the forward's stale share averaged as the backward's (ema=B): each
                # node's mean and mean of x^2 over its past calls, so that both passes see the
                # same estimate of the other nodes.
                q1, q2 = sim.ema_fwd
                pmean, pm2 = q1, pc * torch.clamp(q2 - q1 * q1, min=0.0)
            mean = torch.empty(nodes, c, dtype=torch.float64)
            var = torch.empty(nodes, c, dtype=torch.float64)
            for n in range(nodes):
                parts = [(cn, mean_n[n], m2_n[n]) if k == n else (pc, pmean[k], pm2[k])
                         for k in range(nodes)]
                tot, mm, mv = _merge(*zip(*parts))
                mean[n], var[n] = mm, mv / tot
        if sim.prev_global is not None:  # running statistics: the previous call's exact global
            pg_n, pg_mean, pg_m2 = sim.prev_global
            rm, rv = sim._per_rank(pg_mean[None], (pg_m2 / (pg_n - 1))[None], 1)
            sim._update(rm, rv)
    sim.prev_fwd = (cn, mean_n.clone(), m2_n.clone())
    if o.get("ema_fwd"):   # every call's partials, exact ones too; used from the next call on
        sim.ema_fwd = _ema(sim.ema_fwd, (mean_n, m2_n / cn + mean_n * mean_n), o["ema"])
    sim.prev_global2 = sim.prev_global
    sim.prev_global = (g_n, g_mean.clone(), g_m2.clone())
    if mode == "lagged-guard" and o["drift"]:
        sim.lam = Guard.drift_lambda(sim, g_mean, torch.sqrt(g_m2 / g_n + EPS))
    elif mode == "lagged-guard" and o["step"]:
        sim.lam = Guard.step_lambda(sim, w)
    invstd = 1.0 / torch.sqrt(var + EPS)
    xhat = (xr - mean[:, None]) * invstd[:, None]
    if r_eff is not None:
        w_rows = w[None] * r_eff
        b_rows = b[None] + w[None] * d_eff
    else:
        w_rows = w[None].expand(r, c)
        b_rows = b[None].expand(r, c)
    y = xhat * w_rows[:, None] + b_rows[:, None]
    ctx.sim = sim
    ctx.recording = False
    ctx.node_stats = (mean_n, 1.0 / torch.sqrt(m2_n / cn + EPS))
    ctx.seq = sim.seq
    # trip_fwd: a trip's calls are exact in the forward only (one global round each); their
    # backward stays lagged (the warm-up's stays exact).
    ctx.exact_global_now = (exact_global_now and not (
        o.get("trip_fwd") and mode.startswith("lagged") and sim.seq >= o["warmup"])) or bool(
        o.get("exact_bwd") and mode.startswith("lagged"))
    ctx.shape = shape
    ctx.dtype = x.dtype
    ctx.wdtype = weight.dtype
    ctx.save_for_backward(xr, mean, invstd, w_rows, w,
                          r_eff if r_eff is not None else torch.ones(0),
                          d_eff if d_eff is not None else torch.ones(0))
    sim.seq += 1
    return _unrows(y, shape).to(x.dtype, copy=True)   # not a view (float64 runs)


def _backward(ctx, dy):
    import torch
    xr, mean, invstd, w_rows, w, r_eff, d_eff = ctx.saved_tensors
    sim = ctx.sim
    mode = sim.mode
    r = xr.shape[0]
    dyr = _rows(dy.to(torch.float64), r)
    xmu = xr - mean[:, None]
    xhat = xmu * invstd[:, None]
    s1 = dyr.sum(1)                      # (R, C): sum dy per unit
    s2 = (dyr * xmu).sum(1)              # sum dy (x - mean_unit)
    cnt = xr.shape[1]
    grad_b = s1.sum(0)
    if r_eff.numel():
        grad_w = (r_eff * (dyr * xhat).sum(1) + d_eff * s1).sum(0)
    else:
        grad_w = (dyr * xhat).sum(1).sum(0)

    def job_s2():
        # The job's fresh sum dy (x - mu_n) for each node n, from every node's s2 and s1.
        return torch.stack([(s2 + (mean - mean[n][None]) * s1).sum(0) for n in range(r)])

    def dx_from(S1, S2, M):
        return w_rows[:, None] * invstd[:, None] * (
            dyr - S1[:, None] / M - xmu * (invstd ** 2)[:, None] * S2[:, None] / M)

    if ctx.recording:
        if sim.opts.get("oracle_bwd", 1):
            sim.prev_bwd = (s1.clone(), s2.clone(), mean.clone())
        dx = dx_from(s1.sum(0)[None].expand_as(s1), job_s2(), cnt * r)
        return _unrows(dx, ctx.shape).to(ctx.dtype), grad_w.to(ctx.wdtype), \
            grad_b.to(ctx.wdtype)
    if not mode.startswith("lagged"):
        dx = dx_from(s1, s2, cnt)
    elif ctx.exact_global_now:
        # Warm-up: exact global (every unit's mean is the global one here; with exact_bwd the
        # job's sums re-expressed on each node's lagged mean).
        dx = dx_from(s1.sum(0)[None].expand_as(s1), job_s2(), cnt * r)
        sim.ef_prev = None  # no stale share, no error to feed back
    else:
        # The job's sums for node n: its own fresh ones and the others' of the previous call,
        # re-expressed on node n's mean: sum dy (x - mu_n) = P2_k + (c_k - mu_n) P1_k.
        p1, p2, pc = sim.prev_bwd
        S1 = torch.empty_like(s1)
        S2 = torch.empty_like(s2)
        if sim.opts.get("ema"):
            # ema=B: the others' share is an exponential average over their past calls (weight
            # B on the older average) of sum dy and sum dy x, instead of their last call's.
            q1, q2 = sim.ema_bwd
            for n in range(r):
                others = [k for k in range(r) if k != n]
                S1[n] = s1[n] + q1[others].sum(0)
                S2[n] = s2[n] + (q2[others] - mean[n][None] * q1[others]).sum(0)
        else:
            for n in range(r):
                others = [k for k in range(r) if k != n]
                S1[n] = s1[n] + p1[others].sum(0)
                S2[n] = s2[n] + (p2[others] + (pc[others] - mean[n][None]) * p1[others]).sum(0)
        dx_lag = dx_from(S1, S2, cnt * r)
        # Node-local backward of the lagged forward, as Batch Renormalization's (renorm's)
        # backward: y = gamma (xhat_B r + d) + beta with r = sigma_B / sigma, d = (mu_B - mu) /
        # sigma (the lagged mu, sigma) held constant, the gradient through the node's own
        # mu_B, sigma_B only; it sums to zero over each node.
        mean_b, invstd_b = ctx.node_stats
        s2b = s2 + (mean - mean_b) * s1          # sum dy (x - mu_B)
        xmu_b = xr - mean_b[:, None]
        dx_node = w_rows[:, None] * invstd[:, None] * (
            dyr - s1[:, None] / cnt - xmu_b * (invstd_b ** 2)[:, None] * s2b[:, None] / cnt)
        if mode == "lagged":
            lam = 1.0
        elif mode == "lagged-fwd":
            lam = 0.0
        elif mode == "lagged-damped":
            lam = sim.opts["lam"]
        else:
            lam = sim.lam
        if ctx.seq < sim.lam_until:
            lam = sim.opts["trip_lam"]
        sim.lams.append(lam)
        dx = dx_lag if lam == 1.0 else (dx_node if lam == 0.0 else
                                        lam * dx_lag + (1.0 - lam) * dx_node)
        if sim.opts.get("wfix") and sim.conv is not None:
            # wfix: what the stale share put into the weight gradient of the convolution
            # before the layer, lam * (dx with the job's fresh sums - dx_lag) through that
            # convolution's input (the fresh sums are every node's one call later, so the
            # service could add it a step late: wfix=2; wfix=1 adds it this step, a bound);
            # wfix_mean=1: the sum dy term only.
            import torch.nn.grad as tg
            S2t = S2 if sim.opts.get("wfix_mean") else job_s2()
            d = lam * (dx_from(s1.sum(0)[None].expand_as(s1), S2t, cnt * r) - dx_lag)
            conv = sim.conv
            sim.wfix_new = tg.conv2d_weight(
                sim.conv_in, conv.weight.shape, _unrows(d, ctx.shape), conv.stride,
                conv.padding, conv.dilation, conv.groups)
        if sim.opts.get("ef"):
            # Error feedback (ef=F): the stale share put lam * w * invstd * (e1 / M + (x - mu_n)
            # invstd^2 e2 / M) into this call's dx, e the job's fresh sums minus the ones used;
            # the next call takes F times it back out. Every node knows e one call later (the
            # others' partials of this call are the next call's stale share), so no round is
            # added.
            S1t = s1.sum(0)[None].expand_as(s1)
            S2t = job_s2()
            M = cnt * r
            c1 = lam * w_rows * invstd * (S1t - S1) / M
            c2 = lam * w_rows * invstd ** 3 * (S2t - S2) / M
            if sim.ef_prev is not None:
                p_c1, p_c2 = sim.ef_prev
                dx = dx - sim.opts["ef"] * (p_c1[:, None] + xmu * p_c2[:, None])
            sim.ef_prev = (c1, c2)
        # The guard's signal, known on every rank one call later (each node sends its
        # sum dx_lag and sum dx_lag^2 per channel with its partials): how far the job's
        # lagged input gradients are from summing to zero per channel, in units of their
        # random-walk size sqrt(sum dx^2).
        tot = dx_lag.sum(1).sum(0)
        size = torch.sqrt((dx_lag ** 2).sum(1).sum(0))
        s = float(torch.linalg.norm(tot) / max(float(torch.linalg.norm(size)), 1e-300))
        sim.signal.append(s)
        if mode == "lagged-guard" and not (sim.opts["drift"] or sim.opts["step"]):
            sim.pending.append(s)
            if len(sim.pending) >= sim.opts["delay"]:
                sim.lam = Guard.next_lambda(sim, sim.pending.pop(0))
    if mode.startswith("lagged"):
        sim.prev_bwd = (s1.clone(), s2.clone(), mean.clone())
        if sim.opts.get("ema"):   # every call's sums, exact ones too; used from the next call on
            sim.ema_bwd = _ema(sim.ema_bwd, (s1, s2 + mean * s1), sim.opts["ema"])
    dx = _unrows(dx, ctx.shape).to(ctx.dtype)
    return dx, grad_w.to(ctx.wdtype), grad_b.to(ctx.wdtype)


def _ema(avg, new, b):
    """The exponential average of a tuple of tensors, weight b on the older average avg (None:
    the first value, new itself)."""
    if avg is None:
        return tuple(t.clone() for t in new)
    return tuple(b * a + (1 - b) * t for a, t in zip(avg, new))


def trip_drift(old, new):
    """The trip guard's v: how far a layer's exact global statistics moved from call `old` to
    call `new` (each (N, mean, m2)): the rms over channels of the move in units of the older
    call's standard deviation, sqrt(((mu1 - mu0) / sd0)^2 + log(sd1 / sd0)^2). The same formula
    as hsbn.torch's lagged_trip (client/python/hsbn/torch/_lagged.py, trip_drift)."""
    import torch
    (n0, m0, q0), (n1, m1, q1) = old, new
    sd0 = torch.sqrt(q0 / n0 + EPS)
    sd1 = torch.sqrt(q1 / n1 + EPS)
    move = ((m1 - m0) / sd0) ** 2 + torch.log(sd1 / sd0) ** 2
    return float(move.mean().sqrt())


def node_dx_sums(n, m, m2, sdy, sdy_xm, sdy2, mu, invstd, w, S1, S2, total):
    """The guard's signal without a second exchange: one node's sum dx and sum dx^2 per channel
    of lagged's input gradient dx = w invstd (dy - S1/total - (x - mu) invstd^2 S2/total), from
    that node's partials alone: count n, mean m, m2 (forward), sum dy, sum dy (x - m) (backward,
    around the node's own mean as the protocol sends it) and sum dy^2 (one more row), with the
    merged mu, invstd and job sums S1, S2 the node used. A root that has every node's partials
    of a call can so give every rank the job's sums of dx in that call's late result (a delay of
    one call); without sum dy^2 the denominator needs sum dx^2 sent with the next call (two)."""
    d = m - mu
    sx, sx2 = n * d, m2 + n * d * d           # sum (x - mu), sum (x - mu)^2
    sdx_mu = sdy_xm + d * sdy                 # sum dy (x - mu)
    a = w * invstd
    p, q = S1 / total, invstd * invstd * S2 / total
    sum_dx = a * (sdy - n * p - q * sx)
    sum_dx2 = a * a * (sdy2 + n * p * p + q * q * sx2 - 2 * p * sdy - 2 * q * sdx_mu
                       + 2 * p * q * sx)
    return sum_dx, sum_dx2


class Guard:
    """The adaptive guard (a proposal): per layer, lambda for the next call from the signal s
    of this call (identical on every rank: built from per-node sums every rank receives one
    call later). s = ||sum over the job of the lagged dx, per channel|| / ||sqrt(sum dx^2) per
    channel||: 0 when the job's input gradients sum to zero per channel (exact global
    backward), ~1 for sums of the size of uncorrelated noise; the stale share makes it grow.
    A peak hold reacts at once to growth and relaxes by `hold` per call; lambda = clip(tau /
    held, lam_min, 1): trust the stale share fully while the job's sums stay within tau of
    their noise size, damp in proportion beyond."""

    @staticmethod
    def drift_lambda(sim, mean, sd):
        """The drift guard (a probe of a signal that sees the step size): lambda for this
        call from how fast the layer's exact global statistics moved over the last K = drift
        calls before it (what every rank has from late results), v = rms over channels of
        (mean(t-1) - mean(t-1-K)) / sd(t-1-K), divided by K: sigma units per call.
        lambda = clip(kappa / v, lam_min, 1); 0.5 until K + 1 calls are known.
        With model=1, v is the largest over the model's layers of their v one call older (from
        statistics up to call t - 2): what every rank of a service has at every layer's call t
        without waiting, since each layer fetched its late result of t - 2 at its call t - 1."""
        o = sim.opts
        k = int(o["drift"])
        h = sim.history
        lam = 0.5
        t = sim.seq
        if len(h) > k:
            (m1, _), (m0, s0) = h[-1], h[-1 - k]
            v = float(((m1 - m0) / s0).square().mean().sqrt()) / k
            sim.drift.append(v)
            if sim.model_drift is not None:
                sim.model_drift.setdefault(sim.name, {})[t] = v
                older = [d.get(t - 1) for d in sim.model_drift.values()]
                v = max(older) if older and None not in older else None
                for d in sim.model_drift.values():
                    d.pop(t - 3, None)
            if v is not None:
                lam = float(min(1.0, max(o["lam_min"], o["kappa"] / max(v, 1e-12))))
        h.append((mean.clone(), sd.clone()))
        del h[:-k - 1]
        return lam

    @staticmethod
    def step_lambda(sim, w):
        """The step guard (a probe): lambda for this call from how fast the layer's own
        weight gamma moves, the optimizer's step as the layer sees it (the same bits on every
        rank, no exchange): v = ||gamma(t) - gamma(t-K)|| / ||gamma(t-K)|| / K with K = step,
        lambda = clip(kstep / v, lam_min, 1); 0.5 until K + 1 calls are known."""
        import torch
        o = sim.opts
        k = int(o["step"])
        h = sim.history
        lam = 0.5
        if len(h) >= k:
            w0 = h[-k]
            v = float(torch.linalg.norm(w - w0) / max(float(torch.linalg.norm(w0)), 1e-12)) / k
            sim.drift.append(v)
            lam = float(min(1.0, max(o["lam_min"], o["kstep"] / max(v, 1e-12))))
        h.append(w.clone())
        del h[:-k]
        return lam

    @staticmethod
    def next_lambda(sim, s):
        o = sim.opts
        sim.hold = max(s, o["hold"] * sim.hold)
        return float(min(1.0, max(o["lam_min"], o["tau"] / max(sim.hold, 1e-12))))


def _sim_bn_class():
    import torch
    import torch.nn.functional as F

    class SimBatchNorm(torch.nn.BatchNorm2d):
        """BatchNorm2d whose training forward runs a LayerSim; eval uses running_mean and
        running_var (set from the simulated ranks' records before evaluation)."""

        def forward(self, x):
            if self.training:
                return _fn().apply(x, self.weight, self.bias, self.sim)
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)

    return SimBatchNorm


def convert(model, mode, opts, topo):
    """Replaces every BatchNorm2d of model by SimBatchNorm (same parameters and buffers);
    returns the LayerSims in module order."""
    import torch
    cls = _sim_bn_class()
    sims = []

    def swap(module, prefix=""):
        before = None
        for name, child in module.named_children():
            full = prefix + name
            if isinstance(child, torch.nn.BatchNorm2d) and not isinstance(child, cls):
                new = cls(child.num_features, eps=child.eps, momentum=child.momentum)
                new.load_state_dict(child.state_dict())
                new.sim = LayerSim(mode, opts, topo, child.num_features, full)
                if opts.get("wfix"):
                    if not (isinstance(before, torch.nn.Conv2d)
                            and before.out_channels == child.num_features):
                        raise ValueError("wfix: %s does not follow a Conv2d of its width" % full)
                    new.sim.conv = before
                    before.register_forward_pre_hook(_stash_input(new.sim))
                sims.append(new.sim)
                setattr(module, name, new)
            else:
                swap(child, full + ".")
            before = child
    swap(model)
    if opts.get("trip_model"):
        shared = {"until": 0}
        for sim in sims:
            sim.model_trip = shared
    if "only" in opts:
        if opts["only"] > len(sims):
            raise ValueError("only=%d: the model has %d BatchNorm layers"
                             % (opts["only"], len(sims)))
        for i, sim in enumerate(sims):
            sim.always_exact = i + 1 != opts["only"]
    return sims


def _stash_input(sim):
    import torch

    def hook(module, args):
        sim.conv_in = args[0].detach().to(torch.float64)
    return hook


def apply_wfix(sims):
    """After a step's backward: adds each layer's weight-gradient correction to its
    convolution, this step's (wfix=1) or the previous step's (wfix=2)."""
    for sim in sims:
        if not sim.opts.get("wfix"):
            continue
        fix = sim.wfix_new if sim.opts["wfix"] == 1 else sim.wfix_old
        if fix is not None:
            g = sim.conv.weight.grad
            g.add_(fix.to(g.dtype))
        sim.wfix_old, sim.wfix_new = sim.wfix_new, None


def record_stale_share(sims, run_pass):
    """The oracles (oracle=1, 2, 3): runs run_pass() (a forward and backward of the model) with
    every layer exact global, keeping each layer's per-node partials of it as the stale share
    of the layer's next call; nothing else of the layers changes. The caller discards the
    gradients run_pass leaves."""
    for sim in sims:
        sim.recording = True
    try:
        run_pass()
    finally:
        for sim in sims:
            sim.recording = False


def set_running(model, sims, how):
    """Loads rank 0's running statistics (how="rank0") or their pool over the ranks (law of
    total variance with equal weights: hsbn.torch.sync_running_stats) into the modules."""
    import torch
    mods = [m for m in model.modules() if hasattr(m, "sim")]
    for m in mods:
        s = m.sim
        if how == "rank0":
            mean, var = s.running_mean[0], s.running_var[0]
        else:
            mean = s.running_mean.mean(0)
            var = (s.running_var + (s.running_mean - mean[None]) ** 2).mean(0)
        with torch.no_grad():
            m.running_mean.copy_(mean.to(m.running_mean.dtype))
            m.running_var.copy_(var.to(m.running_var.dtype))


# --- one run -----------------------------------------------------------------------------------

def run_one(cfg, task, seed, mode_text, init, plan, arrays, progress=None, dtype="float32",
            record_first=False, max_steps=None):
    """Trains one (seed, mode) in one process; returns its result dict. max_steps: stop after
    that many steps of the schedule (for checks; no evaluation then)."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    mode, opts = parse_mode(mode_text)
    topo = Topology(cfg["nodes"], cfg["workers_per_node"], cfg.get("group_nodes") or 2)
    model = models.build(task, cfg.get("model"))
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in init.items()})
    sims = convert(model, mode, opts, topo)
    if mode == "lagged-guard" and opts.get("model"):
        model_drift = {}
        for sim in sims:
            sim.model_drift = model_drift
    if dtype == "float64":
        model = model.double()
    lr0 = cfg["lr"][task] if isinstance(cfg["lr"], dict) else cfg["lr"]
    opt = torch.optim.SGD(model.parameters(), lr=lr0, momentum=0.9)
    steps = plan["steps"]
    ranks = list(range(topo.world))
    losses = np.zeros(steps)
    t0 = time.perf_counter()
    first_grads = None
    oracle = opts.get("oracle")
    prev_xy = old_params = None

    def stale_pass(xb, yb):
        def run_pass():
            F.cross_entropy(model(xb), yb).backward()
        record_stale_share(sims, run_pass)
        opt.zero_grad()

    for step in range(steps if max_steps is None else min(steps, max_steps)):
        x, y = train.batch(torch, task, plan, arrays, step, ranks)
        if dtype == "float64":
            x = x.double()
        spike = cfg.get("lr_spike")
        boost = (spike[1] if spike and spike[0] <= step < spike[0] + spike[2] else 1.0)
        for g in opt.param_groups:
            g["lr"] = boost * lr0 * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        if oracle == 1 and prev_xy is not None:
            stale_pass(*prev_xy)          # the previous batch at this step's weights
        elif oracle == 3 and 0 < step < steps - 1:
            xb, yb = train.batch(torch, task, plan, arrays, step + 1, ranks)
            stale_pass(xb.double() if dtype == "float64" else xb, yb)   # unseen, these weights
        elif oracle == 2 and old_params is not None:
            now = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p, q in zip(model.parameters(), old_params):
                    p.copy_(q)
            stale_pass(x, y)              # this batch at the previous step's weights
            with torch.no_grad():
                for p, q in zip(model.parameters(), now):
                    p.copy_(q)
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        apply_wfix(sims)
        if record_first and step == 0:
            first_grads = {k: p.grad.detach().double().numpy().copy()
                           for k, p in model.named_parameters()}
        if oracle == 1:
            prev_xy = (x, y)
        elif oracle == 2:
            old_params = [p.detach().clone() for p in model.parameters()]
        opt.step()
        losses[step] = loss.item()
        if progress is not None:
            progress(step + 1, steps)
    train_s = time.perf_counter() - t0
    if max_steps is not None:
        return {"seed": seed, "mode": mode_text, "loss": losses[:max_steps].tolist(),
                "first_grads": first_grads, "sims": sims, "model": model}
    xs, ys = arrays[task + "_test_x"], arrays[task + "_test_y"]
    scores = {}
    # Where every rank holds the same running statistics (global, renorm, lagged) the pooled
    # ones are rank 0's: one evaluation.
    same = all(bool((s.running_mean == s.running_mean[:1]).all()
                    and (s.running_var == s.running_var[:1]).all()) for s in sims)
    for how in ("rank0",) if same else ("rank0", "pooled"):
        set_running(model, sims, how)
        scores[how] = train.metric(task, train.eval_counts(torch, model, task, xs, ys))
    if same:
        scores["pooled"] = scores["rank0"]
    lagged = [s for s in sims if s.mode.startswith("lagged")]
    out = {"task": task, "seed": seed, "mode": mode_text, "steps": steps,
           "metric": scores["rank0"], "metric_sync_stats": scores["pooled"],
           "loss": losses.tolist(), "train_s": train_s, "run_s": time.perf_counter() - t0}
    if lagged:
        out["guard"] = {s.name: {"signal_median": float(np.median(s.signal)) if s.signal
                                 else None,
                                 "signal_max": float(np.max(s.signal)) if s.signal else None,
                                 "lambda_mean": float(np.mean(s.lams)) if s.lams else None,
                                 "lambda_min": float(np.min(s.lams)) if s.lams else None,
                                 "drift_median": float(np.median(s.drift)) if s.drift
                                 else None}
                        for s in lagged}
        out["trip"] = {s.name: {"trips": s.trips, "exact_calls": s.exact_calls,
                                "calls": s.seq,
                                "v_median": float(np.median(s.trip_v)) if s.trip_v else None,
                                "v_p99": float(np.quantile(s.trip_v, 0.99)) if s.trip_v
                                else None,
                                "v_max": float(np.max(s.trip_v)) if s.trip_v else None,
                                "v_max_at": int(np.argmax(s.trip_v)) + 2 if s.trip_v else None}
                       for s in lagged}
        out["signal"] = {s.name: [round(v, 4) for v in s.signal] for s in lagged}
        out["lambda"] = {s.name: [round(v, 4) for v in s.lams] for s in lagged}
    if record_first:
        out["first_grads"] = first_grads
    return out


# --- the study: seeds x modes, in parallel processes -------------------------------------------

_ARRAYS = None


def _load_arrays(data_dir, task, test_size):
    d = data.load(data_dir)
    a = {"train_x": d["train_x"], "train_y": d["train_y"]}
    n = min(test_size or len(d["test_y"]), len(d["test_y"]))
    if task == "cls":
        a["cls_test_x"], a["cls_test_y"] = d["test_x"][:n], d["test_y"][:n]
    else:
        img, lab = data.test_mosaics(d["test_x"], d["test_y"], test_size or 1000)
        a["seg_test_x"], a["seg_test_y"] = img, lab
    return a


def _worker_init(data_dir, task, test_size):
    global _ARRAYS
    _ARRAYS = _load_arrays(data_dir, task, test_size)


def _job(args):
    cfg, task, seed, mode, init, plan = args
    return run_one(cfg, task, seed, mode, init, plan, _ARRAYS)


def analyze(runs, modes, key="metric"):
    """Per mode: mean, paired 95% interval against node, and the gap fraction
    (mode - node) / (global - node) per seed-paired means, with its interval by the delta of
    paired differences divided by the mean gap."""
    from . import sweep
    by = {m: {r["seed"]: r[key] for r in runs if r["mode"] == m} for m in modes}
    node, glob = by.get("node", {}), by.get("global", {})
    gap = sweep.paired(glob, node) if node and glob else None
    rows = []
    for m in modes:
        v = np.array(list(by[m].values()), np.float64)
        n = len(v)
        half = sweep.t975(n - 1) * v.std(ddof=1) / math.sqrt(n) if n > 1 else float("nan")
        row = {"mode": m, "n": n, "mean": float(v.mean()) if n else float("nan"),
               "half": float(half)}
        if node and m != "node":
            row["vs_node"] = sweep.paired(by[m], node)
        if glob and m != "global":
            row["vs_global"] = sweep.paired(by[m], glob)
        # The gap over the seeds this mode has (paired: the same seeds in all three).
        mine = {s: v for s, v in glob.items() if s in by[m]}
        g = sweep.paired(mine, node) if mine and node else None
        if g and g["n"] and g["mean"] > 0:
            d = sweep.paired(by[m], node)
            row["gap_fraction"] = d["mean"] / g["mean"]
            row["gap_fraction_lo"] = d["lo"] / g["mean"]
            row["gap_fraction_hi"] = d["hi"] / g["mean"]
        rows.append(row)
    return {"rows": rows, "gap": gap}


def markdown(analysis, analysis_pooled, cfg, command, wall, per_run_s):
    def pct(v):
        return "%.2f" % (100 * v)

    def ci(p):
        return "%+.2f [%+.2f, %+.2f]" % (100 * p["mean"], 100 * p["lo"], 100 * p["hi"]) \
            if p and p.get("n") else "—"

    lines = ["# hsbn one-process study", "",
             "Command: `%s`" % command, "",
             "%d nodes × %d workers, %d per worker, skew %.2f, %d steps, lr %g (cosine), train "
             "items %d, seeds %s; wall %.0f s, %.1f s per run (mean)."
             % (cfg["nodes"], cfg["workers_per_node"], cfg["batch"], cfg["skew"],
                cfg["steps"], cfg["lr"], cfg["train_size"], ",".join(map(str, cfg["seeds"])),
                wall, per_run_s), ""]
    for title, an in (("rank 0's running statistics (headline)", analysis),
                      ("running statistics pooled over the ranks (sync_running_stats)",
                       analysis_pooled)):
        lines += ["Scored with %s; mean ± 95%% interval over seeds, differences paired by "
                  "seed:" % title, "",
                  "| mode | accuracy, % | − node, points | − global, points | gap recovered "
                  "(global − node) |", "|---|---:|---:|---:|---:|"]
        for r in an["rows"]:
            gf = ("%.0f %% [%.0f, %.0f]" % (100 * r["gap_fraction"], 100 * r["gap_fraction_lo"],
                                           100 * r["gap_fraction_hi"])
                  if "gap_fraction" in r and r["mode"] not in ("node", "global") else "—")
            lines.append("| %s | %s ± %s | %s | %s | %s |" % (
                r["mode"], pct(r["mean"]), pct(r["half"]), ci(r.get("vs_node")),
                ci(r.get("vs_global")), gf))
        lines.append("")
    return "\n".join(lines) + "\n"


CELL_KEYS = ("nodes", "workers_per_node", "batch", "skew", "lr", "train_size", "steps",
             "task", "model", "group_nodes", "lr_spike")


def run(args, command):
    """hsbn_compare.py --one-process: every seed × mode of the cell, --jobs processes."""
    try:
        modes = split_modes(args.sim_modes)
        for m in modes:
            parse_mode(m)
    except ValueError as e:
        print("hsbn_compare: --sim-modes: %s" % e, file=sys.stderr)
        return 2
    try:
        spike = parse_spike(getattr(args, "lr_spike", None))
    except ValueError as e:
        print("hsbn_compare: --lr-spike: %s" % e, file=sys.stderr)
        return 2
    task = "cls" if args.task in ("both", "cls") else "seg"
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    d = data.load(args.data_dir)
    pool = data.training_pool(d["train_y"], args.train_size)
    lr = args.lr if args.lr is not None else cli.DEFAULT_LR[task]
    cfg = {"nodes": args.nodes, "workers_per_node": args.workers_per_node,
           "batch": args.batch, "skew": args.skew, "lr": lr, "train_size": args.train_size,
           "group_nodes": args.group_nodes, "seeds": seeds, "modes": modes, "task": task,
           "model": args.model, "renorm": RENORM, "lagged": LAGGED, "guard": GUARD,
           "lr_spike": spike}
    jobs = []
    for seed in seeds:
        plan = data.make_plan(task, seed, d["train_y"], pool, args.nodes,
                              args.workers_per_node, args.batch, args.epochs, args.steps,
                              args.skew)
        init = cli.initial_state(task, seed, args.model)
        cfg["steps"] = plan["steps"]
        for m in modes:
            jobs.append((cfg, task, seed, m, init, plan))
    os.makedirs(args.out, exist_ok=True)
    # One run at a time per --out: a second would read the results before the first's last
    # write and overwrite them without it. The lock goes with the process.
    lock = open(os.path.join(args.out, LOCK_NAME), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("hsbn_compare --one-process: another run is writing to %s (it holds %s); wait "
              "for it to end, or choose another --out" % (args.out, LOCK_NAME), file=sys.stderr)
        return 2
    # Runs of the same cell already in --out are kept (and not rerun): a study can be extended
    # by modes or seeds, by one invocation after another.
    runs, commands = [], [command]
    path = os.path.join(args.out, "oneproc.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        same = all(old["config"].get(k) == cfg[k] for k in CELL_KEYS)
        if same:
            runs = old["runs"]
            commands = old.get("commands", [old.get("command")]) + [command]
            have = {(r["seed"], r["mode"]) for r in runs}
            jobs = [j for j in jobs if (j[2], j[3]) not in have]
            modes = list(dict.fromkeys([m for m in ("node", "global") if m in
                                        old["config"]["modes"] + modes]
                                       + old["config"]["modes"] + modes))
            cfg["seeds"] = sorted(set(old["config"]["seeds"]) | set(seeds))
            cfg["modes"] = modes
            print("hsbn_compare --one-process: keeping %d runs of this cell from %s"
                  % (len(runs), path))
    command = " && ".join(commands)
    print("hsbn_compare --one-process: %d runs to do (seeds %s × modes %s), %d steps each, %d "
          "processes" % (len(jobs), ",".join(map(str, seeds)), ",".join(modes), cfg["steps"],
                         args.jobs), flush=True)
    t0 = time.monotonic()
    done = len(runs)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs, initializer=_worker_init,
                  initargs=(args.data_dir, task, args.test_size)) as p:
        for r in p.imap_unordered(_job, jobs):
            runs.append(r)
            el = time.monotonic() - t0
            k = len(runs) - done
            print("[%d/%d] seed %d %s: %.2f %% (pooled %.2f %%), %.1f s; %.0f s elapsed, ~%.0f s "
                  "left" % (k, len(jobs), r["seed"], r["mode"], 100 * r["metric"],
                            100 * r["metric_sync_stats"], r["run_s"], el,
                            el / k * (len(jobs) - k)), flush=True)
            _write(args.out, command, cfg, runs, modes, time.monotonic() - t0)
    wall = time.monotonic() - t0
    md = _write(args.out, command, cfg, runs, modes, wall)
    print(md)
    return 0


def _write(out, command, cfg, runs, modes, wall):
    an = analyze(runs, modes)
    an_p = analyze(runs, modes, "metric_sync_stats")
    per = float(np.mean([r["run_s"] for r in runs])) if runs else float("nan")
    md = markdown(an, an_p, cfg, command, wall, per)
    with open(os.path.join(out, "oneproc.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "oneproc.json"), "w") as f:
        json.dump({"command": command, "commands": command.split(" && "), "config": cfg,
                   "wall_s": wall, "per_run_s": per,
                   "analysis": an, "analysis_pooled": an_p,
                   "runs": sorted(runs, key=lambda r: (r["seed"], modes.index(r["mode"])))},
                  f, indent=1, default=float)
        f.write("\n")
    with open(os.path.join(out, "oneproc.csv"), "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")   # quotes a mode with options (commas)
        w.writerow(["seed", "mode", "steps", "metric_rank0", "metric_pooled", "final_loss",
                    "run_s"])
        for r in sorted(runs, key=lambda r: (r["seed"], modes.index(r["mode"]))):
            w.writerow(["%d" % r["seed"], r["mode"], "%d" % r["steps"], "%.4f" % r["metric"],
                        "%.4f" % r["metric_sync_stats"],
                        "%.5f" % float(np.mean(r["loss"][-10:])), "%.2f" % r["run_s"]])
    return md


def render(out):
    """Rewrites oneproc.md from oneproc.json in `out` (python3 -m hsbncmp.oneproc DIR)."""
    with open(os.path.join(out, "oneproc.json")) as f:
        j = json.load(f)
    modes = j["config"]["modes"]
    modes = [m for m in ("node", "global") if m in modes] + [m for m in modes
                                                             if m not in ("node", "global")]
    j["config"]["modes"] = modes
    return _write(out, j["command"], j["config"], j["runs"], modes, j["wall_s"])


if __name__ == "__main__":
    print(render(sys.argv[1]))
