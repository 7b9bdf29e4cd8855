#!/usr/bin/env python3
"""Compares two builds' exchange benchmark runs (run.py --json), old against new.

    bench/exchange/ab_compare.py --old OLD1.json OLD2.json ... --new NEW1.json NEW2.json ...

For every latency case (implementation, workers, nodes, channels, scope, phase) present in all runs,
prints the median over the runs of each side's p50 and p99 (microseconds) and new/old; for the
throughput rows, the median units per CPU-second. The runs should alternate (old, new, old,
...) on one machine, so that drift in its load falls on both sides alike. Standard library only.
"""

import argparse
import json
import statistics


def cases(paths):
    out = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)["rows"]
        for r in rows:
            if r.get("kind") == "lat":
                key = ("lat", r["impl"], r["workers"], r["nodes"], r.get("channels", 0),
                       r["scope"], r["phase"])
                out.setdefault(key, []).append((r["p50_us"], r["p99_us"]))
            elif r.get("kind") == "load":
                key = ("load", r["impl"], r["role"], r["ranks_per_node"], 0, "", "")
                out.setdefault(key, []).append((r["units_per_cpu_s"], r["units_per_cpu_s"]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", nargs="+", required=True)
    p.add_argument("--new", nargs="+", required=True)
    args = p.parse_args()
    old, new = cases(args.old), cases(args.new)
    print("| case | old p50 | new p50 | new/old | old p99 | new p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for key in sorted(set(old) & set(new), key=str):
        if len(old[key]) != len(args.old) or len(new[key]) != len(args.new):
            continue  # not in every run
        kind, impl, workers, nodes, channels, scope, phase = key
        o50 = statistics.median(v[0] for v in old[key])
        n50 = statistics.median(v[0] for v in new[key])
        if kind == "lat":
            o99 = statistics.median(v[1] for v in old[key])
            n99 = statistics.median(v[1] for v in new[key])
            name = "%s %s %s, %d workers x %d node%s%s" % (
                impl, scope, phase, workers, nodes, "s" if nodes > 1 else "",
                ", C=%d" % channels if channels else "")
            print("| %s | %.1f | %.1f | %.2f | %.1f | %.1f |" % (name, o50, n50, n50 / o50,
                                                                 o99, n99))
        else:
            name = "%s aggregator, units per CPU-second" % workers
            print("| %s | %.0f | %.0f | %.2f | | |" % (name, o50, n50, n50 / o50))


if __name__ == "__main__":
    main()
