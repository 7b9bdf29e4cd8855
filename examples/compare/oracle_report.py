#!/usr/bin/python3
"""Where lagged's stale share loses (issue #41): the oracle runs, from committed one-process runs.

The stale share (the other nodes' partials of the layer's previous call) differs from their
fresh partials in two ways: their batch is the previous one, and it went through the previous
step's weights. Two oracle modes of the study (examples/compare/hsbncmp/oneproc.py) each take one
of them away: lagged:oracle=1 recomputes the previous batch's partials at this step's weights
(with oracle_bwd=0 the forward's only, the statistics Cross-Iteration BN compensates;
oracle=3 the same with the next step's batch, one no step has trained on yet);
lagged:oracle=2 computes this step's batch at the previous step's weights. For each cell named
(default: the fast 150-step cell and the three 1,200-step ones under measured/) this prints
each oracle mode's accuracy (rank 0's running statistics, mean over seeds), the share of the
node->global gap it recovers (the cell's own analysis; pooled statistics in brackets), and its
paired difference (points, mean and 95 % t interval over seeds) against plain lagged and global.

    python3 examples/compare/oracle_report.py [DIR ...]
"""

import os
import sys

from guard_signal import gap_text, load, mode_rows, paired

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = ["measured/oneproc-4x2", "measured/oneproc-4x2-b2-slow1200",
           "measured/oneproc-4x2-slow1200", "measured/oneproc-4x2-b8-slow1200"]
MODES = ["lagged", "lagged:oracle=1", "lagged:oracle=1,oracle_bwd=0", "lagged:oracle=3",
         "lagged:oracle=2"]


def fmt(p):
    return "%+.2f [%+.2f, %+.2f]" % p[:3] if p else "-"


def main(argv):
    dirs = argv or [os.path.join(HERE, d) for d in DEFAULT]
    print("%-26s %-30s %6s %4s %14s %-24s %-24s" % (
        "cell", "mode", "acc %", "n", "gap (pooled)", "- plain lagged, points",
        "- global, points"))
    for d in dirs:
        j = load(d)
        name = os.path.basename(os.path.normpath(d))
        rows, pooled = mode_rows(j)
        for m in MODES:
            if m not in rows:
                continue
            r = rows[m]
            print("%-26s %-30s %6.2f %4d %14s %-24s %-24s" % (
                name, m, 100 * r["mean"], r["n"], gap_text(rows, pooled, m),
                fmt(paired(j["runs"], m, "lagged")) if m != "lagged" else "-",
                fmt(paired(j["runs"], m, "global"))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
