#!/usr/bin/env python3
"""CPU per training step of lagged rounds with the sidecars' pass batching on and off
(--lagged-hold-ms; docs/PROTOCOL.md, "Lagged scope", item 10), in alternating runs.

Each run starts a LocalCluster (2 nodes x 2 workers, every sidecar reaching the root through a
link proxy that delays each chunk --link-ms each way) with --lagged-hold-ms=HOLD on every
aggregator, and runs the same plan on every rank: --steps steps of --layers lagged layers
(forwards 0..L-1, backwards L-1..0, C = --channels), each call after the first step asking for
its previous call's late result, as the lagged layer does, with a fixed numpy matrix product
after every call standing in for the layer's compute. It reports, per step: each aggregator's
and link proxy's CPU (from /proc, over the run), the workers' CPU (process_time, summed over
ranks), the slowest rank's wall time, and the mean time a rank waited for late results.
Arms alternate (on, off, on, off, ...) so that a drift of this shared machine hits both.

  bench/exchange/lagged_hold_ab.py --pairs 3 --json OUT.json [--markdown OUT.md]

Needs numpy and the built library and aggregator (HSBN_LIBRARY, HSBN_AGGREGATOR as the tests set
them, or an installed hsbn); --check exits 1 unless every run has positive numbers. The numbers are CPU and time on whatever machine runs it: read
the ratios of the two arms, not the values.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client",
                                "python"))


def _busy(x, n):
    for _ in range(n):
        x = x @ x * 0.001
    return x


def _rank(steps, layers, channels, products):
    import numpy as np

    import hsbn
    c = hsbn.Client.from_env()
    rng = np.random.default_rng(11 + c.rank)
    mean = rng.random(channels)
    m2 = rng.random(channels) + 1.0
    x = rng.random((96, 96))
    waited = 0.0
    # A pass: each layer's round, then (after the first step) its previous call's late result.
    passes = ((range(layers), c.forward, c.global_stats),
              (range(layers - 1, -1, -1), c.backward, c.global_sums))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for seq in range(steps):
        for ops, round_, late in passes:
            for op in ops:
                round_(op, seq, "lagged", 8, mean, m2)
                if seq > 0:
                    t = time.perf_counter()
                    late(op, seq - 1, channels)
                    waited += time.perf_counter() - t
                _busy(x, products)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    c.close()
    return cpu, wall, waited


def _proc_cpu(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kind(name):
    if name.startswith("link"):
        return "links"
    if name.startswith("node"):
        return "sidecars"
    return name  # root


def run_arm(hold_ms, args):
    from hsbn.cluster import LocalCluster
    with LocalCluster(nodes=2, workers_per_node=2, link_delay_ms=args.link_ms,
                      aggregator_args=["--lagged-hold-ms=%d" % hold_ms]) as cluster:
        pids = cluster.pids()
        before = {name: _proc_cpu(pid) for name, pid in pids.items()}
        ranks = cluster.run(_rank, args.steps, args.layers, args.channels, args.products,
                            timeout=1800)
        after = {name: _proc_cpu(pid) for name, pid in pids.items()}
    per_step = {}
    for name in pids:
        kind = _kind(name)
        per_step[kind] = per_step.get(kind, 0.0) + (after[name] - before[name]) / args.steps * 1e3
    per_step["workers"] = sum(r[0] for r in ranks) / args.steps * 1e3
    return {
        "hold_ms": hold_ms,
        "cpu_ms_per_step": per_step,
        "wall_ms_per_step": max(r[1] for r in ranks) / args.steps * 1e3,
        "late_wait_ms_per_step": sum(r[2] for r in ranks) / len(ranks) / args.steps * 1e3,
    }


def markdown(runs, args):
    kinds = ["workers", "sidecars", "root", "links"]
    lines = ["# Lagged rounds with the sidecars' pass batching on and off", "",
             "`bench/exchange/lagged_hold_ab.py %s`: 2 nodes x 2 workers, %d lagged layers, "
             "C = %d, %d steps per run, %d ms link each way; CPU in ms per step (sidecars and "
             "links summed over both nodes, workers over the four ranks)." % (
                 " ".join(sys.argv[1:]), args.layers, args.channels, args.steps, args.link_ms),
             "", "| run | hold (ms) | %s | wall ms/step | late wait ms/step |" % " | ".join(kinds),
             "|---|---:|%s---:|---:|" % ("---:|" * len(kinds))]
    for i, r in enumerate(runs):
        lines.append("| %d | %d | %s | %.2f | %.3f |" % (
            i + 1, r["hold_ms"], " | ".join("%.2f" % r["cpu_ms_per_step"].get(k, 0.0)
                                            for k in kinds),
            r["wall_ms_per_step"], r["late_wait_ms_per_step"]))
    on = [r for r in runs if r["hold_ms"] > 0]
    off = [r for r in runs if r["hold_ms"] == 0]
    lines += ["", "Median over each arm's runs, on / off:", ""]
    for k in kinds:
        a = statistics.median(r["cpu_ms_per_step"].get(k, 0.0) for r in on)
        b = statistics.median(r["cpu_ms_per_step"].get(k, 0.0) for r in off)
        lines.append("- %s CPU: %.2f / %.2f = %.2f" % (k, a, b, a / b if b else float("nan")))
    a = statistics.median(r["wall_ms_per_step"] for r in on)
    b = statistics.median(r["wall_ms_per_step"] for r in off)
    lines.append("- wall per step: %.2f / %.2f = %.2f" % (a, b, a / b))
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="alternating pairs of runs (default 3)")
    p.add_argument("--hold-ms", type=int, default=50, help="the 'on' arm's hold (default 50)")
    p.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    p.add_argument("--layers", type=int, default=4, help="lagged layers (default 4)")
    p.add_argument("--channels", type=int, default=32, help="channels per layer (default 32)")
    p.add_argument("--products", type=int, default=3,
                   help="96x96 matrix products after each call (default 3)")
    p.add_argument("--link-ms", type=int, default=1, help="link delay each way, ms (default 1)")
    p.add_argument("--json", help="write every run here")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless every run has positive worker CPU and wall time")
    args = p.parse_args()
    if args.pairs < 1 or args.steps < 2 or args.layers < 1 or args.hold_ms < 1:
        p.error("--pairs and --layers must be at least 1, --steps at least 2, --hold-ms at least 1")
    runs = []
    for i in range(args.pairs):
        for hold in (args.hold_ms, 0):
            runs.append(run_arm(hold, args))
            r = runs[-1]
            print("pair %d/%d, hold %d ms: cpu ms/step %s, wall %.2f ms/step" % (
                i + 1, args.pairs, hold,
                " ".join("%s=%.2f" % kv for kv in sorted(r["cpu_ms_per_step"].items())),
                r["wall_ms_per_step"]), flush=True)
    text = markdown(runs, args)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "bench/exchange/lagged_hold_ab.py " + " ".join(sys.argv[1:]),
                       "runs": runs}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.check and not all(r["cpu_ms_per_step"]["workers"] > 0 and r["wall_ms_per_step"] > 0
                              and r["cpu_ms_per_step"].get("sidecars", 0) >= 0 for r in runs):
        sys.exit("lagged_hold_ab: a run without positive numbers")


if __name__ == "__main__":
    main()
