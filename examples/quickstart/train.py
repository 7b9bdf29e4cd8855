"""A plain PyTorch DDP trainer whose BatchNorm is synchronized by hsbn: the three lines marked
`# hsbn` are all it adds. One command runs it (README.md, "Use it in your script"):

    hsbn run --nproc_per_node 2 train.py                        # one node, 2 workers
    hsbn run --simulate-nodes 2 --nproc_per_node 2 train.py     # 2 simulated nodes x 2 workers

It trains a small CNN a few steps on synthetic 12x12 images, each rank its own batch, shifted
by the rank so that the ranks' BatchNorm statistics differ, and every rank prints one line:

    rank R/W node N: bn1 running mean after step 1: [m0, m1, m2, m3]; loss A -> B

After the first step a BatchNorm layer's running mean is 0.1 x the mean of its input over the
batch it normalized with: with scope "global" the whole job's batch, the same on every rank
(tests/python/test_launch.py checks it against that computation).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import hsbn.torch                                                                # hsbn

BATCH, CHANNELS = 8, 4


def make_model():
    """The model, with the same initial weights on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, CHANNELS, 3, padding=1), nn.BatchNorm2d(CHANNELS), nn.ReLU(),
        nn.Conv2d(CHANNELS, CHANNELS, 3, stride=2, padding=1), nn.BatchNorm2d(CHANNELS),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, 10))


def batch(rank, step):
    """Rank `rank`'s images and labels at `step`: the label brightens the image a little, the
    rank shifts it by `rank`."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    x = torch.randn(BATCH, 1, 12, 12, generator=g) * 0.5 + 0.1 * y.view(-1, 1, 1, 1) + rank
    return x, y


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--scope", default="global", help="local, node or global (default global)")
    args = p.parse_args()
    # A GPU per worker when there are enough, else the CPU (every rank must choose the same).
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = make_model().to(device)
    model = hsbn.torch.convert_sync_batchnorm(model, scope=args.scope)           # hsbn
    model = nn.parallel.DistributedDataParallel(
        model, device_ids=[local_rank] if cuda else None,
        broadcast_buffers=False)                                                 # hsbn
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(args.steps):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            mean1 = model.module[1].running_mean.tolist()
    print("rank %d/%d node %s: bn1 running mean after step 1: [%s]; loss %.4f -> %.4f"
          % (rank, world, os.environ.get("GROUP_RANK", "?"),
             ", ".join("%.6f" % m for m in mean1), losses[0], losses[-1]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
