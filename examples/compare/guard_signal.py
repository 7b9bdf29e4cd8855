#!/usr/bin/python3
"""What the lagged guard's signal can tell apart (issue #41), from committed one-process runs.

Reads the oneproc.json of each cell named (default: the fast 150-step cell and the 600- and
1,200-step ones under measured/) and prints
  1. plain lagged's signal s (||job sum dx|| / ||sqrt(sum dx^2)||, per layer) as the median over
     seeds of its median within bins of call index: whether its level or its timing separates
     the regimes;
  2. paired differences (mean, 95 % t interval over seeds, points of accuracy by rank 0's running
     statistics) of each guard variant run (lagged-guard:delay=2, the delay the service can
     have; lagged-guard:drift=K, the drift guard) against the guard, damped 0.5, lagged and node;
     with each variant's mean lambda per layer and, for the drift and step guards, their v.

    python3 examples/compare/guard_signal.py [DIR ...]
"""

import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = ["measured/oneproc-4x2", "measured/oneproc-4x2-slow", "measured/oneproc-4x2-slow1200"]
BINS = [(0, 5), (5, 15), (15, 30), (30, 75), (75, 150), (150, 300), (300, 600), (600, 1200)]
# Two-sided 95 % t quantiles by degrees of freedom.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145}


def load(d):
    with open(os.path.join(d, "oneproc.json")) as f:
        return json.load(f)


def mode_rows(j):
    """{mode: analysis row} of a cell's oneproc.json: rank 0's statistics, and pooled."""
    return ({r["mode"]: r for r in j["analysis"]["rows"]},
            {r["mode"]: r for r in j["analysis_pooled"]["rows"]})


def gap_text(rows, pooled, mode):
    """"NN % (NN %)": the share of the node->global gap `mode` recovers, pooled in brackets."""
    r = rows[mode]
    if "gap_fraction" not in r:
        return "-"
    return "%3.0f %% (%3.0f %%)" % (100 * r["gap_fraction"], 100 * pooled[mode]["gap_fraction"])


def signal_table(name, runs):
    per_layer = {}
    for r in runs:
        if r["mode"] == "lagged" and r.get("signal"):
            for layer, sig in r["signal"].items():
                per_layer.setdefault(layer, []).append(np.asarray(sig))
    for layer, sigs in sorted(per_layer.items()):
        cells = []
        for a, b in BINS:
            v = [np.median(s[a:b]) for s in sigs if len(s) > a]
            cells.append("%6.1f" % np.median(v) if v else "     -")
        print("%-22s %-5s %s" % (name, layer, " ".join(cells)))


def paired(runs, a, b):
    acc = {}
    for r in runs:
        acc.setdefault(r["mode"], {})[r["seed"]] = r["metric"]
    if a not in acc or b not in acc:
        return None
    seeds = sorted(set(acc[a]) & set(acc[b]))
    d = np.array([acc[a][s] - acc[b][s] for s in seeds]) * 100
    if len(d) < 2:
        return None
    h = T95.get(len(d) - 1, 1.96) * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean(), d.mean() - h, d.mean() + h, len(d)


def main(argv):
    dirs = argv or [os.path.join(HERE, d) for d in DEFAULT]
    data = [(os.path.basename(os.path.normpath(d)), load(d)["runs"]) for d in dirs]
    print("plain lagged's signal s per layer: median over seeds of the median within calls")
    print("%-22s %-5s %s" % ("cell", "layer", " ".join("%6s" % ("%d-%d" % ab) for ab in BINS)))
    for name, runs in data:
        signal_table(name, runs)
    print()
    print("paired: each guard variant minus each mode (points, 95 % interval, seeds)")
    for name, runs in data:
        variants = sorted({r["mode"] for r in runs if r["mode"].startswith("lagged-guard:")
                           and "tau=" not in r["mode"]})
        for v in variants:
            for other in ("lagged-guard", "lagged-damped:0.5", "lagged", "node"):
                p = paired(runs, v, other)
                if p:
                    print("%-22s %-32s - %-18s %+.2f [%+.2f, %+.2f] (%d)"
                          % ((name, v, other) + p))
            lams = mean_lambda(runs, v)
            print("%-22s %-32s mean lambda per layer: %s" % (name, v, " / ".join(
                "%.2f" % lams[k] for k in sorted(lams))))
            first, last = lambda_phases(runs, v, 60)
            print("%-22s %-32s mean lambda, first calls but the last 60: %.2f; last 60: %.2f"
                  % (name, v, first, last))
            drift = median_drift(runs, v)
            if drift:
                print("%-22s %-32s median drift or step v per layer: %s" % (
                    name, v, " / ".join("%.2g" % drift[k] for k in sorted(drift))))
    return 0


def lambda_phases(runs, mode, tail):
    """Mean lambda over layers and seeds: over the calls before the last `tail`, over those."""
    first, last = [], []
    for r in runs:
        if r["mode"] == mode:
            for lams in r["lambda"].values():
                first.extend(lams[:-tail])
                last.extend(lams[-tail:])
    return float(np.mean(first)), float(np.mean(last))


def median_drift(runs, mode):
    """Per layer, the median over seeds of the drift or step guard's median v (None-free)."""
    per = {}
    for r in runs:
        if r["mode"] == mode:
            for layer, g in r["guard"].items():
                if g.get("drift_median") is not None:
                    per.setdefault(layer, []).append(g["drift_median"])
    return {k: float(np.median(v)) for k, v in per.items()}


def mean_lambda(runs, mode):
    per = {}
    for r in runs:
        if r["mode"] == mode:
            for layer, g in r["guard"].items():
                per.setdefault(layer, []).append(g["lambda_mean"])
    return {k: float(np.mean(v)) for k, v in per.items()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
