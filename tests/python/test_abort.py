"""Giving up on a job: Client.abort() and Ctrl-C in a round. Real processes: a worker process
blocked in a round whose other rank never contributes gets SIGINT and raises KeyboardInterrupt,
long before the round could end by itself (its deadline is 10 minutes), and the other rank's
next round fails at once naming it and why. Over both transports of the node's rounds ([shm],
[grpc]: transports.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import hsbn
import hsbn.cluster
from hsbn.cli import query_status

# Only an interrupt or an abort can end a round before this.
ROUND_TIMEOUT_MS = 600000
# The test's own limit on each wait below: reaching it means failure, not slowness.
GIVE_UP_S = 120

# Rank 0: joins, says so, then waits in a node round that rank 1 never joins.
CHILD = textwrap.dedent("""
    import signal, sys
    # Python's own Ctrl-C handling, as in a terminal, even when this test runs with SIGINT
    # ignored (a shell's background job inherits it ignored, and so would this child).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np
    import hsbn
    client = hsbn.Client.from_env(round_timeout_ms=%d)
    print("joined", flush=True)
    try:
        client.forward(5, 0, "node", 1, np.zeros(2), np.zeros(2))
    except KeyboardInterrupt:
        import traceback
        frames = [f.name for f in traceback.extract_tb(sys.exc_info()[2])]
        print("KeyboardInterrupt in", ",".join(frames), flush=True)
        sys.exit(3)
    print("the round ended without an interrupt", flush=True)
""" % ROUND_TIMEOUT_MS)


# Rank 0 again, but its round waits on another thread (as on autograd's device threads) while
# the main thread waits in Python: SIGINT's handler aborts the client, so that thread returns.
# With HOLD, the side thread stops between its contribution going out and its wait, until the
# main thread has handled SIGINT: the handler must find the round there too.
SIDE = textwrap.dedent("""
    import signal, sys, threading
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in CHILD
    import numpy as np
    import hsbn
    # One line per write, whole: print writes its text and its newline apart, so two threads
    # printing at once can share a line ("contributedjoined"), which the test never reads.
    out = threading.Lock()
    def say(*words):
        with out:
            print(*words, flush=True)
    client = hsbn.Client.from_env(round_timeout_ms=%d)
    gate = threading.Event()
    if len(sys.argv) > 1 and sys.argv[1] == "HOLD":
        start = client._lib.hsbn_round_start
        def held(*args):
            rc = start(*args)
            say("contributed")
            gate.wait()
            return rc
        client._lib.hsbn_round_start = held
    ended = threading.Event()
    def side():
        try:
            client.forward(5, 0, "node", 1, np.zeros(2), np.zeros(2))
        except hsbn.HsbnError as e:
            say("side thread:", e.reason)
        ended.set()
    threading.Thread(target=side, daemon=True).start()
    say("joined")
    try:
        ended.wait()
    except KeyboardInterrupt:
        gate.set()
        ended.wait(%d)
        say("main thread: KeyboardInterrupt; side thread ended:", ended.is_set())
        sys.exit(3)
