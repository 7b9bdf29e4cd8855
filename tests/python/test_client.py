"""hsbn.Client: construction from the environment, rounds, status, and the errors a user meets
first. The test process itself is the worker here (no PyTorch needed by Client). The tests that
make rounds run over both transports of the node's rounds ([shm], [grpc]: transports.py)."""

import operator
import socket
import time

import numpy as np
import pytest

import hsbn
import hsbn.cluster

LAYOUT = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
          "GROUP_RANK": "0", "HSBN_JOB_ID": "job"}


@pytest.fixture(scope="module")
def cluster():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, round_timeout_ms=10000) as c:
        yield c


def test_environment_without_torchrun_variables_says_what_is_missing():
    env = dict(LAYOUT)
    del env["LOCAL_RANK"], env["GROUP_RANK"]
    with pytest.raises(hsbn.ConfigurationError, match="lacks LOCAL_RANK, GROUP_RANK.*torchrun"):
        hsbn.Client.from_env(env)


@pytest.mark.parametrize("change,complaint", [
    ({"RANK": "4"}, r"RANK=4 is outside \[0, WORLD_SIZE=4\)"),
    ({"WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=2 must be positive and divide WORLD_SIZE=3"),
    ({"LOCAL_RANK": "2"}, r"LOCAL_RANK=2 is outside \[0, LOCAL_WORLD_SIZE=2\)"),
    ({"GROUP_RANK": "2"}, r"GROUP_RANK=2 is outside \[0, 2\)"),
    ({"GROUP_RANK": "1"}, r"RANK=1 but GROUP_RANK\*LOCAL_WORLD_SIZE\+LOCAL_RANK=3"),
    ({"RANK": "one"}, "RANK='one' is not an integer"),
])
def test_inconsistent_environment_is_refused_before_connecting(change, complaint):
    with pytest.raises(hsbn.ConfigurationError, match=complaint):
        hsbn.Client.from_env(dict(LAYOUT, **change))


def test_missing_job_id_says_how_to_set_it():
    env = dict(LAYOUT)
    del env["HSBN_JOB_ID"]
    with pytest.raises(hsbn.ConfigurationError, match="HSBN_JOB_ID is not set"):
        hsbn.Client.from_env(env)
    # torchrun's rendezvous id stands in for it when there is one.
    with pytest.raises(hsbn.UnavailableError, match="no sidecar"):
        hsbn.Client.from_env(dict(env, TORCHELASTIC_RUN_ID="abc", HSBN_CONNECT_TIMEOUT_MS="100",
                                  HSBN_ADDRESS="unix:/nonexistent/hsbn.sock"))


def test_no_sidecar_at_a_unix_socket_fails_after_the_connect_timeout_naming_the_address():
    t0 = time.monotonic()
    with pytest.raises(hsbn.UnavailableError,
                       match="no sidecar at unix:/nonexistent/hsbn.sock.*hsbn-aggregator"):
        hsbn.Client.from_env(dict(LAYOUT, HSBN_ADDRESS="unix:/nonexistent/hsbn.sock",
                                  HSBN_CONNECT_TIMEOUT_MS="400"))
    waited = time.monotonic() - t0
    assert 0.35 < waited < 5.0  # it waited for the sidecar to appear, then gave up


def test_no_sidecar_at_a_tcp_address_fails_within_the_connect_timeout():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(hsbn.HsbnError, match="127.0.0.1:%d" % port) as info:
        hsbn.Client.from_env(dict(LAYOUT, HSBN_ADDRESS="127.0.0.1:%d" % port,
                                  HSBN_CONNECT_TIMEOUT_MS="1000"))
    assert time.monotonic() - t0 < 10.0
    assert info.value.code in (hsbn.errors.UNAVAILABLE, hsbn.errors.DEADLINE_EXCEEDED)


def test_a_lone_worker_gets_its_own_statistics_back_and_sees_itself_in_status(transport_env):
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1, root=False) as c:
        with hsbn.Client.from_env(c.worker_env(0)) as client:
            assert (client.rank, client.world_size, client.num_nodes) == (0, 1, 1)
            mean, m2 = np.array([1.5, -2.0, 0.25]), np.array([3.0, 0.5, 0.0])
            count, out_mean, out_m2 = client.forward(7, 0, "node", 6, mean, m2)
            assert count == 6
            np.testing.assert_array_equal(out_mean, mean)
            np.testing.assert_array_equal(out_m2, m2)
            count, s1, s2 = client.backward(7, 0, "node", 6, mean, m2)
            np.testing.assert_array_equal(s1, mean)
            assert client.stats().transport == transport_env
            status = client.status(include_upstream=False)
            jobs = {j["jobId"]: j for j in status["jobs"]}
            assert c.job_id in jobs
            assert int(jobs[c.job_id].get("roundsCompleted", 0)) == 2
        assert client.closed


