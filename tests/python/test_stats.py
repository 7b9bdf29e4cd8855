"""Client.stats(): rounds completed and failed and seconds blocked in them, per scope and phase,
after real rounds through real aggregators; reset_stats(); and the same numbers reached from a
model converted with hsbn.torch.convert_sync_batchnorm. Over both transports of the node's
rounds ([shm], [grpc]: transports.py)."""

import threading
import time

import numpy as np
import pytest

import hsbn
import hsbn.cluster


@pytest.fixture(scope="module")
def cluster():
    # Two nodes of one worker: node rounds stay at each sidecar, global/shadow go to the root.
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, round_timeout_ms=10000) as c:
        yield c


def _in_threads(fns):
    errors = []

    def wrap(fn):
        try:
            fn()
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_counts_rounds_per_scope_and_phase_time_blocked_failures_and_reset(cluster, transport,
                                                                          transport_env):
    clients = [hsbn.Client.from_env(cluster.worker_env(r, job_id="stats-" + transport))
               for r in range(2)]
    try:
        fresh = clients[0].stats()
        assert isinstance(fresh, hsbn.ClientStats)
        assert fresh.total == hsbn.RoundStats()
        assert set(fresh.rounds) == {(s, p)
                                     for s in ("node", "global", "shadow", "group", "renorm",
                                               "lagged")
                                     for p in ("forward", "backward")}
        mean, m2 = np.array([1.0, 2.0, 3.0]), np.array([0.5, 0.5, 0.5])
        n_node, n_global, n_shadow, n_renorm, delay = 6, 4, 3, 2, 0.3
        wall = [0.0, 0.0]

        def work(r):
            c = clients[r]
            t0 = time.perf_counter()
            for i in range(n_node):
                c.forward(0, i, "node", 4, mean, m2)
            for i in range(n_global):
                if r == 1 and i == 1:
                    time.sleep(delay)  # rank 0 waits for rank 1 in this round
                c.forward(1, i, "global", 4, mean, m2)
                c.backward(1, i, "global", 4, mean, m2)
            for i in range(n_shadow):
                c.forward(2, i, "shadow", 4, mean, m2)
            for i in range(n_renorm):
                c.forward(3, i, "renorm", 4, mean, m2)
                c.backward(3, i, "renorm", 4, mean, m2)
                count, gmean, _ = c.global_stats(3, i)
                assert count == 8 and np.array_equal(gmean, mean)
            wall[r] = time.perf_counter() - t0
        _in_threads([lambda: work(0), lambda: work(1)])

        for r, c in enumerate(clients):
            s = c.stats()
            assert s.get("node", "forward").completed == n_node
            assert s.get("node", "backward") == hsbn.RoundStats()
            assert s.get("global", "forward").completed == n_global
            assert s.get("global", "backward").completed == n_global
            assert s.get("global").completed == 2 * n_global
            assert s.get("shadow", "forward").completed == n_shadow
            assert s.get("renorm", "forward").completed == n_renorm
            assert s.get("renorm", "backward").completed == n_renorm
            assert s.global_stats.completed == n_renorm and s.global_stats.failed == 0
            assert 0 <= s.global_stats_waited <= n_renorm
            assert s.get(phase="backward").completed == n_global + n_renorm
            assert s.total.completed == n_node + 2 * n_global + n_shadow + 2 * n_renorm
            assert s.total.failed == 0
            assert s.transport == transport_env
            for key in (("node", "forward"), ("global", "forward"), ("global", "backward"),
                        ("shadow", "forward")):
                x = s.rounds[key]
                assert 0 < x.max_blocked_seconds <= x.blocked_seconds, (r, key, x)
            # Blocked time is measured inside the calls, so within the wall time around them.
            assert 0 < s.total.blocked_seconds <= wall[r]
            assert s.elapsed_seconds >= wall[r]
            assert s.bytes_sent >= s.total.completed * 2 * 3 * 8
            assert s.bytes_received >= s.total.completed * 2 * 3 * 8
        # Rank 0 sat in one global forward round while rank 1 slept.
        assert clients[0].stats().get("global", "forward").max_blocked_seconds >= delay / 2

        d = clients[0].stats().as_dict()
        assert d["global"]["backward"]["completed"] == n_global
        assert "local" not in d and d["bytes_sent"] > 0

        # A round refused by the sidecar (a negative sum of squares) counts as failed.
        with pytest.raises(hsbn.InvalidArgumentError, match=r"m2\[1\]"):
            clients[0].forward(0, 100, "node", 4, mean, np.array([1.0, -1.0, 1.0]))
        s = clients[0].stats()
        assert s.get("node", "forward").failed == 1
        assert s.get("node", "forward").completed == n_node
        assert s.total.failed == 1

        clients[0].reset_stats()
        z = clients[0].stats()
        assert z.total == hsbn.RoundStats()
        assert z.global_stats == hsbn.RoundStats() and z.global_stats_waited == 0
        assert z.bytes_sent == z.bytes_received == 0
        assert z.elapsed_seconds < 5
        clients[0].forward(0, 101, "node", 4, mean, m2)
        z = clients[0].stats()
        assert z.total.completed == z.get("node", "forward").completed == 1
        # The other client kept its counts.
        assert clients[1].stats().total.completed == n_node + 2 * n_global + n_shadow + 2 * n_renorm
        with pytest.raises(hsbn.ConfigurationError, match="scope must be"):
            z.get("local")
    finally:
        for c in clients:
            c.close()
    with pytest.raises(hsbn.UnavailableError, match="closed"):
        clients[0].stats()


