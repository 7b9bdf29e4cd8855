#!/usr/bin/env python3
"""hsbn's main job: compare local, node and global BatchNorm sync on Fashion-MNIST
(classification and segmentation) on a simulated cluster on this machine. See --help and
docs/results/COMPARISON.md.

    python3 examples/compare/hsbn_compare.py            # defaults: about 10 minutes, 2 cores
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import hsbn  # noqa: F401  (installed, or PYTHONPATH=client/python)
except ImportError:
    # From a checkout: use the package in client/python (worker processes inherit sys.path).
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python"))

from hsbncmp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
