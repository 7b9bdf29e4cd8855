"""Scope "lagged" in hsbn.torch (issue #41) with real aggregators: one LocalCluster (2 nodes x 2
workers: a root, two sidecars) and four worker processes, over both node transports, plus
in-process checks (threads, one client each) for checkpointing and a killed root.

The reference is independent of the layer's algebra: call s of a node's workers is BatchNorm
(torch.nn.BatchNorm, float64) over a "virtual" batch, this node's fresh batch of call s and the
other nodes' batches (inputs and upstream gradients) of call s - 1; the first call is BatchNorm
over the job's batch (the exact warm-up). Outputs and input gradients of the node's rows must
equal it; the running statistics equal BatchNorm's over the job's real batches of every call
but the last (they take the job's exact statistics one call late)."""

import threading

import numpy as np
import pytest
import torch

import hsbn
import hsbn.cli
import hsbn.cluster
import hsbn.torch
import hsbn_cases
from bnref import NODES, WORKERS_PER_NODE, make_spec, reference as job_reference, rel_err
from hsbn.errors import ConfigurationError
from workerpool import on_transport, started

NODE_RANKS = [[n * WORKERS_PER_NODE + w for w in range(WORKERS_PER_NODE)] for n in range(NODES)]
ALL = list(range(NODES * WORKERS_PER_NODE))
TOL = 1e-9


@pytest.fixture(scope="module")
def workers():
    with started(nodes=NODES, workers_per_node=WORKERS_PER_NODE,
                 round_timeout_ms=30000) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool(workers, transport):
    yield from on_transport(workers, transport)


def run_case(pool, spec, data):
    return pool.call(hsbn_cases.bn_steps, [(spec, data[r]) for r in range(pool.world_size)])