def test_a_round_past_its_deadline_is_counted_failed_with_its_wait(cluster, transport,
                                                                   transport_env):
    # Rank 1 never comes: rank 0's global round fails at the client's deadline.
    with hsbn.Client.from_env(cluster.worker_env(0, job_id="stats-deadline-" + transport),
                              round_timeout_ms=500) as c:
        t0 = time.perf_counter()
        with pytest.raises(hsbn.DeadlineExceededError):
            c.backward(0, 0, "global", 2, np.ones(2), np.ones(2))
        waited = time.perf_counter() - t0
        s = c.stats().get("global", "backward")
        assert (s.completed, s.failed) == (0, 1)
        assert 0.5 <= s.blocked_seconds <= waited
        assert c.stats().transport == transport_env


def test_stats_from_a_converted_model(transport_env):
    import torch
    import hsbn.torch

    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1, root=False) as one:
        with hsbn.Client.from_env(one.worker_env(0)) as client:
            torch.manual_seed(0)

            def build():
                return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4),
                                           torch.nn.ReLU(), torch.nn.Linear(4, 3),
                                           torch.nn.BatchNorm1d(3))
            model = hsbn.torch.convert_sync_batchnorm(build(), scope="global", client=client,
                                                      layer_scopes={"4": "node"})
            assert hsbn.torch.model_client(model) is client
            steps = 3
            for _ in range(steps):
                model(torch.randn(8, 5)).square().sum().backward()
            s = hsbn.torch.stats(model)
            assert s.rounds == client.stats().rounds
            for scope in ("global", "node"):
                assert s.get(scope, "forward").completed == steps
            # The layer check at the first step is one more backward (summation) round, in the
            # widest scope of the model.
            assert s.get("global", "backward").completed == steps + 1
            assert s.get("node", "backward").completed == steps
            assert s.get("shadow").rounds == 0
            assert s.total.failed == 0 and s.total.blocked_seconds > 0
            assert s.transport == transport_env

            # A model whose layers use the default client reaches that one.
            hsbn.set_default_client(client)
            try:
                other = hsbn.torch.convert_sync_batchnorm(build(), scope="shadow")
                assert hsbn.torch.model_client(other) is client
                client.reset_stats()
                model(torch.randn(8, 5))
                other(torch.randn(8, 5))
                s = hsbn.torch.stats(other)
                assert s.get("shadow", "forward").completed == 2
                assert s.get("global", "forward").completed == 1
                assert s.get("node", "forward").completed == 1
            finally:
                hsbn.set_default_client(None)

            # Local layers make no rounds and need no client.
            local = hsbn.torch.convert_sync_batchnorm(build(), scope="local")
            assert hsbn.torch.model_client(local) is None
            assert hsbn.torch.stats(local) == hsbn.ClientStats.empty()


def test_stats_say_how_the_nodes_rounds_travel(transport, transport_env):
    # Shared memory where the node can use it (every local rank offers it), else the stream,
    # with the same results either way. The library reads HSBN_TRANSPORT from the process.
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=2) as c:
        envs = [c.worker_env(r, job_id="transport-" + transport) for r in range(2)]
        clients = [hsbn.Client.from_env(e) for e in envs]
        try:
            out = [None, None]

            def work(r):
                mean = np.array([1.0 + r, 2.0, 3.0])
                out[r] = clients[r].forward(0, 0, "node", 4, mean, np.array([0.5, 0.5, 0.5]))
            _in_threads([lambda: work(0), lambda: work(1)])
            for r in range(2):
                s = clients[r].stats()
                assert s.transport == transport_env, s.transport
                assert s.as_dict()["transport"] == transport_env
                assert s.get("node", "forward").completed == 1
            assert out[0][0] == 8
            assert np.array_equal(out[0][1], out[1][1])
            assert out[0][1][0] == 1.5
        finally:
            for cl in clients:
                cl.close()
