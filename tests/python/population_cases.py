"""Worker-side cases of test_running_stats: hsbn.torch.sync_running_stats and precise_bn on
real worker processes (run through workerpool.WorkerPool)."""

import warnings

import torch

import hsbn
import hsbn.torch


def make_model(name, extra=False):
    """Two hsbn layers after convolutions (BatchNorm2d) and one after a linear layer
    (BatchNorm1d), in float64, the same weights on every rank."""
    torch.manual_seed(11)
    layers = [torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
              torch.nn.Conv2d(4, 5, 1), torch.nn.BatchNorm2d(5, momentum=0.3), torch.nn.ReLU(),
              torch.nn.Flatten(), torch.nn.Linear(5 * 4 * 4, 6), torch.nn.BatchNorm1d(6)]
    if extra:
        layers += [torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)]
    model = torch.nn.Sequential(*layers).double()
    return hsbn.torch.convert_sync_batchnorm(model, scope="local", name=name)


def rank_batches(rank, n_batches=None):
    """Rank-dependent data: uneven numbers and sizes of batches, shifted and scaled by rank."""
    g = torch.Generator().manual_seed(100 + rank)
    n = rank + 1 if n_batches is None else n_batches
    out = []
    for i in range(n):
        size = 2 + (rank * 3 + i) % 5
        x = torch.randn(size, 3, 6, 6, generator=g, dtype=torch.float64)
        out.append(x * (1.0 + 0.5 * rank) + 0.7 * rank)
    return out


def bn_state(model):
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, hsbn.torch.SyncBatchNorm):
            out[name] = {"mean": m.running_mean.numpy().copy(),
                         "var": m.running_var.numpy().copy(), "seen": int(m.samples_seen),
                         "tracked": int(m.num_batches_tracked)}
    return out


def train_then_sync(name, scope, rank, train):
    """Trains (forward passes in training mode, local scope: each rank on its own uneven
    batches) when `train`, else leaves the layers without a record of samples seen; then pools
    with sync_running_stats twice. Returns the records before, after one and after two calls,
    the function's answer and the warnings raised."""
    model = make_model(name)
    model.train()
    if train:
        with torch.no_grad():
            for x in rank_batches(rank):
                model(x)
    else:
        # Statistics as loaded from a plain torch checkpoint (rank-dependent).
        with torch.no_grad():
            for i, (_, m) in enumerate(n for n in model.named_modules()
                                       if isinstance(n[1], hsbn.torch.SyncBatchNorm)):
                m.running_mean.copy_(torch.arange(m.num_features) * 0.1 + rank + i)
                m.running_var.copy_(torch.arange(m.num_features) * 0.2 + 1.0 + rank)
    before = bn_state(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answer = hsbn.torch.sync_running_stats(model, scope)
    once = bn_state(model)
    hsbn.torch.sync_running_stats(model, scope)
    twice = bn_state(model)
    return {"before": before, "once": once, "twice": twice, "answer": answer,
            "warnings": [str(w.message) for w in caught]}


def layer_inputs_reference(batches_by_rank, ranks):
    """One process: the plain torch model (hsbn layers reverted to torch.nn.BatchNorm*d) in
    training mode over every batch of `ranks`; the mean and unbiased variance of every BN
    layer's input over all of them."""
    model = hsbn.torch.revert_sync_batchnorm(make_model("ref"))
    model.train()
    inputs = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, inp, name=name: inputs.setdefault(name, []).append(
                    inp[0].transpose(0, 1).reshape(inp[0].shape[1], -1))))
    with torch.no_grad():
        for r in ranks:
            for x in batches_by_rank[r]:
                model(x)
    out = {}
    for name, vs in inputs.items():
        v = torch.cat(vs, 1)
        out[name] = {"mean": v.mean(1).numpy(), "var": v.var(1, unbiased=True).numpy(),
                     "n": v.shape[1]}
    return out


def precise(name, scope, rank, n_batches):
    """Runs a few training forwards (so the running statistics are not the defaults), puts the
    model in eval mode except one layer, then precise_bn over this rank's batches (n_batches[rank]
    of them; 0 runs none). Returns the records and modes before and after."""
    model = make_model(name)
    model.train()
    with torch.no_grad():
        for x in rank_batches(rank, 2):
            model(x * 3.0 - 1.0)
    model.eval()
    model[4].train()   # a mixed state, which must come back as it was
    before = bn_state(model)
    modes = [m.training for m in model.modules()]
    answer = hsbn.torch.precise_bn(model, rank_batches(rank, n_batches[rank]), scope)
    return {"before": before, "after": bn_state(model), "answer": answer,
            "modes_restored": modes == [m.training for m in model.modules()]}


def mismatched_call(name, rank, variant):
    """Every rank calls sync_running_stats, except that rank 1 differs by `variant`:
    "model" (an extra layer), "scope" or "function" (precise_bn instead). Returns the error's
    type and message."""
    model = make_model(name, extra=(variant == "model" and rank == 1))
    try:
        if variant == "function" and rank == 1:
            hsbn.torch.precise_bn(model, [], "global")
        else:
            scope = "node" if (variant == "scope" and rank == 1) else "global"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hsbn.torch.sync_running_stats(model, scope)
    except hsbn.HsbnError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return None


def one_rank_does_not_call(name, rank):
    """Rank 1 never calls sync_running_stats; the others do. Returns the error (rank 0)."""
    model = make_model(name)
    if rank == 1:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hsbn.torch.sync_running_stats(model, "global")
    except hsbn.HsbnError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return "returned"
