"""hsbn.torch.diagnose on a job you can run on one machine: 2 simulated nodes x 2 workers
(hsbn.cluster.LocalCluster: a root, two sidecars, four worker processes), a small CNN, and two
kinds of
data; four DDP training steps (SGD on a stand-in loss), then the doctor on the same batches:

  skewed  node 1's images are brighter (every input shifted by +1.5), 2 images of 8x8 per
          worker, trained in node scope: the doctor must say YES and recommend global;
  even    the same distribution on every node, 64 images of 8x8 per worker, plain (local)
          BatchNorm: the doctor must say NO.

  PYTHONPATH=client/python /usr/bin/python3 examples/doctor/demo.py [OUT]

Writes OUT/{skewed,even}.{txt,json,png} and OUT/machine.txt (default
examples/doctor/measured) and prints the reports. docs/PYTORCH.md ("Is my accuracy drop BatchNorm's fault?") quotes them.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import hsbn.cluster
import hsbn.torch

CASES = {"skewed": ("node", 2, 1.5), "even": ("local", 64, 0.0)}


def net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def worker(case):
    scope, batch, shift = CASES[case]
    rank = int(os.environ["RANK"])
    node = int(os.environ["GROUP_RANK"])
    torch.set_num_threads(1)
    model = hsbn.torch.convert_sync_batchnorm(net(), scope=scope, name="demo-" + case)
    data = torch.Generator().manual_seed(rank)
    batches = [torch.randn(batch, 3, 8, 8, generator=data) + shift * node for _ in range(4)]
    dist.init_process_group("gloo")
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for x in batches:     # a few training steps, so the running statistics have moved
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    report = hsbn.torch.diagnose(ddp, batches)       # every rank, at the same point
    dist.destroy_process_group()
    return report.as_dict() if rank == 0 else None


def main(out):
    os.makedirs(out, exist_ok=True)
    from hsbn.doctor import DoctorReport
    with open(os.path.join(out, "machine.txt"), "w") as f:
        f.write("%d CPU cores, 1-minute load average %.1f at the start, torch %s\n"
                % (os.cpu_count(), os.getloadavg()[0], torch.__version__))
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2) as cluster:
        for case in CASES:
            report = DoctorReport(cluster.run(worker, case)[0])
            report.save(os.path.join(out, case + ".json"))
            report.plot(os.path.join(out, case + ".png"))
            with open(os.path.join(out, case + ".txt"), "w") as f:
                f.write(report.text() + "\n")
            print("--- %s ---\n%s\n" % (case, report.text()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else
         os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured"))
