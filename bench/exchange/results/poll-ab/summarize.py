#!/usr/bin/env python3
"""Per arm of the --poll-us A/B (run.py --json files named ARM-N.json), the median over runs of:
global p50 (us) at 2 nodes x 1 worker and 2 nodes x 2 workers, by phase; the ResNet-50 global
step p50 (ms) at 2 x 2; and, for the 2 x 1 launch (its node and global rounds together), the
aggregators' CPU (us) and context switches per round by process and the workers' CPU per round.
Usage: summarize.py ARM [ARM ...] (file prefixes, e.g. off-c)."""
import glob
import json
import statistics
import sys


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    print("| arm | runs | global p50 (us), 2 x 1: fwd, bwd | 2 x 2: fwd, bwd | ResNet-50 global "
          "step, 2 x 2 (ms) | 2 x 1: aggregator CPU per round, root, node0, node1 (us) "
          "| aggregator csw per round | worker CPU per round (us) |")
    print("|---|---:|---|---|---:|---|---:|---:|")
    for arm in sys.argv[1:]:
        files = sorted(glob.glob(arm + "[0-9]*.json"))
        lat, step, cpu, csw, client = {}, [], {}, [], []
        for f in files:
            with open(f, encoding="utf-8") as fh:
                rows = json.load(fh)["rows"]
            for r in rows:
                if r.get("kind") == "lat" and r["nodes"] == 2 and r["scope"] == "global":
                    lat.setdefault((r["workers"], r["phase"]), []).append(r["p50_us"])
                elif (r.get("kind") == "step" and r["nodes"] == 2
                      and r["scope"] == "global" and r["workers"] == 4):
                    step.append(r["p50_ms"])
                elif r.get("kind") == "cost" and r["nodes"] == 2 and r["workers"] == 2:
                    for p, v in r["server_cpu_us_by_process"].items():
                        cpu.setdefault(p, []).append(v)
                    csw.append(r["server_csw"])
                    client.append(r["client_cpu_us"])

        def pair(w):
            return "%.0f, %.0f" % (med(lat.get((w, "fwd"), [])), med(lat.get((w, "bwd"), [])))
        print("| %s | %d | %s | %s | %.1f | %s | %.2f | %.1f |" % (
            arm, len(files), pair(2), pair(4), med(step),
            ", ".join("%.1f" % med(cpu.get(p, [])) for p in ("root", "node0", "node1")),
            med(csw), med(client)))


if __name__ == "__main__":
    main()
