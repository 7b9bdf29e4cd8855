"""HSBN_DEBUG=INFO: a real worker process says on stderr what its client does, one line each,
prefixed with its rank (the join and its answer, the node's transport and why, the layer check,
slow rounds); without it, the client prints nothing."""

import subprocess
import sys
import textwrap

import pytest

import hsbn.cluster

# One converted model's training step: a join, the layer check, node rounds.
WORKER = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import hsbn.torch
    model = hsbn.torch.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), scope="node")
    model(torch.randn(4, 3)).sum().backward()
    print("done", flush=True)
""")


@pytest.fixture(scope="module")
def cluster():
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1, root=False) as c:
        yield c


def run_worker(cluster, job, **env):
    worker_env = cluster.worker_env(0, job_id=job)
    worker_env.pop("HSBN_DEBUG", None)
    worker_env.pop("HSBN_DEBUG_SLOW_MS", None)
    worker_env.update(env)
    p = subprocess.run([sys.executable, "-c", WORKER], env=worker_env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "done", p.stderr
    return [line for line in p.stderr.splitlines() if line.startswith("hsbn[")]


def test_debug_info_tells_the_join_the_transport_the_layer_check_and_slow_rounds(cluster):
    lines = run_worker(cluster, "debug-info", HSBN_DEBUG="INFO", HSBN_DEBUG_SLOW_MS="0")
    text = "\n".join(lines)
    assert all(line.startswith("hsbn[rank 0] ") for line in lines), text
    assert any("joining job 'debug-info'" in line for line in lines), text
    assert any(line.startswith("hsbn[rank 0] joined: 1 node(s)") for line in lines), text
    assert any("node rounds travel by" in line for line in lines), text
    assert any("layer check of model" in line for line in lines), text
    # HSBN_DEBUG_SLOW_MS=0: every round counts as slow.
    assert any("waited" in line and "forward" in line for line in lines), text


def test_without_hsbn_debug_the_client_prints_nothing(cluster):
    assert run_worker(cluster, "debug-off") == []
