"""torchrun: 2 simulated nodes, each under its own torchrun agent and each with its sidecar
(a LocalCluster: root plus 2 sidecars), 2 workers per node; global scope with torchrun's static
rendezvous, node scope with its c10d rendezvous. The workers' outputs, gradients and running
statistics must be BatchNorm's over the scope's concatenated batch.

The command line is the one docs/PYTORCH.md gives. It works on PyTorch 1.13 and 2.x alike:
underscore spellings (--nproc_per_node; 1.13 refuses --nproc-per-node), and --redirects 1
--tee 1, without which Debian's 1.13 on Python 3.11 fails with "AttributeError: 'NoneType'
object has no attribute 'get'" (Std.from_str("0") is None there: IntFlag no longer lists 0)."""

import json
import os
import re
import socket
import subprocess
import sys
import uuid

import numpy as np
import pytest

import hsbn.cluster
from bnref import assert_group_matches, make_spec
from torchrun_support import needs_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "torchrun_trainer.py")
NODES, PER_NODE = 2, 2


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(node, rendezvous, port, job_id):
    """One node's torchrun command line: `python -m torch.distributed.run` is torchrun for the
    Python running the tests."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=%d" % NODES,
           "--nproc_per_node=%d" % PER_NODE, "--redirects", "1", "--tee", "1"]
    if rendezvous == "static":
        cmd += ["--node_rank=%d" % node, "--master_addr=127.0.0.1", "--master_port=%d" % port]
    else:
        cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:%d" % port,
                "--rdzv_id=%s" % job_id]
    return cmd


@needs_torchrun
@pytest.mark.parametrize("scope,rendezvous", [("global", "static"), ("node", "c10d")])
def test_two_nodes_each_under_its_own_torchrun_agent(tmp_path, scope, rendezvous):
    spec, data = make_spec(scope, "float64", seed=11)
    sizes = [len(steps[0][0]) for steps in data]
    arrays = {"steps": len(data[0]), "C": spec["C"], "weight": spec["weight"],
              "bias": spec["bias"]}
    for r, steps in enumerate(data):
        for s, (x, g) in enumerate(steps):
            arrays["x_%d_%d" % (r, s)] = x
            arrays["g_%d_%d" % (r, s)] = g
    data_path = str(tmp_path / "data.npz")
    np.savez(data_path, **arrays)
    job_id = "torchrun-%s-%s" % (scope, uuid.uuid4().hex[:8])
    port = _free_port()
    with hsbn.cluster.LocalCluster(nodes=NODES, workers_per_node=PER_NODE,
                                   round_timeout_ms=60000) as cluster:
        agents = []
        for node in range(NODES):
            env = dict(os.environ)
            env["HSBN_ADDRESS"] = cluster.node_addresses[node]
            if rendezvous == "static":
                env["HSBN_JOB_ID"] = job_id  # static rendezvous has no run id
            else:
                env.pop("HSBN_JOB_ID", None)  # the job id is torchrun's --rdzv_id
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
                env.pop(k, None)
            log = open(str(tmp_path / ("agent%d.log" % node)), "wb")
            agents.append((subprocess.Popen(
                torchrun_command(node, rendezvous, port, job_id)
                + [TRAINER, data_path, str(tmp_path), scope],
                env=env, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT), log))
        codes = []
        for proc, log in agents:
            try:
                codes.append(proc.wait(timeout=300))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        logs = "\n".join(open(str(tmp_path / ("agent%d.log" % n))).read() for n in range(NODES))
        assert codes == [0, 0], logs + "\n" + "\n".join(cluster.logs().values())
        node_log = "\n".join(cluster.logs()[name] for name in ("node0", "node1"))
    results = []
    for r in range(NODES * PER_NODE):
        saved = np.load(str(tmp_path / ("rank%d.npz" % r)))
        steps = len(data[0])
        results.append({key: [saved["%s_%d" % (key, s)] for s in range(steps)]
                        for key in ("y", "dx", "dw", "db")})
        results[-1].update(running_mean=saved["running_mean"], running_var=saved["running_var"])
        with open(str(tmp_path / ("rank%d.json" % r))) as f:
            info = json.load(f)
        assert info["client"]["rank"] == r and info["client"]["num_nodes"] == NODES
        assert info["env"]["GROUP_RANK"] == str(r // PER_NODE)
        assert info["client"]["job_id"] == job_id, info
    groups = [[0, 1, 2, 3]] if scope == "global" else [[0, 1], [2, 3]]
    assert_group_matches(results, spec, data, groups, 1e-10)
    assert sizes[2] == 0  # an empty worker took part
    # Every worker left at its normal exit: no sidecar saw a crash.
    left = re.findall(r"job '%s': rank \d \([^)]*\) left;" % re.escape(job_id), node_log)
    assert len(left) == NODES * PER_NODE, node_log
    assert "disconnected" not in node_log, node_log
