"""Worker-side halves of test_nonfinite.py (run inside worker processes, see workerpool.py):
plain data in, plain data out."""

import math

import torch

import hsbn.torch


def step_with_inf_gradient(scope, C, inject_rank, seed):
    """One training step of a SyncBatchNorm whose incoming gradient holds +Inf at one element
    (channel 1) on rank `inject_rank` only. Returns what raised (None when nothing did) and,
    per channel, whether this rank's input, weight and bias gradients are all finite."""
    rank = hsbn.default_client().rank
    gen = torch.Generator().manual_seed(seed + rank)
    bn = hsbn.torch.SyncBatchNorm(C, scope=scope, op=7000 + len(scope))
    x = torch.randn(4, C, 3, 2, generator=gen, requires_grad=True)
    g = torch.randn(4, C, 3, 2, generator=gen)
    if rank == inject_rank:
        g[2, 1, 1, 0] = math.inf
    try:
        (bn(x) * g).sum().backward()
    except Exception as e:  # what the test must not see
        return {"rank": rank, "raised": "%s: %s" % (type(e).__name__, e)}

    def finite(t):
        return [bool(torch.isfinite(t[:, c]).all()) if t.dim() > 1 else
                bool(torch.isfinite(t[c])) for c in range(C)]
    return {"rank": rank, "raised": None, "dx": finite(x.grad), "dw": finite(bn.weight.grad),
            "db": finite(bn.bias.grad)}
