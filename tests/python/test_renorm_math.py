"""The client-side arithmetic of scope "renorm" alone: worker threads of a 2-node job in this
process, node rounds reduced by test_autograd_math's in-process stand-in, global statistics by
a stand-in root that merges the node results in node order. Checked against one process
running the renorm formula with torch autograd on the node's concatenated batch, with the
global statistics taken from the job's concatenated batch."""

import threading

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hsbn
import hsbn.torch
from hsbn.torch import _renorm
from bnref import make_spec, node_of, rel_err, NODES, WORKERS_PER_NODE
from test_autograd_math import InProcessRounds, chan_merge, cpu_ops  # noqa: F401 (fixture)
from test_torch_path import no_host_reads  # noqa: F401 (fixture)

EPS = 1e-5
MOMENTUM = 0.1
NODE_RANKS = [[n * WORKERS_PER_NODE + w for w in range(WORKERS_PER_NODE)] for n in range(NODES)]


class StandInJob:
    """Node rounds per node, and a root: the global statistics of (op, seq) are the node
    results merged in node order, once every node has one. The global statistics of the seqs in
    `held` stay unanswered until release(); `waiting` counts callers blocked on them."""

    def __init__(self):
        self.nodes = [InProcessRounds(WORKERS_PER_NODE) for _ in range(NODES)]
        self.cond = threading.Condition()
        self.partials = {}
        self.held = set()
        self.waiting = 0
        self.global_calls = []   # (rank, op, seq) of every global_stats call
        self.scopes = set()      # (phase, scope) the layer sent

    def node_result(self, node, rank, key, payload, merge):
        res = self.nodes[node].reduce(key, rank % WORKERS_PER_NODE, payload, merge)
        if key[2] == 1:
            with self.cond:
                self.partials.setdefault(key[:2], {})[node] = res
                self.cond.notify_all()
        return res

    def _global(self, op, seq):
        p = self.partials.get((op, seq), {})
        if len(p) < NODES or seq in self.held:
            return None
        acc = p[0]
        for n in range(1, NODES):
            acc = chan_merge(acc, p[n])
        return acc

    def ready(self, op, seq):
        with self.cond:
            return self._global(op, seq) is not None

    def global_stats(self, rank, op, seq):
        with self.cond:
            self.global_calls.append((rank, op, seq))
            if self._global(op, seq) is None:
                self.waiting += 1
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: self._global(op, seq) is not None, timeout=30):
                raise TimeoutError("global statistics of op %d seq %d never came" % (op, seq))
            return self._global(op, seq)

    def release(self, world):
        """Once `world` callers wait on held rounds, answers them."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.waiting >= world, timeout=30)
            self.held.clear()
            self.cond.notify_all()


class RenormClient:
    def __init__(self, job, rank):
        self.job, self.rank = job, rank

    def forward(self, op, seq, scope, count, mean, m2):
        self.job.scopes.add(("forward", scope))
        return self.job.node_result(node_of(self.rank), self.rank, (op, seq, 1),
                                    (count, mean, m2), chan_merge)

    def backward(self, op, seq, scope, count, a, b):
        self.job.scopes.add(("backward", scope))
        return self.job.node_result(node_of(self.rank), self.rank, (op, seq, 2), (count, a, b),
                                    lambda x, y: (x[0] + y[0], x[1] + y[1], x[2] + y[2]))

    def global_stats_ready(self, op, seq):
        return self.job.ready(op, seq)

    def global_stats(self, op, seq):
        count, mean, m2 = self.job.global_stats(self.rank, op, seq)
        return count, np.array(mean), np.array(m2)


def make_layer(spec, client, op, **renorm):
    bn = hsbn.torch.SyncBatchNorm(spec["C"], eps=EPS, momentum=spec.get("momentum", MOMENTUM),
                                  affine=spec.get("affine", True), scope="renorm",
                                  client=client, op=op, **renorm)
    bn.double()
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(torch.from_numpy(spec["weight"]))
            bn.bias.copy_(torch.from_numpy(spec["bias"]))
    return bn


def _np(t):
    return t.detach().double().numpy().copy()


def train_steps(bn, steps, wrap=None):
    """Forward and backward of sum(y * g) per step; per-step y, dx, dw, db."""
    out = {"y": [], "dx": [], "dw": [], "db": []}
    for x_np, g_np in steps:
        x = torch.from_numpy(x_np).requires_grad_()
        bn.zero_grad()
        y = bn(x) if wrap is None else wrap(bn, x)
        (y * torch.from_numpy(g_np)).sum().backward()
        out["y"].append(_np(y))
        out["dx"].append(_np(x.grad))
        if bn.affine:
            out["dw"].append(_np(bn.weight.grad))
            out["db"].append(_np(bn.bias.grad))
    return out


def run_job(spec, data, job=None, body=train_steps, barrier=True, **renorm):
    """body(layer, steps) of every rank on a thread of its own; a barrier before each step makes
    every global result of the previous steps arrive before it is asked for (no waits)."""
    world = len(data)
    # The limits reference() assumes unless given: these tests' own, not the library defaults.
    renorm.setdefault("renorm_r_max", 3.0)
    renorm.setdefault("renorm_d_max", 5.0)
    job = job or StandInJob()
    op = hsbn.torch.next_op()
    gate = threading.Barrier(world) if barrier else None
    results, layers, errors = [None] * world, [None] * world, []

    def steps_for(rank):
        for s in data[rank]:
            if gate is not None:
                gate.wait(timeout=30)
            yield s

    def worker(rank):
        try:
            layers[rank] = make_layer(spec, RenormClient(job, rank), op, **renorm)
            results[rank] = body(layers[rank], steps_for(rank))
        except BaseException as e:  # reported below
            errors.append((rank, e))
            if gate is not None:
                gate.abort()
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0][1]
    return results, layers, job


# --- the one-process reference --------------------------------------------------------------------

def _moments(x):
    dims = [0] + list(range(2, x.dim()))
    return x.mean(dims), x.var(dims, unbiased=False), x.numel() // x.shape[1]


def reference(spec, data, node, lag=1, warmup=0, r_max=3.0, d_max=5.0, ramp=0, momentum=1.0):
    """Renorm with torch autograd over node `node`'s concatenated batch, the population
    statistics those of the job's concatenated batch `lag` steps earlier; per-rank y and dx,
    node-summed dw and db, the running statistics, and the (r, d) of every step."""
    ranks = NODE_RANKS[node]
    w = torch.from_numpy(spec["weight"]).requires_grad_()
    b = torch.from_numpy(spec["bias"]).requires_grad_()
    run_mean, run_var = torch.zeros(spec["C"], dtype=torch.float64), torch.ones(spec["C"],
                                                                                dtype=torch.float64)
    out = {"y": {r: [] for r in ranks}, "dx": {r: [] for r in ranks}, "dw": [], "db": [], "rd": []}
    start = max(warmup, lag)
    avg = None
    for s in range(len(data[0])):
        xs = [torch.from_numpy(data[r][s][0]) for r in ranks]
        x = torch.cat(xs).requires_grad_()
        g = torch.cat([torch.from_numpy(data[r][s][1]) for r in ranks])
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        mu_b = x.mean(dims)
        var_b = x.var(dims, unbiased=False)
        xhat = (x - mu_b.reshape(shape)) / torch.sqrt(var_b + EPS).reshape(shape)
        if s >= start:
            gx = torch.cat([torch.from_numpy(data[r][s - lag][0]) for r in range(len(data))])
            g_mean, g_var, g_n = _moments(gx)
            if momentum == 1.0:
                mu, var = g_mean, g_var
            else:
                avg = (g_mean, g_var) if avg is None else (
                    avg[0] * (1 - momentum) + g_mean * momentum,
                    avg[1] * (1 - momentum) + g_var * momentum)
                mu, var = avg
            done = 1.0 if ramp == 0 else min(1.0, (s - start + 1) / ramp)
            rm, dm = 1.0 + (r_max - 1.0) * done, d_max * done
            sigma = torch.sqrt(var + EPS)
            r = torch.clamp(torch.sqrt(var_b.detach() + EPS) / sigma, 1.0 / rm, rm)
            d = torch.clamp((mu_b.detach() - mu) / sigma, -dm, dm)
            xhat = xhat * r.reshape(shape) + d.reshape(shape)
            out["rd"].append((r.numpy(), d.numpy()))
            run_mean = (1 - MOMENTUM) * run_mean + MOMENTUM * g_mean
            run_var = (1 - MOMENTUM) * run_var + MOMENTUM * g_var * g_n / (g_n - 1)
        else:
            out["rd"].append(None)
        y = xhat * w.reshape(shape) + b.reshape(shape)
        w.grad = b.grad = None
        (y * g).sum().backward()
        sizes = [t.shape[0] for t in xs]
        for r_, yr, dxr in zip(ranks, y.detach().split(sizes), x.grad.split(sizes)):
            out["y"][r_].append(yr.numpy())
            out["dx"][r_].append(dxr.numpy())
        out["dw"].append(w.grad.numpy().copy())
        out["db"].append(b.grad.numpy().copy())
    out["running_mean"], out["running_var"] = run_mean.numpy(), run_var.numpy()
    return out


def assert_matches_reference(results, layers, spec, data, tol=1e-11, **kw):
    for node in range(NODES):
        ref = reference(spec, data, node, **kw)
        for s in range(len(data[0])):
            for r in NODE_RANKS[node]:
                for key in ("y", "dx"):
                    e = rel_err(results[r][key][s], ref[key][r][s])
                    assert e <= tol, "%s of rank %d step %d: %.3g" % (key, r, s, e)
            for key in ("dw", "db"):
                total = sum(results[r][key][s] for r in NODE_RANKS[node])
                e = rel_err(total, ref[key][s])
                assert e <= tol, "%s of node %d step %d: %.3g" % (key, node, s, e)
        for r in NODE_RANKS[node]:
            assert rel_err(_np(layers[r].running_mean), ref["running_mean"]) <= tol
            assert rel_err(_np(layers[r].running_var), ref["running_var"]) <= tol
    return ref


def renorm_spec(steps=4, seed=21, **extra):
    return make_spec("renorm", "float64", steps=steps, seed=seed, **extra)


# --- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spatial", [(4, 5), (7,), ()])
def test_outputs_and_gradients_equal_renorm_over_the_node_batch_with_global_population(
        cpu_ops, spatial):
    # Node 1 holds ranks 2 (empty) and 3; with 2 values per channel BatchNorm's dx is 0 up to
    # round-off, so rank 3 gets 4 samples.
    spec, data = renorm_spec(spatial=spatial, sizes=[3, 5, 0, 4])
    results, layers, job = run_job(spec, data, renorm_warmup=0, renorm_ramp=0)
    ref = assert_matches_reference(results, layers, spec, data)
    # The data's nodes are 3.0 apart: the correction is real and unclipped here.
    r, d = ref["rd"][2]
    assert np.all(np.abs(r - 1.0) > 1e-3) and np.all(np.abs(d) > 0.05)
    assert np.all(r < 3.0) and np.all(r > 1 / 3.0) and np.all(np.abs(d) < 5.0)
    # The layer sent renorm rounds (its backward ones are node rounds on the wire); global
    # statistics were asked for the round one call earlier, by every rank, from step 1 on.
    assert job.scopes == {("forward", "renorm"), ("backward", "renorm")}
    assert sorted(s for _, _, s in job.global_calls) == sorted([0, 1, 2] * len(data))


def test_unclipped_renorm_is_normalization_with_the_previous_calls_global_statistics():
    spec, data = renorm_spec(steps=3)
    results, _, _ = run_job(spec, data, renorm_warmup=0, renorm_ramp=0, renorm_r_max=1e6,
                            renorm_d_max=1e6)
    everyone = [np.concatenate([data[r][s][0] for r in range(len(data))]) for s in range(3)]
    for s in (1, 2):
        prev = torch.from_numpy(everyone[s - 1])
        mean, var, _ = _moments(prev)
        shape = [1, -1, 1, 1]
        for r in range(len(data)):
            x = torch.from_numpy(data[r][s][0])
            want = ((x - mean.reshape(shape)) / torch.sqrt(var + EPS).reshape(shape)
                    * torch.from_numpy(spec["weight"]).reshape(shape)
                    + torch.from_numpy(spec["bias"]).reshape(shape))
            assert rel_err(results[r]["y"][s], want.numpy()) <= 1e-12


def test_clipping_and_its_ramp_follow_the_formula(cpu_ops):
    spec, data = renorm_spec(steps=5)
    kw = dict(warmup=1, r_max=1.2, d_max=0.1, ramp=3)
    results, layers, _ = run_job(spec, data, **{"renorm_" + k: v for k, v in kw.items()})
    ref = assert_matches_reference(results, layers, spec, data, **kw)
    # Steps 1..3 ramp the limits up (1/3, 2/3, 1 of the way); the data exceed them.
    for s, done in ((1, 1 / 3), (2, 2 / 3), (3, 1.0), (4, 1.0)):
        r, d = ref["rd"][s]
        assert np.max(np.abs(d)) == pytest.approx(0.1 * done, rel=1e-12)
        assert max(np.max(r), 1 / np.min(r)) == pytest.approx(1 + 0.2 * done, rel=1e-12)


def test_momentum_averages_the_global_statistics_over_calls():
    spec, data = renorm_spec(steps=4)
    results, layers, _ = run_job(spec, data, renorm_warmup=0, renorm_ramp=0,
                                 renorm_momentum=0.5)
    assert_matches_reference(results, layers, spec, data, momentum=0.5)


def test_warmup_is_node_scope_bit_for_bit_and_waits_for_nothing():
    spec, data = renorm_spec(steps=3)
    hsbn.torch.reset_sync_stats()
    renorm, layers, job = run_job(spec, data, renorm_warmup=3)
    assert job.global_calls == []
    # The same steps in node scope: the same bits.
    node_spec = dict(spec, scope="node")
    from test_autograd_math import run_threads
    node = _node_scope_run(node_spec, data, run_threads)
    for r in range(len(data)):
        for key in ("y", "dx", "dw", "db"):
            for a, b in zip(renorm[r][key], node[r][key]):
                assert np.array_equal(a, b), (key, r)
        # No global statistics used: the running statistics are untouched.
        assert np.array_equal(_np(layers[r].running_mean), np.zeros(spec["C"]))
        assert np.array_equal(_np(layers[r].running_var), np.ones(spec["C"]))
        assert int(layers[r].num_batches_tracked) == 0
    st = hsbn.torch.sync_stats()
    assert (st.renorm_calls, st.renorm_global_uses, st.renorm_waits) == (3 * len(data), 0, 0)


def _node_scope_run(spec, data, run_threads):
    """Node scope over the same nodes (test_autograd_math's stand-in reduces over all ranks it
    is given, so each node runs as a job of its own)."""
    out = [None] * len(data)
    for ranks in NODE_RANKS:
        res = run_threads(dict(spec, eps=EPS, momentum=MOMENTUM), [data[r] for r in ranks])
        for r, v in zip(ranks, res):
            out[r] = v
    return out


def test_running_statistics_come_from_the_global_statistics_and_agree_on_every_rank():
    spec, data = renorm_spec(steps=4)
    _, layers, _ = run_job(spec, data, renorm_warmup=2, renorm_ramp=0, renorm_lag=1)
    ref = reference(spec, data, 0, warmup=2)
    for layer in layers:
        assert np.array_equal(_np(layer.running_mean), _np(layers[0].running_mean))
        assert np.array_equal(_np(layer.running_var), _np(layers[0].running_var))
        assert rel_err(_np(layer.running_mean), ref["running_mean"]) <= 1e-12
        assert rel_err(_np(layer.running_var), ref["running_var"]) <= 1e-12
        assert int(layer.num_batches_tracked) == 2   # steps 2 and 3 used global statistics


def test_momentum_none_is_the_cumulative_average_of_the_global_statistics_used():
    spec, data = renorm_spec(steps=4, momentum=None)
    _, layers, _ = run_job(spec, data, renorm_warmup=0, renorm_ramp=0, renorm_lag=2)
    everyone = [torch.from_numpy(np.concatenate([data[r][s][0] for r in range(len(data))]))
                for s in range(4)]
    m0, v0, n = _moments(everyone[0])
    m1, v1, _ = _moments(everyone[1])
    for layer in layers:
        assert int(layer.num_batches_tracked) == 2
        assert rel_err(_np(layer.running_mean), ((m0 + m1) / 2).numpy()) <= 1e-12
        assert rel_err(_np(layer.running_var), ((v0 + v1) / 2 * n / (n - 1)).numpy()) <= 1e-12


def test_lag_and_affine_false():
    spec, data = renorm_spec(steps=4, affine=False)
    spec["weight"], spec["bias"] = np.ones(spec["C"]), np.zeros(spec["C"])
    results, layers, job = run_job(spec, data, renorm_warmup=0, renorm_ramp=0, renorm_lag=2)
    for r in results:
        r["dw"] = [np.zeros(spec["C"])] * 4
        r["db"] = [np.zeros(spec["C"])] * 4
    for node in range(NODES):
        ref = reference(spec, data, node, lag=2)
        for s in range(4):
            for r in NODE_RANKS[node]:
                assert rel_err(results[r]["y"][s], ref["y"][r][s]) <= 1e-12
                assert rel_err(results[r]["dx"][s], ref["dx"][r][s]) <= 1e-12
    assert sorted({s for _, _, s in job.global_calls}) == [0, 1]


def test_every_rank_of_a_node_holds_the_same_bits():
    spec, data = renorm_spec(steps=3)
    results, layers, _ = run_job(spec, data, renorm_warmup=0, renorm_ramp=0)
    for layer in layers[1:]:
        assert torch.equal(layer.running_mean, layers[0].running_mean)
        assert torch.equal(layer.running_var, layers[0].running_var)


def test_a_forward_that_asks_before_the_root_answered_counts_as_a_wait():
    spec, data = renorm_spec(steps=2)
    job = StandInJob()
    hsbn.torch.reset_sync_stats()
    # The global statistics of seq 0 (used at step 1) come once every rank waits for them.
    job.held.add(0)
    releaser = threading.Thread(target=job.release, args=(len(data),))
    releaser.start()
    run_job(spec, data, job=job, renorm_warmup=0, renorm_ramp=0)
    releaser.join()
    st = hsbn.torch.sync_stats()
    assert (st.renorm_calls, st.renorm_global_uses, st.renorm_waits) == (8, 4, 4)
    assert st.renorm_wait_share == 0.5
    assert st.renorm_wait_seconds > 0.0


def test_barriered_steps_never_wait():
    spec, data = renorm_spec(steps=3)
    hsbn.torch.reset_sync_stats()
    run_job(spec, data, renorm_warmup=0, renorm_ramp=0)
    st = hsbn.torch.sync_stats()
    assert (st.renorm_calls, st.renorm_global_uses, st.renorm_waits) == (12, 8, 0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recomputation_reuses_the_first_pass_r_and_d(reentrant):
    spec, data = renorm_spec(steps=3)
    kw = dict(renorm_warmup=0, renorm_ramp=0)
    plain, _, plain_job = run_job(spec, data, **kw)
    hsbn.torch.reset_sync_stats()
    ckpt, layers, job = run_job(
        spec, data, body=lambda bn, steps: train_steps(
            bn, steps, wrap=lambda m, x: checkpoint(m, x, use_reentrant=reentrant)), **kw)
    for r in range(len(data)):
        for key in ("y", "dx", "dw", "db"):
            for a, b in zip(ckpt[r][key], plain[r][key]):
                assert np.array_equal(a, b), (key, r)
    # The recomputations made node rounds (seq advanced twice per step) but asked the root
    # for nothing: first passes at seq 0, 2, 4 asked for seq 1 and 3 (the recomputations of
    # steps 0 and 1: the same batches).
    assert sorted({s for _, _, s in job.global_calls}) == [1, 3]
    assert len(job.global_calls) == len(plain_job.global_calls)
    st = hsbn.torch.sync_stats()
    assert (st.renorm_calls, st.renorm_recomputes, st.renorm_global_uses) == (12, 12, 8)
    # The running statistics were updated once per first pass that used global statistics.
    assert all(int(layer.num_batches_tracked) == 2 for layer in layers)


def test_a_recomputation_that_differs_from_its_first_pass_is_an_error():
    spec, data = renorm_spec(steps=1)

    def noisy(bn, steps):
        def segment(x):
            return bn(x + torch.rand(x.shape, dtype=x.dtype))
        for x_np, g_np in steps:
            x = torch.from_numpy(x_np).requires_grad_()
            y = checkpoint(segment, x, preserve_rng_state=False, use_reentrant=True)
            (y * torch.from_numpy(g_np)).sum().backward()
    with pytest.raises(_renorm.RecomputeError, match="recomputed in backward.*"
                                                     "preserve_rng_state"):
        run_job(spec, data, body=noisy, renorm_warmup=0)


def test_eval_mode_uses_the_running_statistics_and_makes_no_round():
    spec, data = renorm_spec(steps=2)
    _, layers, job = run_job(spec, data, renorm_warmup=0, renorm_ramp=0)
    bn = layers[0]
    bn.eval()
    calls = len(job.global_calls)
    x = torch.from_numpy(data[0][0][0])
    want = torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight,
                                          bn.bias, False, 0.0, EPS)
    with torch.no_grad():
        assert torch.equal(bn(x), want)
    assert len(job.global_calls) == calls


def test_state_dict_is_torchs_and_round_trips():
    spec, data = renorm_spec(steps=2)
    _, layers, _ = run_job(spec, data, renorm_warmup=0, renorm_ramp=0)
    state = layers[0].state_dict()
    assert sorted(state) == sorted(torch.nn.BatchNorm2d(3).state_dict())
    fresh = hsbn.torch.SyncBatchNorm(3, scope="renorm").double()
    fresh.load_state_dict(state)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, state[k]), k
    plain = torch.nn.BatchNorm2d(3).double()
    plain.load_state_dict(state)  # strictly, into torch's own


def test_convert_and_layer_scopes_accept_renorm_and_its_options():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4),
                                torch.nn.BatchNorm2d(4))
    converted = hsbn.torch.convert_sync_batchnorm(model, scope="node",
                                                  layer_scopes={"2": "renorm"},
                                                  renorm_lag=2, renorm_r_max=2.0)
    assert hsbn.torch.scopes(converted) == {"1": "node", "2": "renorm"}
    assert converted[2].renorm_options == dict(_renorm.DEFAULTS, lag=2, r_max=2.0)
    assert "renorm" in hsbn.SCOPES and "renorm" in hsbn.torch.SCOPES
    with pytest.raises(hsbn.ConfigurationError, match="renorm_r_max must be >= 1"):
        hsbn.torch.convert_sync_batchnorm(model, scope="renorm", renorm_r_max=0.5)
    with pytest.raises(hsbn.ConfigurationError, match="renorm_lag must be an int >= 1"):
        hsbn.torch.SyncBatchNorm(3, scope="renorm", renorm_lag=0)


def test_a_round_is_one_download_and_one_upload_global_statistics_add_none():
    spec, data = renorm_spec(steps=3)
    hsbn.torch.reset_sync_stats()
    run_job(spec, data, renorm_warmup=0, renorm_ramp=0)
    st = hsbn.torch.sync_stats()
    # 4 workers x 3 steps x (forward + backward); r, d and the running statistics' values
    # travel up with the forward round's mean and invstd.
    assert (st.rounds, st.downloads, st.uploads, st.device_waits) == (24, 24, 24, 0)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_step_reads_no_tensor_value_on_the_host(no_host_reads, momentum):
    spec, data = renorm_spec(steps=3, momentum=momentum)
    _, layers, _ = run_job(spec, data, renorm_warmup=1, renorm_ramp=0)
    assert all(int(layer.num_batches_tracked.numpy()) == 2 for layer in layers)
