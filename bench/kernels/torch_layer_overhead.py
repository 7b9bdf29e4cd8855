#!/usr/bin/env python3
"""hsbn.torch.SyncBatchNorm's per-layer cost outside its rounds, beside torch.nn.BatchNorm2d, on
the CPU (issue 14).

Setting: a one-worker job in node scope with a real sidecar (LocalCluster, 1 node x 1 worker,
no root), C = 256, N*H*W = 4096 (N = 16, 16 x 16), float32, forward + backward of one layer.
Measured, per iteration, interleaved so that a loaded machine slows both alike:
  bn       torch.nn.BatchNorm2d forward + backward
  hsbn     hsbn.torch.SyncBatchNorm forward + backward (two rounds)
  rounds   the rounds' own time: blocked_seconds from Client.stats() (forward + backward)
  outside  hsbn - rounds: the layer's arithmetic and host work
--scopes node,lagged,... measures a layer of each scope in the same iterations (one job with a
root, so that renorm's and lagged's late results come; their fetches are not rounds, so they
count as outside): what each scope's host work adds, side by side.
Reported: medians over --iters iterations, and outside / bn (goal: at most 2), in wall time and
in this thread's CPU time (bn_cpu, hsbn_cpu: steadier on a loaded machine; the rounds block
without using this thread's CPU, so hsbn_cpu is the layer's own work plus the round calls'
small host part). --threads sets torch.set_num_threads (default 1: torch's work then runs on
this thread, so its CPU time is all of it; also the fairest on a shared 2-core machine).

  PYTHONPATH=client/python HSBN_LIBRARY=... HSBN_AGGREGATOR=... \
    /usr/bin/python3 bench/kernels/torch_layer_overhead.py [--iters 200] [--json F]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

import hsbn
import hsbn.cluster
import hsbn.torch
from hsbn.torch import _ops


# glibc returns freed multi-megabyte blocks to the kernel, and on the development VM touching
# fresh pages costs up to ~15 us each: a 4 MB temporary then takes 10+ ms to first write, for
# torch's BatchNorm2d and hsbn alike, and which one pays depends on the order of allocations.
# The benchmark keeps freed memory in the process (as a training loop's steady state does).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
              "MALLOC_TOP_PAD_": str(1 << 28)}


def main():
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()) and \
            "--keep-malloc" not in sys.argv:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **MALLOC_ENV))
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep-malloc", action="store_true",
                    help="run with the process's malloc settings (default: keep freed memory)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--cpu-ops", choices=("torch", "kernels"), default="torch")
    ap.add_argument("--scopes", default="node",
                    help="comma-separated scopes to measure side by side (default node), from "
                         "node, global, renorm, lagged")
    ap.add_argument("--size", type=int, default=16,
                    help="N = H = W of the input (default 16: N*H*W = 4096)")
    ap.add_argument("--json")
    args = ap.parse_args()
    scopes = [x for x in args.scopes.split(",") if x]
    bad = [x for x in scopes if x not in ("node", "global", "renorm", "lagged")]
    if bad or not scopes or len(set(scopes)) != len(scopes):
        ap.error("--scopes takes distinct scopes from node, global, renorm, lagged; got %r"
                 % args.scopes)
    torch.set_num_threads(args.threads)
    _ops.set_cpu_ops(args.cpu_ops)
    C = args.channels
    torch.manual_seed(0)
    n = args.size
    x0 = torch.randn(n, C, n, n) * 2 + 1
    g = torch.randn(n, C, n, n)
    ref = torch.nn.BatchNorm2d(C)
    samples = {"bn": [], "bn_cpu": []}
    for sc in scopes:
        for k in ("hsbn", "rounds", "outside", "hsbn_cpu"):
            samples["%s:%s" % (k, sc)] = []
    root = any(sc != "node" for sc in scopes)
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1, root=root) as cluster:
        client = hsbn.Client.from_env(env=cluster.worker_env(0))
        layers = {sc: hsbn.torch.SyncBatchNorm(C, scope=sc, client=client, op=i + 1)
                  for i, sc in enumerate(scopes)}

        def step(m):
            x = x0.detach().requires_grad_()
            m(x).backward(g)

        for _ in range(10):  # warm-up: allocator, first rounds
            step(ref)
            for layer in layers.values():
                step(layer)
        for _ in range(args.iters):
            c0, t0 = time.thread_time(), time.perf_counter()
            step(ref)
            c1, t1 = time.thread_time(), time.perf_counter()
            samples["bn"].append(t1 - t0)
            samples["bn_cpu"].append(c1 - c0)
            for sc, layer in layers.items():
                client.reset_stats()
                c2, t2 = time.thread_time(), time.perf_counter()
                step(layer)
                c3, t3 = time.thread_time(), time.perf_counter()
                rounds = client.stats().total.blocked_seconds
                samples["hsbn:" + sc].append(t3 - t2)
                samples["rounds:" + sc].append(rounds)
                samples["outside:" + sc].append(t3 - t2 - rounds)
                samples["hsbn_cpu:" + sc].append(c3 - c2)
        client.close()
    med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    print("C=%d, N*H*W=%d, float32, CPU ops %r, %d thread(s), %d iterations, medians (us):"
          % (C, n ** 3, args.cpu_ops, args.threads, args.iters))
    print("  BatchNorm2d fwd+bwd            %9.1f   (thread CPU %.1f)" % (med["bn"],
                                                                        med["bn_cpu"]))
    out = dict(channels=C, size=n, cpu_ops=args.cpu_ops, threads=args.threads,
               iters=args.iters, median_us=med, scopes={})
    for sc in scopes:
        ratio = med["outside:" + sc] / med["bn"]
        ratio_cpu = med["hsbn_cpu:" + sc] / med["bn_cpu"]
        print("  %-6s SyncBatchNorm fwd+bwd   %9.1f" % (sc, med["hsbn:" + sc]))
        print("    of which rounds (2)          %9.1f" % med["rounds:" + sc])
        print("    outside the rounds           %9.1f" % med["outside:" + sc])
        print("    outside / BatchNorm2d        %9.2f   (goal <= 2)" % ratio)
        print("    thread CPU time %.1f, / BatchNorm2d's %.2f" % (med["hsbn_cpu:" + sc],
                                                                 ratio_cpu))
        out["scopes"][sc] = dict(outside_over_bn=ratio, cpu_over_bn_cpu=ratio_cpu)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