def lagged_reference(spec, data, node, damping=1.0, exact=(0,), ema=0.0):
    """{"y", "dx": {rank: [per call]}, "dw", "db": [per call, summed over the node]} of the
    node's ranks: BatchNorm over the virtual batch of each call (module docstring), or over
    the job's batch for the calls in `exact` (the warm-up, and those the trip guard sends
    there); with damping < 1 the input gradient of the other calls is damping * that +
    (1 - damping) * the node-local one,
    w invstd (dy - mean_node(dy) - (x - m_k) sum_node(dy (x - m_k)) / (M_k + n_k eps)).
    With ema = B > 0 (lagged_ema; exact = (0,) only) the virtual batch of call s >= 1 holds the
    other nodes' batches of every earlier call t, weighted as the exponential average weighs
    them (1 - B) B^(s-1-t), call 0 B^(s-1), and this node's fresh batch weighted 1: BatchNorm
    of a weighted batch (weighted mean and variance, loss sum of weight * dy * y)."""
    eps = spec.get("eps", 1e-5)
    w = torch.from_numpy(spec["weight"])
    b = torch.from_numpy(spec["bias"])
    mine = NODE_RANKS[node]
    out = {"y": {r: [] for r in mine}, "dx": {r: [] for r in mine}, "dw": [], "db": []}
    for s in range(len(data[0])):
        rows = [(r, s) for r in mine] + [(r, s if s in exact else s - 1) for r in ALL
                                        if r not in mine]
        if ema and s not in exact:
            assert tuple(exact) == (0,)
            age = [(1.0 - ema) * ema ** (s - 1 - t) if t > 0 else ema ** (s - 1)
                   for t in range(s)]
            rows = [(r, s, 1.0) for r in mine] + [(r, t, age[t]) for t in range(s)
                                                  for r in ALL if r not in mine]
        else:
            rows = [row + (1.0,) for row in rows]
        xs = [torch.from_numpy(data[r][t][0]) for r, t, _ in rows]
        gs = [torch.from_numpy(data[r][t][1]) for r, t, _ in rows]
        x = torch.cat(xs).requires_grad_()
        g = torch.cat(gs)
        shape = [-1] + [1] * (x.dim() - 1)
        wt = torch.cat([torch.full((t.shape[0],), a, dtype=x.dtype)
                        for t, (_, _, a) in zip(xs, rows)]).reshape(shape)
        dims = [0] + list(range(2, x.dim()))
        xd = x.detach()
        if ema and s not in exact:   # weighted BatchNorm, by autograd
            total = (wt * torch.ones_like(xd)).sum(dims, keepdim=True)
            mu = (wt * xd).sum(dims, keepdim=True) / total
            invstd = 1.0 / torch.sqrt((wt * (xd - mu) ** 2).sum(dims, keepdim=True) / total
                                      + eps)
            m_w = (wt * x).sum(dims, keepdim=True) / total
            v_w = (wt * (x - m_w) ** 2).sum(dims, keepdim=True) / total
            y = (x - m_w) / torch.sqrt(v_w + eps) * w.reshape(m_w.shape) + b.reshape(m_w.shape)
            (wt * y * g).sum().backward()
        else:
            y = torch.nn.functional.batch_norm(x, None, None, w, b, True, 0.0, eps)
            (y * g).sum().backward()
            mu = xd.mean(dims, keepdim=True)
            invstd = 1.0 / torch.sqrt(xd.var(dims, unbiased=False, keepdim=True) + eps)
        sizes = [t.shape[0] for t in xs]
        ys, dxs = y.detach().split(sizes), x.grad.split(sizes)
        n_mine = sum(sizes[:len(mine)])
        xk, gk = xd[:n_mine], g[:n_mine]
        xhat_k = (xk - mu) * invstd
        out["dw"].append((gk * xhat_k).sum(dims).numpy())
        out["db"].append(gk.sum(dims).numpy())
        if damping != 1.0 and s not in exact:  # exact calls are exact global, undamped
            count_k = xk.numel() // xk.shape[1]
            m_k = xk.mean(dims, keepdim=True)
            mk2 = ((xk - m_k) ** 2).sum(dims, keepdim=True)
            mean_dy = gk.sum(dims, keepdim=True) / count_k
            s_k = (gk * (xk - m_k)).sum(dims, keepdim=True)
            wb = w.reshape(m_k.shape)
            local = wb * invstd * (gk - mean_dy - (xk - m_k) * s_k / (mk2 + count_k * eps))
            lagged = torch.cat(dxs[:len(mine)])
            dx_k = damping * lagged + (1.0 - damping) * local
            dxs = list(dx_k.split(sizes[:len(mine)]))
        for i, r in enumerate(mine):
            out["y"][r].append(ys[i].numpy())
            out["dx"][r].append(dxs[i].numpy())
    return out


def lagged_case(seed, steps=4, repeat=False, **options):
    # Rank 2 has an empty batch; rank 3 four samples. Node 1's inputs are shifted by 3 and
    # spread more (make_spec), so node and job statistics differ.
    spec, data = make_spec("lagged", "float64", steps=1 if repeat else steps, seed=seed,
                           sizes=[3, 5, 0, 4])
    if repeat:
        data = [[d[0]] * steps for d in data]
    # The plain design (lambda 1, no average) unless a test asks for damping or the average:
    # the references are exact.
    spec["options"] = dict({"lagged_damping": 1.0, "lagged_warmup": 1, "lagged_ema": 0.0},
                           **options)
    return spec, data


def check_against(results, data, spec, damping=1.0, tol=TOL, exact=(0,), ema=0.0):
    worst = {}
    for node in range(NODES):
        ref = lagged_reference(spec, data, node, damping, exact, ema)
        for s in range(len(data[0])):
            for r in NODE_RANKS[node]:
                for key in ("y", "dx"):
                    e = rel_err(results[r][key][s], ref[key][r][s])
                    worst[key] = max(worst.get(key, 0.0), e)
                    assert e <= tol, "%s of rank %d call %d: %.3g" % (key, r, s, e)
            for key in ("dw", "db"):
                total = sum(results[r][key][s] for r in NODE_RANKS[node])
                e = rel_err(total, ref[key][s])
                worst[key] = max(worst.get(key, 0.0), e)
                assert e <= tol, "%s of node %d call %d: %.3g" % (key, node, s, e)
    # Running statistics: the job's exact statistics of every call but the last.
    ref = job_reference(spec, [d[:-1] for d in data], ALL)
    for r in ALL:
        for key in ("running_mean", "running_var"):
            e = rel_err(results[r][key], ref[key])
            worst[key] = max(worst.get(key, 0.0), e)
            assert e <= tol, "%s of rank %d: %.3g" % (key, r, e)
        assert results[r]["num_batches_tracked"] == len(data[0]) - 1
    return worst


