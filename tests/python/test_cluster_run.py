"""LocalCluster.run as a new user meets it: results that are tensors come back (not shared
memory of an exited worker), and a script without the `__main__` guard is told so at once."""

import subprocess
import sys

import torch

import cluster_cases
import hsbn.cluster

SCRIPT = """
import torch
import hsbn.cluster


def work():
    return torch.ones(2) * 21

{body}
"""
BODY = """with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=2) as cluster:
    print("sum", float(sum(t.sum() for t in cluster.run(work))))
"""


def test_run_returns_tensors_by_rank():
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=2) as cluster:
        out = cluster.run(cluster_cases.tensors_of_rank, timeout=240)
    assert [r["rank"] for r in out] == [0, 1]
    for rank, r in enumerate(out):
        assert torch.equal(r["full"], torch.full((3,), float(rank)))
        assert torch.equal(r["nested"][0], torch.arange(4, dtype=torch.float64) * rank)


def _script(tmp_path, body):
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT.format(body=body))
    return subprocess.run([sys.executable, str(path)], cwd=str(tmp_path), timeout=240,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_script_with_the_main_guard_gets_its_tensors(tmp_path):
    guarded = 'if __name__ == "__main__":\n' + "".join(
        "    " + line + "\n" for line in BODY.splitlines())
    proc = _script(tmp_path, guarded)
    assert proc.returncode == 0, proc.stderr
    assert "sum 84.0" in proc.stdout


def test_a_script_without_the_main_guard_is_told_what_to_add(tmp_path):
    proc = _script(tmp_path, BODY)
    assert proc.returncode == 1
    assert "hsbn.cluster.ClusterError" in proc.stderr, proc.stderr
    assert 'must sit under `if __name__ == "__main__":`' in proc.stderr, proc.stderr
    assert "user_script.py" in proc.stderr
    assert "EOFError" not in proc.stderr and "FileNotFoundError" not in proc.stderr
