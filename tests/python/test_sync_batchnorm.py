"""hsbn.torch.SyncBatchNorm against torch.nn.BatchNorm*d on the scope's concatenated batch.

One LocalCluster (2 nodes x 2 workers: a root, two sidecars) and four worker processes serve the
whole module. Batch sizes are uneven (3, 5, 0, 2): rank 2 has an empty batch. Every test runs
over both transports of the node's rounds ([shm], [grpc]: transports.py), and one compares
their results bit for bit.
"""

import numpy as np
import pytest
import torch

import hsbn_cases
import transports
from bnref import (NODES, SIZES, WORKERS_PER_NODE, assert_group_matches, make_spec, node_of,
                   reference, rel_err)
from workerpool import on_transport, started

GLOBAL = [[0, 1, 2, 3]]
BY_NODE = [[0, 1], [2, 3]]
TOL = {"float64": 1e-10, "float32": 1e-5}


@pytest.fixture(scope="module")
def workers():
    with started(nodes=NODES, workers_per_node=WORKERS_PER_NODE, round_timeout_ms=30000) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool(workers, transport):
    yield from on_transport(workers, transport)


def run_case(pool, spec, data):
    return pool.call(hsbn_cases.bn_steps, [(spec, data[r]) for r in range(pool.world_size)])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_global_scope_equals_batchnorm2d_over_the_global_batch(pool, dtype):
    spec, data = make_spec("global", dtype)
    results = run_case(pool, spec, data)
    assert_group_matches(results, spec, data, GLOBAL, TOL[dtype])
    assert all(r["num_batches_tracked"] == 2 for r in results)
    assert results[2]["y"][0].shape == (0, 3, 4, 5)  # the empty worker took part
    # The layer was constructed in the same order everywhere, so every rank used the same op.
    assert len({r["op"] for r in results}) == 1


@pytest.mark.parametrize("spatial", [(), (7,), (2, 3, 4)], ids=["N,C", "N,C,L", "N,C,D,H,W"])
def test_global_scope_1d_and_3d(pool, spatial):
    spec, data = make_spec("global", "float64", spatial=spatial, seed=1)
    results = run_case(pool, spec, data)
    assert_group_matches(results, spec, data, GLOBAL, TOL["float64"])


@pytest.mark.parametrize("spatial", [(4, 5), (2, 3, 4)], ids=["2d", "3d"])
def test_global_scope_channels_last_stays_channels_last(pool, spatial):
    spec, data = make_spec("global", "float64", spatial=spatial, seed=2, channels_last=True)
    results = run_case(pool, spec, data)
    assert_group_matches(results, spec, data, GLOBAL, TOL["float64"])
    for r, res in enumerate(results):
        if SIZES[r] > 0:  # an empty tensor is contiguous in every format
            assert res["channels_last"] == [(True, True)] * 2, "rank %d: %s" % (
                r, res["channels_last"])


def test_node_scope_equals_batchnorm_over_each_nodes_batch(pool):
    spec, data = make_spec("node", "float64", seed=3)
    results = run_case(pool, spec, data)
    assert_group_matches(results, spec, data, BY_NODE, TOL["float64"])
    # The nodes' data differ, so node statistics are not the global ones.
    assert rel_err(results[0]["running_mean"], results[3]["running_mean"]) > 0.1


def test_local_scope_equals_plain_batchnorm_on_each_worker(workers):
    # No rounds, so no transport to run it over.
    sizes = [3, 5, 4, 2]  # plain BatchNorm needs a non-empty batch
    spec, data = make_spec("local", "float64", seed=4, sizes=sizes)
    results = run_case(workers, spec, data)
    assert_group_matches(results, spec, data, [[r] for r in range(4)], TOL["float64"])


def test_shadow_scope_gives_node_results_and_status_shows_divergence(pool):
    spec, data = make_spec("shadow", "float64", seed=5, steps=1)
    results = run_case(pool, spec, data)
    assert_group_matches(results, spec, data, BY_NODE, TOL["float64"])
    op = results[0]["op"]
    div = pool.call(hsbn_cases.wait_for_divergence, [(op, NODES)] * 4)[0]
    entries = {int(d.get("node", 0)): d for d in div["entries"]}
    assert sorted(entries) == [0, 1], div["status"]
    # mean_shift = |mean_node - mean_global| / sqrt(var_global + 1e-5), averaged over channels.
    xs = {n: np.concatenate([data[r][0][0] for r in range(4) if node_of(r) == n]) for n in (0, 1)}
    allx = np.concatenate([xs[0], xs[1]])
    g_mean, g_var = allx.mean(axis=(0, 2, 3)), allx.var(axis=(0, 2, 3))
    for n in (0, 1):
        expected = np.mean(np.abs(xs[n].mean(axis=(0, 2, 3)) - g_mean) / np.sqrt(g_var + 1e-5))
        assert int(entries[n].get("rounds", 0)) >= 1
        assert entries[n]["meanShiftAvg"] == pytest.approx(expected, rel=1e-9)
        assert expected > 0.1  # the nodes really differ


