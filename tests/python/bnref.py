"""Test data and the reference: torch.nn.BatchNorm*d applied to a group's concatenated batch."""

import numpy as np
import torch

SIZES = [3, 5, 0, 2]          # per rank; rank 2 has an empty batch
NODES, WORKERS_PER_NODE = 2, 2


def node_of(rank):
    return rank // WORKERS_PER_NODE


def make_spec(scope, dtype="float64", C=3, spatial=(4, 5), steps=2, sizes=SIZES, seed=0,
              **extra):
    """Per-rank step inputs and one spec (weights, scope, dtype) shared by every rank. Nodes get
    different offsets so that node and global statistics differ."""
    rng = np.random.default_rng(seed)
    spec = {"scope": scope, "dtype": dtype, "C": C,
            "weight": rng.uniform(0.5, 2.0, C), "bias": rng.uniform(-1.0, 1.0, C)}
    spec.update(extra)
    data = [[] for _ in sizes]
    for _ in range(steps):
        for r, n in enumerate(sizes):
            x = rng.standard_normal((n, C) + tuple(spatial)) * (1.0 + r) + 3.0 * node_of(r)
            g = rng.standard_normal((n, C) + tuple(spatial))
            data[r].append((x, g))
    return spec, data


def _bn_class(ndim):
    return {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
            5: torch.nn.BatchNorm3d}[ndim]


def reference(spec, data, ranks):
    """torch.nn.BatchNorm on the concatenation of `ranks`' batches, step by step (inputs cast to
    the spec's dtype first, like the workers do). Returns per-step outputs and input gradients
    split back by rank, the weight and bias gradients, and the final running statistics."""
    dtype = getattr(torch, spec["dtype"])
    ndim = data[ranks[0]][0][0].ndim
    affine = spec.get("affine", True)
    bn = _bn_class(ndim)(spec["C"], eps=spec.get("eps", 1e-5), momentum=spec.get("momentum", 0.1),
                         affine=affine,
                         track_running_stats=spec.get("track_running_stats", True))
    bn.to(getattr(torch, spec.get("param_dtype", spec["dtype"])))
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.from_numpy(spec["weight"]))
            bn.bias.copy_(torch.from_numpy(spec["bias"]))
    out = {"y": {r: [] for r in ranks}, "dx": {r: [] for r in ranks}, "dw": [], "db": []}
    for step in range(len(data[ranks[0]])):
        xs = [torch.from_numpy(data[r][step][0]).to(dtype) for r in ranks]
        gs = [torch.from_numpy(data[r][step][1]).to(dtype) for r in ranks]
        x = torch.cat(xs).requires_grad_()
        bn.zero_grad()
        y = bn(x)
        (y * torch.cat(gs)).sum().backward()
        sizes = [t.shape[0] for t in xs]
        for r, yr, dxr in zip(ranks, y.detach().split(sizes), x.grad.split(sizes)):
            out["y"][r].append(yr.double().numpy())
            out["dx"][r].append(dxr.double().numpy())
        if affine:
            # Copies: the gradients accumulate in place at the next step.
            out["dw"].append(bn.weight.grad.double().numpy().copy())
            out["db"].append(bn.bias.grad.double().numpy().copy())
    if bn.track_running_stats:
        out["running_mean"] = bn.running_mean.double().numpy()
        out["running_var"] = bn.running_var.double().numpy()
    out["module"] = bn
    return out


def rel_err(actual, expected):
    """max |actual - expected| / max |expected| (absolute when expected is all zeros)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.size == 0:
        return 0.0
    scale = np.max(np.abs(expected))
    diff = np.max(np.abs(actual - expected))
    return diff / scale if scale > 0 else diff


def assert_group_matches(results, spec, data, groups, tol):
    """Each group's workers together equal BatchNorm on the group's concatenated batch."""
    worst = {}
    for ranks in groups:
        ref = reference(spec, data, ranks)
        steps = len(ref["y"][ranks[0]])
        for s in range(steps):
            for r in ranks:
                for key in ("y", "dx"):
                    e = rel_err(results[r][key][s], ref[key][r][s])
                    worst[key] = max(worst.get(key, 0.0), e)
                    assert e <= tol, "%s of rank %d, step %d: relative error %.3g > %g" % (
                        key, r, s, e, tol)
            for key in ("dw", "db") if ref["dw"] else ():
                # Each worker holds its share; their sum is the group's gradient.
                total = sum(results[r][key][s] for r in ranks)
                e = rel_err(total, ref[key][s])
                worst[key] = max(worst.get(key, 0.0), e)
                assert e <= tol, "%s summed over ranks %s, step %d: relative error %.3g > %g" % (
                    key, ranks, s, e, tol)
        for r in ranks:
            for key in ("running_mean", "running_var") if "running_mean" in ref else ():
                e = rel_err(results[r][key], ref[key])
                worst[key] = max(worst.get(key, 0.0), e)
                assert e <= tol, "%s of rank %d: relative error %.3g > %g" % (key, r, e, tol)
    return worst