@pytest.mark.parametrize("ema", [0.0, 0.8])
def test_the_same_batch_every_call_gives_global_scope_on_every_rank(pool, ema):
    # Issue #41's exactness check: the same batch and upstream gradient on every call, no
    # weight update: outputs and input gradients equal global BatchNorm's (float64, 1e-9) on
    # every call (call 0 is the exact warm-up; calls 1.. merge this node's fresh share with
    # the others' of the previous call, which is the same batch, or with the average of their
    # earlier calls, all the same batch), on every rank.
    spec, data = lagged_case(41, steps=4, repeat=True, lagged_ema=ema)
    results = run_case(pool, spec, data)
    ref = job_reference(spec, data, ALL)
    worst = {}
    for s in range(4):
        for r in ALL:
            for key in ("y", "dx"):
                e = rel_err(results[r][key][s], ref[key][r][s])
                worst[key] = max(worst.get(key, 0.0), e)
                assert e <= TOL, "%s of rank %d call %d: %.3g" % (key, r, s, e)
        for key in ("dw", "db"):
            e = rel_err(sum(results[r][key][s] for r in ALL), ref[key][s])
            assert e <= TOL, "%s of the job, call %d: %.3g" % (key, s, e)
    print("lagged vs global, same batch:", worst)


def test_fresh_data_equals_the_virtual_batch_and_does_not_sum_to_zero_per_node(pool):
    spec, data = lagged_case(42, steps=4)
    results = run_case(pool, spec, data)
    worst = check_against(results, data, spec)
    print("lagged vs the virtual-batch reference, fresh data:", worst)
    # On fresh node-shifted data a node's input gradients do not sum to zero per channel
    # (global's sum to zero over the job, node's over the node): calls 1.. are stale.
    for node in range(NODES):
        for s in range(1, 4):
            dxs = [results[r]["dx"][s] for r in NODE_RANKS[node]]
            total = sum(d.sum(axis=(0, 2, 3)) for d in dxs if d.size)
            scale = max(np.abs(d).max() for d in dxs if d.size)
            assert np.all(np.abs(total) > 1e-6 * scale), (node, s, total, scale)
    # The running statistics are the job's: the same bits on every rank, and on a rerun.
    again = run_case(pool, spec, data)
    for r in ALL:
        for key in ("running_mean", "running_var"):
            assert results[r][key].tobytes() == results[0][key].tobytes(), (key, r)
            assert again[r][key].tobytes() == results[r][key].tobytes(), (key, r)
        for key in ("y", "dx"):
            for s in range(4):
                assert again[r][key][s].tobytes() == results[r][key][s].tobytes(), (key, r, s)


def test_ema_averages_the_other_nodes_share_in_both_passes(pool):
    # lagged_ema: the other nodes' share is their earlier calls' batches, weighted as the
    # average weighs them, in the forward and the backward alike (lagged_reference); the
    # running statistics stay the job's exact ones; with damping too.
    spec, data = lagged_case(44, steps=5, lagged_ema=0.75)
    results = run_case(pool, spec, data)
    worst = check_against(results, data, spec, ema=0.75)
    print("lagged, ema 0.75, vs the weighted virtual batch:", worst)
    plain = run_case(pool, *lagged_case(44, steps=5))
    for r in ALL:   # calls 0 and 1 have one earlier call at most: the same as plain lagged
        for s in range(5):
            if not results[r]["y"][s].size:
                continue
            for key in ("y", "dx"):
                e = rel_err(results[r][key][s], plain[r][key][s])
                assert (e <= 1e-12) if s < 2 else (e > 1e-6), (key, r, s, e)
    spec, data = lagged_case(45, steps=4, lagged_ema=0.5, lagged_damping=0.5)
    check_against(run_case(pool, spec, data), data, spec, damping=0.5, ema=0.5)


