"""examples/trainer/train.py, the trainer deploy/slurm/hsbn-job.sbatch runs by default, trains
under torchrun's environment on a real root and two sidecars (2 nodes x 1 worker, CPU)."""

import os
import re
import subprocess
import sys

import hsbn.cluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(REPO, "examples", "trainer", "train.py")


def test_the_sbatch_example_runs_a_trainer_that_exists():
    with open(os.path.join(REPO, "deploy", "slurm", "hsbn-job.sbatch")) as f:
        text = f.read()
    assert 'trainer="$HSBN_HOME/examples/trainer/train.py"' in text
    assert os.path.isfile(TRAINER)


def test_the_example_trainer_syncs_every_batchnorm_round_globally():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1) as cl:
        procs = [subprocess.Popen([sys.executable, TRAINER, "--steps", "3", "--batch", "4"],
                                  env=cl.worker_env(r), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        # 2 BatchNorm layers x (forward + backward) x 3 steps, and the layer check at the
        # model's first synchronized forward (docs/PYTORCH.md).
        m = re.search(r"rank %d done: (\d+) rounds, [0-9.]+ s blocked in them, (\d+) failed" % r,
                      out)
        assert m and (int(m.group(1)), int(m.group(2))) == (13, 0), out
    assert "step 2  loss" in outs[0]
