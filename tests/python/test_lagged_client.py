"""Lagged scope through hsbn.Client with real aggregators (2 nodes x 2 workers): both phases
are answered with the node's statistics at once, and global_stats() / global_sums() then give
the job's, equal to a global round's and to the concatenated batch's, the same bits on every
rank. Over both transports of the node's rounds ([shm], [grpc]: transports.py)."""

import threading

import numpy as np
import pytest

import hsbn
import hsbn.cluster

C, N = 3, 6  # channels, values per channel per rank


@pytest.fixture(scope="module")
def cluster():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=10000) as c:
        yield c


def _data(rank, seq):
    rng = np.random.default_rng(1000 * seq + rank)
    node = rank // 2
    x = rng.normal(1.5 * node, 1.0 + 0.5 * node, size=(C, N))
    dy = rng.normal(0.2 * node, 1.0, size=(C, N))
    return x, dy


def _moments(x):
    mean = x.mean(axis=1)
    return mean, ((x - mean[:, None]) ** 2).sum(axis=1)


def _sums(x, dy, center):
    return dy.sum(axis=1), (dy * (x - center[:, None])).sum(axis=1)


def test_global_stats_and_global_sums_are_the_jobs_after_node_answers(cluster, transport,
                                                                      transport_env):
    seqs = 3
    clients = [hsbn.Client.from_env(cluster.worker_env(r, job_id="lagged-py-" + transport))
               for r in range(4)]
    got = [None] * 4
    errors = []

    def work(r):
        try:
            c, out = clients[r], []
            for seq in range(seqs):
                x, dy = _data(r, seq)
                mean, m2 = _moments(x)
                n_node, node_mean, node_m2 = c.forward(21, seq, "lagged", N, mean, m2)
                ref = c.forward(22, seq, "node", N, mean, m2)
                glob = c.forward(23, seq, "global", N, mean, m2)
                assert n_node == 2 * N and np.array_equal(node_mean, ref[1])
                # Backward sums around the node's mean (the protocol's contract).
                s_dy, s_dyxmu = _sums(x, dy, node_mean)
                nb = c.backward(21, seq, "lagged", N, s_dy, s_dyxmu)
                rb = c.backward(22, seq, "node", N, s_dy, s_dyxmu)
                assert nb[0] == rb[0] and np.array_equal(nb[1], rb[1])
                assert np.array_equal(nb[2], rb[2])
                g_dy, g_dyxmu = _sums(x, dy, glob[1])
                gb = c.backward(23, seq, "global", N, g_dy, g_dyxmu)
                late_f = c.global_stats(21, seq)
                late_b = c.global_sums(21, seq)
                assert c.global_sums_ready(21, seq)
                out.append((glob, gb, late_f, late_b))
            got[r] = out
        except Exception as e:  # reported below
            errors.append((r, e))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not errors, errors
        for seq in range(seqs):
            xs, dys = zip(*(_data(r, seq) for r in range(4)))
            x, dy = np.concatenate(xs, axis=1), np.concatenate(dys, axis=1)
            mean, m2 = _moments(x)
            want_dy, want_dyxmu = _sums(x, dy, mean)
            for r in range(4):
                glob, gb, (fc, fmean, fm2), (bc, bdy, bdyxmu) = got[r][seq]
                # Forward: a global round's bits; backward: its sum dy bit for bit and
                # sum dy (x - job mean) to round-off; both the concatenated batch's.
                assert fc == glob[0] == 4 * N
                assert np.array_equal(fmean, glob[1]) and np.array_equal(fm2, glob[2])
                assert bc == gb[0] == 4 * N
                assert np.array_equal(bdy, gb[1])
                np.testing.assert_allclose(bdyxmu, gb[2], rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(fmean, mean, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(fm2, m2, rtol=1e-12)
                np.testing.assert_allclose(bdy, want_dy, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(bdyxmu, want_dyxmu, rtol=1e-12, atol=1e-12)
                # Every rank: the same bits.
                assert np.array_equal(bdyxmu, got[0][seq][3][2])
                assert np.array_equal(fm2, got[0][seq][2][2])
        for c in clients:
            s = c.stats()
            assert s.get("lagged", "forward").completed == seqs
            assert s.get("lagged", "backward").completed == seqs
            assert s.global_stats.completed == 2 * seqs
            assert s.late_dropped == 0
            assert s.transport == transport_env
    finally:
        for c in clients:
            c.close()