def test_ema_skips_a_non_finite_call_instead_of_keeping_it(pool):
    # An overflowing backward (GradScaler's case: that step is skipped) puts an Inf in rank 3's
    # sums of call 2. Plain lagged carries it into node 0's next call only; the average would
    # carry it into every later call, so a non-finite share is not folded into it: node 0's
    # input gradients stay finite from call 3 on, where plain lagged's call 3 is not.
    spec, data = lagged_case(46, steps=5)
    x, dy = data[3][2]
    dy = dy.copy()
    dy.flat[0] = np.inf
    data[3][2] = (x, dy)
    plain = run_case(pool, spec, data)
    spec["options"]["lagged_ema"] = 0.5
    ema = run_case(pool, spec, data)
    for r in NODE_RANKS[0]:
        assert not np.isfinite(plain[r]["dx"][3]).all(), r
        assert np.isfinite(plain[r]["dx"][4]).all(), r
        for s in range(5):
            assert np.isfinite(ema[r]["dx"][s]).all(), (r, s)
    assert not np.isfinite(ema[3]["dx"][2]).all()   # the overflowing call itself, as plain


def test_damping_mixes_the_node_local_gradient(pool):
    spec, data = lagged_case(43, steps=3, lagged_damping=0.5)
    results = run_case(pool, spec, data)
    worst = check_against(results, data, spec, damping=0.5)
    print("damped lagged (0.5) vs reference:", worst)


def test_the_trip_guard_sends_a_jumping_layer_exact_global_for_its_calls_then_back(pool):
    # Every rank's inputs move by 30 (many standard deviations) from call 3 on, as a learning-
    # rate spike moves a layer's input. Call 4 is the first that knows call 3's job statistics
    # (one call late): its check sees v (trip_drift of calls 2 and 3) far above lagged_trip,
    # so calls 4 and 5 (lagged_trip_calls 2) are exact global, both passes, on every rank;
    # call 6 sees calls 4 and 5 alike and goes back to lagged. Without the guard the same
    # data gives the plain lagged calls.
    spec, data = lagged_case(46, steps=8)
    for r in ALL:
        data[r] = [(x + 30.0 if s >= 3 else x, g) for s, (x, g) in enumerate(data[r])]
    guarded = dict(spec, options=dict(spec["options"], lagged_trip=1.0, lagged_trip_calls=2))
    results = run_case(pool, guarded, data)
    worst = check_against(results, data, guarded, exact=(0, 4, 5))
    print("lagged with a trip at call 4 vs reference:", worst)
    for node in range(NODES):   # and not the plain lagged calls (the check can fail)
        ref = lagged_reference(spec, data, node)
        r = NODE_RANKS[node][-1]   # rank 2 has an empty batch
        assert rel_err(results[r]["y"][4], ref["y"][r][4]) > 1e-3
    off = dict(spec, options=dict(spec["options"], lagged_trip=0.0))
    check_against(run_case(pool, off, data), data, off)
    # A threshold above the jump: no trip.
    high = dict(spec, options=dict(spec["options"], lagged_trip=1e6))
    check_against(run_case(pool, high, data), data, high)


def test_the_relative_trip_guard_trips_on_a_jump_against_the_layer_s_own_level(pool):
    # lagged_trip_rel: v against 5 times the layer's level of v, from its 6th v on (call 7):
    # the inputs jump at call 7, call 8 knows it and trips, calls 8 and 9 are exact global.
    spec, data = lagged_case(48, steps=11)
    for r in ALL:
        data[r] = [(x + 30.0 if s >= 7 else x, g) for s, (x, g) in enumerate(data[r])]
    guarded = dict(spec, options=dict(spec["options"], lagged_trip_rel=5.0,
                                      lagged_trip_calls=2))
    check_against(run_case(pool, guarded, data), data, guarded, exact=(0, 8, 9))