""" % (ROUND_TIMEOUT_MS, GIVE_UP_S))


@pytest.fixture(scope="module")
def cluster():
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=2, root=False,
                                   round_timeout_ms=ROUND_TIMEOUT_MS) as c:
        yield c


def contributed(address, job_id, index):
    for job in query_status(address).get("jobs", []):
        if job.get("jobId") == job_id:
            for m in job.get("members", []):
                if int(m.get("index", 0)) == index:
                    return int(m.get("contributions", 0))
    return 0


def wait_for(predicate, what):
    """Polls a condition of another process (its contribution, as `hsbn status` shows it);
    running out of GIVE_UP_S is a failure."""
    deadline = time.monotonic() + GIVE_UP_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _read_until(child, word, seen):
    """Reads the child's lines into `seen` until one is `word`. A child that has not said it
    within GIVE_UP_S is killed, so that the test fails naming what it read instead of hanging
    in readline."""
    timer = threading.Timer(GIVE_UP_S, child.kill)
    timer.start()
    try:
        while word not in seen:
            line = child.stdout.readline()
            assert line, ("the child ended (or was killed after %d s) before it said %r: %s"
                          % (GIVE_UP_S, word, seen))
            seen.append(line.strip())
    finally:
        timer.cancel()


def test_sigint_in_a_round_raises_keyboard_interrupt_and_the_other_rank_learns_why(
        cluster, transport, transport_env):
    job = "sigint-" + transport
    env = cluster.worker_env(0, job_id=job)
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        assert child.stdout.readline().strip() == "joined"
        # Rank 1 joins (so that the node's transport is decided for both) but never
        # contributes to rank 0's round.
        with hsbn.Client.from_env(cluster.worker_env(1, job_id=job),
                                  round_timeout_ms=ROUND_TIMEOUT_MS) as other:
            wait_for(lambda: contributed(cluster.node_addresses[0], job, 0) > 0,
                     "rank 0 never contributed to its round")
            child.send_signal(signal.SIGINT)
            out, _ = child.communicate(timeout=GIVE_UP_S)
            assert child.returncode == 3, out
            # Raised from the wait itself, not before the round started.
            assert "KeyboardInterrupt in" in out and "_wait" in out, out
            # Rank 1's round fails at once (not at the 10-minute deadline), naming rank 0 and
            # why it is gone.
            with pytest.raises(hsbn.RoundFailedError) as e:
                other.forward(5, 0, "node", 1, np.zeros(2), np.zeros(2))
            assert (e.value.code_name, e.value.reason) == ("ABORTED", "MEMBER_ABORTED")
            assert "rank 0" in str(e.value) and "KeyboardInterrupt" in str(e.value), e.value
            assert other.stats().transport == transport_env
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_abort_from_another_thread_ends_a_wait_and_fails_the_other_rank_at_once(
        cluster, transport, transport_env):
    job = "abort-" + transport
    results = {}
    with hsbn.Client.from_env(cluster.worker_env(0, job_id=job),
                              round_timeout_ms=ROUND_TIMEOUT_MS) as a, \
            hsbn.Client.from_env(cluster.worker_env(1, job_id=job),
                                 round_timeout_ms=ROUND_TIMEOUT_MS) as b:
        # One good round on both ranks: the node's transport is decided and in use.
        both = [threading.Thread(target=lambda c=c: c.forward(1, 0, "node", 1, np.ones(2),
                                                             np.zeros(2))) for c in (a, b)]
        for t in both:
            t.start()
        for t in both:
            t.join(GIVE_UP_S)
        assert a.stats().transport == b.stats().transport == transport_env

        def blocked():
            try:
                a.forward(1, 1, "node", 1, np.ones(2), np.zeros(2))
            except hsbn.HsbnError as e:
                results["a"] = e
        waiter = threading.Thread(target=blocked)
        waiter.start()
        wait_for(lambda: contributed(cluster.node_addresses[0], job, 0) > 1,
                 "rank 0 never contributed to its second round")
        a.abort("the loss diverged")
        waiter.join(GIVE_UP_S)
        assert not waiter.is_alive()
        assert results["a"].code_name == "ABORTED" and "the loss diverged" in str(results["a"])
        assert results["a"].reason == "CLIENT_ABORTED"
        # Later rounds of the aborted client fail at once too.
        with pytest.raises(hsbn.RoundFailedError, match="the loss diverged"):
            a.forward(1, 2, "node", 1, np.ones(2), np.zeros(2))
        # Rank 1 learns at once, with the reason.
        with pytest.raises(hsbn.RoundFailedError) as e:
            b.forward(1, 1, "node", 1, np.ones(2), np.zeros(2))
        assert "rank 0" in str(e.value) and "the loss diverged" in str(e.value), e.value
        assert e.value.reason == "MEMBER_ABORTED"


@pytest.mark.parametrize("hold", [False, True], ids=["waiting", "contributed"])
def test_sigint_aborts_a_round_that_waits_on_another_thread(cluster, transport, transport_env,
                                                             hold):
    job = "sigint-side-%s-%s" % (transport, hold)
    child = subprocess.Popen([sys.executable, "-c", SIDE] + (["HOLD"] if hold else []),
                             env=cluster.worker_env(0, job_id=job), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        _read_until(child, "joined", seen)
        with hsbn.Client.from_env(cluster.worker_env(1, job_id=job),
                                  round_timeout_ms=ROUND_TIMEOUT_MS):
            wait_for(lambda: contributed(cluster.node_addresses[0], job, 0) > 0,
                     "rank 0 never contributed to its round")
            if hold:  # the side thread is held there now
                _read_until(child, "contributed", seen)
            child.send_signal(signal.SIGINT)
            out, _ = child.communicate(timeout=GIVE_UP_S)
        assert child.returncode == 3, out
        assert "side thread: CLIENT_ABORTED" in out, out
        assert "side thread ended: True" in out, out
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
