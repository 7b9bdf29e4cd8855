"""LocalCluster's group tier (group_tier=True): a group aggregator per group_nodes consecutive
nodes between their sidecars and the root, each level's link delayed by its own proxy. Asserted
through real processes: group rounds are answered by the group aggregators and never cross a
group aggregator's link to the root; global rounds cross both levels; `hsbn status --upstream`
shows the tree; the arguments are checked."""

import threading

import numpy as np
import pytest

import hsbn
import hsbn.cluster
from hsbn import cli


def _rounds(clients, scope, first_seq, n, channels=2):
    errors, out = [], {}

    def work(r, client):
        try:
            for i in range(n):
                out[(r, i)] = client.forward(0, first_seq + i, scope, 2,
                                             np.array([float(r), 2.0]), np.array([1.0, 1.0]))
        except BaseException as e:  # reported by the test thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(r, c)) for r, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


def test_group_rounds_stay_in_the_tier_and_global_rounds_cross_both_levels():
    with hsbn.cluster.LocalCluster(nodes=4, workers_per_node=1, group_nodes=2, group_tier=True,
                                   group_link_delay_us=200, link_delay_us=3000) as c:
        assert len(c.groups) == 2 and len(c.group_proxies) == 2
        clients = [hsbn.Client.from_env(c.worker_env(r)) for r in range(4)]
        try:
            _rounds(clients, "global", 0, 1)  # every level has joined
            for node in range(4):
                c.link_command(node, "stats-reset")
            before = [c.group_link_stats(g) for g in range(2)]
            out = _rounds(clients, "group", 10, 5)
            for (r, i), (count, mean, _) in out.items():
                # group g = nodes 2g, 2g+1 holding means 2g and 2g+1
                assert count == 4
                np.testing.assert_array_equal(mean, [2 * (r // 2) + 0.5, 2.0])
            for g in range(2):  # nothing but a keepalive ping crossed to the root
                after = c.group_link_stats(g)
                assert after["up_chunks"] - before[g]["up_chunks"] < 3, g
            for node in range(4):
                st = c.link_stats(node)
                # each group round crossed the node's link to its group aggregator, held >= 200 us
                assert st["up_chunks"] >= 5 and st["up_held_min_us"] >= 200, st
            out = _rounds(clients, "global", 20, 3)
            for (r, i), (count, mean, _) in out.items():
                assert count == 8
                np.testing.assert_array_equal(mean, [1.5, 2.0])
            for g in range(2):
                after = c.group_link_stats(g)
                assert after["up_chunks"] - before[g]["up_chunks"] >= 3, g
                assert after["up_held_min_us"] >= 3000, after

            # The tree, from a rank's sidecar up: node, group, root.
            st = cli.query_status(c.node_addresses[3], job_id=c.job_id, include_upstream=True)
            assert st["role"] == "node"
            assert st["upstream"]["role"] == "group"
            assert st["upstream"]["jobs"][0]["group"] == 1
            assert st["upstream"]["upstream"]["role"] == "root"
            assert st["upstream"]["upstream"]["jobs"][0]["memberNodes"] == 2
            text = "\n".join(cli._fmt_status(st))
            assert "serves group 1 (nodes 2-3)" in text
            assert "node 3 " in text and "group 1 " in text
        finally:
            for cl in clients:
                cl.close()


@pytest.mark.parametrize("kwargs, text", [
    (dict(nodes=4, group_tier=True), "group_tier=True needs group_nodes"),
    (dict(nodes=4, group_nodes=3), "group_nodes must be a positive int that divides nodes=4"),
    (dict(nodes=4, group_nodes=2, group_link_delay_us=100), "needs group_tier=True"),
    (dict(nodes=4, link_delay_ms=1, link_delay_us=1000), "not both"),
    (dict(nodes=4, link_delay_us=-1), "link_delay_us must be an int"),
    (dict(nodes=1, group_nodes=1, group_tier=True), "at least two nodes"),
])
def test_bad_group_tier_arguments_are_refused_before_anything_starts(kwargs, text):
    with pytest.raises(ValueError, match=text):
        hsbn.cluster.LocalCluster(**kwargs)


def test_worker_env_carries_the_group_size():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, group_nodes=2,
                                   group_tier=True) as c:
        assert c.worker_env(1, {})["HSBN_GROUP_NODES"] == "2"
        assert c.worker_env(1, {})["HSBN_ADDRESS"] == c.node_addresses[1]