def test_options_are_checked():
    for bad in (-0.1, 1.5, float("nan"), True, "1"):
        with pytest.raises(ConfigurationError, match="lagged_damping"):
            hsbn.torch.SyncBatchNorm(3, scope="lagged", lagged_damping=bad)
    with pytest.raises(ConfigurationError, match="lagged_warmup"):
        hsbn.torch.SyncBatchNorm(3, scope="lagged", lagged_warmup=0)
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ConfigurationError, match="lagged_trip"):
            hsbn.torch.SyncBatchNorm(3, scope="lagged", lagged_trip=bad)
    for bad in (-1.0, float("inf"), False):
        with pytest.raises(ConfigurationError, match="lagged_trip_rel"):
            hsbn.torch.SyncBatchNorm(3, scope="lagged", lagged_trip_rel=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigurationError, match="lagged_trip_calls"):
            hsbn.torch.SyncBatchNorm(3, scope="lagged", lagged_trip_calls=bad)
    for bad in (1.0, -0.1, float("nan"), True, "0.5"):
        with pytest.raises(ConfigurationError, match="lagged_ema"):
            hsbn.torch.SyncBatchNorm(3, scope="lagged", lagged_ema=bad)
    default = dict(hsbn.torch._lagged.DEFAULTS)
    assert default["damping"] == 1.0 and default["warmup"] == 20 and default["trip_calls"] == 30
    assert default["trip_rel"] == 4.0 and default["trip"] == 0.0 and default["ema"] == 0.8
    assert hsbn.torch.SyncBatchNorm(3, scope="lagged").lagged_options == default
    bn = hsbn.torch.SyncBatchNorm(3, scope="lagged", lagged_damping=0.25, lagged_trip=2.5)
    assert bn.lagged_options == dict(default, damping=0.25, trip=2.5)
    assert bn.lagged_trips == []
    assert bn.lagged_damping == 0.25
    bn.lagged_damping = 0.75
    assert bn.lagged_damping == 0.75
    with pytest.raises(ConfigurationError):
        bn.lagged_damping = 2.0
    m = hsbn.torch.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(2)),
                                          scope="lagged", lagged_damping=0.5, lagged_warmup=3,
                                          lagged_ema=0.0)
    assert m[0].lagged_options == dict(default, damping=0.5, warmup=3, ema=0.0)
    with pytest.raises(ConfigurationError, match="lagged_damping"):
        hsbn.torch.convert_sync_batchnorm(torch.nn.BatchNorm1d(2), lagged_damping=-1)


# --- in-process: one client per rank, threads --------------------------------------------------

def _threads(fn, n=4, timeout=120):
    out, errors = [None] * n, []

    def one(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # reported by the caller
            errors.append((r, e))
    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out, errors


def _layer(spec, client, op, checkpointed=False, **options):
    bn = hsbn.torch.SyncBatchNorm(spec["C"], scope="lagged", client=client, op=op,
                                  **dict({"lagged_damping": 1.0, "lagged_warmup": 1,
                                          "lagged_ema": 0.0}, **options)).double()
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(spec["weight"]))
        bn.bias.copy_(torch.from_numpy(spec["bias"]))
    return bn


