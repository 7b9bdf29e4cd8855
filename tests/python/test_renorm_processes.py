"""Scope "renorm" with real processes: one LocalCluster (2 nodes x 2 workers: a root, two
sidecars) and four worker processes, over both node transports. Outputs, input gradients, the
node-summed weight and bias gradients and the running statistics equal the one-process renorm
formula (test_renorm_math.reference: the node's concatenated batch, normalized toward the job's
concatenated batch of the previous call); every rank holds the same running statistics and a
rerun gives the same bits."""

import numpy as np
import pytest

import hsbn_cases
from bnref import NODES, WORKERS_PER_NODE, make_spec, rel_err
from test_renorm_math import reference
from workerpool import on_transport, started

NODE_RANKS = [[n * WORKERS_PER_NODE + w for w in range(WORKERS_PER_NODE)] for n in range(NODES)]
TOL = 1e-10


@pytest.fixture(scope="module")
def workers():
    with started(nodes=NODES, workers_per_node=WORKERS_PER_NODE, round_timeout_ms=30000) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool(workers, transport):
    yield from on_transport(workers, transport)


def run_case(pool, spec, data):
    return pool.call(hsbn_cases.bn_steps, [(spec, data[r]) for r in range(pool.world_size)])


def renorm_case(seed, **renorm):
    # Rank 2 has an empty batch; rank 3 four samples (with two, BatchNorm's dx is 0 up to
    # round-off and says little).
    spec, data = make_spec("renorm", "float64", steps=4, seed=seed, sizes=[3, 5, 0, 4])
    # The limits test_renorm_math.reference() assumes: these tests' own, not the defaults.
    spec["renorm"] = dict({"renorm_r_max": 3.0, "renorm_d_max": 5.0}, **renorm)
    return spec, data


def test_renorm_equals_the_formula_over_the_node_batch_with_the_jobs_statistics(pool):
    spec, data = renorm_case(31, renorm_warmup=0, renorm_ramp=0)
    results = run_case(pool, spec, data)
    for node in range(NODES):
        ref = reference(spec, data, node, warmup=0, ramp=0)
        for s in range(len(data[0])):
            for r in NODE_RANKS[node]:
                for key in ("y", "dx"):
                    e = rel_err(results[r][key][s], ref[key][r][s])
                    assert e <= TOL, "%s of rank %d step %d: %.3g" % (key, r, s, e)
            for key in ("dw", "db"):
                total = sum(results[r][key][s] for r in NODE_RANKS[node])
                e = rel_err(total, ref[key][s])
                assert e <= TOL, "%s of node %d step %d: %.3g" % (key, node, s, e)
        # The correction is real at step 1 on: the nodes' data differ.
        r_, d_ = ref["rd"][1]
        assert np.all(np.abs(r_ - 1.0) > 1e-3) and np.all(np.abs(d_) > 1e-2)
        for r in NODE_RANKS[node]:
            assert rel_err(results[r]["running_mean"], ref["running_mean"]) <= TOL
            assert rel_err(results[r]["running_var"], ref["running_var"]) <= TOL
    # Running statistics come from the job's statistics only: the same bits on every rank.
    for r in range(1, 4):
        assert results[r]["running_mean"].tobytes() == results[0]["running_mean"].tobytes()
        assert results[r]["running_var"].tobytes() == results[0]["running_var"].tobytes()


def test_a_rerun_gives_the_same_bits_and_warmup_is_node_scope(pool):
    spec, data = renorm_case(32, renorm_warmup=2, renorm_ramp=3)
    first = run_case(pool, spec, data)
    again = run_case(pool, spec, data)
    for r in range(4):
        for key in ("y", "dx", "dw", "db"):
            for s in range(len(data[0])):
                assert first[r][key][s].tobytes() == again[r][key][s].tobytes(), (key, r, s)
        assert first[r]["running_mean"].tobytes() == again[r]["running_mean"].tobytes()
    # The same data in node scope: the warm-up steps (0 and 1) are node scope bit for bit, the
    # later ones are not.
    node_spec = dict(spec, scope="node")
    node_spec.pop("renorm")
    node = run_case(pool, node_spec, data)
    for r in (0, 1, 3):
        for s in (0, 1):
            assert first[r]["y"][s].tobytes() == node[r]["y"][s].tobytes(), (r, s)
        assert first[r]["y"][3].tobytes() != node[r]["y"][3].tobytes(), r


def test_a_layer_whose_op_ran_another_scope_before_warms_up_again(pool):
    # The same op first in node scope (a model rebuilt under the same layer names, or a scope
    # switched mid-run, continues the op's seq), then in renorm: its first calls warm up
    # (node scope, bit for bit) instead of asking for global statistics of node rounds, which
    # have none; later calls use the job's statistics of their own earlier renorm calls.
    op = 0x5eed0001
    spec, data = renorm_case(33, renorm_warmup=2, renorm_ramp=0)
    node_spec = dict(spec, scope="node")
    node_spec.pop("renorm")
    before = pool.call(hsbn_cases.bn_steps, [(node_spec, data[r], None, op) for r in range(4)])
    after = pool.call(hsbn_cases.bn_steps, [(spec, data[r], None, op) for r in range(4)])
    for r in (0, 1, 3):
        for s in (0, 1):
            assert after[r]["y"][s].tobytes() == before[r]["y"][s].tobytes(), (r, s)
        assert after[r]["y"][3].tobytes() != before[r]["y"][3].tobytes(), r
