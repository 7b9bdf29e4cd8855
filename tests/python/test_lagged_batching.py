"""A sidecar holds a job's lagged partials until their pass ends and sends them as one batch
(--lagged-hold-ms, server/pass_batcher.h), with real aggregators and link proxies (2 nodes x 2
workers): what crosses the link per step falls from a message per layer to about one per pass,
the late results are the same bits as with every partial sent at once, and a partial whose pass
never ends (nothing else comes) still leaves, so a wait for its result ends."""

import numpy as np
import pytest

import hsbn
import hsbn.cluster

C, LAYERS, STEPS = 4, 16, 10


def _train(steps, layers):
    """Each rank: `steps` training steps of `layers` lagged layers, forwards 0..L-1 then
    backwards L-1..0, each call after the first step asking for its previous call's late
    result (as the lagged layer does). Returns the late results, in order."""
    c = hsbn.Client.from_env()
    rng = np.random.default_rng(7 + c.rank)
    late = []
    for seq in range(steps):
        for op in range(layers):
            x = rng.normal(c.node_rank, 1.0, size=(C, 5))
            mean, m2 = x.mean(axis=1), ((x - x.mean(axis=1)[:, None]) ** 2).sum(axis=1)
            c.forward(op, seq, "lagged", 5, mean, m2)
            if seq > 0:
                late.append(c.global_stats(op, seq - 1, C))
        for op in reversed(range(layers)):
            dy = rng.normal(0.0, 1.0, size=(C, 5))
            c.backward(op, seq, "lagged", 5, dy.sum(axis=1), dy.sum(axis=1) * 0.5)
            if seq > 0:
                late.append(c.global_sums(op, seq - 1, C))
    # The last step's results too: nothing comes after its backward pass but this wait.
    for op in range(layers):
        late.append(c.global_stats(op, steps - 1, C))
        late.append(c.global_sums(op, steps - 1, C))
    c.close()
    return [(n, a.tobytes(), b.tobytes()) for n, a, b in late]


def _run(hold_ms):
    args = [] if hold_ms is None else ["--lagged-hold-ms=%d" % hold_ms]
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, link_proxy=True,
                                   round_timeout_ms=20000, aggregator_args=args) as cluster:
        # Everything a sidecar sends its parent crosses its proxy: joins, names, partials.
        before = [cluster.link_stats(n)["up_chunks"] for n in range(2)]
        results = cluster.run(_train, STEPS, LAYERS, timeout=300)
        after = [cluster.link_stats(n)["up_chunks"] for n in range(2)]
    return results, [a - b for a, b in zip(after, before)]


@pytest.fixture(scope="module")
def held():
    # Held with a backstop far beyond the run, so that a loaded machine's slow passes still
    # leave once per pass (the default 50 ms would send a long pass in pieces: fine for the
    # service, not for counting).
    return _run(60000)


@pytest.fixture(scope="module")
def at_once():
    return _run(0)


def test_held_partials_cross_the_link_about_once_per_pass(held):
    results, up_chunks = held
    partials = 2 * LAYERS * STEPS  # lagged partials each sidecar forwards
    for node, chunks in enumerate(up_chunks):
        # Two passes a step: about 2 * STEPS writes, plus the job's join and the first step's
        # passes; a write per partial would be `partials`. Chunks are the proxy's reads, which
        # can only merge writes, never split a small one.
        assert chunks <= partials // 3, (node, chunks, partials)
    for rank_late in results:
        assert len(rank_late) == 2 * LAYERS * STEPS


def test_late_results_are_the_same_bits_held_or_sent_at_once(held, at_once):
    assert len(held[0]) == len(at_once[0]) == 4
    for late_held, late_now in zip(held[0], at_once[0]):
        assert late_held == late_now
    # Every rank of the job holds the same bits.
    for rank_late in held[0][1:]:
        assert rank_late == held[0][0]


def _exact_calls(calls):
    """Each call waits for its own late result at once, as a lagged layer's exact call does:
    nothing else of the job comes to end the pass, so only the wait can send the partial."""
    c = hsbn.Client.from_env()
    rng = np.random.default_rng(3 + c.rank)
    out = []
    for seq in range(calls):
        x = rng.normal(c.node_rank, 1.0, size=(C, 5))
        mean, m2 = x.mean(axis=1), ((x - x.mean(axis=1)[:, None]) ** 2).sum(axis=1)
        c.forward(1, seq, "lagged", 5, mean, m2)
        late = c.global_stats(1, seq, C)
        glob = c.forward(2, seq, "global", 5, mean, m2)
        out.append((late[0] == glob[0], np.array_equal(late[1], glob[1]),
                    np.array_equal(late[2], glob[2])))
        dy = rng.normal(0.0, 1.0, size=(C, 5))
        c.backward(1, seq, "lagged", 5, dy.sum(axis=1), dy.sum(axis=1) * 0.5)
        n, sum_dy, _ = c.global_sums(1, seq, C)
        out.append((n == glob[0], bool(np.isfinite(sum_dy).all()), True))
    transport = c.stats().transport
    c.close()
    return out, transport


def test_a_wait_for_a_held_round_sends_it(transport, transport_env):
    # A hold of a minute and a round timeout of 20 s: a wait that did not send the held partial
    # would fail with DEADLINE_EXCEEDED instead of returning the job's statistics.
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=20000,
                                   aggregator_args=["--lagged-hold-ms=60000"]) as cluster:
        results = cluster.run(_exact_calls, 4, timeout=300)
    for rank, (checks, used) in enumerate(results):
        assert used == transport_env
        assert len(checks) == 8
        for check in checks:
            assert check == (True, True, True), (rank, checks)


def test_a_wait_on_a_stream_that_broke_says_the_result_is_lost_without_reconnecting(
        transport, transport_env):
    # A lagged round held at node 0's sidecar, which then restarts: the round's result is lost
    # with the held partial, and the wait says so at once (UNAVAILABLE, the stream broke), not
    # at the round timeout; its LateWanted is never sent on a new stream.
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, round_timeout_ms=20000,
                                   aggregator_args=["--lagged-hold-ms=60000"]) as cluster:
        clients = [hsbn.Client.from_env(cluster.worker_env(r, job_id="broke-" + transport))
                   for r in range(2)]
        try:
            mean, m2 = np.zeros(C), np.ones(C)
            for c in clients:  # one worker per node: each node round completes at once
                c.forward(1, 0, "lagged", 5, mean, m2)
            assert clients[0].stats().transport == transport_env
            cluster.restart_sidecar(0)
            with pytest.raises(hsbn.UnavailableError, match="broke"):
                clients[0].global_stats(1, 0, C)
        finally:
            for c in clients:
                c.close()
