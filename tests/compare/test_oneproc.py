"""The one-process study (examples/compare/hsbncmp/oneproc.py, issue #41): its explicit
BatchNorm of every scope against torch's BatchNorm (float64), lagged against global where they
must agree, renorm against hsbn.torch's own correction, and its first steps against the
committed distributed runs. Seconds, no cluster, no native parts."""

import json
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import COMPARE
from hsbncmp import cli, data, oneproc

NODES, WPN, B = 4, 2, 3
C, H = 5, 4
TOL = 1e-12


def _bn(mode, opts=None):
    base, o = oneproc.parse_mode(mode)
    o.update(opts or {})
    topo = oneproc.Topology(NODES, WPN, 2)
    m = oneproc._sim_bn_class()(C).double()
    m.sim = oneproc.LayerSim(base, o, topo, C)
    with torch.no_grad():
        m.weight.copy_(torch.linspace(0.5, 1.5, C, dtype=torch.float64))
        m.bias.copy_(torch.linspace(-0.2, 0.3, C, dtype=torch.float64))
    return m


def _batch(seed, shift=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(NODES * WPN * B, C, H, H, generator=g, dtype=torch.float64)
    if shift:  # node-shifted inputs, as class skew makes them
        x = x + torch.arange(NODES, dtype=torch.float64).repeat_interleave(WPN * B)[
            :, None, None, None] * 0.7
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    return x, dy


def _call(m, x, dy):
    x = x.clone().requires_grad_(True)
    m.weight.grad = m.bias.grad = None
    y = m(x)
    y.backward(dy)
    return y.detach(), x.grad, m.weight.grad.clone(), m.bias.grad.clone()


def _torch_bn(x, dy, parts, weight, bias):
    """torch's BatchNorm (training) on each of `parts` contiguous chunks of the batch."""
    ys, dxs, dws, dbs = [], [], 0, 0
    for xc, dyc in zip(x.chunk(parts), dy.chunk(parts)):
        w = weight.detach().clone().requires_grad_(True)
        b = bias.detach().clone().requires_grad_(True)
        xc = xc.clone().requires_grad_(True)
        y = F.batch_norm(xc, None, None, w, b, True, 0.0, 1e-5)
        y.backward(dyc)
        ys.append(y.detach())
        dxs.append(xc.grad)
        dws, dbs = dws + w.grad, dbs + b.grad
    return torch.cat(ys), torch.cat(dxs), dws, dbs


@pytest.mark.parametrize("mode,parts", [("global", 1), ("node", NODES), ("local", NODES * WPN),
                                        ("group", NODES // 2)])
def test_explicit_batchnorm_equals_torch_on_the_scopes_batch(mode, parts):
    m = _bn(mode)
    x, dy = _batch(1)
    got = _call(m, x, dy)
    want = _torch_bn(x, dy, parts, m.weight, m.bias)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=TOL), (mode, float((a - b).abs().max()))
    # Running statistics: the scope's (unbiased) statistics, momentum 0.1, per rank.
    xr = x.transpose(0, 1).reshape(C, parts, -1)
    want_mean = 0.1 * xr.mean(2).t().repeat_interleave(NODES * WPN // parts, 0)
    assert torch.allclose(m.sim.running_mean, want_mean, atol=TOL)


def test_lagged_equals_global_on_a_repeated_batch_from_the_second_call():
    lag, glob = _bn("lagged"), _bn("global")
    x, dy = _batch(2)
    for call in range(4):
        got, want = _call(lag, x, dy), _call(glob, x, dy)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=0, atol=1e-9), call
    # lagged-damped at lambda 1 is plain lagged.
    lam = _bn("lagged-damped:1.0")
    for call in range(3):
        got, want = _call(lam, x, dy), _call(glob, x, dy)
        assert torch.allclose(got[1], want[1], rtol=0, atol=1e-9)


def test_lagged_on_fresh_data_differs_and_its_job_sums_do_not_vanish():
    lag, glob, node = _bn("lagged"), _bn("global"), _bn("lagged-fwd")
    for call in range(3):
        x, dy = _batch(10 + call)
        a, b, c = _call(lag, x, dy), _call(glob, x, dy), _call(node, x, dy)
    # The forward of lagged and lagged-fwd is the same; their backward differs.
    assert torch.allclose(a[0], c[0], atol=TOL)
    assert not torch.allclose(a[1], b[1], atol=1e-6)
    # Exact global input gradients sum to zero per channel over the job; lagged's do not,
    # node-local ones sum to zero per node.
    assert b[1].sum((0, 2, 3)).abs().max() < 1e-10
    assert a[1].sum((0, 2, 3)).abs().max() > 1e-6
    assert c[1].reshape(NODES, -1, C, H, H).sum((1, 3, 4)).abs().max() < 1e-10
    assert lag.sim.signal and lag.sim.signal[-1] > 0


def test_damped_mixes_lagged_and_node_local_backward():
    x0, dy0 = _batch(20)
    x1, dy1 = _batch(21)
    outs = {}
    for mode in ("lagged", "lagged-fwd", "lagged-damped:0.25"):
        m = _bn(mode)
        _call(m, x0, dy0)
        outs[mode] = _call(m, x1, dy1)
    mix = 0.25 * outs["lagged"][1] + 0.75 * outs["lagged-fwd"][1]
    assert torch.allclose(outs["lagged-damped:0.25"][1], mix, atol=TOL)


def test_renorm_is_node_in_warmup_then_hsbns_correction():
    from hsbn.torch import _renorm
    ren, node = _bn("renorm", {"warmup": 2, "ramp": 0}), _bn("node")
    xs = [_batch(30 + k) for k in range(4)]
    for k, (x, dy) in enumerate(xs):
        a, b = _call(ren, x, dy), _call(node, x, dy)
        if k < 2:
            for u, v in zip(a, b):
                assert torch.allclose(u, v, atol=TOL)
            assert torch.allclose(ren.sim.running_mean, torch.zeros_like(ren.sim.running_mean))
            continue
        # The correction with the previous call's global statistics, hsbn.torch's function.
        xp = xs[k - 1][0].transpose(0, 1).reshape(C, -1)
        g_mean, g_var = xp.mean(1).numpy(), xp.var(1, unbiased=False).numpy()
        xn = x.transpose(0, 1).reshape(C, NODES, -1)
        for n in range(NODES):
            cnt = xn.shape[2]
            mb = xn[:, n].mean(1).numpy()
            m2b = ((xn[:, n] - xn[:, n].mean(1, keepdim=True)) ** 2).sum(1).numpy()
            r, d = _renorm.correction(cnt, mb, m2b, g_mean, g_var, 1e-5, 1.1, 0.25)
            sl = slice(n * WPN * B, (n + 1) * WPN * B)
            xhat = (x[sl] - torch.from_numpy(mb)[None, :, None, None]) / torch.from_numpy(
                np.sqrt(m2b / cnt + 1e-5))[None, :, None, None]
            def col(v):
                return v[None, :, None, None]
            want = (col(ren.weight.detach()) * (xhat * col(torch.from_numpy(r))
                                                + col(torch.from_numpy(d)))
                    + col(ren.bias.detach()))
            assert torch.allclose(a[0][sl], want, atol=TOL)


def test_guard_damps_when_the_job_sums_grow():
    m = _bn("lagged-guard", {"tau": 1.0, "hold": 0.5})
    x, dy = _batch(40)
    _call(m, x, dy)
    _call(m, x, dy)  # the same batch: the job's lagged dx sums to zero, full trust
    assert m.sim.signal[-1] < 1e-9 and m.sim.lam == 1.0
    for k in range(3):  # the statistics jump between calls: the signal grows, lambda drops
        x2, dy2 = _batch(41 + k)
        _call(m, x2 * (3.0 + 2 * k) + 5 * k, dy2)
    assert max(m.sim.signal) > 1.0 and min(m.sim.lams) < 1.0


def test_guard_delay_acts_on_the_signal_calls_later():
    # delay=2 (what the service can do) uses each call's signal one call later than delay=1:
    # the same signals (dx_lag does not depend on lambda), lambdas shifted by one call.
    runs = {}
    for delay in (1, 2):
        m = _bn("lagged-guard", {"tau": 1.0, "hold": 0.5, "delay": delay})
        for k in range(6):
            x, dy = _batch(50 + k)
            _call(m, x * (1.0 + k) + 2 * k, dy)
        runs[delay] = m.sim
    assert runs[1].signal == runs[2].signal
    assert len(set(runs[1].lams)) > 2  # the guard moved
    assert runs[2].lams == [0.0] + runs[1].lams[:-1]
    with pytest.raises(ValueError, match="delay"):
        oneproc.parse_mode("lagged-guard:delay=0")
    with pytest.raises(ValueError, match="choose one"):
        oneproc.parse_mode("lagged-guard:drift=16,step=16")
    with pytest.raises(ValueError, match="whole number"):
        oneproc.parse_mode("lagged-guard:step=2.5")


def test_sim_modes_list_keeps_a_mode_s_options_together():
    assert oneproc.split_modes("node, lagged-guard:tau=1,hold=0.9,delay=2,global") == [
        "node", "lagged-guard:tau=1,hold=0.9,delay=2", "global"]
    assert oneproc.parse_mode("lagged-guard:tau=1,hold=0.9,delay=2")[1]["delay"] == 2


def test_mode_parsing():
    assert oneproc.parse_mode("lagged-damped:0.25") == ("lagged-damped", {
        "warmup": 1, "trip": 0.0, "trip_calls": 8, "trip_rel": 0.0, "lam": 0.25})
    assert oneproc.parse_mode("lagged:warmup=75")[1]["warmup"] == 75
    for bad in ("nosuch", "lagged-damped", "lagged:warmup=0"):
        with pytest.raises(ValueError):
            oneproc.parse_mode(bad)


def test_first_steps_equal_the_committed_distributed_runs():
    """The committed main job (measured/main-4x2: 4 nodes x 2 workers, batch 4, skew 0.8, 150
    steps, seeds 0 and 1, hsbn's node and global scopes in a LocalCluster): the one-process
    node and global runs take the same first steps, to the float32 round-off of its loss."""
    path = os.path.join(COMPARE, "measured", "main-4x2", "results.json")
    with open(path) as f:
        ref = json.load(f)
    try:
        d = data.load(None)
    except data.DataMissingError as e:
        pytest.fail(str(e), pytrace=False)
    c = ref["config"]
    pool = data.training_pool(d["train_y"], c["train_size"])
    arrays = {"train_x": d["train_x"], "train_y": d["train_y"]}
    cfg = {"nodes": c["nodes"], "workers_per_node": c["workers_per_node"],
           "lr": c["lr"]["cls"], "group_nodes": 2}
    k = 4
    for seed in (0, 1):
        plan = data.make_plan("cls", seed, d["train_y"], pool, c["nodes"],
                              c["workers_per_node"], c["batch"], c["epochs"], None, c["skew"])
        init = cli.initial_state("cls", seed)
        for mode in ("node", "global"):
            dist = next(r for r in ref["runs"] if r["task"] == "cls" and r["seed"] == seed
                        and r["mode"] == mode)
            got = oneproc.run_one(cfg, "cls", seed, mode, init, plan, arrays, max_steps=k)
            diff = np.abs(np.subtract(got["loss"], dist["loss"][:k]))
            assert diff.max() < 2e-5, (seed, mode, diff)


def test_renorm_first_steps_equal_the_committed_distributed_renorm_run():
    """measured/main-4x2-renorm (hsbn's scope renorm, its defaults: warm-up 5, ramp 20, r_max
    1.1, d_max 0.25): seed 0's first 10 steps, 5 of them corrected with the previous call's
    global statistics, are the one-process renorm's to float32 round-off. (Seed 1's part at
    step 5 by 1e-5 and its node and global runs by 5e-4 within 12 steps: round-off amplified by
    training, as between the reference and its reversed-order twin.)"""
    path = os.path.join(COMPARE, "measured", "main-4x2-renorm", "results.json")
    with open(path) as f:
        ref = json.load(f)
    c = ref["config"]
    assert c["renorm"] == dict(oneproc.RENORM, lag=1, momentum=1.0)
    try:
        d = data.load(None)
    except data.DataMissingError as e:
        pytest.fail(str(e), pytrace=False)
    pool = data.training_pool(d["train_y"], c["train_size"])
    arrays = {"train_x": d["train_x"], "train_y": d["train_y"]}
    cfg = {"nodes": c["nodes"], "workers_per_node": c["workers_per_node"],
           "lr": c["lr"]["cls"], "group_nodes": 2}
    plan = data.make_plan("cls", 0, d["train_y"], pool, c["nodes"], c["workers_per_node"],
                          c["batch"], c["epochs"], None, c["skew"])
    dist = next(r for r in ref["runs"] if r["task"] == "cls" and r["seed"] == 0
                and r["mode"] == "renorm")
    got = oneproc.run_one(cfg, "cls", 0, "renorm", cli.initial_state("cls", 0), plan, arrays,
                          max_steps=10)
    assert np.abs(np.subtract(got["loss"], dist["loss"][:10])).max() < 2e-6


def test_node_dx_sums_from_partials_equal_the_direct_sums():
    # The guard's signal from one node's partials (what a root has) equals summing dx itself.
    rng = np.random.default_rng(3)
    n, c = 37, 5
    x = torch.from_numpy(rng.standard_normal((n, c)) * 2 + 1)
    dy = torch.from_numpy(rng.standard_normal((n, c)) + 0.3)
    mu = torch.from_numpy(rng.standard_normal(c) * 0.5)
    invstd = torch.from_numpy(rng.uniform(0.3, 2.0, c))
    w = torch.from_numpy(rng.uniform(0.5, 1.5, c))
    S1 = torch.from_numpy(rng.standard_normal(c) * 9)
    S2 = torch.from_numpy(rng.standard_normal(c) * 7)
    total = 4 * n
    dx = w * invstd * (dy - S1 / total - (x - mu) * invstd ** 2 * S2 / total)
    m = x.mean(0)
    got = oneproc.node_dx_sums(n, m, ((x - m) ** 2).sum(0), dy.sum(0), (dy * (x - m)).sum(0),
                               (dy * dy).sum(0), mu, invstd, w, S1, S2, total)
    assert torch.allclose(got[0], dx.sum(0), rtol=1e-10, atol=1e-10)
    assert torch.allclose(got[1], (dx * dx).sum(0), rtol=1e-10, atol=1e-10)
    assert float((dx.sum(0)).abs().min()) > 1e-3  # lagged's sums do not vanish here


def _script(name):
    """One of examples/compare's report scripts, imported as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(COMPARE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_guard_signal_report_reads_the_committed_cells(capsys):
    gs = _script("guard_signal")
    assert gs.main([]) == 0
    out = capsys.readouterr().out
    for cell in ("oneproc-4x2", "oneproc-4x2-slow", "oneproc-4x2-slow1200"):
        assert re.search(r"^%s +lagged-guard:delay=2 +- lagged-guard +[-+]\d" % cell, out,
                         re.M), out
        assert re.search(r"^%s +c1\.1 +\d" % cell, out, re.M), out
    runs = gs.load(os.path.join(COMPARE, "measured", "oneproc-4x2"))["runs"]
    same = gs.paired(runs, "node", "node")
    assert same[:3] == (0.0, 0.0, 0.0) and same[3] == 10
    assert gs.paired(runs, "lagged-guard:delay=2", "node")[1] > 0  # above node, every seed


def test_drift_guard_trusts_still_statistics_and_damps_moving_ones():
    # drift=K: lambda from how far the exact global means moved over the K calls before, in
    # standard deviations per call; 0.5 until K + 1 calls are known.
    still = _bn("lagged-guard", {"drift": 2, "kappa": 0.05})
    moving = _bn("lagged-guard", {"drift": 2, "kappa": 0.05})
    x, dy = _batch(60)
    for k in range(6):
        _call(still, x, dy)
        _call(moving, x + 0.2 * k, dy)  # 0.2 / sd per call
    # Lagged calls are 1..5 (call 0 is the warm-up); calls 1 and 2 know fewer than 3 calls.
    assert still.sim.lams[:2] == [0.5, 0.5] and moving.sim.lams[:2] == [0.5, 0.5]
    assert still.sim.lams[2:] == [1.0] * 3 and still.sim.drift == [0.0] * 3
    sd = torch.sqrt(x.transpose(0, 1).reshape(C, -1).var(1, unbiased=False) + 1e-5)
    v = float(((0.2 / sd) ** 2).mean().sqrt())  # a shift leaves sd as it is
    assert np.allclose(moving.sim.drift, [v] * 3, rtol=1e-12, atol=0)
    assert np.allclose(moving.sim.lams[2:], [0.05 / v] * 3, rtol=1e-12, atol=0)
    assert 0.05 / v < 0.5


def test_drift_guard_model_wide_uses_the_drift_one_call_older():
    # model=1: the largest v over the model's layers, each from statistics up to call t - 2
    # (a service has them at every layer's call t without waiting): one call later than
    # the layer's own v, the same value here where the drift is steady.
    own = _bn("lagged-guard", {"drift": 2, "kappa": 0.05})
    wide = _bn("lagged-guard", {"drift": 2, "kappa": 0.05, "model": 1})
    wide.sim.model_drift = {}
    x, dy = _batch(60)
    for k in range(7):
        _call(own, x + 0.2 * k, dy)
        _call(wide, x + 0.2 * k, dy)
    lam = own.sim.lams[-1]
    assert lam < 0.5
    assert np.allclose(own.sim.lams, [0.5, 0.5, lam, lam, lam, lam], rtol=1e-12, atol=0)
    assert np.allclose(wide.sim.lams, [0.5, 0.5, 0.5, lam, lam, lam], rtol=1e-12, atol=0)


def test_step_guard_sees_the_layer_s_own_weight_move():
    # step=K: lambda from ||gamma(t) - gamma(t-K)|| / ||gamma(t-K)|| / K, what the optimizer's
    # steps did to the layer's own weight; 0.5 until K + 1 calls are known.
    still = _bn("lagged-guard", {"step": 2, "kstep": 1e-3})
    moving = _bn("lagged-guard", {"step": 2, "kstep": 1e-3})
    x, dy = _batch(70)
    for k in range(6):
        _call(still, x, dy)
        _call(moving, x, dy)
        with torch.no_grad():
            moving.weight.mul_(1.01)  # 1 % a call
    v = (1.01 ** 2 - 1) / 2
    assert still.sim.lams[:1] == [0.5] and still.sim.lams[1:] == [1.0] * 4
    assert moving.sim.lams[:1] == [0.5]
    assert np.allclose(moving.sim.lams[1:], [1e-3 / v] * 4, rtol=1e-9, atol=0)


def _jump(*layers):
    """Seven calls of each layer on the same batches, shifted by 20 from call 3 on: per call,
    the tuple of each layer's (output, input gradient)."""
    outs = []
    for s in range(7):
        x, dy = _batch(300 + s)
        if s >= 3:
            x = x + 20.0
        outs.append(tuple(_call(m, x, dy) for m in layers))
    return outs


def test_trip_sends_a_jumping_layer_exact_global_then_back():
    # Calls 0-2 on one distribution, 3.. shifted by 20: call 4 knows call 3's statistics and
    # trips, so calls 4 and 5 (trip_calls 2) equal global; call 6 is lagged again.
    m = _bn("lagged:trip=1.0,trip_calls=2")
    outs = _jump(m, _bn("global"), _bn("lagged"))
    assert m.sim.trips == [4]
    assert m.sim.exact_calls == 3          # the warm-up, 4 and 5
    for s, (got, g, plain) in enumerate(outs):
        exact = s in (0, 4, 5)
        for a, b, c in zip(got[:2], g[:2], plain[:2]):
            if exact:
                assert torch.allclose(a, b, atol=1e-10), s
            else:
                assert torch.allclose(a, c, atol=1e-10), s
    assert not torch.allclose(outs[4][0][0], outs[4][2][0], atol=1e-3)
    assert max(m.sim.trip_v) > 1.0 > sorted(m.sim.trip_v)[-2]


def test_trip_variants_damping_only_and_forward_only():
    # The same jump: trip_lam=0 trips at 4 with no exact call, calls 4 and 5 back-propagate
    # with lambda 0 (node-local) and forward as plain lagged; trip_fwd=1 forwards 4 and 5
    # exact global and back-propagates them lagged.
    damp = _bn("lagged:trip=1.0,trip_calls=2,trip_lam=0")
    fwd = _bn("lagged:trip=1.0,trip_calls=2,trip_fwd=1")
    outs = _jump(damp, fwd, _bn("global"), _bn("lagged"))
    assert damp.sim.trips == [4] and fwd.sim.trips == [4]
    assert damp.sim.exact_calls == 1 and fwd.sim.exact_calls == 3
    assert damp.sim.lams == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]   # calls 1-6 (0 is the warm-up)
    for s, (d, f, g, plain) in enumerate(outs):
        assert torch.allclose(d[0], g[0] if s == 0 else plain[0], atol=1e-10), s
        assert torch.allclose(f[0], g[0] if s in (0, 4, 5) else plain[0], atol=1e-10), s
    # Forward-only: calls 4 and 5's input gradients are not global's (lagged backward).
    assert not torch.allclose(outs[4][1][1], outs[4][2][1], atol=1e-6)
    assert not torch.allclose(outs[4][0][1], outs[4][3][1], atol=1e-6)   # lambda 0 there
    for bad in ("lagged:trip_lam=1.5", "lagged:trip_lam=-0.1"):
        with pytest.raises(ValueError):
            oneproc.parse_mode(bad)


def test_trip_drift_is_the_clients_formula():
    from hsbn.torch._lagged import trip_drift as client_drift
    g = torch.Generator().manual_seed(7)
    a = (40, torch.randn(C, generator=g, dtype=torch.float64),
         torch.rand(C, generator=g, dtype=torch.float64) * 40)
    b = (48, a[1] + 0.3, a[2] * 2.0)
    ours = oneproc.trip_drift(a, b)
    theirs = client_drift(*[(n, m.numpy(), q.numpy()) for n, m, q in (a, b)])
    assert ours == pytest.approx(theirs, rel=1e-12) and ours > 0.3
    assert oneproc.trip_drift(a, a) == 0.0


def test_lr_spike_and_trip_options_are_checked():
    assert oneproc.parse_spike("60:20:3") == [60, 20.0, 3]
    assert oneproc.parse_spike(None) is None
    for bad in ("60:20", "x:1:1", "1:0:1", "1:2:0", "-1:2:1", "1:nan:1"):
        with pytest.raises(ValueError):
            oneproc.parse_spike(bad)
    assert oneproc.parse_mode("lagged-damped:0.5,trip=0.4")[1]["trip"] == 0.4
    assert oneproc.parse_mode("lagged:trip=0.4,trip_calls=3")[1]["trip_calls"] == 3
    for bad in ("lagged:trip=-1", "lagged:trip_calls=0", "lagged:trip_calls=1.5"):
        with pytest.raises(ValueError):
            oneproc.parse_mode(bad)


def test_relative_trip_waits_for_history_then_trips_on_the_layer_s_own_level():
    # trip_rel=5: no trip before the 6th v (call 7) whatever v is; then a jump at call 8
    # (known at call 9) trips against the level of the calls before.
    m = _bn("lagged:trip_rel=5,trip_calls=2")
    for s in range(12):
        x, dy = _batch(400 + s)
        if s == 1:
            x = x * 3.0          # a jump early: v large at call 3, but no history yet
        if s >= 8:
            x = x + 20.0
        _call(m, x, dy)
    assert m.sim.trips == [9]
    v = m.sim.trip_v
    # v[k] is known at call k + 2: the early jump's v (calls 2 and 3) is far above the level
    # the later calls set, and tripped nothing.
    assert min(v[0], v[1]) > 5 * max(v[2:7]) and v[7] > 5 * max(v[2:7])
    # With trip_hist=8 the level needs 8 v's first: the same jump (the 8th v) trips nothing.
    m = _bn("lagged:trip_rel=5,trip_calls=2,trip_hist=8")
    for s in range(12):
        x, dy = _batch(400 + s)
        if s == 1:
            x = x * 3.0
        if s >= 8:
            x = x + 20.0
        _call(m, x, dy)
    assert m.sim.trips == [] and len(m.sim.trip_v) == 10
    assert oneproc.parse_mode("lagged:trip_rel=4,trip_hist=20")[1]["trip_hist"] == 20
    for bad in ("lagged:trip_hist=0", "lagged:trip_hist=2.5"):
        with pytest.raises(ValueError):
            oneproc.parse_mode(bad)


def test_ema_and_error_feedback_equal_global_on_a_repeated_batch():
    # A repeated batch leaves the others' share unchanged: its average is that share, and the
    # error to feed back is zero, so both stay exact from the second call.
    glob = _bn("global")
    x, dy = _batch(30)
    mods = {mode: _bn(mode) for mode in ("lagged:ema=0.8", "lagged:ef=1",
                                         "lagged-damped:1.0,ema=0.5,ef=0.5",
                                         "lagged:ema=0.8,ema_fwd=1")}
    for call in range(4):
        want = _call(glob, x, dy)
        for mode, m in mods.items():
            got = _call(m, x, dy)
            for a, b in zip(got, want):
                assert torch.allclose(a, b, rtol=0, atol=1e-9), (mode, call)


def test_ema_averages_the_stale_share_and_error_feedback_corrects_by_an_affine_term():
    batches = [_batch(40 + k) for k in range(4)]
    outs = {}
    for mode in ("lagged", "lagged:ema=0", "lagged:ema=0.5", "lagged:ef=0", "lagged:ef=1"):
        m = _bn(mode)
        outs[mode] = [_call(m, x, dy) for x, dy in batches]
    for same in ("lagged:ema=0", "lagged:ef=0"):  # B = 0 and F = 0 are plain lagged
        for a, b in zip(outs[same], outs["lagged"]):
            assert torch.allclose(a[1], b[1], rtol=0, atol=TOL), same
    # The first call is exact global and the second has no error to feed back; the average
    # of one call's share is that share: all equal to plain lagged up to the third call.
    for mode in ("lagged:ema=0.5", "lagged:ef=1"):
        for call in (0, 1):
            assert torch.allclose(outs[mode][call][1], outs["lagged"][call][1], atol=TOL)
        assert not torch.allclose(outs[mode][3][1], outs["lagged"][3][1], atol=1e-6), mode
    # The forward is untouched by both.
    assert torch.allclose(outs["lagged:ef=1"][3][0], outs["lagged"][3][0], atol=TOL)
    # Error feedback changes each node's dx per channel by a + b * x (the fed-back constant
    # and (x - mean) terms): a least-squares fit of that form leaves no residual.
    x = batches[2][0]
    diff = outs["lagged:ef=1"][2][1] - outs["lagged"][2][1]
    xs = x.transpose(0, 1).reshape(C, NODES, -1)
    ds = diff.transpose(0, 1).reshape(C, NODES, -1)
    assert ds.abs().max() > 1e-6
    for c in range(C):
        for n in range(NODES):
            a = torch.stack([torch.ones_like(xs[c, n]), xs[c, n]], 1)
            coef = torch.linalg.lstsq(a, ds[c, n][:, None]).solution
            assert (a @ coef - ds[c, n][:, None]).abs().max() < 1e-10


def _weighted_bn(x, dy, wt, weight, bias):
    """BatchNorm (training, float64) of a batch whose items carry weights wt (weighted mean
    and variance, loss sum of wt * dy * y): y and dx by autograd."""
    x = x.clone().requires_grad_(True)
    wt = wt.reshape(-1, 1, 1, 1)
    tot = (wt * torch.ones_like(x)).sum((0, 2, 3), keepdim=True)
    m = (wt * x).sum((0, 2, 3), keepdim=True) / tot
    v = (wt * (x - m) ** 2).sum((0, 2, 3), keepdim=True) / tot
    y = (x - m) / torch.sqrt(v + 1e-5) * weight.reshape(m.shape) + bias.reshape(m.shape)
    (wt * y * dy).sum().backward()
    return y.detach(), x.grad


def test_ema_fwd_is_batchnorm_of_the_weighted_earlier_batches():
    # ema=B,ema_fwd=1 (hsbn.torch's lagged_ema=B): node n's call s normalizes, in both passes,
    # its fresh batch (weight 1) with the other nodes' batches of every earlier call t, weighted
    # (1 - B) B^(s-1-t) (call 0: B^(s-1)), as the averaged share weighs them.
    b_ = 0.75
    m = _bn("lagged:ema=%g,ema_fwd=1" % b_)
    plain = _bn("lagged")
    batches = [_batch(60 + k) for k in range(5)]
    per = WPN * B
    for s, (x, dy) in enumerate(batches):
        y, dx, _, _ = _call(m, x, dy)
        y_plain = _call(plain, x, dy)[0]
        # Calls 0 (exact) and 1 (one earlier call) equal plain lagged; later ones do not.
        assert torch.allclose(y, y_plain, rtol=0, atol=1e-12) == (s < 2), s
        if s == 0:
            continue
        age = [(1 - b_) * b_ ** (s - 1 - t) if t else b_ ** (s - 1) for t in range(s)]
        for n in range(NODES):
            mine = slice(n * per, (n + 1) * per)
            xs, gs, ws = [x[mine]], [dy[mine]], [torch.ones(per, dtype=torch.float64)]
            for t in range(s):
                for k in range(NODES):
                    if k != n:
                        xs.append(batches[t][0][k * per:(k + 1) * per])
                        gs.append(batches[t][1][k * per:(k + 1) * per])
                        ws.append(torch.full((per,), age[t], dtype=torch.float64))
            ry, rdx = _weighted_bn(torch.cat(xs), torch.cat(gs), torch.cat(ws),
                                   m.weight.detach(), m.bias.detach())
            assert torch.allclose(y[mine], ry[:per], rtol=0, atol=1e-10), (s, n)
            assert torch.allclose(dx[mine], rdx[:per], rtol=0, atol=1e-10), (s, n)


def test_ema_and_ef_options_are_checked():
    assert oneproc.parse_mode("lagged:ema=0.8")[1]["ema"] == 0.8
    assert oneproc.parse_mode("lagged-damped:0.5,ef=1")[1]["ef"] == 1.0
    for bad in ("lagged:ema=1", "lagged:ema=-0.1", "lagged:ef=2", "node:ema=0.5", "renorm:ef=1",
                "lagged:exact_bwd=0.5", "global:exact_bwd=1", "lagged:ema_fwd=1",
                "lagged:ema=0.5,ema_fwd=2", "lagged:ema=0.5,oracle=2"):
        with pytest.raises(ValueError):
            oneproc.parse_mode(bad)


def test_exact_backward_sees_the_other_nodes_fresh_gradients_and_lagged_does_not():
    batches = [_batch(50 + k) for k in range(3)]
    x, dy = batches[2]
    dy2 = dy.clone()
    dy2[2 * WPN * B:3 * WPN * B] += 1.0  # node 2's upstream gradient at the last call
    got = {}
    for mode in ("lagged", "lagged:exact_bwd=1"):
        for name, last in (("dy", dy), ("dy2", dy2)):
            m = _bn(mode)
            for xb, dyb in batches[:2]:
                _call(m, xb, dyb)
            got[mode, name] = _call(m, x, last)
    node0 = slice(0, WPN * B)
    # Lagged: node 0's input gradient uses node 2's sums of the call before, so it is unchanged.
    assert torch.allclose(got["lagged", "dy"][1][node0], got["lagged", "dy2"][1][node0],
                          rtol=0, atol=TOL)
    # Exact backward: the job's fresh sums, so node 0's gradient moves; its forward is lagged's.
    assert not torch.allclose(got["lagged:exact_bwd=1", "dy"][1][node0],
                              got["lagged:exact_bwd=1", "dy2"][1][node0], atol=1e-6)
    assert torch.allclose(got["lagged:exact_bwd=1", "dy"][0], got["lagged", "dy"][0], atol=TOL)


def _converted(mode, *layers):
    """A float64 Sequential of `layers`, converted by oneproc.convert with mode's options."""
    base, o = oneproc.parse_mode(mode)
    model = torch.nn.Sequential(*layers).double()
    return model, oneproc.convert(model, base, o, oneproc.Topology(NODES, WPN, 2))


def _two_layer(mode):
    return _converted(mode, torch.nn.BatchNorm2d(C), torch.nn.BatchNorm2d(C))


def _run_two(mode, batches):
    model, sims = _two_layer(mode)
    outs = []
    for x, dy in batches:
        x = x.clone().requires_grad_(True)
        mid = model[0](x)
        mid.retain_grad()
        model[1](mid).backward(dy)
        outs.append((mid.detach(), x.grad, mid.grad))
    return outs, sims


def test_only_and_stop_place_the_lagged_calls():
    batches = [_batch(70 + k) for k in range(4)]
    got = {m: _run_two(m, batches) for m in ("global", "lagged", "lagged:only=2",
                                             "lagged:only=1", "lagged:stop=2")}
    # only=2: the first layer is exact global in both passes, so its output is global's; the
    # second is lagged, so from the second call on the gradient reaching the first layer is
    # not global's.
    for call in range(4):
        assert torch.allclose(got["lagged:only=2"][0][call][0], got["global"][0][call][0],
                              rtol=0, atol=TOL)
    assert not torch.allclose(got["lagged:only=2"][0][3][2], got["global"][0][3][2], atol=1e-6)
    # only=1: the first layer is lagged (its output is plain lagged's), the second exact.
    assert torch.allclose(got["lagged:only=1"][0][3][0], got["lagged"][0][3][0], rtol=0,
                          atol=TOL)
    assert not torch.allclose(got["lagged:only=1"][0][3][0], got["global"][0][3][0], atol=1e-6)
    assert [s.exact_calls for s in got["lagged:only=1"][1]] == [1, 4]
    # stop=2: calls 0 (the warm-up) and 2, 3 exact global; call 1 lagged.
    stop = got["lagged:stop=2"]
    assert [s.exact_calls for s in stop[1]] == [3, 3]
    assert torch.allclose(stop[0][1][0], got["lagged"][0][1][0], rtol=0, atol=TOL)
    for call in (2, 3):
        assert torch.allclose(stop[0][call][0], got["global"][0][call][0], rtol=0, atol=TOL)
        assert torch.allclose(stop[0][call][1], got["global"][0][call][1], rtol=0, atol=TOL)


def _refused(*modes):
    for bad in modes:
        with pytest.raises(ValueError):
            oneproc.parse_mode(bad)


def test_only_and_stop_are_checked():
    assert oneproc.parse_mode("lagged-damped:0.5,only=3")[1]["only"] == 3
    _refused("lagged:only=0", "lagged:only=1.5", "node:only=1", "global:stop=5", "lagged:stop=0")
    with pytest.raises(ValueError, match="2 BatchNorm layers"):
        _two_layer("lagged:only=3")


def _conv_bn(mode):
    torch.manual_seed(3)
    return _converted(mode, torch.nn.Conv2d(C, C, 3, padding=1, bias=False),
                      torch.nn.BatchNorm2d(C))


def _run_conv_bn(mode, batches):
    """Per call: (conv weight gradient, input gradient, BatchNorm weight gradient), no update."""
    model, sims = _conv_bn(mode)
    out = []
    for x, dy in batches:
        x = x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=False)
        model(x).backward(dy)
        oneproc.apply_wfix(sims)
        out.append((model[0].weight.grad.clone(), x.grad, model[1].weight.grad.clone()))
    return out


def test_wfix_corrects_the_convolution_s_weight_gradient_now_or_a_step_late():
    batches = [_batch(90 + k) for k in range(4)]
    got = {m: _run_conv_bn(m, batches) for m in (
        "lagged", "lagged:exact_bwd=1", "lagged:wfix=1", "lagged:wfix=2",
        "lagged:wfix=1,wfix_mean=1")}
    lag, exact = got["lagged"], got["lagged:exact_bwd=1"]
    for call in range(1, 4):
        # Lagged and exact_bwd differ in the convolution's gradient (the stale share)...
        assert not torch.allclose(lag[call][0], exact[call][0], atol=1e-6)
        # ...wfix=1 takes exact_bwd's there, and leaves the input and BatchNorm gradients
        # lagged's (it corrects the weight gradient only).
        w1 = got["lagged:wfix=1"][call]
        assert torch.allclose(w1[0], exact[call][0], rtol=0, atol=1e-10)
        assert torch.allclose(w1[1], lag[call][1], rtol=0, atol=TOL)
        assert torch.allclose(w1[2], lag[call][2], rtol=0, atol=TOL)
        # wfix=2 adds the previous call's correction (none after the exact warm-up call).
        before = exact[call - 1][0] - lag[call - 1][0] if call > 1 else 0
        assert torch.allclose(got["lagged:wfix=2"][call][0], lag[call][0] + before, rtol=0,
                              atol=1e-10)
        # wfix_mean: the sum dy term only, a part of the correction.
        wm = got["lagged:wfix=1,wfix_mean=1"][call][0]
        assert not torch.allclose(wm, lag[call][0], atol=1e-6)
        assert not torch.allclose(wm, exact[call][0], atol=1e-6)


def test_wfix_options_are_checked():
    assert oneproc.parse_mode("lagged:wfix=2")[1]["wfix"] == 2
    _refused("lagged:wfix=3", "lagged:wfix=0.5", "node:wfix=1", "lagged:wfix_mean=1",
             "lagged:wfix=1,wfix_mean=2")
    with pytest.raises(ValueError, match="does not follow a Conv2d"):
        _two_layer("lagged:wfix=1")


def test_a_second_run_into_the_same_out_is_refused_while_the_first_writes(tmp_path):
    """Two --one-process runs into one --out would each rewrite oneproc.json from what they
    read at their start, and the later writer would drop the other's runs."""
    import fcntl
    import subprocess
    import sys
    script = os.path.join(COMPARE, "hsbn_compare.py")
    with open(tmp_path / oneproc.LOCK_NAME, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)   # as a running study holds it
        proc = subprocess.run([sys.executable, script, "--one-process", "--seeds", "1",
                               "--steps", "1", "--sim-modes", "node", "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "another run is writing to %s" % tmp_path in proc.stderr
    assert not (tmp_path / "oneproc.json").exists()


def test_model_wide_trip_sends_every_layer_exact():
    # Two layers called in order a, b; only b's input jumps (call 3 on). b trips at call 4;
    # with trip_model=1 a goes exact too: from call 5 (it ran call 4 before b tripped), b at 4
    # and 5 (trip_calls 2). Without it a stays lagged throughout.
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.BatchNorm2d(C)
            self.b = torch.nn.BatchNorm2d(C)

        def forward(self, x, z):
            return self.a(x), self.b(z)

    def run(mode):
        base, o = oneproc.parse_mode(mode)
        model = Two().double()
        sims = oneproc.convert(model, base, o, oneproc.Topology(NODES, WPN, 2))
        exact = []
        for s in range(8):
            x, dy = _batch(500 + s)
            z, dz = _batch(600 + s)
            if s >= 3:
                z = z + 20.0
            before = [sim.exact_calls for sim in sims]
            ya, yb = model(x, z)
            (ya * dy).sum().add((yb * dz).sum()).backward()
            exact.append([sim.exact_calls - b for sim, b in zip(sims, before)])
        return sims, exact

    sims, exact = run("lagged:trip=1.0,trip_calls=2,trip_model=1")
    assert sims[1].trips == [4] and sims[0].trips == []
    assert [e[0] for e in exact] == [1, 0, 0, 0, 0, 1, 0, 0]
    assert [e[1] for e in exact] == [1, 0, 0, 0, 1, 1, 0, 0]
    sims, exact = run("lagged:trip=1.0,trip_calls=2")
    assert sims[1].trips == [4] and [e[0] for e in exact] == [1, 0, 0, 0, 0, 0, 0, 0]
    for bad in ("lagged:trip_model=2", "node:trip_model=1"):
        with pytest.raises(ValueError):
            oneproc.parse_mode(bad)


def _record(m, x, dy):
    """The oracles' pass on one layer: its per-node partials of (x, dy) become the stale share."""
    def run_pass():
        x_ = x.clone().requires_grad_(True)
        m(x_).backward(dy)
    before = (m.sim.seq, m.sim.running_mean.clone(), len(m.sim.signal))
    oneproc.record_stale_share([m.sim], run_pass)
    assert (m.sim.seq, len(m.sim.signal)) == (before[0], before[2])
    assert torch.equal(m.sim.running_mean, before[1])
    m.weight.grad = m.bias.grad = None


def test_oracle_pass_sets_the_stale_share_and_nothing_else():
    # The stale share recorded from this very batch makes lagged exact global on fresh data...
    lag, glob = _bn("lagged:oracle=1"), _bn("global")
    for call in range(4):
        x, dy = _batch(800 + call)
        if call:
            _record(lag, x, dy)
        got, want = _call(lag, x, dy), _call(glob, x, dy)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=0, atol=1e-9), call
    # ...and from the previous batch, at the same weights, it is plain lagged's.
    rec, plain = _bn("lagged:oracle=1"), _bn("lagged")
    prev = None
    for call in range(4):
        x, dy = _batch(810 + call)
        if prev is not None:
            _record(rec, *prev)
        got, want = _call(rec, x, dy), _call(plain, x, dy)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=0, atol=TOL), call
        assert rec.sim.seq == plain.sim.seq == call + 1
        prev = (x, dy)
    assert not torch.allclose(got[1], _call(_bn("global"), x, dy)[1], atol=1e-6)
    # oracle_bwd=0: the pass gives the forward's share only; the backward's stays the
    # previous call's. Recorded from this batch: the forward is global's, the backward not.
    fwd, glob, prev = _bn("lagged:oracle=1,oracle_bwd=0"), _bn("global"), None
    for call in range(3):
        x, dy = _batch(820 + call)
        if call:
            _record(fwd, x, dy)
        got, want = _call(fwd, x, dy), _call(glob, x, dy)
    assert torch.allclose(got[0], want[0], rtol=0, atol=1e-9)
    assert not torch.allclose(got[1], want[1], atol=1e-6)


def test_oracles_in_training_fresh_batch_at_still_weights_is_global():
    """run_one's oracle passes, float64, 4 steps: with the learning rate 0 the weights never
    move, so oracle=2's stale share (this batch at the previous weights) is this call's own
    partials and lagged trains as global; plain lagged, oracle=1 (the previous batch) and
    oracle=3 (the next) do not. With a learning rate oracle=1 differs from plain lagged (the
    weights moved)."""
    try:
        d = data.load(None)
    except data.DataMissingError as e:
        pytest.fail(str(e), pytrace=False)
    pool = data.training_pool(d["train_y"], 2000)
    arrays = {"train_x": d["train_x"], "train_y": d["train_y"]}
    plan = data.make_plan("cls", 0, d["train_y"], pool, 4, 2, 4, 1, 40, 0.8)
    init = cli.initial_state("cls", 0)

    def losses(mode, lr):
        cfg = {"nodes": 4, "workers_per_node": 2, "lr": lr, "group_nodes": 2}
        return np.array(oneproc.run_one(cfg, "cls", 0, mode, init, plan, arrays,
                                        dtype="float64", max_steps=4)["loss"])

    glob = losses("global", 0.0)
    assert np.abs(losses("lagged:oracle=2", 0.0) - glob).max() < 1e-12
    assert np.abs(losses("lagged", 0.0) - glob)[1:].min() > 1e-6
    assert np.abs(losses("lagged:oracle=1", 0.0) - glob)[1:].min() > 1e-6
    assert np.abs(losses("lagged:oracle=1", 0.05) - losses("lagged", 0.05))[1:].min() > 1e-9
    # Which batch each oracle takes: with every step's batch the same, oracle=1 (the previous
    # batch) and oracle=3 (the next) are this call's own partials at still weights: global.
    same = dict(plan, idx=np.repeat(plan["idx"][:1], plan["steps"], 0))

    def same_losses(mode):
        cfg = {"nodes": 4, "workers_per_node": 2, "lr": 0.0, "group_nodes": 2}
        return np.array(oneproc.run_one(cfg, "cls", 0, mode, init, same, arrays,
                                        dtype="float64", max_steps=4)["loss"])

    glob_same = same_losses("global")
    for mode in ("lagged:oracle=1", "lagged:oracle=3"):
        assert np.abs(same_losses(mode) - glob_same).max() < 1e-12, mode
    assert np.abs(losses("lagged:oracle=3", 0.0) - glob)[1:].min() > 1e-6
    _refused("lagged:oracle=4", "global:oracle=1", "lagged:oracle=1.5", "lagged:oracle_bwd=0",
             "lagged:oracle=1,oracle_bwd=2")
    assert oneproc.parse_mode("lagged-damped:0.5,oracle=2")[1]["oracle"] == 2


def test_oracle_report_reads_the_committed_cells(capsys):
    rep = _script("oracle_report")
    assert rep.main([]) == 0
    out = capsys.readouterr().out
    for cell in ("oneproc-4x2-b2-slow1200", "oneproc-4x2-slow1200"):
        for mode in ("lagged:oracle=1", "lagged:oracle=2"):
            assert re.search(r"^%s +%s +\d+\.\d\d +6 +-?\d+ %% \( *-?\d+ %%\) +[-+]\d"
                             % (cell, re.escape(mode)), out, re.M), out
    # The paired difference is the mean of the per-seed differences.
    runs = rep.load(os.path.join(COMPARE, "measured", "oneproc-4x2-slow1200"))["runs"]
    acc = {(r["mode"], r["seed"]): r["metric"] for r in runs}
    want = 100 * np.mean([acc[("lagged:oracle=2", s)] - acc[("lagged", s)] for s in range(6)])
    assert abs(rep.paired(runs, "lagged:oracle=2", "lagged")[0] - want) < 1e-9


def test_ema_report_reads_the_committed_cells(capsys):
    rep = _script("ema_report")
    assert rep.main([]) == 0
    out = capsys.readouterr().out
    for cell in ("oneproc-4x2", "oneproc-resnet18", "oneproc-4x2-b2-slow1200",
                 "oneproc-4x2-slow1200", "oneproc-4x2-b8-slow1200"):
        assert re.search(r"^%s +new default +\d+\.\d\d +(6|10) +-?\d+ %% \( *-?\d+ %%\) +[-+]\d"
                         r".* +\d+\.\d$" % cell, out, re.M), out
    # The exact-call share is the runs' own count, and the paired difference the mean of the
    # per-seed differences.
    d = os.path.join(COMPARE, "measured", "oneproc-4x2-slow1200")
    runs = rep.load(d)["runs"]
    new = "lagged:trip_rel=4,trip_calls=30,warmup=20,ema=0.8,ema_fwd=1"
    mine = [r for r in runs if r["mode"] == new]
    assert len(mine) == 6
    share = np.mean([sum(t["exact_calls"] for t in r["trip"].values())
                     / sum(t["calls"] for t in r["trip"].values()) for r in mine])
    assert rep.exact_share(runs, new) == "%.1f" % (100 * share)
    acc = {(r["mode"], r["seed"]): r["metric"] for r in runs}
    want = 100 * np.mean([acc[(new, s)] - acc[("node", s)] for s in range(6)])
    assert abs(rep.paired(runs, new, "node")[0] - want) < 1e-9
