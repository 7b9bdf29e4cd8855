"""Time of one training step (forward, backward, SGD) of a comparison model on one torch
thread, to size a run before starting it (docs/results/COMPARISON.md, "Scaling up").

  PYTHONPATH=examples/compare /usr/bin/python3 examples/compare/model_step_ms.py \\
      [--model resnet18] [--batch 4] [--steps 20]

Prints the median over --steps steps (after 3 warm-up steps) and the machine's load.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hsbncmp import models  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a torchvision classifier (default: the CNN)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = models.build("cls", a.model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(a.batch, 1, 28, 28)
    y = torch.randint(0, 10, (a.batch,))
    times = []
    for i in range(a.steps + 3):
        t0 = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    print("%s, batch %d of 28x28, 1 thread: %.1f ms per step (median of %d); %d parameters; "
          "1-minute load average %.1f on %d cores"
          % (a.model or "the small CNN", a.batch, 1e3 * statistics.median(times), a.steps,
             sum(q.numel() for q in net.parameters()), os.getloadavg()[0], os.cpu_count()))


if __name__ == "__main__":
    main()