def test_two_nodes_reduce_in_node_order_through_the_root(cluster, transport, transport_env):
    # Two clients in this process, one per node, each on its own thread (rounds block).
    import threading
    clients = [hsbn.Client.from_env(cluster.worker_env(r, job_id="two-nodes-" + transport))
               for r in range(2)]
    try:
        data = [(2, np.array([0.0, 1.0]), np.array([2.0, 0.0])),
                (4, np.array([3.0, 1.0]), np.array([4.0, 8.0]))]
        out = [None, None]

        def contribute(r):
            out[r] = clients[r].forward(0, 0, "global", *data[r])
        threads = [threading.Thread(target=contribute, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # Chan: n = 6, mean = (2*m0 + 4*m1)/6, m2 = m2_0 + m2_1 + d^2 * 2 * 4 / 6
        assert out[0][0] == out[1][0] == 6
        np.testing.assert_allclose(out[0][1], [2.0, 1.0], rtol=1e-15)
        np.testing.assert_allclose(out[0][2], [6.0 + 9.0 * 8 / 6, 8.0], rtol=1e-15)
        np.testing.assert_array_equal(out[0][1], out[1][1])  # bitwise identical everywhere
        np.testing.assert_array_equal(out[0][2], out[1][2])
        assert [c.stats().transport for c in clients] == [transport_env] * 2
    finally:
        for c in clients:
            c.close()


def test_workers_disagreeing_on_the_layout_are_refused(cluster):
    first = hsbn.Client.from_env(cluster.worker_env(0, job_id="layout-job"))
    try:
        # Wait until the sidecar lists the first worker as connected (its stream attached).
        deadline = time.monotonic() + 10
        while True:
            jobs = {j["jobId"]: j for j in first.status(include_upstream=False)["jobs"]}
            members = jobs.get("layout-job", {}).get("members", [])
            if any(m.get("connected") for m in members):
                break
            assert time.monotonic() < deadline, jobs
            time.sleep(0.01)
        # Same sidecar (node 0), same job, but a 2 x 2 layout where the first said 2 x 1.
        wrong = dict(cluster.worker_env(0, job_id="layout-job"), WORLD_SIZE="4",
                     LOCAL_WORLD_SIZE="2", LOCAL_RANK="1", GROUP_RANK="0", RANK="1")
        with pytest.raises(hsbn.HsbnError, match="(?i)world.?size|layout") as info:
            hsbn.Client.from_env(wrong)
        assert info.value.code in (hsbn.errors.INVALID_ARGUMENT,
                                   hsbn.errors.FAILED_PRECONDITION)
    finally:
        first.close()


def test_a_closed_client_says_so():
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1, root=False) as c:
        client = hsbn.Client.from_env(c.worker_env(0))
        client.close()
        client.close()
        with pytest.raises(hsbn.UnavailableError, match="closed"):
            client.forward(0, 0, "node", 1, [0.0], [0.0])


def test_local_cluster_run_returns_values_by_rank_and_reports_failures(cluster):
    assert cluster.run(operator.add, 2, 3, timeout=120) == [5, 5]
    with pytest.raises(hsbn.cluster.ClusterError,
                       match="(?s)2 of 2 workers failed.*rank 0.*ZeroDivisionError.*rank 1"):
        cluster.run(operator.truediv, 1, 0, timeout=120)


def test_worker_env_is_what_torchrun_would_set(cluster):
    env = cluster.worker_env(1, base={})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK")} == {"RANK": "1", "WORLD_SIZE": "2",
                                                   "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                                   "GROUP_RANK": "1"}
    assert env["HSBN_JOB_ID"] == cluster.job_id
    assert env["HSBN_ADDRESS"] == cluster.node_addresses[1] != cluster.node_addresses[0]
    with pytest.raises(ValueError, match="outside"):
        cluster.worker_env(2)


def test_a_wrong_library_path_is_named_in_the_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HSBN_LIBRARY", str(tmp_path / "nope.so"))
    with pytest.raises(hsbn.NativeNotFoundError, match="HSBN_LIBRARY=.*nope.so does not name"):
        hsbn.library_path()
    monkeypatch.setenv("HSBN_AGGREGATOR", str(tmp_path))
    with pytest.raises(hsbn.NativeNotFoundError, match="does not name a file"):
        hsbn.aggregator_path()


def test_python_m_hsbn_reports_the_native_parts():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "hsbn"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=120)
    text = out.stdout.decode()
    assert out.returncode == 0, text
    assert hsbn.library_path() in text and hsbn.aggregator_path() in text
    assert "BN kernels       CPU" in text


def test_keyword_overrides_stand_in_for_missing_layout_variables():
    env = {k: v for k, v in LAYOUT.items() if k != "GROUP_RANK"}
    with pytest.raises(hsbn.ConfigurationError, match="lacks GROUP_RANK"):
        hsbn.Client.from_env(env)
    # node_rank= supplies GROUP_RANK: the layout is complete and it goes on to connect.
    with pytest.raises(hsbn.UnavailableError, match="no sidecar"):
        hsbn.Client.from_env(dict(env, HSBN_ADDRESS="unix:/nonexistent/hsbn.sock",
                                  HSBN_CONNECT_TIMEOUT_MS="100"),
                             node_rank=int(LAYOUT["GROUP_RANK"]))
