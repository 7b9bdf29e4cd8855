"""One training run of the comparison.

`cluster_worker` runs in every worker process of a hsbn.cluster.LocalCluster: it joins the gloo
process group once, then trains every (task, seed, mode) job in turn with the model converted
to hsbn.torch.SyncBatchNorm in that mode's scope and wrapped in DDP. `reference_run` trains one
(task, seed) in one process with plain BatchNorm over the concatenated global batch.

Every run starts from the same initial weights (made in the parent from the seed), reads the
same items in the same order (the plan of data.make_plan), and takes the same SGD steps:
momentum 0.9, cosine-decayed learning rate, cross-entropy averaged over the global batch (DDP
averages the workers' gradients, whose losses are averages over equal-sized worker batches).
"""

import faulthandler
import math
import os
import signal
import time

import numpy as np

from . import data, kinks, models


# The global vs reference check compares the first step (each BatchNorm layer's statistics,
# every parameter's gradient, the running statistics after it) with a float64 one-process run;
# see cli.global_reference_check. BN_EPS is the layers' eps (torch's default).
BN_EPS = 1e-5

SCOPE = {"local": "local", "node": "node", "global": "global", "shadow": "shadow",
         "group": "group", "auto": "auto", "renorm": "renorm", "lagged": "lagged"}


# --- data --------------------------------------------------------------------------------------

def load_cache(cache):
    return {k: np.load(p, mmap_mode="r") for k, p in cache.items()}


def batch(torch, task, plan, arrays, step, ranks):
    """Inputs and targets of the workers `ranks` at `step`, concatenated in that order."""
    if task == "cls":
        idx = np.concatenate([plan["idx"][step, r] for r in ranks])
        x = data.to_input(np.asarray(arrays["train_x"][idx]))
        y = np.asarray(arrays["train_y"][idx]).astype(np.int64)
    else:
        cells = np.concatenate([plan["cells"][step, r] for r in ranks])
        shifts = np.concatenate([plan["shifts"][step, r] for r in ranks])
        img, lab = data.compose(arrays["train_x"], arrays["train_y"], cells, shifts)
        x, y = data.to_input(img), lab.astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def eval_counts(torch, model, task, xs, ys, chunk=256):
    """Classification: [correct, total]; segmentation: the flattened confusion matrix."""
    k = data.SEG_CLASSES
    counts = np.zeros(2 if task == "cls" else k * k, np.float64)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(ys), chunk):
            x = torch.from_numpy(data.to_input(np.asarray(xs[i:i + chunk])))
            y = np.asarray(ys[i:i + chunk]).astype(np.int64)
            pred = model(x).argmax(1).numpy()
            if task == "cls":
                counts[0] += (pred == y).sum()
                counts[1] += len(y)
            else:
                counts += np.bincount(y.ravel() * k + pred.ravel(), minlength=k * k)
    model.train(was_training)
    return counts


def metric(task, counts):
    """Test accuracy (classification) or mean IoU over background + 10 classes (segmentation)."""
    if task == "cls":
        return float(counts[0] / max(counts[1], 1))
    k = data.SEG_CLASSES
    cm = counts.reshape(k, k)
    tp = np.diag(cm)
    union = cm.sum(0) + cm.sum(1) - tp
    present = union > 0
    return float(np.mean(tp[present] / union[present]))


def eval_points(steps, evals):
    return sorted({max(1, int(round(k * steps / evals))) for k in range(1, evals + 1)})


def state_numpy(model):
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()
            if not k.endswith("num_batches_tracked")}


def _progress_tick(progress, job_index):
    if progress is not None:
        with progress.get_lock():
            progress[0] += 1
            progress[1] = job_index


def _lr(cfg, task):
    return cfg["lr"][task]


# --- the first step, recorded for the check ----------------------------------------------------

def _grads(model):
    return {k: p.grad.detach().to("cpu").double().numpy().copy()
            for k, p in model.named_parameters() if p.grad is not None}


def _running(model):
    return {k: v.detach().to("cpu").double().numpy().copy() for k, v in model.state_dict().items()
            if k.endswith(("running_mean", "running_var"))}


