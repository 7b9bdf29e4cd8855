#!/usr/bin/python3
"""The trip guard of lagged scope (issue #41), from committed one-process runs.

For each cell named (default: the fast 150-step cell, the same cell with a learning-rate spike,
and the 600-step one under measured/) and each lagged mode with a trip (and the modes it is
compared with), prints
  - accuracy (rank 0's running statistics, mean over seeds) and the share of the node->global
    gap recovered, with its 95 % interval (from the cell's own analysis);
  - paired differences (points, mean and 95 % t interval over seeds) against the same mode
    without the trip, and against node;
  - the trip's cost: the share of lagged calls that ran exact global (a global round, both
    passes), the warm-up's included, and trips per run; per layer for the spiked cell.

    python3 examples/compare/trip_report.py [DIR ...]
"""

import json
import os
import sys

import numpy as np

from guard_signal import paired

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = ["measured/oneproc-4x2", "measured/oneproc-4x2-spike", "measured/oneproc-4x2-slow"]


def base_of(mode):
    """'lagged-damped:0.5,trip=0.3' -> 'lagged-damped:0.5'; 'lagged:trip=0.3' -> 'lagged'."""
    head, _, rest = mode.partition(":")
    keep = [o for o in rest.split(",") if o and not o.startswith("trip")]
    return head + (":" + ",".join(keep) if keep else "")


def fmt(d):
    return "%+.2f [%+.2f, %+.2f]" % d[:3] if d else "-"


def cell(d):
    with open(os.path.join(d, "oneproc.json")) as f:
        j = json.load(f)
    spike = j["config"].get("lr_spike")
    print("\n## %s: %d steps, lr %s%s, seeds %d" % (
        os.path.basename(d), j["config"]["steps"], j["config"]["lr"],
        ", lr x%g for %d steps from step %d" % (spike[1], spike[2], spike[0]) if spike else "",
        len(j["config"]["seeds"])))
    rows = {r["mode"]: r for r in j["analysis"]["rows"]}
    runs = j["runs"]
    tripped = [m for m in rows if base_of(m) != m]
    shown = ["node", "global"] + sorted({base_of(m) for m in tripped} & set(rows)) + tripped
    print("%-30s %7s %22s %28s %28s %8s %6s" % ("mode", "acc %", "gap recovered", "vs no trip",
                                                "vs node", "exact %", "trips"))
    for m in shown:
        if m not in rows:
            continue
        r = rows[m]
        gap = ("%4.0f %% [%.0f, %.0f]" % (100 * r["gap_fraction"], 100 * r["gap_fraction_lo"],
                                           100 * r["gap_fraction_hi"])
               if r.get("gap_fraction") is not None else "-")
        mine = [x for x in runs if x["mode"] == m and x.get("trip")]
        exact = trips = "-"
        if mine:
            ex = [sum(t["exact_calls"] for t in x["trip"].values())
                  / sum(t["calls"] for t in x["trip"].values()) for x in mine]
            exact = "%.1f" % (100 * np.mean(ex))
            trips = "%.1f" % np.mean([sum(len(t["trips"]) for t in x["trip"].values())
                                      for x in mine])
        print("%-30s %7.2f %22s %28s %28s %8s %6s" % (
            m, 100 * r["mean"], gap, fmt(paired(runs, m, base_of(m))) if m in tripped else "-",
            fmt(paired(runs, m, "node")) if m != "node" else "-", exact, trips))
    if spike:
        for m in tripped:
            mine = [x for x in runs if x["mode"] == m]
            layers = sorted(mine[0]["trip"])
            print("  %s: trips per layer (mean over seeds) %s; first trip at or after the "
                  "spike's first step, calls later (median): %s" % (
                      m, ", ".join("%s %.1f" % (k, np.mean([len(x["trip"][k]["trips"])
                                                            for x in mine])) for k in layers),
                      ", ".join("%s %s" % (k, _delay(mine, k, spike[0])) for k in layers)))


def _delay(runs, layer, step):
    d = [min([t - step for t in x["trip"][layer]["trips"] if t >= step] or [None],
             key=lambda v: 1e9 if v is None else v) for x in runs]
    d = [v for v in d if v is not None]
    return "%g (%d/%d runs)" % (np.median(d), len(d), len(runs)) if d else "none"


def main(argv):
    for d in argv or DEFAULT:
        cell(d if os.path.isabs(d) else os.path.join(HERE, d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
