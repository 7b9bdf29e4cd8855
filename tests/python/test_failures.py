"""Failure semantics seen from PyTorch: a peer process killed in the middle of a step makes the
others raise a Python exception that names the missing rank, within seconds (long before the
round's deadline). Over both transports of the node's rounds ([shm], [grpc]: transports.py); the
workers killed over one are started afresh for the other."""

import os
import signal
import time

import pytest

import hsbn_cases
from hsbn.cli import query_status
from workerpool import on_transport, started

ROUND_TIMEOUT_MS = 15000  # well above the 10 s the tests allow for noticing a death


@pytest.fixture(scope="module")
def workers():
    with started(nodes=2, workers_per_node=2, round_timeout_ms=ROUND_TIMEOUT_MS) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool(workers, transport):
    yield from on_transport(workers, transport)


def contributions(address, job_id):
    """(rank 2's contributions at node 1's sidecar, node 0's contributions at the root), read
    as an operator does (hsbn status: no job joined; a member's own status shows its job only)."""
    st = query_status(address, include_upstream=True)

    def members(status):
        for job in status.get("jobs", []):
            if job.get("jobId") == job_id:
                return {int(m.get("index", 0)): int(m.get("contributions", 0))
                        for m in job.get("members", [])}
        return {}
    return members(st).get(0, 0), members(st.get("upstream") or {}).get(0, 0)


def wait_until_contributed(observer, job_id, before, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        now = contributions(observer, job_id)
        if now[0] > before[0] and now[1] > before[1]:
            return
        assert time.monotonic() < deadline, "ranks 0-2 did not contribute: %s" % (now,)
        time.sleep(0.02)


def test_killed_peer_makes_the_others_raise_naming_its_rank_within_seconds(pool):
    # One good step first, so that every rank is a live member of the job.
    assert all(r["raised"] is None
               for r in pool.call(hsbn_cases.forward_round_timed, [(3,)] * 4, timeout=60))
    victim = 3
    pids = pool.call(hsbn_cases.pid, [()] * 4)
    job_id = pool.call(hsbn_cases.client_info, [()] * 4)[0]["job_id"]
    # Node 1's sidecar (and through it the root) is watched without joining anything.
    observer = pool.cluster.node_addresses[1]
    before = contributions(observer, job_id)
    pool.send([(hsbn_cases.forward_round_timed, (3,))] * 3 + [(hsbn_cases.hang_then_die, ())])
    # Kill rank 3 once ranks 0-2 are waiting in the round for it: rank 2 has contributed at
    # node 1 and node 0's partial has reached the root.
    wait_until_contributed(observer, job_id, before)
    t_kill = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    answers = pool.gather(ranks=[0, 1, 2], timeout=ROUND_TIMEOUT_MS / 1000.0 + 30)
    elapsed = time.monotonic() - t_kill
    for rank, (ok, value) in sorted(answers.items()):
        assert ok, value
        assert value["is_hsbn"], "rank %d raised %s: %s" % (rank, value["raised"],
                                                             value["message"])
        assert "rank 3" in value["message"] or "ranks 3" in value["message"] \
            or "rank=3" in value["message"], "rank %d: %s" % (rank, value["message"])
    assert elapsed < 10.0, "the others learned of the death after %.1f s" % elapsed


def test_a_round_after_a_peer_died_fails_at_once_naming_it(pool):
    # Runs after the test above: rank 3 is dead, ranks 0-2 start a new step.
    # The sidecar sees the killed process's socket close before the kernel reaps it: wait for
    # the exit itself.
    pool.procs[3].join(30)
    assert pool.procs[3].exitcode is not None, "needs the previous test's dead rank 3"
    pool.send([(hsbn_cases.forward_round_timed, (3,))] * 3)
    answers = pool.gather(ranks=[0, 1, 2], timeout=ROUND_TIMEOUT_MS / 1000.0 + 30)
    for rank, (ok, value) in sorted(answers.items()):
        assert ok, value
        assert value["is_hsbn"] and "rank 3" in value["message"], (rank, value)
        assert value["seconds"] < 10.0, "rank %d waited %.1f s: %s" % (
            rank, value["seconds"], value["message"])


def test_a_sidecar_stopped_between_rounds_is_named_on_every_rank(transport_env):
    # The usual moment of a pod roll or `systemctl restart`: the ranks compute between rounds.
    # Each rank's next call raises UnavailableError with the sidecar's own words and reason
    # SHUTTING_DOWN at once: with a 60 s connect timeout, a call that waited for a new process
    # instead would end with another message (and a minute later).
    import threading

    import numpy as np

    import hsbn

    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=2, root=False) as c:
        clients = [hsbn.Client.from_env(dict(c.worker_env(r), HSBN_CONNECT_TIMEOUT_MS="60000"))
                   for r in range(2)]
        try:
            def rounds(seq):
                out = [None, None]

                def one(r):
                    try:
                        out[r] = clients[r].forward(1, seq, "node", 4, np.full(2, r + 1.0),
                                                    np.ones(2))
                    except hsbn.HsbnError as e:
                        out[r] = e
                threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                return out

            first = rounds(0)
            assert all(not isinstance(o, Exception) for o in first), first
            assert first[0][1][0] == 1.5  # the node's mean
            assert clients[0].stats().transport == transport_env
            assert c.stop_sidecar(0) == 0
            took = []
            for r in range(2):
                t0 = time.monotonic()
                with pytest.raises(hsbn.UnavailableError) as info:
                    clients[r].forward(1, 1, "node", 4, np.ones(2), np.ones(2))
                took.append(time.monotonic() - t0)
                assert info.value.reason == "SHUTTING_DOWN", info.value
                assert "sidecar node0 is shutting down (SIGTERM)" in str(info.value)
                assert "Restart the job from its last checkpoint" in str(info.value)
            print("between-rounds stop named after %s s" % ["%.3f" % t for t in took])
            # A new process on the address: the call after the failure rejoins it.
            c.restart_sidecar(0)
            again = rounds(2)
            assert all(not isinstance(o, Exception) for o in again), again
            assert again[1][1][0] == 1.5
        finally:
            for client in clients:
                client.close()


@pytest.mark.parametrize("parent", ["root", "group"])
def test_a_parent_stopped_between_rounds_is_named_at_the_next_global_round(parent):
    # The root (or a group aggregator) stops politely while the ranks compute: the next global
    # round fails on every rank with its words and reason SHUTTING_DOWN, after a short wait
    # for a restarted one (not the 5 s connect timeout, whose message would differ).
    import threading

    import numpy as np

    import hsbn

    tier = dict(group_tier=True, group_nodes=2) if parent == "group" else {}
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, **tier) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r)) for r in range(2)]
        try:
            def rounds(seq):
                out = [None, None]

                def one(r):
                    try:
                        out[r] = clients[r].forward(1, seq, "global", 4, np.full(2, r + 1.0),
                                                    np.ones(2))
                    except hsbn.HsbnError as e:
                        out[r] = e
                threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                return out

            first = rounds(0)
            assert all(not isinstance(o, Exception) for o in first), first
            assert first[0][1][0] == 1.5
            (c.root if parent == "root" else c.groups[0]).stop()
            words = ("aggregator root is shutting down (SIGTERM)" if parent == "root" else
                     "group aggregator group0 is shutting down (SIGTERM)")
            for r, e in enumerate(rounds(1)):
                assert isinstance(e, hsbn.UnavailableError), (r, e)
                assert e.reason == "SHUTTING_DOWN", (r, e)
                assert words in str(e), (r, str(e))
        finally:
            for client in clients:
                client.close()
