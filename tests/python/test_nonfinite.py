"""Mixed precision: a non-finite incoming gradient on one rank must reach every rank of the
scope as non-finite gradients, and nobody raises, so that every rank's GradScaler skips the
step together (as with torch.nn.SyncBatchNorm). Non-finite values are data, not protocol
errors (docs/PROTOCOL.md, DESIGN.md "Failure semantics").

Real aggregators: 2 nodes x 2 workers; rank 1 (node 0) injects +Inf into channel 1 of its
incoming gradient. Over both transports of the node's rounds ([shm], [grpc]: transports.py)."""

import pytest

import hsbn
import torch_path_cases
from workerpool import WorkerPool

C = 3


@pytest.fixture(scope="module")
def workers():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=30000) as cl:
        pool = WorkerPool(cl)
        try:
            yield pool
        finally:
            pool.close()


@pytest.fixture(scope="module")
def pool(workers, transport):
    yield workers.use_transport(transport)
    workers.check_transport()


def _run(pool, scope):
    return pool.call(torch_path_cases.step_with_inf_gradient,
                     [(scope, C, 1, 40) for _ in range(pool.world_size)])


def test_inf_gradient_on_one_rank_reaches_every_rank_in_global_scope_and_none_raises(pool):
    results = _run(pool, "global")
    assert [r["raised"] for r in results] == [None] * 4
    for r in results:
        # The backward round sums sum_dy of channel 1 over all ranks: +Inf everywhere, so
        # channel 1 of every rank's input gradient is non-finite; the other channels are not.
        assert r["dx"] == [True, False, True], r
    # Weight and bias gradients are each rank's own share: non-finite on rank 1 only.
    assert [r["db"][1] for r in results] == [True, False, True, True]


def test_inf_gradient_stays_within_its_node_in_node_scope(pool):
    results = _run(pool, "node")
    assert [r["raised"] for r in results] == [None] * 4
    assert [r["dx"] for r in results] == [[True, False, True]] * 2 + [[True, True, True]] * 2
