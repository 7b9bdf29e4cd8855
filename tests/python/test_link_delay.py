"""LocalCluster's simulated cross-node link (link_delay_ms / link_proxy): every sidecar reaches
the root through its own hsbn-linkproxy. What a round pays is read from the proxies' own
counters, never from a clock: global rounds cross each node's link up and down with every
chunk held at least the delay; node rounds do not cross it."""

import threading

import numpy as np
import pytest

import hsbn
import hsbn.cluster


def _rounds(cluster, clients, scope, first_seq, n):
    errors = []

    def work(client):
        try:
            for i in range(n):
                count, mean, _ = client.forward(0, first_seq + i, scope, 2,
                                                np.array([1.0, 2.0]), np.array([1.0, 1.0]))
                assert count == (2 * len(clients) if scope == "global" else 2)
                np.testing.assert_array_equal(mean, [1.0, 2.0])
        except BaseException as e:  # reported by the test thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_global_rounds_pay_the_link_delay_both_ways_and_node_rounds_do_not():
    delay, n = 30, 10
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, link_delay_ms=delay) as c:
        clients = [hsbn.Client.from_env(c.worker_env(r)) for r in range(2)]
        try:
            _rounds(c, clients, "global", 0, 1)  # the sidecars' links are up
            before = [c.link_stats(node) for node in range(2)]
            _rounds(c, clients, "node", 100, n)
            for node in range(2):
                after = c.link_stats(node)
                # at most a keepalive ping may cross while node rounds run
                assert after["up_chunks"] - before[node]["up_chunks"] < n // 2
                assert after["down_chunks"] - before[node]["down_chunks"] < n // 2
                c.link_command(node, "stats-reset")
            _rounds(c, clients, "global", 1, n)
            for node in range(2):
                st = c.link_stats(node)
                assert st["delay_up_ms"] == st["delay_down_ms"] == delay
                assert st["up_chunks"] >= n and st["down_chunks"] >= n, st
                assert st["up_held_min_us"] >= delay * 1000, st
                assert st["down_held_min_us"] >= delay * 1000, st
        finally:
            for cl in clients:
                cl.close()


def test_link_commands_are_checked_and_need_proxies():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, link_proxy=True) as c:
        assert c.link_stats(0)["delay_up_ms"] == 0
        assert c.link_command(1, "delay 5 7") == "delay up=5 down=7"
        assert c.link_stats(1)["delay_down_ms"] == 7
        with pytest.raises(hsbn.cluster.ClusterError, match="error"):
            c.link_command(0, "delay -3")
        with pytest.raises(ValueError):
            c.link_command(2, "stats")
        assert set(c.pids()) == {"root", "node0", "node1", "link0", "link1"}
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1) as c:
        with pytest.raises(hsbn.cluster.ClusterError, match="no link proxies"):
            c.link_stats(0)


@pytest.mark.parametrize("bad", [-1, 1.5, "10", 600001])
def test_a_bad_link_delay_is_refused(bad):
    with pytest.raises(ValueError, match="link_delay_ms"):
        hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, link_delay_ms=bad)


def test_the_proxy_binary_documents_its_commands_and_takes_them_on_stdin(tmp_path):
    import subprocess
    from hsbn import _lib
    binary = _lib.linkproxy_path()
    text = subprocess.run([binary, "--help"], capture_output=True, text=True, check=True).stdout
    for word in ("--target", "--listen", "--delay-ms", "--control", "--ready-file", "drop",
                 "reset", "stall", "resume", "delay UP [DOWN]", "stats", "stats-reset", "quit"):
        assert word in text, word
    bad = subprocess.run([binary, "--target=127.0.0.1:1", "--delay-ms=-4"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--delay-ms" in bad.stderr
    ready = tmp_path / "ready"
    p = subprocess.Popen([binary, "--target=127.0.0.1:1", "--ready-file=%s" % ready],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        p.stdin.write("delay 3\nstats\nbogus\n")
        p.stdin.flush()
        assert p.stdout.readline() == "ok delay up=3 down=3\n"
        stats = p.stdout.readline()
        assert stats.startswith("ok mode=forward ") and " delay_down_ms=3 " in stats
        assert p.stdout.readline().startswith("error unknown command")
        p.stdin.close()  # EOF on stdin ends the proxy
        assert p.wait(60) == 0
        assert ready.read_text().startswith("127.0.0.1:")
    finally:
        if p.poll() is None:
            p.kill()