def _calls(bn, steps, checkpointed=False, reentrant=False):
    from torch.utils.checkpoint import checkpoint
    out = {"y": [], "dx": []}
    for x_np, g_np in steps:
        x = torch.from_numpy(x_np).requires_grad_()
        y = checkpoint(bn, x, use_reentrant=reentrant) if checkpointed else bn(x)
        (y * torch.from_numpy(g_np)).sum().backward()
        out["y"].append(y.detach().numpy().copy())
        out["dx"].append(x.grad.numpy().copy())
    out["running_mean"] = bn.running_mean.numpy().copy()
    out["running_var"] = bn.running_var.numpy().copy()
    return out


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_reuses_the_first_pass_and_changes_nothing(reentrant):
    # torch.utils.checkpoint (use_reentrant=False, and the reentrant form): the recomputation in
    # backward makes its node round again and reuses its first pass's statistics; the results
    # are the bits of the same calls without checkpointing.
    spec, data = lagged_case(44, steps=4)
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=20000) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r, job_id="lagged-ckpt-%d" % reentrant))
                   for r in range(4)]
        try:
            hsbn.torch.reset_sync_stats()
            plain, errors = _threads(lambda r: _calls(_layer(spec, clients[r], 501), data[r]))
            assert not errors, errors
            ckpt, errors = _threads(
                lambda r: _calls(_layer(spec, clients[r], 502), data[r], checkpointed=True,
                                 reentrant=reentrant))
            assert not errors, errors
            st = hsbn.torch.sync_stats()
        finally:
            for cl in clients:
                cl.close()
    for r in ALL:
        for key in ("y", "dx"):
            for s in range(4):
                assert ckpt[r][key][s].tobytes() == plain[r][key][s].tobytes(), (key, r, s)
        for key in ("running_mean", "running_var"):
            assert ckpt[r][key].tobytes() == plain[r][key].tobytes(), (key, r)
    assert st.lagged_recomputes == 4 * 4
    assert st.lagged_calls == 2 * 4 * 4
    assert st.lagged_exact == 2 * 4  # one warm-up call per layer and rank


def test_trips_are_the_same_on_every_rank_counted_and_blind_to_recomputations():
    # The jump of the trip test above, checkpointed (each call's recomputation is a lagged
    # round of its own, with the first pass's statistics: the guard must compare training
    # calls, not a call with its recomputation): one trip per rank, at call 4, with the same
    # v on every rank, in sync_stats, and the bits of the same calls without checkpointing.
    spec, data = lagged_case(47, steps=7)
    for r in ALL:
        data[r] = [(x + 30.0 if s >= 3 else x, g) for s, (x, g) in enumerate(data[r])]
    opts = dict(lagged_trip=1.0, lagged_trip_calls=2)
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=20000) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r, job_id="lagged-trip"))
                   for r in range(4)]
        try:
            hsbn.torch.reset_sync_stats()
            layers = [_layer(spec, clients[r], 701, **opts) for r in range(4)]
            plain, errors = _threads(lambda r: _calls(layers[r], data[r]))
            assert not errors, errors
            st = hsbn.torch.sync_stats()
            ck_layers = [_layer(spec, clients[r], 702, **opts) for r in range(4)]
            ckpt, errors = _threads(lambda r: _calls(ck_layers[r], data[r], checkpointed=True))
            assert not errors, errors
            # Each sidecar counted each layer's trip once (four reports of it came), with the
            # same v, in Status (as `hsbn status` prints it).
            shown = {}
            for node in (0, 2):
                status = clients[node].status(include_upstream=False)
                job = [j for j in status["jobs"] if j["jobId"] == "lagged-trip"][0]
                shown[node] = {int(t["op"]): t for t in job["laggedTrips"]}
                assert "lagged trip guard op 701: trips 1  last at seq 4" in "\n".join(
                    hsbn.cli._fmt_status(status))
        finally:
            for cl in clients:
                cl.close()
    assert st.lagged_trips == 4 and st.lagged_exact == 4 * 3   # warm-up, calls 4 and 5
    for node in (0, 2):
        assert sorted(shown[node]) == [701, 702]
        for op, seq in ((701, 4), (702, 8)):
            t = shown[node][op]
            assert (int(t["trips"]), int(t["lastSeq"]), int(t["exactCalls"])) == (1, seq, 2)
            assert float(t["lastDrift"]) == layers[0].lagged_trips[0][2]
    for bn in layers + ck_layers:   # (training call, its round seq, v)
        assert [t[:2] for t in bn.lagged_trips] == [(4, 4 if bn in layers else 8)]
        assert bn.lagged_trips[0][2] == layers[0].lagged_trips[0][2] > 1.0
    for r in ALL:
        for key in ("y", "dx"):
            for s in range(7):
                assert ckpt[r][key][s].tobytes() == plain[r][key][s].tobytes(), (key, r, s)


