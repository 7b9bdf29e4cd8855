#!/usr/bin/env python3
"""What a round costs through the group tier, side by side with the flat tree, in one run.

Two LocalClusters of 4 nodes x 2 workers on this machine, the same links as the comparison's
default (docs/results/COMPARISON.md, "Group tier"):
  - flat: every sidecar reaches the root through a proxy delaying 1 ms each way;
  - tier: groups of 2 nodes, each sidecar reaches its group aggregator through a proxy delaying
    100 us each way, each group aggregator reaches the root through one delaying 1 ms.
In each, every worker runs --rounds forward rounds of 64 channels per scope (node, group,
global; interleaved, so load drifts hit every scope alike), after --warmup untimed ones, and
records each round's wall time. Prints p50/p90 per (tree, scope) and the ratios group/global and
group/node, and writes them (--out: JSON, and a Markdown table beside it).

  /usr/bin/python3 bench/tier/latency.py --out bench/tier/results/latency.json
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))

SCOPES = ["node", "group", "global"]


def worker(rounds, warmup, channels):
    import numpy as np
    import hsbn
    client = hsbn.Client.from_env()
    times = {s: [] for s in SCOPES}
    mean = np.arange(channels, dtype=np.float64)
    m2 = np.ones(channels)
    seq = 0
    for i in range(warmup + rounds):
        for op, scope in enumerate(SCOPES):
            t0 = time.perf_counter()
            client.forward(op, seq, scope, 4, mean, m2)
            if i >= warmup:
                times[scope].append(time.perf_counter() - t0)
        seq += 1
    client.close()
    return times


def quantile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--out", help="write the results here (JSON; the table beside it as .md)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.channels < 1:
        p.error("--rounds and --channels must be positive, --warmup >= 0")
    import hsbn.cluster
    trees = {
        "flat": dict(link_delay_us=1000),
        "tier": dict(group_tier=True, group_link_delay_us=100, link_delay_us=1000),
    }
    rows = []
    for tree, kwargs in trees.items():
        with hsbn.cluster.LocalCluster(nodes=4, workers_per_node=2, group_nodes=2,
                                       **kwargs) as cluster:
            per_rank = cluster.run(worker, args.rounds, args.warmup, args.channels,
                                   timeout=1800)
        for scope in SCOPES:
            samples = [t * 1e6 for r in per_rank for t in r[scope]]
            rows.append({"tree": tree, "scope": scope, "rounds": len(samples),
                         "p50_us": quantile(samples, 0.5), "p90_us": quantile(samples, 0.9)})
            print("%-4s %-6s p50 %8.0f us  p90 %8.0f us  (%d rounds)"
                  % (tree, scope, rows[-1]["p50_us"], rows[-1]["p90_us"], len(samples)))
    p50 = {(r["tree"], r["scope"]): r["p50_us"] for r in rows}
    ratios = {
        "tier group / tier global": p50[("tier", "group")] / p50[("tier", "global")],
        "flat group / flat global": p50[("flat", "group")] / p50[("flat", "global")],
        "tier group / flat group": p50[("tier", "group")] / p50[("flat", "group")],
        "tier global / flat global": p50[("tier", "global")] / p50[("flat", "global")],
    }
    for k, v in ratios.items():
        print("%-26s %.2f (p50)" % (k, v))
    load = os.getloadavg()[0]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        result = {"rows": rows, "ratios_p50": ratios, "rounds": args.rounds,
                  "channels": args.channels, "cpus": os.cpu_count(), "load_1min_end": load}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        md = ["| tree | scope | p50 µs | p90 µs |", "|---|---|---:|---:|"]
        md += ["| %s | %s | %.0f | %.0f |" % (r["tree"], r["scope"], r["p50_us"], r["p90_us"])
               for r in rows]
        md += ["", "| ratio of p50 | |", "|---|---:|"]
        md += ["| %s | %.2f |" % kv for kv in ratios.items()]
        md += ["", "4 nodes × 2 workers, %d channels, %d timed rounds per worker and scope; %d "
               "CPU cores, 1-minute load average %.1f at the end." % (
                   args.channels, args.rounds, os.cpu_count(), load)]
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
