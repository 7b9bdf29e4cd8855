"""A small trainer to launch with torchrun, deploy/slurm/hsbn-job.sbatch or the Kubernetes
manifests: DDP over a small CNN on synthetic data, its BatchNorm layers synchronized by hsbn.
It needs the environment torchrun gives every worker (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) plus HSBN_JOB_ID and HSBN_ADDRESS, a
sidecar on every node and, for more than one node, a root (docs/DEPLOY.md). GPUs when CUDA is
available (NCCL), else CPUs (gloo).

  hsbn-aggregator --role=node --listen=unix:/tmp/hsbn.sock &
  torchrun --standalone --nproc_per_node=2 --redirects 1 --tee 1 \
      examples/trainer/train.py --steps 20 --scope global

That line works with PyTorch 1.13 and 2.x: 1.13's torchrun refuses the dashed spellings
(--nproc-per-node), and on Python 3.11 it needs --redirects 1 --tee 1 (docs/PYTORCH.md).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import hsbn.torch


def model(channels=16, classes=10):
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, stride=2), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8, help="images per worker and step")
    p.add_argument("--scope", default="global",
                   choices=["local", "node", "group", "global", "shadow", "auto"],
                   help="group needs HSBN_GROUP_NODES=K on every worker (docs/PYTORCH.md)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every worker
    net = hsbn.torch.convert_sync_batchnorm(model().to(device), scope=args.scope)
    net = nn.parallel.DistributedDataParallel(
        net, device_ids=[device.index] if cuda else None,
        broadcast_buffers=args.scope == "global")  # node/shadow/local keep their own statistics
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        x = torch.randn(args.batch, 3, 32, 32, generator=data).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=data).to(device)
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print("step %d  loss %.4f" % (step, loss.item()), flush=True)
    stats = hsbn.torch.stats(net.module).total
    print("rank %d done: %d rounds, %.3f s blocked in them, %d failed"
          % (rank, stats.completed, stats.blocked_seconds, stats.failed), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