def _input_stats_hooks(torch, model, record):
    """Forward hooks that record each BatchNorm layer's batch mean and biased variance
    (computed in float64 from its input, what exact BatchNorm over that input uses), by the
    layer's index in module order. Returns the hook handles."""
    handles = []
    layers = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for i, m in enumerate(layers):
        def hook(module, inputs, i=i):
            x = inputs[0].detach().double().transpose(0, 1).reshape(module.num_features, -1)
            record[i] = (x.mean(1).numpy().copy(), x.var(1, unbiased=False).numpy().copy())
        handles.append(m.register_forward_pre_hook(hook))
    return handles


def _recording_forward(client, ops, record, perturb):
    """client.forward that also records each layer's merged (mean, biased variance) by the
    layer's index (`ops`: op -> index), and with `perturb` = (index, k) moves that layer's
    merged mean by k of its standard deviations on every rank (a wrong statistic, for testing
    that the check catches one)."""
    real = client.forward

    def forward(op, seq, scope, count, mean, m2):
        n, gm, gm2 = real(op, seq, scope, count, mean, m2)
        i = ops.get(int(op))
        if i is not None and n > 0:
            if perturb is not None and perturb[0] == i:
                gm = gm + perturb[1] * np.sqrt(gm2 / n)
            record[i] = (np.array(gm, np.float64), np.array(gm2, np.float64) / n)
        return n, gm, gm2
    return forward


def dump_stacks_on_sigusr1():
    """`kill -USR1 PID` prints this process's Python stacks (every thread) to stderr: how a
    stalled study tells where each of its processes waits. Set in the main process and in
    every worker (the tests send it before they give up on a run)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _stall_forever():
    """A worker that hangs (--debug-stall-at-step, for the tests of --stall-minutes)."""
    import threading
    threading.Event().wait()


# --- distributed runs --------------------------------------------------------------------------

def cluster_worker(cfg, jobs, inits, plans, cache, progress):
    """Runs every job of `jobs` ((task, seed, mode) tuples) on this worker; returns the results
    on rank 0 (None elsewhere)."""
    import torch
    import torch.distributed as dist
    import hsbn
    import hsbn.torch

    dump_stacks_on_sigusr1()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.get("group_nodes"):
        # Groups of K consecutive nodes for scope "group" (and auto's choice between group and
        # global): a setting of the job, the same on every worker.
        os.environ["HSBN_GROUP_NODES"] = str(cfg["group_nodes"])
    client = hsbn.Client.from_env()
    hsbn.set_default_client(client)
    arrays = load_cache(cache)
    results = []
    for j, (task, seed, mode) in enumerate(jobs):
        results.append(_distributed_run(torch, dist, hsbn, cfg, task, seed, mode,
                                        inits[(task, seed)], plans[(task, seed)], arrays,
                                        client, rank, world, progress, j))
    # No destroy_process_group(): the worker leaves gloo by exiting, after its result is sent.
    # In torch 2.x ProcessGroupGloo's destructor joins its threads holding the GIL, while one
    # of them may wait for the GIL to free a tensor whose Python object is gone (torch 2.6
    # hung so here twice in 46 runs on a loaded 2-core machine; docs/PYTORCH.md).
    dist.barrier()
    client.close()
    return results if rank == 0 else None


def _bn_layers(torch, model):
    from torch.nn.modules.batchnorm import _BatchNorm
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]


def _distributed_eval(torch, dist, model, task, xs, ys, rank, world, stats):
    """Evaluates `model` with rank 0's running statistics (stats="rank0": what a checkpoint
    saved by rank 0 holds) or the average of every worker's (stats="avg"), each worker scoring
    its share of the test set; returns the metric."""
    bufs = []
    for _, m in _bn_layers(torch, model):
        bufs += [m.running_mean, m.running_var]
    saved = [b.clone() for b in bufs]
    for b in bufs:
        if stats == "rank0":
            dist.broadcast(b, 0)
        else:
            dist.all_reduce(b)
            b.div_(world)
    counts = torch.from_numpy(eval_counts(torch, model, task, xs[rank::world], ys[rank::world]))
    dist.all_reduce(counts)
    for b, s in zip(bufs, saved):
        b.copy_(s)
    return metric(task, counts.numpy())


def precise_batches(torch, task, plan, arrays, rank, items, chunk=32):
    """This worker's own training inputs of the last steps (`items` of them, or all it saw),
    in batches of `chunk`: what precise_bn recomputes the statistics over."""
    steps = plan["steps"]
    per = plan["idx"].shape[2] if task == "cls" else plan["cells"].shape[2]
    k = min(steps, max(1, -(-items // per)))
    x = torch.cat([batch(torch, task, plan, arrays, s, [rank])[0]
                   for s in range(steps - k, steps)])[:items]
    return list(torch.split(x, chunk))


def _pooled_evals(torch, dist, hsbn, cfg, model, task, plan, arrays, xs, ys, rank, world):
    """The metric with the running statistics pooled over the job (sync_running_stats,
    global) and recomputed over every worker's last training inputs (precise_bn, global); the
    model's own statistics are restored after each."""
    bufs = []
    for _, m in _bn_layers(torch, model):
        bufs += [m.running_mean, m.running_var]
    saved = [b.clone() for b in bufs]
    out = []
    for how in ("sync", "precise"):
        if how == "sync":
            hsbn.torch.sync_running_stats(model, "global")
        else:
            hsbn.torch.precise_bn(model, precise_batches(torch, task, plan, arrays, rank,
                                                         cfg["precise_items"]), "global")
        counts = torch.from_numpy(eval_counts(torch, model, task, xs[rank::world],
                                              ys[rank::world]))
        dist.all_reduce(counts)
        out.append(metric(task, counts.numpy()))
        for b, s in zip(bufs, saved):
            b.copy_(s)
    return out


