"""The renorm tuning table (README.md here) from the runs of run.sh: per setting, renorm's
accuracy on seeds 10-12 paired with the baseline's node and global on the same seeds.
Usage: python3 tabulate.py (from anywhere; reads the folders beside it)."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from hsbncmp import sweep  # noqa: E402


def runs(name):
    with open(os.path.join(HERE, name, "sweep.json")) as f:
        res = json.load(f)
    return res["config"], res["runs"]


def main():
    _, base = runs("baseline")
    node = sweep._by_seed(base, "node")
    glob = sweep._by_seed(base, "global")
    node_sync = sweep._by_seed(base, "node", "sync_ms")
    node_pooled = sweep._by_seed(base, "node", "metric_sync_stats")
    target = {s: node[s] + sweep.GOAL_SHARE * (glob[s] - node[s]) for s in node}
    print("baseline (seeds %s): node %s (with pooled statistics %s), global %s; "
          "global − node %s"
          % (sorted(node), " ".join("%.2f" % (100 * node[s]) for s in sorted(node)),
             " ".join("%.2f" % (100 * node_pooled[s]) for s in sorted(node)),
             " ".join("%.2f" % (100 * glob[s]) for s in sorted(glob)),
             sweep._ci(sweep.paired(glob, node))))
    print()
    print("| setting | warm-up | ramp | r_max | d_max | renorm accuracy per seed | "
          "renorm − node | renorm − node with pooled statistics | renorm − target | "
          "calls that waited | sync ms/step (node's) |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    names = sorted(d for d in os.listdir(HERE)
                   if d != "baseline" and os.path.isfile(os.path.join(HERE, d, "sweep.json")))
    rows = []
    for name in names:
        cfg, rs = runs(name)
        o = cfg["renorm"]
        rows.append((o["warmup"], o["ramp"], o["r_max"], o["d_max"], name, cfg, rs))
    for *_, name, cfg, rs in sorted(rows):
        o = cfg["renorm"]
        acc = sweep._by_seed(rs, "renorm")
        waits = [r["renorm"]["wait_share"] for r in rs if r["mode"] == "renorm"]
        sync = sweep._by_seed(rs, "renorm", "sync_ms")
        print("| %s | %d | %d | %g | %g | %s | %s | %s | %s | %.1f%% | %.1f (%.1f) |" % (
            name, o["warmup"], o["ramp"], o["r_max"], o["d_max"],
            " ".join("%.2f" % (100 * acc[s]) for s in sorted(acc)),
            sweep._ci(sweep.paired(acc, node)), sweep._ci(sweep.paired(acc, node_pooled)),
            sweep._ci(sweep.paired(acc, target)),
            100 * sum(waits) / len(waits), sum(sync.values()) / len(sync),
            sum(node_sync.values()) / len(node_sync)))


if __name__ == "__main__":
    main()
