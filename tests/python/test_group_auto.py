"""Group scope and auto scope, with real aggregators (a root and a sidecar per node) and real
worker processes.

Group scope runs on 4 nodes x 1 worker (groups of 2 nodes, uneven batches, one empty): each
group equals torch.nn.BatchNorm over the group's concatenated batch, forward and backward,
bitwise the same on the group's members and across reruns; groups of all nodes give global's
bits, groups of one node give node's. Auto scope runs on 2 nodes x 2 workers (one layer whose
input is offset by node, one whose input is not): decisions per layer, the same on every rank,
kept through a state_dict without a new warm-up; and on the 4 x 1 cluster with groups.

Group and auto scope rounds always take the stream (docs/PROTOCOL.md); node and global ones take
the node's transport. So the 4 x 1 cluster's tests, which compare group with global and node
scope bit for bit, run over both transports ([shm], [grpc]: transports.py); the auto scope tests
on 2 x 2 run once.
"""

import io

import pytest
import torch

import hsbn
import hsbn.torch
import group_auto_cases as cases
from bnref import assert_group_matches, make_spec
from workerpool import WorkerPool

SIZES = [3, 5, 0, 2]
GROUPS = [[0, 1], [2, 3]]


def _pool(nodes, workers_per_node):
    cluster = hsbn.cluster.LocalCluster(nodes=nodes, workers_per_node=workers_per_node,
                                        round_timeout_ms=30000)
    cluster.start()
    try:
        return cluster, WorkerPool(cluster)
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="module")
def four_nodes_workers():
    cluster, pool = _pool(4, 1)
    try:
        yield pool
    finally:
        pool.close()
        cluster.stop()


@pytest.fixture(scope="module")
def four_nodes(four_nodes_workers, transport):
    yield four_nodes_workers.use_transport(transport)
    four_nodes_workers.check_transport()


@pytest.fixture(scope="module")
def two_by_two():
    cluster, pool = _pool(2, 2)
    try:
        yield pool
    finally:
        pool.close()
        cluster.stop()


def _spec(scope, sizes):
    # bnref offsets data by node of a 2-worker node layout: here every rank is a node, and
    # ranks 0-1 / 2-3 (the groups) differ by that offset, so group and global differ.
    return make_spec(scope, "float64", sizes=sizes, seed=21)


def _run(pool, scope, group_nodes, suffix, sizes=SIZES):
    spec, data = _spec(scope, sizes)
    return spec, data, pool.call(cases.group_bn_steps,
                                 [(spec, data[r], suffix, group_nodes) for r in range(4)])


# --- group scope -----------------------------------------------------------------------------

def test_group_scope_equals_batchnorm_over_each_groups_batch_bitwise_on_its_members(four_nodes):
    spec, data, results = _run(four_nodes, "group", 2, "g2")
    assert_group_matches(results, spec, data, GROUPS, 1e-10)
    # Every member of a group normalized with the same bits (its running statistics are
    # computed from them); the two groups' statistics differ.
    for a, b in GROUPS:
        assert results[a]["running_bytes"] == results[b]["running_bytes"]
    assert results[0]["running_bytes"] != results[2]["running_bytes"]
    # A rerun (a new job) gives the same bits.
    _, _, again = _run(four_nodes, "group", 2, "g2-again")
    for r in range(4):
        assert again[r]["running_bytes"] == results[r]["running_bytes"]
        for s in range(len(results[r]["y"])):
            assert again[r]["y"][s].tobytes() == results[r]["y"][s].tobytes()
            assert again[r]["dx"][s].tobytes() == results[r]["dx"][s].tobytes()


def test_group_of_all_nodes_is_global_and_group_of_one_node_is_node(four_nodes):
    sizes = [3, 5, 4, 2]  # a node of one worker needs a batch of its own
    _, _, everyone = _run(four_nodes, "group", 4, "g4", sizes)
    _, _, glob = _run(four_nodes, "global", 4, "g4-global", sizes)
    _, _, single = _run(four_nodes, "group", 1, "g1", sizes)
    _, _, node = _run(four_nodes, "node", 1, "g1-node", sizes)
    for r in range(4):
        assert everyone[r]["running_bytes"] == glob[r]["running_bytes"]
        assert single[r]["running_bytes"] == node[r]["running_bytes"]
        for s in range(len(everyone[r]["y"])):
            assert everyone[r]["y"][s].tobytes() == glob[r]["y"][s].tobytes()
            assert everyone[r]["dx"][s].tobytes() == glob[r]["dx"][s].tobytes()
            assert single[r]["dx"][s].tobytes() == node[r]["dx"][s].tobytes()
    assert everyone[0]["running_bytes"] != single[0]["running_bytes"]


def test_a_group_size_that_does_not_divide_the_nodes_fails_to_join_naming_both(four_nodes):
    errors = four_nodes.call(cases.join_error, [(3,)] * 4)
    for e in errors:
        assert e is not None and "HSBN_GROUP_NODES=3" in e and "4 nodes" in e, e
    assert four_nodes.call(cases.join_error, [(2,)] * 4) == [None] * 4


def test_a_layers_group_size_must_be_its_clients(four_nodes):
    for e in four_nodes.call(cases.group_nodes_mismatch_error, [()] * 4):
        assert e is not None and "group_nodes=2" in e and "group_nodes=0" in e, e


