"""hsbn.torch.diagnose: is a multi-GPU accuracy gap BatchNorm's fault?

Runs inside the user's own job, on every rank at the same point, over a few batches. Every
BatchNorm layer (hsbn's, torch's SyncBatchNorm and unconverted BatchNorm*d alike) is measured
at once at every level: the rank's own batch, its node's, its group's and the job's, with
hsbn's own forward rounds (Chan's merge, exact), so the distances shadow scope records for
node vs job come for every level in one pass. During the pass each layer normalizes with the
job's statistics (as global scope would), so what later layers see does not depend on the
scopes being diagnosed; layers that are in eval mode keep doing what they do in training.

It leaves training as it found it: the BatchNorm layers run in eval mode during the pass (so
no running statistics, num_batches_tracked, samples_seen, round counters or auto-scope state
move), under torch.no_grad(), with the RNG states saved and restored (dropout draws), and
every module's train/eval mode restored; no optimizer is touched. Its rounds use keys of
their own: ops in the layer-check range hashed from "doctor:<layer name>", seqs from 3 * 2**61
(training seqs count from 0, sync_running_stats / precise_bn use [2**62, 3 * 2**61)).
"""

import gc
import math
import statistics
import time

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import client as _client
from ..client import default_client
from ..doctor import FORMAT, DoctorReport
from ..errors import HsbnError, InvalidArgumentError, INVALID_ARGUMENT
from .modules import SyncBatchNorm
from ._inspect import model_client
from ._keys import _CHECK_BASE, _hash64
from ._layer_check import _book

SEQ_BASE = 3 << 61
_CALL_STRIDE = 1 << 32          # seqs of one call: layer call * 4 + slot, calls < 2**29
_SLOTS = {"node": 0, "group": 1, "global": 2, "global-timed": 3}
_CALLS = ("doctor", )           # the book's counter of diagnose calls
_DIGEST_SLOTS = 4
_MAX_ROUND_CHANNELS = 8192


def _doctor_op(name):
    return _CHECK_BASE | (_hash64("doctor:" + name) & (_CHECK_BASE - 1))


DIGEST_OP = _doctor_op("\0the doctor's check")
_client.set_op_label(DIGEST_OP, "hsbn.torch.diagnose's check")


def _wrapping_ddp(module):
    """The DistributedDataParallel that wraps `module` (or `module` itself when it is one),
    else None. Follows what refers to `module` (DDP holds it in its _modules dict), never the
    whole heap: gc.get_objects() would hand out tensors that PyTorch is finalizing."""
    ddp_type = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    if ddp_type is None:
        return None
    if isinstance(module, ddp_type):
        return module
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None   # no process group, no DDP
    for holder in gc.get_referrers(module):
        if not isinstance(holder, dict) or not any(v is module for v in holder.values()):
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, ddp_type) and owner.module is module:
                return owner
            if isinstance(owner, dict):   # an instance __dict__ (before Python 3.11)
                for obj in gc.get_referrers(owner):
                    if isinstance(obj, ddp_type) and obj.module is module:
                        return obj
    return None


def _kind(m):
    if isinstance(m, SyncBatchNorm):
        return "hsbn"
    if isinstance(m, torch.nn.SyncBatchNorm):
        return "torch-sync"
    return "batchnorm"


def _training_scope(m, model_training):
    """The statistics this layer normalizes with in training: a level, or "frozen"."""
    if not m.training and model_training:
        return "frozen"
    kind = _kind(m)
    if kind == "hsbn":
        s = m.current_scope()
        # renorm normalizes as with (earlier calls') global statistics, up to its clipping;
        # lagged with the job's, the other nodes' share one call old.
        return {"shadow": "node", "renorm": "global", "lagged": "global"}.get(s, s)
    if kind == "torch-sync":
        return "global"   # its process group: the whole job unless the user gave another
    return "local"


def _moments(x):
    """(count per channel, mean[C], m2[C]) of x (N, C, ...) in float64."""
    c = x.shape[1]
    v = x.detach().to(torch.float64).transpose(0, 1).reshape(c, -1)
    n = v.shape[1]
    if n == 0:
        return 0, np.zeros(c), np.zeros(c)
    mean = v.mean(1)
    m2 = ((v - mean[:, None]) ** 2).sum(1)
    return n, mean.cpu().numpy(), m2.cpu().numpy()