def test_divergence_is_reported_by_layer_name(pool):
    divs = pool.call(hsbn_cases.shadow_divergence_by_name, [(NODES,)] * 4)
    # The root's own record (Status, the divergence file) names them too: the layers sent
    # their names ("model:layer") to the aggregators.
    for div in divs:
        assert sorted(div.pop("_root").values()) == ["divnet:1", "divnet:4"]
    for div in divs:
        assert sorted(div) == ["1", "4"], div  # the BatchNorm layers' names in the Sequential
        for rows in div.values():
            assert [r["node"] for r in rows] == [0, 1]
            assert all(r["rounds"] >= 2 for r in rows)
        # The nodes' inputs differ by 3 standard deviations: the first layer sees it.
        assert all(r["mean_shift_avg"] > 0.5 for r in div["1"])
    assert divs[0] == divs[3]  # every rank reads the same record


def test_eval_mode_uses_running_statistics_and_exchanges_nothing(pool):
    spec, data = make_spec("global", "float64", seed=6)
    rng = np.random.default_rng(60)
    spec["eval_input"] = rng.standard_normal((4, 3, 4, 5))
    results = run_case(pool, spec, data)
    ref = reference(spec, data, [0, 1, 2, 3])
    bn = ref["module"].eval()
    with torch.no_grad():
        expected = bn(torch.from_numpy(spec["eval_input"])).numpy()
    for r, res in enumerate(results):
        assert rel_err(res["y_eval"], expected) <= 1e-10, r
    r0 = results[0]
    assert r0["rounds_before_eval"] is not None and r0["rounds_before_eval"] > 0
    assert r0["rounds_after_eval"] == r0["rounds_before_eval"]


def test_momentum_none_is_the_cumulative_average(pool):
    spec, data = make_spec("global", "float64", seed=7, steps=3, momentum=None)
    results = run_case(pool, spec, data)
    assert_group_matches(results, spec, data, GLOBAL, TOL["float64"])


@pytest.mark.parametrize("dtype,out_tol", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_half_precision_input_keeps_statistics_in_float32_or_better(pool, dtype, out_tol):
    spec, data = make_spec("global", dtype, seed=8, steps=1, param_dtype="float32")
    results = run_case(pool, spec, data)
    # Reference: float64 BatchNorm on the same (rounded) values.
    rounded = [[(torch.from_numpy(x).to(getattr(torch, dtype)).double().numpy(),
                 torch.from_numpy(g).to(getattr(torch, dtype)).double().numpy())
                for x, g in steps] for steps in data]
    ref_spec = dict(spec, dtype="float64", param_dtype="float64")
    ref = reference(ref_spec, rounded, [0, 1, 2, 3])
    for r, res in enumerate(results):
        assert res["y_dtype"] == "torch." + dtype and res["grad_dtype"] == "torch." + dtype
        assert res["running_dtype"] == "torch.float32"
        # Statistics from half inputs, reduced in float64: float32 round-off only.
        assert rel_err(res["running_mean"], ref["running_mean"]) <= 1e-6
        assert rel_err(res["running_var"], ref["running_var"]) <= 1e-6
        if SIZES[r]:
            assert rel_err(res["y"][0], ref["y"][r][0]) <= out_tol
    dw = sum(res["dw"][0] for res in results)
    assert rel_err(dw, ref["dw"][0]) <= out_tol


def test_every_worker_sees_its_place_in_the_job(pool):
    infos = pool.call(hsbn_cases.client_info, [()] * 4)
    for r, info in enumerate(infos):
        assert (info["rank"], info["local_rank"], info["node_rank"]) == (r, r % 2, r // 2)
        assert (info["world_size"], info["local_world_size"], info["num_nodes"]) == (4, 2, 2)


def test_shared_memory_and_the_stream_give_the_same_bits_in_every_scope(workers):
    # Each worker runs the same steps in a job on shared memory and in a job on the stream,
    # forward and backward, node, shadow and global scope, float64 and float32; every output,
    # gradient and running statistic must be bitwise the same.
    cases = [make_spec(scope, dtype, seed=30 + i)
             for i, (scope, dtype) in enumerate((s, d) for s in ("node", "shadow", "global")
                                                for d in ("float64", "float32"))]
    out = workers.call(hsbn_cases.bn_steps_over_both_transports,
                       [([(spec, data[r]) for spec, data in cases], "same-bits")
                        for r in range(workers.world_size)])
    for r, by_transport in enumerate(out):
        for name in transports.NAMES:
            assert by_transport[name]["transport"] == transports.EXPECTED[name], (r, name)
        shm, grpc = by_transport["shm"]["results"], by_transport["grpc"]["results"]
        for (spec, _), a, b in zip(cases, shm, grpc):
            where = "rank %d, %s %s" % (r, spec["scope"], spec["dtype"])
            for key in ("y", "dx", "dw", "db"):
                assert len(a[key]) == len(b[key]) == 2, (where, key)
                for step, (x, y) in enumerate(zip(a[key], b[key])):
                    assert x.dtype == y.dtype and x.shape == y.shape, (where, key, step)
                    assert x.tobytes() == y.tobytes(), "%s: %s of step %d differs" % (
                        where, key, step)
            for key in ("running_mean", "running_var"):
                assert a[key].tobytes() == b[key].tobytes(), (where, key)
    # And the common answer is BatchNorm's over the scope's batch, not a shared wrong one.
    for (spec, data), i in zip(cases, range(len(cases))):
        groups = GLOBAL if spec["scope"] == "global" else BY_NODE
        assert_group_matches([o["shm"]["results"][i] for o in out], spec, data, groups,
                             TOL[spec["dtype"]])
