"""Failure semantics seen from PyTorch: a peer process killed in the middle of a step makes the
others raise a Python exception that names the missing rank, within seconds (long before the
round's deadline)."""

import os
import signal
import time

import pytest

import hsbn.cluster
import hsbn_cases
from workerpool import WorkerPool

ROUND_TIMEOUT_MS = 60000


@pytest.fixture(scope="module")
def pool():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2,
                                   round_timeout_ms=ROUND_TIMEOUT_MS) as cluster:
        workers = WorkerPool(cluster)
        try:
            yield workers
        finally:
            workers.close()


def test_killed_peer_makes_the_others_raise_naming_its_rank_within_seconds(pool):
    # One good step first, so that every rank is a live member of the job.
    assert all(r["raised"] is None
               for r in pool.call(hsbn_cases.forward_round_timed, [(3,)] * 4, timeout=60))
    victim = 3
    pids = pool.call(hsbn_cases.pid, [()] * 4)
    pool.send([(hsbn_cases.forward_round_timed, (3,))] * 3 + [(hsbn_cases.hang_then_die, ())])
    time.sleep(1.0)  # ranks 0-2 are now waiting in the round for rank 3
    t_kill = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    answers = pool.gather(ranks=[0, 1, 2], timeout=ROUND_TIMEOUT_MS / 1000.0 / 2)
    elapsed = time.monotonic() - t_kill
    for rank, (ok, value) in sorted(answers.items()):
        assert ok, value
        assert value["is_hsbn"], "rank %d raised %s: %s" % (rank, value["raised"],
                                                             value["message"])
        assert "rank 3" in value["message"] or "ranks 3" in value["message"] \
            or "rank=3" in value["message"], "rank %d: %s" % (rank, value["message"])
    assert elapsed < 10.0, "the others learned of the death after %.1f s" % elapsed