def _distance(mean, var, gmean, gvar, eps):
    shift = float(np.mean(np.abs(mean - gmean) / np.sqrt(gvar + eps)))
    logvar = float(np.mean(np.abs(np.log((var + eps) / (gvar + eps)))))
    return shift, logvar


class _Layer:
    def __init__(self, name, module, model_training):
        self.name = name
        self.m = module
        self.kind = _kind(module)
        self.scope = _training_scope(module, model_training)
        self.op = _doctor_op(name)
        c = module.num_features
        self.batches = 0
        self.calls = 0
        self.local_counts = []
        self.level_counts = {}
        self.sums = {}          # level -> [shift sum, logvar sum, n]
        self.c = c


def _levels(client):
    out = ["local", "node"]
    if getattr(client, "group_nodes", 0) not in (0, 1, client.num_nodes):
        out.append("group")
    out.append("global")
    return out


def _check_round(client, seq, layers, num_batches):
    h = _hash64("\0".join("%s\0%d" % (lay.name, lay.c) for lay in layers)
                + "\0batches=%s" % num_batches)
    a = np.array([(h >> (16 * i)) & 0xFFFF for i in range(_DIGEST_SLOTS)], dtype=np.float64)
    count, sums, squares = client.backward(DIGEST_OP, seq, "global", 1, a, a * a)
    if not all(count * int(q) == int(s) * int(s) for s, q in zip(sums, squares)):
        raise InvalidArgumentError(
            "hsbn.torch.diagnose: the %d ranks did not call it alike: their models' BatchNorm "
            "layers (names, channels) or num_batches differ (this rank: %d layers, num_batches "
            "%s). Every rank must call it at the same point with the same model"
            % (count, len(layers), num_batches), INVALID_ARGUMENT)


def _accumulate(lay, got, levels, eps):
    """Adds one batch's statistics of every level (got: level -> (count, mean, m2)) to the
    layer's record: counts, and each level's distance from the job's statistics."""
    gn, gmean, gm2 = got["global"]
    lay.batches += 1
    lay.local_counts.append(got["local"][0])
    for lv in levels[1:]:
        lay.level_counts.setdefault(lv, []).append(got[lv][0])
    if gn < 1:
        return
    gvar = gm2 / gn
    for lv in levels[:-1]:
        cnt, lmean, lm2 = got[lv]
        if cnt < 1:
            continue
        s = lay.sums.setdefault(lv, [0.0, 0.0, 0])
        shift, logvar = _distance(lmean, lm2 / cnt, gmean, gvar, eps)
        s[0] += shift
        s[1] += logvar
        s[2] += 1


