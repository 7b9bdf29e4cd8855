#!/usr/bin/python3
"""The stale share averaged in both passes (issue #41), from committed one-process runs.

hsbn.torch's lagged_ema=B takes the other nodes' share as an exponential average over the
layer's earlier calls, in the forward and the backward alike; in the study
(examples/compare/hsbncmp/oneproc.py) it is the option pair ema=B,ema_fwd=1 (ema=B alone
averages the backward's share only). For each cell named (default: every committed cell with
such runs under measured/) this prints, for the modes below that the cell has, accuracy (rank 0's
running statistics, mean over seeds), the share of the node->global gap recovered (the cell's own
analysis, pooled statistics in brackets), the paired difference (points, mean and 95 % t
interval over seeds) against node and against the same mode without the average (the shorter
warm-ups: against the default), and the share
of lagged calls that ran exact global (the warm-up's and the trip guard's).

    python3 examples/compare/ema_report.py [DIR ...]
"""

import os
import sys

import numpy as np

from guard_signal import gap_text, load, mode_rows, paired

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = ["measured/oneproc-4x2", "measured/oneproc-4x2-spike", "measured/oneproc-resnet18",
           "measured/oneproc-4x2-slow", "measured/oneproc-resnet18-slow300",
           "measured/oneproc-4x2-b2-slow1200", "measured/oneproc-4x2-slow1200",
           "measured/oneproc-4x2-b8-slow1200", "measured/oneproc-4x2-slow2400"]
GUARDS = "trip_rel=4,trip_calls=30,warmup=20"
AVG = "ema=0.8,ema_fwd=1"
# (mode, the mode it is paired with, label): the same without the average; for the shorter
# warm-ups (tried for the cost of the exact calls, not kept), the default.
MODES = [
    ("lagged", None, "plain lagged"),
    ("lagged:ema=0.8", "lagged", "backward averaged"),
    ("lagged:ema=0.5,ema_fwd=1", "lagged", "both averaged, 0.5"),
    ("lagged:" + AVG, "lagged", "both averaged, 0.8"),
    ("lagged-damped:0.5," + GUARDS, None, "old default (damping 0.5)"),
    ("lagged-damped:0.5,%s,%s" % (GUARDS, AVG), "lagged-damped:0.5," + GUARDS,
     "old default + average"),
    ("lagged:" + GUARDS, None, "damping 1 + guards"),
    ("lagged:%s,%s" % (GUARDS, AVG), "lagged:" + GUARDS, "new default"),
    ("lagged:trip_rel=4,trip_calls=30,warmup=5," + AVG, "lagged:%s,%s" % (GUARDS, AVG), "default, warm-up 5"),
    ("lagged:trip_rel=4,trip_calls=30,warmup=2," + AVG, "lagged:%s,%s" % (GUARDS, AVG), "default, warm-up 2"),
    ("lagged:trip_rel=4,trip_calls=10,warmup=20," + AVG, "lagged:%s,%s" % (GUARDS, AVG), "default, trips 10 calls"),
]


def fmt(p):
    return "%+.2f [%+.2f, %+.2f]" % p[:3] if p else "-"


def exact_share(runs, mode):
    mine = [x for x in runs if x["mode"] == mode and x.get("trip")]
    if not mine:
        return "-"
    return "%.1f" % (100 * np.mean([sum(t["exact_calls"] for t in x["trip"].values())
                                    / sum(t["calls"] for t in x["trip"].values())
                                    for x in mine]))


def main(argv):
    dirs = argv or [os.path.join(HERE, d) for d in DEFAULT]
    print("%-26s %-27s %6s %3s %14s %-24s %-24s %6s" % (
        "cell", "mode", "acc %", "n", "gap (pooled)", "- node, points",
        "- paired with", "exact"))
    for d in dirs:
        j = load(d)
        name = os.path.basename(os.path.normpath(d))
        rows, pooled = mode_rows(j)
        for mode, without, label in MODES:
            if mode not in rows:
                continue
            r = rows[mode]
            print("%-26s %-27s %6.2f %3d %14s %-24s %-24s %6s" % (
                name, label, 100 * r["mean"], r["n"], gap_text(rows, pooled, mode),
                fmt(paired(j["runs"], mode, "node")),
                fmt(paired(j["runs"], mode, without)) if without else "-",
                exact_share(j["runs"], mode)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