def test_a_killed_root_fails_the_call_naming_the_round_and_node_rounds_go_on():
    spec, data = lagged_case(45, steps=4)
    op = 601
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=10000) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r, job_id="lagged-kill")) for r in range(4)]
        layers = [_layer(spec, clients[r], op) for r in range(4)]
        try:
            def two_calls(r):
                _calls(layers[r], data[r][:2])
                # Both late results of call 1 are in before the root dies.
                while not (clients[r].global_stats_ready(op, 1)
                           and clients[r].global_sums_ready(op, 1)):
                    threading.Event().wait(0.01)
            _, errors = _threads(two_calls)
            assert not errors, errors
            c.root.proc.kill()
            c.root.proc.wait()

            def more(r):
                _calls(layers[r], data[r][2:3])   # uses call 1's results: works
                try:
                    _calls(layers[r], data[r][3:4])  # needs call 2's: the root is gone
                except hsbn.HsbnError as e:
                    return e
                return None
            got, errors = _threads(more)
            assert not errors, errors
            for r, e in enumerate(got):
                assert isinstance(e, hsbn.HsbnError), (r, e)
                msg = str(e)
                assert "lagged round op %d, seq 2" % op in msg, (r, msg)
                assert "root" in msg.lower(), (r, msg)
            print("rank 0's error:", got[0])

            def node_round(r):
                x = np.full(2, float(r))
                return clients[r].forward(7, 0, "node", 1, x, np.zeros(2))[1]
            means, errors = _threads(node_round)
            assert not errors, errors
            assert np.allclose(means[0], 0.5) and np.allclose(means[3], 2.5)
        finally:
            for cl in clients:
                cl.close()


def test_through_the_group_tier_the_same_batch_gives_global_scope():
    # 4 nodes x 1 worker, groups of 2 with their own aggregator: the group aggregators re-centre
    # their nodes' backward partials on the group's mean (docs/PROTOCOL.md, "Lagged scope").
    spec, data = make_spec("lagged", "float64", steps=1, seed=46, sizes=[3, 5, 2, 4])
    data = [[d[0]] * 3 for d in data]
    with hsbn.cluster.LocalCluster(nodes=4, workers_per_node=1, group_tier=True, group_nodes=2,
                                   round_timeout_ms=20000) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r, job_id="lagged-tier")) for r in range(4)]
        try:
            got, errors = _threads(lambda r: _calls(_layer(spec, clients[r], 701), data[r]))
            assert not errors, errors
        finally:
            for cl in clients:
                cl.close()
    ref = job_reference(spec, data, ALL)
    worst = {}
    for s in range(3):
        for r in ALL:
            for key in ("y", "dx"):
                e = rel_err(got[r][key][s], ref[key][r][s])
                worst[key] = max(worst.get(key, 0.0), e)
                assert e <= TOL, "%s of rank %d call %d: %.3g" % (key, r, s, e)
    for r in ALL:
        assert got[r]["running_mean"].tobytes() == got[0]["running_mean"].tobytes()
    print("lagged through the group tier vs global, same batch:", worst)


def test_a_one_node_job_is_node_scope_and_float32_stays_close_to_global():
    # One node, no root: the late results are the node's answers, the other nodes' share is
    # empty, and lagged is node scope (here: the job's batch) on every call.
    spec, data = make_spec("lagged", "float32", steps=3, seed=47, sizes=[3, 5])
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=2, root=False,
                                   round_timeout_ms=20000) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r, job_id="lagged-one")) for r in range(2)]
        try:
            def run(r):
                bn = hsbn.torch.SyncBatchNorm(3, scope="lagged", client=clients[r], op=801,
                                              lagged_warmup=1)
                with torch.no_grad():
                    bn.weight.copy_(torch.from_numpy(spec["weight"]))
                    bn.bias.copy_(torch.from_numpy(spec["bias"]))
                out = {"y": [], "dx": []}
                for x_np, g_np in data[r]:
                    x = torch.from_numpy(x_np).float().requires_grad_()
                    y = bn(x)
                    (y * torch.from_numpy(g_np).float()).sum().backward()
                    out["y"].append(y.detach().double().numpy())
                    out["dx"].append(x.grad.double().numpy())
                return out
            got, errors = _threads(run, n=2)
            assert not errors, errors
        finally:
            for cl in clients:
                cl.close()
    ref = job_reference(spec, data, [0, 1])
    for s in range(3):
        for r in range(2):
            for key in ("y", "dx"):
                e = rel_err(got[r][key][s], ref[key][r][s])
                assert e <= 1e-5, "%s of rank %d call %d: %.3g" % (key, r, s, e)


