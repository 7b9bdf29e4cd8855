#!/usr/bin/python3
"""The service's distributed runs against the one-process study, seed by seed.

Reads a sweep's runs.csv (hsbn_compare.py --sweep: the real service, 4 nodes x 2 workers) and
a one-process study's oneproc.csv (hsbn_compare.py --one-process), both of the same cell, and
prints per mode: the accuracy (rank 0's running statistics) of each, their paired difference
over the seeds both ran (mean, 95 % t-interval), and for the service the share of the
node -> global gap recovered and the sync time relative to node's, paired by seed.

  service_vs_oneproc.py [--cell BATCH,SKEW] SWEEP_DIR ONEPROC_DIR [SERVICE_MODE=ONEPROC_MODE ...]

--cell picks the sweep's cell (default 4,0.8: the default cell, which the one-process study
runs unless told otherwise).

Modes present under the same name in both are paired; name others as SERVICE=ONEPROC, e.g.
lagged=lagged-damped:0.5,trip_rel=4,trip_calls=30 (hsbn.torch's lagged defaults).
"""

import csv
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hsbncmp.sweep import paired, paired_ratio  # noqa: E402


def _load(path, metric, keys=(), cell=None):
    out = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if cell and (int(row["batch"]), float(row["skew"])) != cell:
                continue
            rec = out.setdefault(row["mode"], {})
            rec[int(row["seed"])] = {"metric": float(row[metric]),
                                     **{k: float(row[k]) for k in keys}}
    return out


def _ci(p, scale=100.0, fmt="%+.2f"):
    if p["n"] < 2:
        return (fmt % (scale * p["mean"])) + " (n=%d)" % p["n"]
    return (fmt + " [" + fmt + ", " + fmt + "]") % (scale * p["mean"], scale * p["lo"],
                                                   scale * p["hi"])


def report(sweep_dir, oneproc_dir, pairs, cell=(4, 0.8)):
    svc = _load(os.path.join(sweep_dir, "runs.csv"), "metric", ("sync_ms", "step_ms"), cell)
    one = _load(os.path.join(oneproc_dir, "oneproc.csv"), "metric_rank0")
    names = {m: m for m in svc if m in one}
    names.update(pairs)
    lines = ["service: %s (cell: batch %d, skew %g); one-process: %s"
             % (sweep_dir, cell[0], cell[1], oneproc_dir), "",
             "%-8s %-44s %9s %9s %26s %22s %22s" % (
                 "service", "one-process mode", "svc acc", "1p acc", "svc - 1p (points)",
                 "svc gap recovered", "svc sync / node")]
    acc = {m: {s: r["metric"] for s, r in recs.items()} for m, recs in svc.items()}
    for m in [m for m in ("local", "node", "group", "renorm", "lagged", "global") if m in names]:
        o = names[m]
        if m not in svc or o not in one:
            continue
        a = acc[m]
        b = {s: r["metric"] for s, r in one[o].items()}
        seeds = sorted(set(a) & set(b))
        d = paired({s: a[s] for s in seeds}, {s: b[s] for s in seeds})
        gap = ""
        if "node" in acc and "global" in acc and m not in ("node", "global"):
            g = paired(acc["global"], acc["node"])
            got = paired(a, acc["node"])
            gap = "%.0f %%" % (100 * got["mean"] / g["mean"]) if g["mean"] else "-"
        ratio = ""
        if "node" in svc and m != "node":
            r = paired_ratio({s: v["sync_ms"] for s, v in svc[m].items()},
                             {s: v["sync_ms"] for s, v in svc["node"].items()})
            ratio = _ci(r, 1.0, "%.2f")
        mean = (lambda v: 100 * sum(v) / len(v) if v else math.nan)
        lines.append("%-8s %-44s %9.2f %9.2f %26s %22s %22s" % (
            m, o, mean([a[s] for s in seeds]), mean([b[s] for s in seeds]),
            _ci(d) + " n=%d" % d["n"], gap, ratio))
    return "\n".join(lines)


def main(argv):
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cell = (4, 0.8)
    if argv and argv[0] == "--cell":
        try:
            b, sk = argv[1].split(",")
            cell = (int(b), float(sk))
        except (IndexError, ValueError):
            print("service_vs_oneproc: --cell takes BATCH,SKEW, e.g. 4,0.8", file=sys.stderr)
            return 2
        argv = argv[2:]
    if len(argv) < 2:
        print(__doc__)
        return 2
    pairs = {}
    for item in argv[2:]:
        k, eq, v = item.partition("=")
        if not eq:
            print("service_vs_oneproc: %r is not SERVICE_MODE=ONEPROC_MODE" % item,
                  file=sys.stderr)
            return 2
        pairs[k] = v
    for d, name in ((argv[0], "runs.csv"), (argv[1], "oneproc.csv")):
        if not os.path.exists(os.path.join(d, name)):
            print("service_vs_oneproc: no %s in %s" % (name, d), file=sys.stderr)
            return 2
    print(report(argv[0], argv[1], pairs, cell))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
