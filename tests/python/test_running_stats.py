"""hsbn.torch.sync_running_stats and precise_bn on a LocalCluster (2 nodes x 2 workers, real
aggregators and worker processes), checked against one-process computations: the law of total
variance over the ranks' records, and plain torch BatchNorm over every rank's batches in one
process. Also: mismatched calls fail on every rank with a clear error, and a rank that never
calls makes the others fail at the round deadline with a message naming the call. The global and
node scope tests run over both transports of the node's rounds ([shm], [grpc]: transports.py);
group scope rounds always take the stream (docs/PROTOCOL.md)."""

import numpy as np
import pytest

import population_cases as cases
from workerpool import on_transport, started

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
LAYERS = ["1", "4", "8"]


@pytest.fixture(scope="module")
def workers():
    with started(nodes=NODES, workers_per_node=PER_NODE, round_timeout_ms=60000) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool(workers, transport):
    yield from on_transport(workers, transport)


@pytest.fixture(scope="module")
def short_deadline_workers():
    with started(nodes=1, workers_per_node=2, root=False, round_timeout_ms=3000) as pool:
        yield pool


@pytest.fixture(scope="module")
def short_deadline_pool(short_deadline_workers, transport):
    yield from on_transport(short_deadline_workers, transport)


def scope_members(scope):
    if scope == "global":
        return [list(range(WORLD))]
    return [list(range(n * PER_NODE, (n + 1) * PER_NODE)) for n in range(NODES)]


def mixture(records, weights):
    """The law of total variance over ranks' (mean, var) records, weighted: one process, in
    float64."""
    w = np.asarray(weights, np.float64)
    means = np.stack([r["mean"] for r in records])
    vars_ = np.stack([r["var"] for r in records])
    mean = (w[:, None] * means).sum(0) / w.sum()
    var = (w[:, None] * (vars_ + (means - mean) ** 2)).sum(0) / w.sum()
    return mean, var


def close(a, b, rtol=1e-12):
    a, b = np.asarray(a), np.asarray(b)
    return np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)) <= rtol


@pytest.mark.parametrize("scope", ["global", "node"])
def test_sync_running_stats_pools_by_samples_seen(pool, scope):
    out = pool.call(cases.train_then_sync, [("Pool" + scope, scope, r, True)
                                            for r in range(WORLD)])
    for members in scope_members(scope):
        for layer in LAYERS:
            records = [out[r]["before"][layer] for r in members]
            seen = [rec["seen"] for rec in records]
            # Uneven: rank r ran r + 1 batches of rank-dependent sizes.
            assert len(set(seen)) == len(seen) and min(seen) > 0, seen
            mean, var = mixture(records, seen)
            # The ranks' records really differ (else pooling would prove nothing).
            assert np.ptp(np.stack([rec["mean"] for rec in records]), axis=0).max() > 0.01
            for r in members:
                after = out[r]["once"][layer]
                assert close(after["mean"], mean), (r, layer, after["mean"], mean)
                assert close(after["var"], var), (r, layer, after["var"], var)
                # Pooling again changes nothing; samples seen and batch counts are kept.
                assert close(out[r]["twice"][layer]["mean"], mean)
                assert close(out[r]["twice"][layer]["var"], var)
                assert after["seen"] == out[r]["before"][layer]["seen"]
                assert after["tracked"] == out[r]["before"][layer]["tracked"]
                assert out[r]["answer"][layer] == sum(seen)
                assert out[r]["warnings"] == []
            # The weights matter: equal weights would give another answer.
            eq_mean, _ = mixture(records, [1] * len(records))
            assert not close(eq_mean, mean, 1e-3)


def test_layers_without_a_record_pool_with_equal_weights_and_warn(pool):
    out = pool.call(cases.train_then_sync, [("NoRecord", "global", r, False)
                                            for r in range(WORLD)])
    for layer in LAYERS:
        records = [out[r]["before"][layer] for r in range(WORLD)]
        assert all(rec["seen"] == 0 for rec in records)
        mean, var = mixture(records, [1] * WORLD)
        for r in range(WORLD):
            assert close(out[r]["once"][layer]["mean"], mean)
            assert close(out[r]["once"][layer]["var"], var)
            assert close(out[r]["twice"][layer]["var"], var)
            assert out[r]["answer"][layer] == WORLD
    for r in range(WORLD):
        assert len(out[r]["warnings"]) == 1, out[r]["warnings"]
        assert "no record of samples seen" in out[r]["warnings"][0]
        assert "equal weights" in out[r]["warnings"][0]