# The kinds of processes a LocalCluster runs, by the names of hsbn.cluster's pids(): the
# aggregators (root, group tier, sidecars) and the simulated cross-node links' proxies (a
# stand-in for the network, reported apart).
_PROC_KINDS = (("link", "links"), ("root", "root"), ("group", "groups"), ("node", "sidecars"))


def _proc_cpu(pids):
    """{kind: CPU seconds (user + system) so far, summed over the processes of that kind} for
    pids {name: pid}; None where /proc cannot be read (not Linux, a process gone)."""
    if not pids:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        kind = next((k for prefix, k in _PROC_KINDS if name.startswith(prefix)), "other")
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _blocked_seconds(client):
    """Seconds this worker has spent blocked in hsbn rounds (forward and backward, every scope),
    including waiting for the other members of each round, and in renorm's waits for global
    statistics (client.global_stats): the client's own counters."""
    st = client.stats()
    return st.total.blocked_seconds + st.global_stats.blocked_seconds


def _distributed_run(torch, dist, hsbn, cfg, task, seed, mode, init, plan, arrays, client,
                     rank, world, progress, job_index):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = models.build(task, cfg.get("model"))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    # A name per run: its layers get round keys (and shadow divergence records at the root)
    # of their own, apart from the other runs' in this job.
    options = {}
    if mode == "renorm":
        options = {"renorm_" + k: v for k, v in cfg["renorm"].items()}
    elif mode == "lagged" and cfg.get("lagged"):
        options = {"lagged_" + k: v for k, v in cfg["lagged"].items()}
    model = hsbn.torch.convert_sync_batchnorm(model, scope=SCOPE[mode], client=client,
                                              name="%s-%s-seed%d" % (task, mode, seed),
                                              **options)
    if hasattr(hsbn.torch, "reset_sync_stats"):
        hsbn.torch.reset_sync_stats()  # this run's renorm counts only
    ddp = DDP(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=_lr(cfg, task), momentum=0.9)
    steps = plan["steps"]
    points = eval_points(steps, cfg["evals"])
    xs_c, ys_c = arrays[task + "_curve_x"], arrays[task + "_curve_y"]
    losses = np.zeros(steps, np.float64)
    step_s = np.zeros(steps, np.float64)
    sync_s = np.zeros(steps, np.float64)
    cpu_s = 0.0   # this worker's CPU time in its timed steps (every thread: DDP's too)
    agg0 = _proc_cpu(cfg.get("cluster_pids")) if rank == 0 else None
    curve = []
    # The first step's merged statistics (read from the client's answers), for the check.
    ops = {int(m.op): i for i, (_, m) in enumerate(_bn_layers(torch, model))
           if getattr(m, "op", None) is not None}
    first = {"stats": {}}
    perturb = cfg.get("perturb_mean") if mode == "global" else None
    for step in range(steps):
        if step == cfg.get("debug_stall_at_step") and rank == 0:
            _stall_forever()  # tests of --stall-minutes
        x, y = batch(torch, task, plan, arrays, step, [rank])
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, task) * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        if step == 0:
            client.forward = _recording_forward(client, ops, first["stats"], perturb)
        # Sync time: what the step spent blocked in hsbn rounds (read outside the timed step).
        s0 = _blocked_seconds(client)
        c0 = time.process_time()
        t0 = time.perf_counter()
        if step == 0 and mode == "global":
            # The branch of the first step's forward pass (its ReLU and max-pool decisions),
            # for the check: its float64 gradient is computed on the same branch.
            with kinks.Kinks() as k:
                out = ddp(x)
        else:
            out = ddp(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            del client.forward
            first["grads"] = _grads(model)  # DDP's average over the workers
        opt.step()
        step_s[step] = time.perf_counter() - t0
        cpu_s += time.process_time() - c0
        sync_s[step] = _blocked_seconds(client) - s0
        losses[step] = loss.item()
        if step == 0:
            first["running"] = _running(model)
            if mode == "global":
                every = [None] * world
                dist.all_gather_object(every, k.decisions)
                first["kinks"] = kinks.concat(every)  # the global batch, in rank order
        if step + 1 in points:
            curve.append((step + 1, _distributed_eval(torch, dist, model, task, xs_c, ys_c,
                                                      rank, world, "rank0")))
        if rank == 0:
            _progress_tick(progress, job_index)
    # CPU per step: the workers' in their timed steps, summed over the workers; each
    # aggregator kind's (and the simulated links') over the whole loop, which its curve
    # evaluations do not load (they make no rounds).
    agg1 = _proc_cpu(cfg.get("cluster_pids")) if rank == 0 else None
    worker_cpu = torch.tensor([cpu_s], dtype=torch.float64)
    dist.all_reduce(worker_cpu)
    cpu = None
    if agg0 is not None and agg1 is not None and set(agg0) == set(agg1):
        cpu = {k: 1e3 * (agg1[k] - agg0[k]) / steps for k in agg1}
        cpu["workers"] = 1e3 * float(worker_cpu[0]) / steps
    renorm = None
    if mode == "renorm":
        # Summed over the workers, read before the evaluations below make rounds: forward
        # calls, those that used global statistics, those that had to wait for them, and the
        # seconds spent fetching them.
        st = hsbn.torch.sync_stats()
        counts = torch.tensor([st.renorm_calls, st.renorm_global_uses, st.renorm_waits,
                               st.renorm_wait_seconds], dtype=torch.float64)
        dist.all_reduce(counts)
        calls, uses, waits, secs = counts.tolist()
        renorm = {"calls": int(calls), "global_uses": int(uses), "waits": int(waits),
                  "wait_share": waits / calls if calls else 0.0,
                  "wait_ms_per_step": 1e3 * secs / (world * steps)}
    lagged = None
    if mode == "lagged":
        # Summed over the workers, before the evaluations: training calls, those that ran
        # exact global (warm-up and trips), trips, fetches of late results that had to wait,
        # and the seconds spent in those fetches (inside the sync time above).
        st = hsbn.torch.sync_stats()
        counts = torch.tensor([st.lagged_calls, st.lagged_exact, st.lagged_trips,
                               st.lagged_waits, st.lagged_wait_seconds], dtype=torch.float64)
        dist.all_reduce(counts)
        calls, exact, trips, waits, secs = counts.tolist()
        lagged = {"calls": int(calls), "exact": int(exact), "trips": int(trips / world),
                  "waits": int(waits), "exact_share": exact / calls if calls else 0.0,
                  "wait_ms_per_step": 1e3 * secs / (world * steps)}
    xs_t, ys_t = arrays[task + "_test_x"], arrays[task + "_test_y"]
    final = _distributed_eval(torch, dist, model, task, xs_t, ys_t, rank, world, "rank0")
    final_avg = _distributed_eval(torch, dist, model, task, xs_t, ys_t, rank, world, "avg")
    final_sync, final_precise = _pooled_evals(torch, dist, hsbn, cfg, model, task, plan,
                                              arrays, xs_t, ys_t, rank, world)
    # The global training loss (mean over the workers' equal-sized batches), and timings.
    loss_t = torch.from_numpy(losses)
    dist.all_reduce(loss_t)
    warm = min(5, steps // 5)
    mine = torch.tensor([step_s[warm:].mean(), sync_s[warm:].mean()], dtype=torch.float64)
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, mine)
    scopes, decisions = None, None
    if mode == "auto" and rank == 0 and hasattr(hsbn.torch, "scopes"):
        scopes = {k: str(v) for k, v in hsbn.torch.scopes(model).items()}
        decisions = {k: (None if v is None else {kk: (vv if isinstance(vv, (int, float, str))
                                                      else str(vv)) for kk, vv in v.items()})
                     for k, v in hsbn.torch.auto_decisions(model).items()}
    divergence = None
    if mode == "shadow":
        # With a group tier each group aggregator holds its own nodes' record: every rank
        # reads its chain, rank 0 merges them.
        mine = _shadow_divergence(model, client, steps, hsbn)
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            merged = {(int(e.get("op", 0)), int(e.get("node", 0))): e
                      for rows in every for e in rows}
            divergence = sorted(merged.values(), key=lambda e: (e["index"], int(e.get("node", 0))))
    dist.barrier()
    if rank != 0:
        return None
    per_rank = torch.stack(gathered).numpy()
    return {
        "task": task, "seed": seed, "mode": mode, "steps": steps,
        "metric": final, "metric_avg_stats": final_avg,
        "metric_sync_stats": final_sync, "metric_precise_bn": final_precise,
        "scopes": scopes, "auto_decisions": decisions,
        "curve": curve, "loss": (loss_t.numpy() / world).tolist(),
        "step_ms": float(per_rank[:, 0].mean() * 1e3),
        "step_ms_max_rank": float(per_rank[:, 0].max() * 1e3),
        "sync_ms": float(per_rank[:, 1].mean() * 1e3),
        "cpu_ms_per_step": cpu,
        "divergence": divergence, "renorm": renorm, "lagged": lagged,
        "state": state_numpy(model),
        "first_step": first if mode in ("global", "node") else None,
    }


def _shadow_divergence(model, client, steps, hsbn):
    """The per-layer record of how far each node's statistics were from the global ones during
    the shadow run (the root's; with a group tier, this rank's group aggregator's), once it has seen every forward round (the root computes it off the
    critical path), or whatever it has after 20 s."""
    layers = [(name, m.op) for name, m in model.named_modules()
              if isinstance(m, hsbn.torch.SyncBatchNorm)]
    ops = {op: name for name, op in layers}
    index = {op: i for i, (_, op) in enumerate(layers)}  # module order
    deadline = time.monotonic() + 20.0
    while True:
        st = client.status(include_upstream=True)
        # Every level above the sidecar: the root, or a group aggregator (its group's nodes)
        # and the root (groups only).
        entries, level, expected = [], st.get("upstream") or {}, client.num_nodes
        while level:
            job = next((j for j in level.get("jobs", []) if j.get("jobId") == client.job_id), {})
            if level.get("role") == "group":
                expected = int(job.get("groupNodes", client.num_nodes))
            entries += [d for d in job.get("divergence", []) if int(d.get("op", 0)) in ops]
            level = level.get("upstream") or {}
        done = (len(entries) >= len(ops) * expected
                and all(int(d.get("rounds", 0)) >= steps for d in entries))
        if done or time.monotonic() > deadline:
            out = []
            for d in entries:
                e = dict(d)
                e["layer"] = ops[int(d.get("op", 0))]
                e["index"] = index[int(d.get("op", 0))]
                out.append(e)
            return sorted(out, key=lambda e: (e["index"], int(e.get("node", 0))))
        time.sleep(0.1)


# --- the one-process reference -----------------------------------------------------------------

def reference_run(cfg, task, seed, label, order, init, plan, cache, global_kinks, progress,
                  job_index):
    """One process, plain torch BatchNorm over the global batch: the workers' batches
    concatenated in rank order (order="forward"), or in reverse rank order (order="reversed":
    the same mathematics, a different floating-point summation order, which measures round-off
    noise). `global_kinks`: the kink decisions of global's first step (or None), for the
    float64 gradient on global's branch (see first_step_float64)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    arrays = load_cache(cache)
    model = models.build(task, cfg.get("model"))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    opt = torch.optim.SGD(model.parameters(), lr=_lr(cfg, task), momentum=0.9)
    steps = plan["steps"]
    world = cfg["nodes"] * cfg["workers_per_node"]
    ranks = list(range(world)) if order == "forward" else list(reversed(range(world)))
    points = eval_points(steps, cfg["evals"])
    xs_c, ys_c = arrays[task + "_curve_x"], arrays[task + "_curve_y"]
    losses = np.zeros(steps)
    step_s = np.zeros(steps)
    curve = []
    first = {"stats": {}}
    for step in range(steps):
        x, y = batch(torch, task, plan, arrays, step, ranks)
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, task) * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        hooks = _input_stats_hooks(torch, model, first["stats"]) if step == 0 else []
        t0 = time.perf_counter()
        if step == 0 and order == "forward":
            with kinks.Kinks() as k:  # this run's branch, as in _distributed_run
                out = model(x)
            own_kinks = k.decisions
        else:
            out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            first["grads"] = _grads(model)
        opt.step()
        step_s[step] = time.perf_counter() - t0
        for h in hooks:
            h.remove()
        if step == 0:
            first["running"] = _running(model)
        losses[step] = loss.item()
        if step + 1 in points:
            curve.append((step + 1, metric(task, eval_counts(torch, model, task, xs_c, ys_c))))
        _progress_tick(progress, job_index)
    final = metric(task, eval_counts(torch, model, task, arrays[task + "_test_x"],
                                     arrays[task + "_test_y"]))
    warm = min(5, steps // 5)
    return {
        "task": task, "seed": seed, "mode": label, "steps": steps,
        "metric": final, "metric_avg_stats": final, "metric_sync_stats": final,
        "metric_precise_bn": None, "scopes": None,
        "curve": curve, "loss": losses.tolist(),
        "step_ms": float(step_s[warm:].mean() * 1e3), "step_ms_max_rank": None,
        "sync_ms": 0.0, "divergence": None,
        "state": state_numpy(model),
        "first_step": first,
        "first_step_f64": first_step_float64(
            cfg, task, init, plan, arrays,
            {"reference": own_kinks, "global": global_kinks} if order == "forward" else {}),
    }


def first_step_float64(cfg, task, init, plan, arrays, branches=None):
    """The reference's first step in float64 (weights, inputs and arithmetic): each BatchNorm
    layer's batch statistics, every parameter's gradient and the running statistics after the
    step. The truth the check measures global and the float32 reference against: neither has
    float64's round-off, and a wrong statistic is far from both.

    `branches` ({label: kink decisions of that run's first step, or None}): for each, the
    float64 gradient on that run's branch (kinks.Kinks replays its ReLU and max-pool
    decisions; "grads_on_branch") and where its decisions differ from float64's own, with the
    largest float64 distance from the kink among them ("kink_flips"; see kinks.flips)."""
    import torch
    import torch.nn.functional as F

    world = cfg["nodes"] * cfg["workers_per_node"]
    x, y = batch(torch, task, plan, arrays, 0, list(range(world)))

    def step(replay=None, record=False):
        model = models.build(task, cfg.get("model")).double()
        model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
        stats = {}
        hooks = _input_stats_hooks(torch, model, stats) if replay is None else []
        with kinks.Kinks(replay=replay, keep_inputs=record) as k:
            out = model(x.double())
        F.cross_entropy(out, y).backward()
        for h in hooks:
            h.remove()
        return model, stats, k

    model, stats, own = step(record=True)
    first = {"stats": stats, "grads": _grads(model), "running": _running(model),
             "grads_on_branch": {}, "kink_flips": {}}
    for label, decisions in (branches or {}).items():
        if decisions is None:
            continue
        flips = kinks.flips(decisions, own)
        first["kink_flips"][label] = flips
        # On float64's own branch the replay is float64's gradient itself.
        first["grads_on_branch"][label] = (_grads(step(replay=decisions)[0]) if flips["count"]
                                           else first["grads"])
    return first
