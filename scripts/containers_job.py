"""The trainer of scripts/containers.sh: one rank of a job, in a container, next to its node's
sidecar. A small CNN (three hsbn BatchNorm layers, fp64) runs STEPS forward and backward passes
on this rank's batches (a distribution of its own per node and rank), and every step is checked
against the reference: the same model with torch.nn.BatchNorm2d over the concatenated batch of
the scope's ranks (the node's for node scope, every rank's for global), which this process
rebuilds from the ranks' seeds. Checked to 1e-9 (relative): the output, the input gradient
(which the synchronized backward round gives) and every layer's running mean and variance.

    python3 containers_job.py --scope node|global [--steps N] [--expect-transport shm]
    python3 containers_job.py --scope node --forever   # rounds until it fails (the faults)
    python3 containers_job.py --scope node --hold-after 1   # waits for SIGUSR1 after step 1

It needs torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK),
HSBN_JOB_ID and HSBN_ADDRESS. It prints one line the caller reads, then exits:

    HSBN-JOB PASS rank=R scope=S steps=N max_err=E transport=T rounds=K
    HSBN-JOB FAIL rank=R scope=S step=N [after=T] error=TYPE: MESSAGE      (exit status 3)
    HSBN-JOB MISMATCH rank=R ... what=... err=...                 (exit status 4)

and, with --forever, "HSBN-JOB RUNNING rank=R" once its first step has passed. With --hold-after,
a failure after SIGUSR1 says after=T: seconds from the signal's receipt to the error, measured
in this process (what the rank itself waited, not the container's start or exit).
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.nn as nn

import hsbn
import hsbn.torch

C = (8, 16, 16)  # channels of the three BatchNorm layers


def net():
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    return nn.Sequential(
        nn.Conv2d(3, C[0], 3, padding=1), nn.BatchNorm2d(C[0]), nn.ReLU(),
        nn.Conv2d(C[0], C[1], 3, padding=1, stride=2), nn.BatchNorm2d(C[1]), nn.ReLU(),
        nn.Conv2d(C[1], C[2], 3, padding=1), nn.BatchNorm2d(C[2]),
        nn.AdaptiveAvgPool2d(1), nn.Flatten()).double()


def batch(rank, node, step, size):
    """Rank `rank`'s batch at `step`: its own seed, and a distribution per node (node n's
    images are shifted by n and scaled by 1 + n/2), so node and global statistics differ."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 3, 12, 12, generator=g, dtype=torch.float64)
    x = x * (1.0 + 0.5 * node) + node
    dy = torch.randn(size, C[2], generator=g, dtype=torch.float64)
    return x, dy


def bn_layers(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def rel_err(a, b):
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scope", choices=["node", "global"], required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=3, help="images per rank and step")
    p.add_argument("--expect-transport", default=None,
                   help="fail unless the client's transport starts with this (shm, grpc)")
    p.add_argument("--forever", action="store_true",
                   help="run rounds until one fails (the fault checks); checks the first step")
    p.add_argument("--hold-after", type=int, default=None, metavar="STEP",
                   help="after STEP's rounds, print HSBN-JOB HOLD and wait for SIGUSR1 "
                        "(between rounds: the sidecar is stopped then)")
    args = p.parse_args(argv)

    env = {k: int(os.environ[k]) for k in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    rank, world, lws, node = (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"],
                              env["GROUP_RANK"])
    members = list(range(node * lws, node * lws + lws)) if args.scope == "node" \
        else list(range(world))
    tag = "rank=%d scope=%s" % (rank, args.scope)

    if args.hold_after is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    model = hsbn.torch.convert_sync_batchnorm(net(), scope=args.scope)
    ref = net()
    worst, step = 0.0, 0
    resumed = None  # time.monotonic() at SIGUSR1's receipt (--hold-after)
    try:
        while step < args.steps or args.forever:
            x, dy = batch(rank, node, step, args.batch)
            x.requires_grad_(True)
            model.zero_grad()
            y = model(x)
            y.backward(dy)
            if step < args.steps:
                # The reference: BatchNorm over the scope's concatenated batch.
                xs, dys = zip(*(batch(r, r // lws, step, args.batch) for r in members))
                xr = torch.cat(xs).requires_grad_(True)
                ref.zero_grad()
                yr = ref(xr)
                yr.backward(torch.cat(dys))
                mine = slice(members.index(rank) * args.batch, (members.index(rank) + 1) * args.batch)
                checks = [("output", y, yr[mine]), ("input grad", x.grad, xr.grad[mine])]
                for i, (a, b) in enumerate(zip(bn_layers(model), bn_layers(ref))):
                    checks.append(("bn%d running_mean" % i, a.running_mean, b.running_mean))
                    checks.append(("bn%d running_var" % i, a.running_var, b.running_var))
                for what, a, b in checks:
                    err = rel_err(a.detach(), b.detach())
                    worst = max(worst, err)
                    if not err < 1e-9:
                        print("HSBN-JOB MISMATCH %s step=%d what=%s err=%.3g"
                              % (tag, step, what, err), flush=True)
                        return 4
                if step == 0 and args.scope == "node" and world > lws:
                    # Node scope must differ from global here (the nodes' data differ): the
                    # check above would pass by accident if the sidecar answered globally.
                    xg = torch.cat([batch(r, r // lws, 0, args.batch)[0] for r in range(world)])
                    start = rank * args.batch
                    gap = rel_err(y.detach(), net()(xg).detach()[start:start + args.batch])
                    if not gap > 1e-3:
                        print("HSBN-JOB MISMATCH %s step=0 what=node output equals global's "
                              "err=%.3g" % (tag, gap), flush=True)
                        return 4
                if step == 0 and args.forever:
                    print("HSBN-JOB RUNNING %s" % tag, flush=True)
            if step == args.hold_after:
                print("HSBN-JOB HOLD %s step=%d" % (tag, step), flush=True)
                signal.sigwait([signal.SIGUSR1])
                resumed = time.monotonic()
            step += 1
    except hsbn.HsbnError as e:
        after = "" if resumed is None else " after=%.3f" % (time.monotonic() - resumed)
        print("HSBN-JOB FAIL %s step=%d%s error=%s: %s"
              % (tag, step, after, type(e).__name__, " ".join(str(e).split())), flush=True)
        return 3
    stats = hsbn.torch.stats(model)
    transport = stats.transport or "?"
    rounds = stats.total.completed
    if args.expect_transport and not transport.startswith(args.expect_transport):
        print("HSBN-JOB FAIL %s step=%d error=transport: %r, expected %s"
              % (tag, step, transport, args.expect_transport), flush=True)
        return 3
    print("HSBN-JOB PASS %s steps=%d max_err=%.3g transport=%s rounds=%d"
          % (tag, step, worst, transport.replace(" ", "_"), rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