@pytest.mark.parametrize("scope", ["global", "node"])
def test_precise_bn_matches_one_process_over_all_batches_of_the_scope(pool, scope):
    # Uneven: rank 0 runs 3 batches, rank 1 none, rank 2 one, rank 3 four, of uneven sizes.
    n_batches = [3, 0, 1, 4]
    out = pool.call(cases.precise, [("Precise" + scope, scope, r, n_batches)
                                    for r in range(WORLD)])
    batches = {r: cases.rank_batches(r, n_batches[r]) for r in range(WORLD)}
    for members in scope_members(scope):
        ref = cases.layer_inputs_reference(batches, members)
        for layer in LAYERS:
            for r in members:
                after, before = out[r]["after"][layer], out[r]["before"][layer]
                assert close(after["mean"], ref[layer]["mean"], 1e-10), (r, layer)
                assert close(after["var"], ref[layer]["var"], 1e-10), (r, layer)
                assert out[r]["answer"][layer] == ref[layer]["n"]
                # The pass's own forwards did not count as training steps.
                assert after["tracked"] == before["tracked"]
                own = cases.layer_inputs_reference(batches, [r]).get(layer, {"n": 0})["n"]
                assert after["seen"] == own
                assert not close(before["mean"], after["mean"], 1e-3)
        for r in members:
            assert out[r]["modes_restored"]


@pytest.mark.parametrize("variant", ["model", "function", "scope"])
def test_ranks_that_call_differently_fail_on_every_rank(pool, variant):
    out = pool.call(cases.mismatched_call, [("Mismatch" + variant, r, variant)
                                            for r in range(WORLD)], timeout=200)
    for r, err in enumerate(out):
        assert err is not None, "rank %d returned normally" % r
        assert "sync_running_stats" in err["message"] or "precise_bn" in err["message"], err
        # On every rank at once, not at the deadline: found by the check round's sums, or (rank 1
        # asks for node scope where the others ask for global) by its node's sidecar or ranks,
        # which tell the root, so the other node fails too.
        assert err["type"] == "InvalidArgumentError", err
        if variant != "scope":
            assert "did not call it alike" in err["message"], err
        else:
            assert "field 'scope'" in err["message"], err


def test_a_rank_that_never_calls_fails_the_others_at_the_deadline_with_a_message(
        short_deadline_pool):
    out = short_deadline_pool.call(cases.one_rank_does_not_call,
                                   [("Missing", r) for r in range(2)], timeout=120)
    assert out[1] is None
    assert out[0]["type"] == "DeadlineExceededError", out[0]
    assert "the check round of hsbn.torch.sync_running_stats" in out[0]["message"], out[0]
    assert "rank 1" in out[0]["message"], out[0]


@pytest.fixture(scope="module")
def group_pool():
    # 4 nodes x 1 worker in groups of 2 nodes: group scope pools ranks {0, 1} and {2, 3}.
    mp = pytest.MonkeyPatch()
    mp.setenv("HSBN_GROUP_NODES", "2")
    try:
        with started(nodes=4, workers_per_node=1, round_timeout_ms=60000) as workers:
            yield workers
    finally:
        mp.undo()


def test_group_scope_pools_each_group_of_nodes(group_pool):
    out = group_pool.call(cases.train_then_sync, [("PoolGroup", "group", r, True)
                                                  for r in range(4)])
    n_batches = [1, 0, 2, 3]
    prec = group_pool.call(cases.precise, [("PreciseGroup", "group", r, n_batches)
                                           for r in range(4)])
    batches = {r: cases.rank_batches(r, n_batches[r]) for r in range(4)}
    for members in ([0, 1], [2, 3]):
        ref = cases.layer_inputs_reference(batches, members)
        for layer in LAYERS:
            records = [out[r]["before"][layer] for r in members]
            mean, var = mixture(records, [rec["seen"] for rec in records])
            for r in members:
                assert close(out[r]["once"][layer]["mean"], mean), (r, layer)
                assert close(out[r]["once"][layer]["var"], var), (r, layer)
                assert close(prec[r]["after"][layer]["mean"], ref[layer]["mean"], 1e-10)
                assert close(prec[r]["after"][layer]["var"], ref[layer]["var"], 1e-10)
    # The two groups really ended with different statistics.
    assert not close(out[0]["once"]["1"]["mean"], out[2]["once"]["1"]["mean"], 1e-3)
