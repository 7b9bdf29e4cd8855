"""Errors carry their reason as a value (HsbnError.reason, hsbn.h's hsbn_reason names), end to end
from the aggregator or the node's shared memory to Python, so programs branch on code and
reason, never on the message's text. Over both transports of the node's rounds."""

import numpy as np
import pytest

import hsbn
import hsbn.cluster


@pytest.fixture(scope="module")
def cluster():
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=2, root=False,
                                   round_timeout_ms=300) as c:
        yield c


def test_a_round_that_times_out_says_timed_out(cluster, transport, transport_env):
    job = "timeout-" + transport
    with hsbn.Client.from_env(cluster.worker_env(0, job_id=job)) as a, \
            hsbn.Client.from_env(cluster.worker_env(1, job_id=job)):
        with pytest.raises(hsbn.DeadlineExceededError) as e:
            a.forward(1, 0, "node", 1, np.ones(2), np.zeros(2))  # rank 1 never comes
        assert e.value.reason == "TIMED_OUT", e.value


def test_a_join_with_another_layout_says_layout(cluster):
    env = cluster.worker_env(0, job_id="layouts")
    with hsbn.Client.from_env(env):
        other = dict(cluster.worker_env(1, job_id="layouts"), WORLD_SIZE="4",
                     LOCAL_WORLD_SIZE="4")
        with pytest.raises(hsbn.InvalidArgumentError) as e:
            hsbn.Client.from_env(other)
        assert e.value.reason == "LAYOUT", e.value


def test_the_library_names_every_reason():
    lib = hsbn._lib.lib()
    names = [lib.hsbn_reason_string(i).decode() for i in range(19)]
    assert names[0] == "UNSPECIFIED" and names[3] == "MEMBER_ABORTED"
    assert names[17] == "CLIENT_ABORTED" and names[18] == "SHUTTING_DOWN"
    assert lib.hsbn_reason_string(999) == b"UNSPECIFIED"