def _normalized(x, module, gmean, gvar):
    """x normalized with the job's statistics (and the layer's affine), as training does."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    gm = torch.from_numpy(gmean).to(x.device, x.dtype).view(shape)
    inv = torch.from_numpy(1.0 / np.sqrt(gvar + module.eps)).to(x.device, x.dtype)
    y = (x - gm) * inv.view(shape)
    if module.affine:
        y = y * module.weight.view(shape) + module.bias.view(shape)
    return y


def diagnose(model, batches, *, num_batches=None, forward=None, client=None,
             max_mean_shift=0.05, max_log_var_ratio=0.05):
    """Is a multi-GPU accuracy gap BatchNorm's fault here? Call it on every rank of the job at
    the same point (for example before training, or at a checkpoint), with a few of each rank's
    own training batches (the same number on every rank); returns an hsbn.doctor.DoctorReport
    (print it, .save(path) it as JSON, .plot(path) it), the same numbers on every rank.

    model: the model as trained, or the DistributedDataParallel around it (then its
      broadcast_buffers is checked too). The forward passes run on the model itself, never
      through DDP (which would broadcast buffers).
    batches: an iterable of batches; `forward(model, batch)` runs one (default: model(batch),
      or model(batch[0]) for a tuple or list). num_batches: how many to take (default all).
    client: the hsbn.Client for the rounds (default: the model's, else hsbn.default_client()).
    max_mean_shift, max_log_var_ratio: how far a level's statistics may be from the job's
      before the doctor says the layer explains a gap (auto scope's defaults).
    """
    ddp = _wrapping_ddp(model)
    inner = model.module if ddp is not None and ddp is model else model
    named = [(n or type(m).__name__, m) for n, m in inner.named_modules()
             if isinstance(m, _BatchNorm)]
    if client is None:
        client = model_client(inner) or default_client()
    levels = _levels(client)
    layers = [_Layer(n, m, inner.training) for n, m in named]
    book = _book(client)
    base = SEQ_BASE + book.next_seq(_CALLS) * _CALL_STRIDE
    before = client.stats()   # the job's training rounds so far
    _check_round(client, base + (1 << 31), layers, num_batches)
    times = {lv: [] for lv in levels if lv != "local"}
    state = _freeze(inner, [lay.m for lay in layers])
    batch_index = [0]

    def hook_for(lay):
        def hook(module, inputs, output):
            x = inputs[0]
            n, mean, m2 = _moments(x)
            got = {"local": (n, mean, m2)}
            # Per call of the layer (a module used twice in a forward gets two keys).
            seq = base + lay.calls * 4
            lay.calls += 1
            # The job's round first: it also lines the ranks up, so the rounds timed after it
            # measure the round, not how far apart the ranks arrived.
            for lv, slot, timed in ([("global", _SLOTS["global"], False)]
                                    + [(lv, _SLOTS[lv], True) for lv in levels[1:-1]]
                                    + [("global", _SLOTS["global-timed"], True)]):
                t0 = time.perf_counter()
                try:
                    got[lv] = client.forward(lay.op, seq + slot, lv, n, mean, m2)
                except HsbnError as e:
                    err = type(e)("%s (hsbn.torch.diagnose, layer %r, batch %d)"
                                  % (e, lay.name, batch_index[0]), e.code)
                    err.reason = e.reason
                    raise err from None
                if timed:
                    times[lv].append(time.perf_counter() - t0)
            gn, gmean, gm2 = got["global"]
            _accumulate(lay, got, levels, module.eps)
            if lay.scope == "frozen" or gn < 2:
                return None   # an eval-mode layer keeps normalizing as it does in training
            return _normalized(x, module, gmean, gm2 / gn)
        return hook

    handles = [lay.m.register_forward_hook(hook_for(lay)) for lay in layers]
    run = forward or _default_forward
    done = 0
    try:
        with torch.no_grad():
            for i, b in enumerate(batches):
                if num_batches is not None and i >= num_batches:
                    break
                batch_index[0] = i
                run(inner, b)
                done += 1
    finally:
        for h in handles:
            h.remove()
        _thaw(state)
    after = client.stats()
    return DoctorReport(_report(client, levels, layers, done, times, before, after, base, inner,
                                ddp, max_mean_shift, max_log_var_ratio))


def _default_forward(model, batch):
    return model(batch[0] if isinstance(batch, (tuple, list)) else batch)


def _freeze(model, bn_layers):
    """Puts the BatchNorm layers in eval mode; returns what _thaw needs to restore everything."""
    modes = [(m, m.training) for m in model.modules()]
    rng = torch.get_rng_state()
    cuda_rng = (torch.cuda.get_rng_state_all()
                if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    for m in bn_layers:
        m.training = False
    return modes, rng, cuda_rng


def _thaw(state):
    modes, rng, cuda_rng = state
    for m, training in modes:
        m.training = training
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)


def _over_ranks(client, op, seq, values):
    """The mean over every rank of the job of each entry of `values`, and its variance over
    ranks (one forward round per chunk: Chan's merge of count 1 per rank)."""
    values = np.asarray(values, np.float64)
    mean = np.zeros_like(values)
    var = np.zeros_like(values)
    limit = max(1, min(_MAX_ROUND_CHANNELS, getattr(client, "max_channels", 0) or
                       _MAX_ROUND_CHANNELS))
    for k, start in enumerate(range(0, len(values), limit)):
        part = values[start:start + limit]
        n, m, m2 = client.forward(op, seq + k * 4, "global", 1, part, np.zeros_like(part))
        mean[start:start + limit] = m
        var[start:start + limit] = m2 / max(1, n)
    return mean, var


def _gather(client, levels, layers, base):
    """Every rank's per-layer divergences and counts, and the running statistics' spread,
    averaged over the ranks: (mean vector, {layer name: spread})."""
    # Per rank: per layer, per level below global, the averages; local count stats.
    vec = []
    for lay in layers:
        for lv in levels[:-1]:
            s = lay.sums.get(lv, [0.0, 0.0, 0])
            k = max(1, s[2])
            vec += [s[0] / k, s[1] / k]
        counts = lay.local_counts or [0]
        vec += [float(np.mean(counts)), 1.0 if min(counts) <= 1 else 0.0]
    seq = base + (1 << 31) + 4
    mean, _ = _over_ranks(client, DIGEST_OP, seq, vec) if vec else (np.zeros(0), None)
    # Running statistics' spread over ranks: running mean (in units of the running std) and
    # log running var.
    spread_in, spread_layers = [], []
    for lay in layers:
        m = lay.m
        if m.track_running_stats and m.running_mean is not None:
            rm = m.running_mean.detach().to("cpu", torch.float64).numpy()
            rv = m.running_var.detach().to("cpu", torch.float64).numpy()
            spread_in += list(rm) + list(np.log(rv + m.eps)) + list(rv)
            spread_layers.append(lay)
    smean, svar = (_over_ranks(client, DIGEST_OP, seq + (1 << 24), spread_in)
                   if spread_in else (None, None))
    spread_of, soff = {}, 0
    for lay in spread_layers:
        c = lay.c
        rm_var = svar[soff:soff + c]
        lv_var = svar[soff + c:soff + 2 * c]
        rv_mean = smean[soff + 2 * c:soff + 3 * c]
        spread_of[lay.name] = {
            "mean": float(np.mean(np.sqrt(rm_var) / np.sqrt(rv_mean + lay.m.eps))),
            "log_var": float(np.mean(np.sqrt(lv_var)))}
        soff += 3 * c
    return mean, spread_of


def _layer_entry(lay, levels, digest, spread_of, round_ms, max_shift, max_logvar):
    """One layer's row of the report from its slice of the averaged digest (_gather's vector:
    2 values per level below global, then 2 count values)."""
    div, off = {}, 0
    for lv in levels[:-1]:
        div[lv] = {"mean_shift": float(digest[off]), "log_var_ratio": float(digest[off + 1])}
        off += 2
    local_mean, some_rank_one = float(digest[off]), bool(digest[off + 1] > 0)
    div["global"] = {"mean_shift": 0.0, "log_var_ratio": 0.0}
    counts = {"local_mean": local_mean, "some_rank_at_most_one": some_rank_one}
    for lv in levels[1:]:
        got = lay.level_counts.get(lv) or [0]
        counts[lv] = float(np.mean(got))

    def within(lv):
        d = div[lv]
        return d["mean_shift"] <= max_shift and d["log_var_ratio"] <= max_logvar
    recommended = next(lv for lv in levels
                       if lv == "global" or (within(lv) and not (lv == "local"
                                                                and some_rank_one)))
    cost = {lv: (0.0 if lv == "local" else 2.0 * round_ms.get(lv, float("nan")))
            for lv in levels}
    trains = lay.scope
    explains = (trains not in ("frozen", "global") and trains in div and not within(trains))
    # Where only a cross-node level is close enough, scope "lagged" normalizes with the job's
    # statistics (the other nodes' one call old) for node rounds on the critical path: the
    # alternative to price next to it (docs/results/COMPARISON.md, "Which scope when").
    alternative = None
    if "node" in div and not within("node") and recommended in ("group", "global"):
        alternative = "lagged"
        cost["lagged"] = cost.get("node", float("nan"))
    return {
        "name": lay.name, "kind": lay.kind, "channels": lay.c, "training_scope": trains,
        "counts": counts, "divergence": div, "running_spread": spread_of.get(lay.name),
        "explains": bool(explains), "recommended": recommended,
        "alternative": alternative,
        "cost_ms_per_step": {k: (None if math.isnan(v) else v) for k, v in cost.items()},
        "momentum": lay.m.momentum, "track_running_stats": bool(lay.m.track_running_stats),
    }


def _step_costs(entries, levels):
    """Sync ms per step of the layers as trained, as recommended, with the lagged alternative
    where offered, and all global."""
    def step_cost(pick):
        total = 0.0
        for e in entries:
            v = e["cost_ms_per_step"].get(pick(e))
            total += v if v is not None else 0.0
        return total
    return {"as_trained_ms": step_cost(lambda e: e["training_scope"]
                                       if e["training_scope"] in levels else "local"),
            "recommended_ms": step_cost(lambda e: e["recommended"]),
            "alternative_ms": step_cost(lambda e: e["alternative"] or e["recommended"]),
            "all_global_ms": step_cost(lambda e: "global")}


# The deepest model of the one-process study's lagged figures (its small CNN).
STUDY_LAYERS = 4


def _lagged_note(layers, ms):
    """The summary's offer of scope 'lagged' for a model of `layers` BatchNorm layers, priced
    at `ms` of sync per step, with what hsbn's studies measured for a model that deep."""
    note = (" Or scope='lagged' where the 'use' column offers it: node rounds only (about "
            "%.2f ms of sync per step), the job's statistics with the other nodes' share "
            "averaged over earlier calls; with its defaults (that average, its first 20 calls "
            "exact global, and a trip guard that runs a layer exact global for 30 calls when "
            "its statistics jump) it recovered 97-99 %% of the node-to-global accuracy gap in "
            "hsbn's one-process study of a %d-layer CNN (150 to 2,400 steps, every cell above "
            "node), and 59 %% under a forced learning-rate spike (docs/results/COMPARISON.md, "
            "\"Which scope when\")." % (ms, STUDY_LAYERS))
    if layers > STUDY_LAYERS:
        note += (" This model has %d BatchNorm layers: on ResNet-18 (20) in a short, steep "
                 "schedule (75 steps, lr 0.05) lagged recovered 95 %% of the gap in the study "
                 "but ran 29 %% of its calls exact global, and 94 %% at 300 steps and lr 0.01 "
                 "with 7 %% of its calls exact; for a deep model in a short schedule it "
                 "saves only a part of global's cost (\"Which scope when\" there)." % layers)
    return note


def _summary(entries, yes, smells, cost):
    """The report's one paragraph: the verdict, its largest reason, and what the fix costs."""
    lagged_note = ""
    if any(e["alternative"] for e in entries):
        lagged_note = _lagged_note(len(entries), cost["alternative_ms"])
    if not entries:
        return "The model has no BatchNorm layers."
    if yes:
        worst = max(yes, key=lambda e: e["divergence"][e["training_scope"]]["mean_shift"])
        d = worst["divergence"][worst["training_scope"]]
        return ("%d of %d BatchNorm layers normalize with statistics further from the job's "
                "than the thresholds (largest: %r, trained in %s scope: mean shift %.3f, "
                "|log var ratio| %.3f), so BatchNorm can explain a multi-GPU gap. Use the "
                "'use' column per layer (hsbn.torch.convert_sync_batchnorm(..., "
                "layer_scopes=...)): about %.2f ms of sync per step, against %.2f ms for "
                "all global." % (len(yes), len(entries), worst["name"],
                                 worst["training_scope"], d["mean_shift"],
                                 d["log_var_ratio"], cost["recommended_ms"],
                                 cost["all_global_ms"])) + lagged_note
    return ("Every BatchNorm layer normalizes with statistics within the thresholds of the "
            "job's, so BatchNorm statistics do not explain a multi-GPU gap here%s."
            % (" (but see the configuration smells)" if smells else ""))


def _report(client, levels, layers, batches, times, before, after, base, inner, ddp,
            max_shift, max_logvar):
    per = ["shift", "logvar"]
    mean, spread_of = _gather(client, levels, layers, base)
    round_ms = {lv: 1e3 * statistics.median(t) for lv, t in times.items() if t}
    training_ms = {}
    for lv in ("node", "group", "global"):
        done = before.get(scope=lv).completed
        if done:
            training_ms[lv] = 1e3 * before.get(scope=lv).blocked_seconds / done
    width = 2 * (len(levels) - 1) + 2  # one layer's values in the digest
    entries = [_layer_entry(lay, levels, mean[i * width:(i + 1) * width], spread_of, round_ms,
                            max_shift, max_logvar)
               for i, lay in enumerate(layers)]
    smells = _smells(inner, ddp, layers, entries)
    guard = _lagged_guard(layers)
    yes = [e for e in entries if e["explains"]]
    cost = _step_costs(entries, levels)
    summary = _summary(entries, yes, smells, cost)
    return {
        "format": FORMAT, "verdict": "yes" if yes else "no", "summary": summary,
        "job": {"job_id": client.job_id, "world_size": client.world_size,
                "num_nodes": client.num_nodes, "group_nodes": getattr(client, "group_nodes", 0),
                "rank": client.rank},
        "levels": levels, "batches": batches,
        "thresholds": {"mean_shift": max_shift, "log_var_ratio": max_logvar},
        "layers": entries, "smells": smells, "round_ms": round_ms,
        "training_round_ms": training_ms, "cost": cost, "lagged_guard": guard,
        "rounds": after.total.completed - before.total.completed,
        "per_rank_measures": per,
    }


def _lagged_guard(layers):
    """The trip guard's record of each layer training in lagged scope (the same on every rank):
    its trips so far, the last one's training call and drift v, and how many exact global
    calls each trip buys. [] when no layer trains lagged."""
    out = []
    for lay in layers:
        if lay.kind != "hsbn" or lay.m.current_scope() != "lagged":
            continue
        trips = lay.m.lagged_trips
        opts = lay.m.lagged_options
        out.append({"name": lay.name, "trips": len(trips),
                    "last_call": trips[-1][0] if trips else None,
                    "last_drift": float(trips[-1][2]) if trips else None,
                    "trip_rel": opts.get("trip_rel"), "trip": opts.get("trip"),
                    "trip_calls": opts.get("trip_calls")})
    return out


def _smells(inner, ddp, layers, entries):
    out = []

    def add(kind, names, message, fix):
        if names:
            out.append({"kind": kind, "layers": names, "message": message, "fix": fix})
    training = inner.training
    add("unconverted", [lay.name for lay in layers if lay.kind == "batchnorm"
                        and lay.scope == "local"],
        "plain BatchNorm layers: each rank normalizes with its own batch only",
        "hsbn.torch.convert_sync_batchnorm(model, scope=...) before wrapping the model in "
        "DistributedDataParallel (the 'use' column says which scope per layer)")
    add("converted_after_ddp", [lay.name for lay in layers
                                if getattr(lay.m, "_hsbn_converted_under_ddp", False)],
        "these layers were converted after DistributedDataParallel wrapped the model: DDP "
        "recorded the model's modules, parameters and buffers when it was built",
        "convert first, then wrap: model = hsbn.torch.convert_sync_batchnorm(model, ...); "
        "model = DistributedDataParallel(model, ...)")
    if ddp is not None and getattr(ddp, "broadcast_buffers", False):
        # The buffers DDP broadcasts (those it found when it was built), where it says.
        known = {id(b) for b in getattr(ddp, "modules_buffers", None) or []}
        add("broadcast_buffers", [lay.name for lay, e in zip(layers, entries)
                                  if e["training_scope"] in ("node", "group", "local")
                                  and e["track_running_stats"]
                                  and (not known or id(lay.m.running_mean) in known)],
            "DistributedDataParallel(broadcast_buffers=True) copies rank 0's running statistics "
            "to every rank at each forward, while these layers normalize with statistics of "
            "less than the job: every node ends up with node 0's running statistics",
            "DistributedDataParallel(model, broadcast_buffers=False), and "
            "hsbn.torch.sync_running_stats(model, 'global') before saving a checkpoint")
    add("track_running_stats_false", [lay.name for lay in layers
                                      if not lay.m.track_running_stats],
        "track_running_stats=False: no running statistics, so evaluation normalizes each "
        "evaluation batch with its own statistics (results depend on the eval batch size)",
        "keep track_running_stats=True (the default) unless that is intended")
    if training:
        add("frozen", [lay.name for lay in layers if lay.scope == "frozen"],
            "BatchNorm layers in eval mode while the model trains (frozen BN): they normalize "
            "with their running statistics and neither synchronize nor update them",
            "intended when fine-tuning with tiny batches from a checkpoint's statistics; "
            "otherwise look for a .eval() on these modules after model.train()")
    add("momentum", [lay.name for lay in layers
                     if lay.m.momentum is not None and lay.m.momentum > 0.5],
        "momentum above 0.5: torch's momentum is the weight of the new batch (Keras' and "
        "TensorFlow's 0.99 is torch's 0.01), so the running statistics are almost the last "
        "batch's",
        "momentum=0.1 (torch's default) or 1 - the Keras value")
    add("batch_of_one", [e["name"] for e in entries
                         if e["counts"]["some_rank_at_most_one"]],
        "on some rank these layers see at most 1 value per channel (batch 1 after pooling, or "
        "1x1 positions): plain BatchNorm fails ('Expected more than 1 value per channel') and a "
        "rank's own statistics mean nothing",
        "synchronize these layers (node, group or global scope) or give each rank more than "
        "one sample")
    return out