def test_auto_scope_with_groups_compares_groups_with_global(four_nodes):
    # Nodes 0 and 2 are offset by 0, nodes 1 and 3 by 3: each node is far from the global
    # statistics, but each group (0-1, 2-3) is the global mixture.
    results = four_nodes.call(cases.auto_decides_per_layer,
                              [("auto-groups", 5, 2, [0.0, 3.0, 0.0, 3.0])] * 4)
    for res in results:
        assert res["decided"] == {"skewed": "group", "even": "group"}, res["decisions"]
        assert res["decisions"] == results[0]["decisions"]
        rows = res["divergence"]["skewed"]
        assert [r["group"] for r in rows] == [0, 1]
        assert all(r["rounds"] == 5 for r in rows)
        # After the decision both layers reduce over groups: 2 group forward rounds per step.
        assert res["after"] == {"node": 0, "group": 6, "global": 0, "shadow": 0}, res["after"]


# --- auto scope ------------------------------------------------------------------------------

def test_auto_scope_decides_per_layer_the_same_on_every_rank_after_the_default_warmup(
        two_by_two):
    results = two_by_two.call(cases.auto_decides_per_layer, [("auto", None)] * 4)
    first = results[0]
    for res in results:
        # During the warm-up (50 forward rounds by default) both layers run in shadow scope.
        assert res["during"] == {"skewed": "shadow", "even": "shadow"}
        # "skewed" sees inputs offset by node (mean shift ~0.8 global standard deviations):
        # global. "even" sees node-normalized inputs: node.
        assert res["decided"] == {"skewed": "global", "even": "node"}, res["decisions"]
        assert res["decisions"] == first["decisions"]  # every number, on every rank
        assert res["decision_round"] == {"node": 0, "group": 0, "global": 2, "shadow": 0}
        assert res["after"] == {"node": 3, "group": 0, "global": 3, "shadow": 0}
    d = first["decisions"]
    assert d["skewed"]["rounds"] == 50 and d["even"]["rounds"] == 50
    assert d["skewed"]["decided_at"] == 50
    assert d["skewed"]["mean_shift"] > 0.5
    assert d["even"]["mean_shift"] < 1e-6 and d["even"]["log_var_ratio"] < 1e-3
    # The decision comes from the root's record, which divergence() shows.
    rows = first["divergence"]["skewed"]
    assert [r["node"] for r in rows] == [0, 1]
    assert max(r["mean_shift_avg"] for r in rows) == pytest.approx(d["skewed"]["mean_shift"])


def test_auto_decisions_survive_a_state_dict_and_it_loads_into_plain_batchnorm(two_by_two):
    saved = two_by_two.call(cases.auto_decides_per_layer, [("auto-save", 4)] * 4)
    expected = {"skewed": "global", "even": "node"}
    assert all(res["decided"] == expected for res in saved)
    resumed = two_by_two.call(cases.resume_from_state,
                              [(saved[r]["state"], "auto-resume") for r in range(4)])
    for res in resumed:
        assert res["loaded"] == expected     # known before the first step
        assert res["scopes"] == expected
        # No warm-up: every forward round went straight to the decided scope.
        assert res["rounds"] == {"node": 3, "group": 0, "global": 3, "shadow": 0}
        assert res["decisions"]["skewed"]["scope"] == "global"
        assert res["decisions"]["skewed"]["decided_at"] == -1   # restored, not decided here
        assert res["reverted_types"] == ["BatchNorm2d", "Net"]
        # Saved again, the restored decision travels on.
        sd = torch.load(io.BytesIO(res["saved_again"]))
        assert sd._metadata["skewed"]["hsbn_auto"]["scope"] == "global"


@pytest.mark.parametrize("kwargs, words", [
    ({"auto_warmup": 0}, "auto_warmup must be an int >= 1"),
    ({"auto_warmup": 2.5}, "auto_warmup must be an int >= 1"),
    ({"auto_max_mean_shift": -0.1}, "auto_max_mean_shift must be a finite number >= 0"),
    ({"auto_max_log_var_ratio": float("nan")}, "auto_max_log_var_ratio must be a finite"),
    ({"auto_recheck_every": -1}, "auto_recheck_every must be an int >= 0"),
    ({"group_nodes": -2}, "group_nodes must be a non-negative int"),
])
def test_bad_auto_and_group_parameters_are_refused_naming_them(kwargs, words):
    with pytest.raises(hsbn.ConfigurationError, match=words):
        hsbn.torch.SyncBatchNorm(3, scope="auto", **kwargs)
    with pytest.raises(hsbn.ConfigurationError, match=words):
        hsbn.torch.convert_sync_batchnorm(torch.nn.BatchNorm2d(3), scope="auto", **kwargs)


def test_a_loaded_decision_says_decided_at_minus_one():
    bn = hsbn.torch.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3)),
                                           scope="auto", name="loaded")
    sd = bn.state_dict()
    sd._metadata["0"]["hsbn_auto"] = {"scope": "global", "mean_shift": 0.3,
                                      "log_var_ratio": 0.01, "rounds": 50, "decided_at": 50}
    bn.load_state_dict(sd)
    assert hsbn.torch.auto_decisions(bn)["0"]["decided_at"] == -1
    assert hsbn.torch.auto_decisions(bn)["0"]["mean_shift"] == 0.3
    assert hsbn.torch.scopes(bn) == {"0": "global"}


def test_a_bad_saved_decision_fails_load_state_dict():
    bn = hsbn.torch.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3)),
                                           scope="auto", name="bad")
    sd = bn.state_dict()
    sd._metadata["0"]["hsbn_auto"] = {"scope": "sideways"}
    with pytest.raises(RuntimeError, match="'sideways'"):
        bn.load_state_dict(sd)
    assert hsbn.torch.scopes(bn) == {"0": "shadow"}