def test_a_call_the_guard_sends_to_exact_is_global_and_running_stats_count_every_call_once():
    # The guard's hook: LaggedState.exact(seq) true for call 2 makes it an exact global call
    # (it waits for its own late results); calls 1 and 3 stay lagged, and the running
    # statistics still take the job's statistics of every call but the last, once each.
    spec, data = lagged_case(48, steps=4)
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=20000) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r, job_id="lagged-guard"))
                   for r in range(4)]
        try:
            def run(r):
                bn = _layer(spec, clients[r], 901)
                plain = bn._lagged.exact
                bn._lagged.exact = lambda seq: seq == 2 or plain(seq)
                out = _calls(bn, data[r])
                out["num_batches_tracked"] = int(bn.num_batches_tracked)
                return out
            got, errors = _threads(run)
            assert not errors, errors
        finally:
            for cl in clients:
                cl.close()
    job = job_reference(spec, data, ALL)
    running = job_reference(spec, [d[:-1] for d in data], ALL)
    for node in range(NODES):
        ref = lagged_reference(spec, data, node)
        for r in NODE_RANKS[node]:
            for s in range(4):
                want = job if s == 2 else ref
                for key in ("y", "dx"):
                    e = rel_err(got[r][key][s], want[key][r][s])
                    assert e <= TOL, "%s of rank %d call %d: %.3g" % (key, r, s, e)
    for r in ALL:
        assert got[r]["num_batches_tracked"] == 3
        for key in ("running_mean", "running_var"):
            assert rel_err(got[r][key], running[key]) <= TOL, (r, key)
            assert got[r][key].tobytes() == got[0][key].tobytes(), (r, key)


def test_a_root_killed_before_a_backwards_sums_fails_the_next_backward_naming_the_round():
    spec, data = lagged_case(49, steps=3)
    op = 611
    gate = threading.Barrier(5, timeout=60)
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=10000) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r, job_id="lagged-kill-bwd"))
                   for r in range(4)]
        try:
            def run(r):
                bn = _layer(spec, clients[r], op)
                _calls(bn, data[r][:1])   # call 0: exact
                x = torch.from_numpy(data[r][1][0]).requires_grad_()
                y = bn(x)                 # call 1's forward
                while not clients[r].global_stats_ready(op, 1):
                    threading.Event().wait(0.01)
                gate.wait()               # the root is killed now
                gate.wait()
                # Call 1's backward: node round, the other share from call 0's sums: works.
                (y * torch.from_numpy(data[r][1][1])).sum().backward()
                x = torch.from_numpy(data[r][2][0]).requires_grad_()
                y = bn(x)                 # call 2's forward: call 1's statistics are in
                try:
                    (y * torch.from_numpy(data[r][2][1])).sum().backward()  # needs 1's sums
                except hsbn.HsbnError as e:
                    return e
                return None
            box = {}
            t = threading.Thread(target=lambda: box.update(out=_threads(run)))
            t.start()
            gate.wait()
            c.root.proc.kill()
            c.root.proc.wait()
            gate.wait()
            t.join(120)
            got, errors = box["out"]
            assert not errors, errors
            for r, e in enumerate(got):
                assert isinstance(e, hsbn.HsbnError), (r, e)
                assert "the global sums of lagged round op %d, seq 1" % op in str(e), (r, str(e))
                assert "root" in str(e).lower(), (r, str(e))
            print("rank 0's error:", got[0])
        finally:
            for cl in clients:
                cl.close()
