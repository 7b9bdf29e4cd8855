#!/usr/bin/env python3
"""End to end on a GPU with an installed hsbn (the self-contained wheel): LocalCluster starts a
root and two sidecars (2 nodes x 2 workers; the local ranks on GPUs LOCAL_RANK % --devices), and every worker trains a small
convolutional net with two hsbn SyncBatchNorm layers for a few SGD steps, in node scope and in
global scope, with each CUDA op set the installed library offers.

Checks: every loss finite; one host wait per round (hsbn.torch.sync_stats); running statistics
(updated from the scope's statistics) bitwise equal on all workers of a scope, and different
between the two nodes in node scope (their data differ). Exit status 1 on any failure, 2 when
there is no GPU.

  PYTHONPATH=<wheel installed here> gpu_e2e_check.py [--devices N] [--json F]
"""
import argparse
import json
import os
import sys
import traceback

import torch

STEPS = 4


def train_worker(scope, ops, device="cuda", devices=1):
    """One worker: returns its losses, final running statistics and sync counts. On CUDA it
    uses GPU LOCAL_RANK % devices, as a torchrun trainer does."""
    import hsbn.torch
    rank = int(os.environ["RANK"])
    node = int(os.environ["GROUP_RANK"])
    torch.manual_seed(100)  # the same initial weights everywhere
    dev = torch.device(device)
    if device == "cuda":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % devices)
        torch.cuda.set_device(dev)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10)).to(dev)
    net = hsbn.torch.convert_sync_batchnorm(net, scope=scope)
    hsbn.torch.set_cuda_ops(ops, module=net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator(device=dev).manual_seed(rank)
    hsbn.torch.reset_sync_stats()
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 3, 16, 16, device=dev, generator=gen) * (1 + node) + 2 * node
        y = torch.randint(0, 10, (8,), device=dev, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    s = hsbn.torch.sync_stats()
    return dict(rank=rank, node=node, losses=losses, device=str(dev),
                running_mean=net[1].running_mean.cpu().tolist(),
                running_var=net[4].running_var.cpu().tolist(),
                rounds=s.rounds, device_waits=s.device_waits, downloads=s.downloads,
                uploads=s.uploads)


def check(results, scope, device="cuda", devices=1):
    problems = []
    for n in (0, 1):
        used = [r["device"] for r in results if r["node"] == n]
        if device == "cuda" and devices > 1 and len(set(used)) != len(used):
            problems.append("node %d: local ranks shared a GPU (%s) with %d GPUs visible"
                            % (n, used, devices))
    for r in results:
        if not all(map(lambda v: v == v and abs(v) != float("inf"), r["losses"])):
            problems.append("rank %d: non-finite loss %s" % (r["rank"], r["losses"]))
        want = 2 * 2 * STEPS  # two layers, forward and backward
        got = (r["rounds"], r["downloads"], r["uploads"], r["device_waits"])
        if got != (want,) * 3 + (want if device == "cuda" else 0,):
            problems.append("rank %d: rounds/downloads/uploads/waits %s, expected %d each"
                            % (r["rank"], got, want))
    groups = ([results] if scope == "global" else
              [[r for r in results if r["node"] == n] for n in (0, 1)])
    for g in groups:
        for key in ("running_mean", "running_var"):
            if any(r[key] != g[0][key] for r in g):
                problems.append("%s differs between ranks %s of one %s scope"
                                % (key, [r["rank"] for r in g], scope))
    if scope == "node" and groups[0][0]["running_mean"] == groups[1][0]["running_mean"]:
        problems.append("node scope: both nodes got the same running_mean (not node statistics?)")
    return problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--require-kernels", action="store_true",
                    help="fail when the library's CUDA kernels are not usable (the device check)")
    ap.add_argument("--devices", type=int, default=1,
                    help="GPUs to spread each node's local ranks over (LOCAL_RANK %% devices)")
    ap.add_argument("--cpu-plumbing", action="store_true",
                    help="run on CPU tensors: proves the script and the package, not the GPU")
    args = ap.parse_args()
    device = "cpu" if args.cpu_plumbing else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("FAIL: torch sees no CUDA device")
        return 2
    import hsbn
    import hsbn.cluster
    print("hsbn from %s; library %s; aggregator %s" % (os.path.dirname(hsbn.__file__),
                                                       hsbn._lib.library_path(),
                                                       hsbn._lib.aggregator_path()))
    op_sets = ["torch"]
    k = hsbn._lib.bn_kernels()
    if device == "cpu":
        pass
    elif k is not None and k.hsbn_bn_cuda_available():
        op_sets.append("kernels")
    elif args.require_kernels:
        print("FAIL: %s has no usable CUDA kernels (built without CUDA, or a driver older than "
              "its CUDA runtime): hsbn's op set cannot run end to end" % hsbn._lib.library_path())
        return 1
    else:
        print("NOTE: this library has no usable CUDA kernels; only torch's op set runs end to "
              "end (the kernels are checked by gpu_module_check.py)")
    out, failed = [], 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_e2e_check as me  # importable by name in the spawned workers
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2, round_timeout_ms=60000) as cl:
        for ops in op_sets:
            for scope in ("node", "global"):
                name = "%s scope, %s ops" % (scope, ops)
                try:
                    results = cl.run(me.train_worker, scope, ops, device, args.devices,
                                     timeout=300)
                    problems = check(results, scope, device, args.devices)
                except Exception:
                    results, problems = None, [traceback.format_exc()]
                failed += bool(problems)
                print("%s %s%s" % ("FAIL" if problems else "ok  ", name,
                                   "".join("\n  " + p for p in problems)))
                if results:
                    print("  losses of rank 0: %s" % ["%.4f" % v for v in results[0]["losses"]])
                out.append(dict(case=name, problems=problems, results=results))
    print("end to end: %s" % ("all %d runs passed" % len(out) if not failed
                              else "FAIL: %d of %d runs" % (failed, len(out))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
