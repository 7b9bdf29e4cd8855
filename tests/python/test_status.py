"""`hsbn status`: an operator reads an aggregator's Status without joining a job, against real
aggregator processes — a sidecar serving two jobs, a root with two sidecars, and a sidecar with
job tokens, where the operator sees only the job whose token it presents."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hsbn
from hsbn import cluster as hc


def hsbn_status(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hsbn", "status"] + list(args),
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))


def status_json(*args, env=None):
    p = hsbn_status("--json", *args, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture
def sidecar(tmp_path):
    """A node aggregator on a Unix socket, started with extra flags."""
    started = []

    def start(*flags):
        agg = hc._Aggregator("node0", [os.environ["HSBN_AGGREGATOR"], "--role=node",
                                       "--listen=unix:%s/node0.sock" % tmp_path] + list(flags),
                             str(tmp_path))
        agg.start()
        started.append(agg)
        agg.wait_ready(time.monotonic() + 30)
        return agg.addresses[0]
    yield start
    for agg in started:
        agg.stop()


def member(address, job, token=None):
    """A one-worker job at `address` that has completed one node round (mean [1, 2])."""
    c = hsbn.Client(address, job, 0, 1, 0, 1, 0, token=token)
    n, _, _ = c.forward(0, 0, "node", 3, np.array([1.0, 2.0]), np.array([0.5, 0.5]))
    assert n == 3
    return c


def test_status_lists_every_job_of_a_sidecar_without_joining_one(sidecar):
    address = sidecar()
    a, b = member(address, "job-a"), member(address, "job-b")
    try:
        st = status_json("--address", address)
        assert st["role"] == "node" and st["aggregatorId"] == "node0"
        jobs = {j["jobId"]: j for j in st["jobs"]}
        assert sorted(jobs) == ["job-a", "job-b"]
        for j in jobs.values():
            # The operator's query is not a member: one worker each, connected, one round.
            assert [(m["rank"], m["connected"], int(m["contributions"])) for m in j["members"]] \
                == [(0, True, 1)]
            assert (int(j["roundsCompleted"]), int(j["roundsFailed"]), int(j["openRounds"])) \
                == (1, 0, 0)
        one = status_json("--address", address, "--job", "job-b")
        assert [j["jobId"] for j in one["jobs"]] == ["job-b"]
        text = hsbn_status("--address", address)
        assert text.returncode == 0, text.stderr
        assert "aggregator node0  role node" in text.stdout
        assert "job job-a  world 1  nodes 1  members 1/1  open rounds 0  completed 1  failed 0" \
            in text.stdout
        assert "rank 0   connected contributions 1" in text.stdout
        # HSBN_ADDRESS is the default address, as for workers.
        assert [j["jobId"] for j in status_json(env={"HSBN_ADDRESS": address})["jobs"]] \
            == ["job-a", "job-b"]
    finally:
        a.close()
        b.close()


def test_status_of_a_root_and_of_a_sidecar_with_its_upstream():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, job_id="two-nodes") as cl:
        results = [None, None]

        def worker(rank):
            c = hsbn.Client.from_env(env=cl.worker_env(rank))
            results[rank] = (c, c.forward(0, 0, "global", 2 + rank, np.array([float(rank)]),
                                          np.array([1.0])))
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        try:
            assert [r[1][0] for r in results] == [5, 5]
            root = status_json("--address", cl.root_address)
            assert root["role"] == "root"
            [job] = root["jobs"]
            assert (job["jobId"], job["numNodes"], job["worldSize"]) == ("two-nodes", 2, 2)
            assert [(m["index"], m["connected"]) for m in job["members"]] == [(0, True), (1, True)]
            assert int(job["roundsCompleted"]) == 1
            side = status_json("--address", cl.node_addresses[1], "--upstream")
            assert side["role"] == "node" and side["upstream"]["role"] == "root"
            assert [j["jobId"] for j in side["upstream"]["jobs"]] == ["two-nodes"]
        finally:
            for r in results:
                if r:
                    r[0].close()


def test_status_shows_lagged_forward_records_until_their_backward_and_late_results_due():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, job_id="lagged-status") as cl:
        clients = [hsbn.Client.from_env(env=dict(cl.worker_env(r), HSBN_TRANSPORT="grpc"))
                   for r in range(2)]
        errors = []

        def both(fn):
            def run(r):
                try:
                    fn(clients[r], r)
                except Exception as e:  # reported below
                    errors.append(e)
            threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors

        try:
            # A lagged forward, its late result fetched: every aggregator completed it and
            # keeps what its backward needs.
            both(lambda c, r: (c.forward(5, 0, "lagged", 2, np.array([float(r)]), np.array([1.0])),
                               c.global_stats(5, 0)))
            for address in (cl.node_addresses[0], cl.root_address):
                [job] = status_json("--address", address)["jobs"]
                assert int(job.get("laggedForwards", 0)) == 1, job
                assert int(job.get("lateDue", 0)) == 0, job
            text = hsbn_status("--address", cl.node_addresses[0]).stdout
            assert "lagged forward records 1" in text, text
            # Its backward, and that late result: nothing is kept any more.
            both(lambda c, r: (c.backward(5, 0, "lagged", 2, np.array([1.0]), np.array([0.0])),
                               c.global_sums(5, 0)))
            for address in (cl.node_addresses[0], cl.root_address):
                [job] = status_json("--address", address)["jobs"]
                assert int(job.get("laggedForwards", 0)) == 0, job
            assert "lagged forward records" not in hsbn_status(
                "--address", cl.node_addresses[0]).stdout
        finally:
            for c in clients:
                c.close()


def test_status_names_the_address_where_nothing_answers(tmp_path):
    p = hsbn_status("--address", "unix:%s/none.sock" % tmp_path)
    assert p.returncode == 1
    assert "UNAVAILABLE" in p.stderr and "unix:%s/none.sock" % tmp_path in p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize("address, says", [
    ("127.0.0.1:99999", "--address=127.0.0.1:99999: the port must be a number from 1 to 65535"),
    ("127.0.0.1:0", "--address=127.0.0.1:0: the port must be a number from 1 to 65535"),
    ("/run/hsbn/hsbn.sock", "--address=/run/hsbn/hsbn.sock is a path: a Unix socket is written "
                            "--address=unix:/run/hsbn/hsbn.sock"),
    ("notaport", "--address=notaport has no port"),
    ("::1:7070", "--address=::1:7070: an IPv6 address goes in brackets"),
    ("unix:", "--address=unix: names no socket"),
])
def test_status_refuses_an_address_that_cannot_be_meant_before_connecting(address, says):
    # gRPC would wrap port 99999 to 34463 and take a path for a host name to resolve.
    p = hsbn_status("--address", address)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("hsbn status: " + says), p.stderr


def test_status_names_HSBN_ADDRESS_when_the_address_came_from_it():
    p = hsbn_status(env={"HSBN_ADDRESS": "/tmp/hsbn.sock"})
    assert p.returncode == 2, p.stderr
    assert ("HSBN_ADDRESS=/tmp/hsbn.sock is a path: a Unix socket is written "
            "HSBN_ADDRESS=unix:/tmp/hsbn.sock") in p.stderr, p.stderr


def test_with_tokens_status_shows_only_the_job_whose_token_it_presents(sidecar, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("job-a secret-a\njob-b secret-b\n")
    os.chmod(str(tokens), 0o600)
    token_a = tmp_path / "token-a"
    token_a.write_text("secret-a\n")
    address = sidecar("--token-file=%s" % tokens)
    a, b = member(address, "job-a", "secret-a"), member(address, "job-b", "secret-b")
    try:
        p = hsbn_status("--json", "--address", address, "--job", "job-a",
                        "--token-file", str(token_a))
        assert p.returncode == 0, p.stderr
        assert [j["jobId"] for j in json.loads(p.stdout)["jobs"]] == ["job-a"]
        # The same token from HSBN_TOKEN, as workers pass it.
        st = status_json("--address", address, "--job", "job-a", env={"HSBN_TOKEN": "secret-a"})
        assert [j["jobId"] for j in st["jobs"]] == ["job-a"]
        # Another job's token, or none: the other tenant's job is never shown.
        for args, env in ((["--job", "job-b", "--token-file", str(token_a)], {}),
                          (["--job", "job-b"], {}),
                          ([], {}),
                          ([], {"HSBN_TOKEN": "secret-a"})):
            p = hsbn_status("--json", "--address", address, *args, env=env)
            assert "job-b" not in p.stdout, (args, p.stdout)
            if p.returncode == 0:
                assert [j["jobId"] for j in json.loads(p.stdout)["jobs"]] in ([], ["job-a"])
            else:
                assert p.returncode == 1 and p.stdout == ""
                assert re.search(r"\b(UNAUTHENTICATED|PERMISSION_DENIED|INVALID_ARGUMENT)\b",
                                 p.stderr), p.stderr
    finally:
        a.close()
        b.close()
