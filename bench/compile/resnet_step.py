#!/usr/bin/env python3
"""A ResNet-18 training step on the CPU, eager and compiled (torch.compile, torch >= 2.4), with
hsbn's SyncBatchNorm in global and node scope beside torch.nn.BatchNorm2d (issue #35, part 4).

Setting: LocalCluster with real aggregators, 2 nodes x 1 worker (so global crosses nodes and node
does not), torchvision's ResNet-18 (10 classes), batch --batch of --size x --size images,
SGD (lr 0.01), one torch thread per worker. Six variants per worker, each its own model from
the same initial weights:
  torch_bn eager / compiled         torch.nn.BatchNorm2d
  hsbn_global eager / compiled      hsbn.torch.convert_sync_batchnorm(scope="global")
  hsbn_node eager / compiled        the same, scope="node"
Compiled: torch.compile(model, fullgraph=True, backend=--backend) with hsbn's custom ops on
(hsbn.torch.use_custom_ops(True)); inductor's convolution layout optimization is off for every
compiled variant (Debian 13's torch 2.6 is wrong with it on AVX-512 CPUs, without hsbn;
docs/PYTORCH.md). The first --warmup steps of each variant (compilation) are timed apart; then
--steps rounds, each running one step of every variant in turn (interleaved: a loaded machine
slows all alike). Reported per variant: compile time (first step), median and quartiles of a
step's wall time, and ratios: compiled / eager, and hsbn / torch_bn in each mode. Rank 0's
numbers; both ranks' in the JSON.

  PYTHONPATH=client/python HSBN_LIBRARY=... HSBN_AGGREGATOR=... \\
    python3 bench/compile/resnet_step.py [--steps 20] [--json F]
(under torch 2.x: scripts/torch2-root.sh with HSBN_TORCH2_RUN="python bench/compile/resnet_step.py")
"""
import argparse
import json
import os
import statistics
import sys
import time

VARIANTS = [(kind, mode) for kind in ("torch_bn", "hsbn_global", "hsbn_node")
            for mode in ("eager", "compiled")]


def _build(torch, torchvision, hsbn, kind):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    if kind != "torch_bn":
        model = hsbn.torch.convert_sync_batchnorm(model, scope=kind.split("_")[1],
                                                  name="resnet18-" + kind)
    return model


def worker(args):
    import torch
    import torchvision
    import hsbn
    import hsbn.torch
    import torch._dynamo
    import torch._inductor.config

    torch.set_num_threads(1)
    hsbn.torch.use_custom_ops(True)
    torch._inductor.config.layout_optimization = False
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(args["batch"], 3, args["size"], args["size"], generator=gen),
             torch.randint(0, 10, (args["batch"],), generator=gen))
            for _ in range(4)]
    runs = {}
    for kind, mode in VARIANTS:
        model = _build(torch, torchvision, hsbn, kind)
        # hsbn layers of the eager variants keep their autograd.Function (the default path);
        # the compiled ones trace the custom ops.
        fn = (torch.compile(model, fullgraph=True, backend=args["backend"]) if mode == "compiled"
              else model)
        runs[(kind, mode)] = dict(model=model, fn=fn,
                                  opt=torch.optim.SGD(model.parameters(), lr=0.01),
                                  times=[], first=[])

    def step(run, i):
        x, y = data[i % len(data)]
        run["opt"].zero_grad()
        t = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(run["fn"](x), y)
        loss.backward()
        run["opt"].step()
        return time.perf_counter() - t, float(loss)

    losses = {}
    for key in VARIANTS:
        if key[1] == "eager":
            hsbn.torch.use_custom_ops(False)
        for i in range(args["warmup"]):
            dt, loss = step(runs[key], i)
            runs[key]["first"].append(dt)
        hsbn.torch.use_custom_ops(True)
    for i in range(args["steps"]):
        for key in VARIANTS:
            hsbn.torch.use_custom_ops(key[1] == "compiled")
            dt, loss = step(runs[key], args["warmup"] + i)
            runs[key]["times"].append(dt)
            losses.setdefault("%s/%s" % key, []).append(loss)
    from torch._dynamo.utils import counters
    return {"rank": rank, "torch": torch.__version__,
            "graph_breaks": sum(counters["graph_break"].values()),
            "variants": {"%s/%s" % k: {"first": r["first"], "times": r["times"]}
                         for k, r in runs.items()},
            "losses": losses}


def summarize(res):
    out = {}
    for name, v in res["variants"].items():
        t = sorted(v["times"])
        q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0]] * 3
        out[name] = {"compile_s": v["first"][0] if v["first"] else None,
                     "median_ms": 1e3 * statistics.median(t), "q1_ms": 1e3 * q[0],
                     "q3_ms": 1e3 * q[2]}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64, help="image side (default 64)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.steps < 2 or args.warmup < 1:
        ap.error("--steps needs at least 2 and --warmup at least 1")
    import torch
    if not hasattr(torch.library, "custom_op"):
        print("resnet_step: torch %s has no torch.library.custom_op (torch >= 2.4 needed)"
              % torch.__version__)
        return 2
    import hsbn.cluster
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import resnet_step as me  # importable by name in the spawned workers
    cfg = dict(steps=args.steps, warmup=args.warmup, batch=args.batch, size=args.size,
               backend=args.backend)
    print("ResNet-18 training step, CPU, 2 nodes x 1 worker, batch %d of %dx%d, backend %s, "
          "%d timed rounds after %d warm-up steps" % (args.batch, args.size, args.size,
                                                      args.backend, args.steps, args.warmup),
          flush=True)
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, round_timeout_ms=600000) as cl:
        results = cl.run(me.worker, cfg, timeout=3600)
    s = summarize(results[0])
    print("torch %s; graph breaks (compiled variants): %d" % (results[0]["torch"],
                                                               results[0]["graph_breaks"]))
    print("%-22s %10s %10s %10s %10s" % ("variant (rank 0)", "compile s", "median ms",
                                         "q1 ms", "q3 ms"))
    for name, v in s.items():
        print("%-22s %10.1f %10.1f %10.1f %10.1f" % (name, v["compile_s"], v["median_ms"],
                                                     v["q1_ms"], v["q3_ms"]))
    ratios = {}
    for kind in ("torch_bn", "hsbn_global", "hsbn_node"):
        ratios["%s compiled/eager" % kind] = (s[kind + "/compiled"]["median_ms"]
                                              / s[kind + "/eager"]["median_ms"])
    for kind in ("hsbn_global", "hsbn_node"):
        for mode in ("eager", "compiled"):
            ratios["%s/torch_bn %s" % (kind, mode)] = (s["%s/%s" % (kind, mode)]["median_ms"]
                                                       / s["torch_bn/" + mode]["median_ms"])
    for k, v in ratios.items():
        print("%-32s %.2f" % (k, v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "summary_rank0": s, "ratios_rank0": ratios,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
