#!/usr/bin/env python3
"""Renders an A/B of torch_layer_overhead.py runs: DIR holds old-1.json, new-1.json, old-2.json,
... (alternating runs of the same command, `old` and `new` being two versions of the Python
package); prints a markdown table of each pair's layer time over BatchNorm2d's time of the same
run (a run slowed as a whole cancels out) and the median of new/old over the pairs.

  bench/kernels/ab_layer_overhead.py DIR [TITLE] > DIR/compare.md
"""
import glob
import json
import os
import re
import statistics
import sys


def main(argv):
    if len(argv) not in (2, 3) or not os.path.isdir(argv[1]):
        sys.exit(__doc__)
    d = argv[1]
    pairs = sorted(int(m.group(1)) for m in (re.search(r"old-(\d+)\.json$", p)
                                             for p in glob.glob(os.path.join(d, "old-*.json")))
                   if m and os.path.exists(os.path.join(d, "new-%s.json" % m.group(1))))
    if not pairs:
        sys.exit("%s: no old-N.json with its new-N.json" % d)
    runs = [(json.load(open(os.path.join(d, "old-%d.json" % i))),
             json.load(open(os.path.join(d, "new-%d.json" % i)))) for i in pairs]
    scopes = sorted({k.split(":", 1)[1] for k in runs[0][0]["median_us"] if k.startswith("hsbn:")})
    o = runs[0][0]
    print("# %s\n" % (argv[2] if len(argv) > 2 else "A/B of the layer's host time"))
    print("bench/kernels/torch_layer_overhead.py --channels %d --size %d --iters %d --scopes %s "
          "(CPU ops %s, %d thread), %d alternating pairs; rendered by "
          "bench/kernels/ab_layer_overhead.py. Each cell: the layer's forward+backward median "
          "over BatchNorm2d's median in the same run.\n"
          % (o["channels"], o["size"], o["iters"], ",".join(scopes), o["cpu_ops"], o["threads"],
             len(pairs)))
    print("| pair | " + " | ".join("old %s | new %s" % (s, s) for s in scopes) + " |")
    print("|---:|" + "---:|---:|" * len(scopes))
    ratios = {s: [] for s in scopes}
    for i, (a, b) in zip(pairs, runs):
        cells = []
        for s in scopes:
            x = a["median_us"]["hsbn:" + s] / a["median_us"]["bn"]
            y = b["median_us"]["hsbn:" + s] / b["median_us"]["bn"]
            ratios[s].append(y / x)
            cells += ["%.2f" % x, "%.2f" % y]
        print("| %d | %s |" % (i, " | ".join(cells)))
    print("\nnew/old, median of the pairs: "
          + ", ".join("%s %.3f" % (s, statistics.median(r)) for s, r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
