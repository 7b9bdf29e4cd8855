"""Worker-side halves of the layer-naming tests (test_layer_matching.py): run inside worker
processes (WorkerPool or LocalCluster.run), take plain data, return plain data."""

import collections
import copy
import time
import warnings

import torch

import hsbn
import hsbn.torch
import hsbn_cases


def build_net(variant="same", rank=0):
    """A small model whose synchronized layers are, in module order: stem_bn (4 channels),
    block_bn (4), head_bn (4). A variant changes it on one rank only:
      renamed: rank 1 calls the second layer block_norm;
      wider:   rank 2's block_bn has 6 channels;
      extra:   rank 3 has a fourth layer, tail_bn;
      scoped:  rank 0 synchronizes head_bn per node (see scopes_for);
      nodeonly: rank 0 synchronizes every layer per node (see scopes_for)."""
    wide = 6 if variant == "wider" and rank == 2 else 4
    block = "block_norm" if variant == "renamed" and rank == 1 else "block_bn"
    layers = [("conv1", torch.nn.Conv2d(3, 4, 1)), ("stem_bn", torch.nn.BatchNorm2d(4)),
              ("conv2", torch.nn.Conv2d(4, wide, 1)), (block, torch.nn.BatchNorm2d(wide)),
              ("pool", torch.nn.AdaptiveAvgPool2d(1)), ("flat", torch.nn.Flatten()),
              ("fc", torch.nn.Linear(wide, 4)), ("head_bn", torch.nn.BatchNorm1d(4))]
    if variant == "extra" and rank == 3:
        layers.append(("tail_bn", torch.nn.BatchNorm1d(4)))
    return torch.nn.Sequential(collections.OrderedDict(layers))


def scopes_for(variant, rank):
    if variant == "nodeonly" and rank == 0:
        return {"stem_bn": "node", "block_bn": "node", "head_bn": "node"}
    return {"head_bn": "node"} if variant == "scoped" and rank == 0 else None


def mismatch_forward(variant, name):
    """Converts build_net(variant) and runs one training step; returns how it ended, with the
    monotonic clock (one clock for every process of the machine) around the call."""
    rank = hsbn.default_client().rank
    torch.manual_seed(rank)
    model = hsbn.torch.convert_sync_batchnorm(build_net(variant, rank), scope="global",
                                              layer_scopes=scopes_for(variant, rank), name=name)
    x = torch.randn(4, 3, 5, 5)
    t0 = time.monotonic()
    try:
        model(x).sum().backward()
    except hsbn.torch.LayerMismatchError as e:
        return {"raised": type(e).__name__, "message": str(e), "position": e.position,
                "layers": e.layers, "model": e.model, "t0": t0, "t1": time.monotonic()}
    except hsbn.HsbnError as e:
        return {"raised": type(e).__name__, "message": str(e), "reason": e.reason, "t0": t0,
                "t1": time.monotonic()}
    return {"raised": None, "t0": t0, "t1": time.monotonic()}


def one_rank_runs_a_layer_alone(name):
    """Both ranks run layer `main`; rank 0 alone then runs layer `aux` in training mode."""
    rank = hsbn.default_client().rank
    model = hsbn.torch.convert_sync_batchnorm(
        torch.nn.Sequential(collections.OrderedDict(main=torch.nn.BatchNorm1d(3),
                                                    aux=torch.nn.BatchNorm1d(3))), name=name)
    x = torch.randn(4, 3)
    model.main(x)
    if rank != 0:
        return None
    try:
        model.aux(x)
    except hsbn.HsbnError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def one_rank_skips_backward(name):
    """Both ranks run the forward; rank 1 never runs the backward."""
    rank = hsbn.default_client().rank
    model = hsbn.torch.convert_sync_batchnorm(
        torch.nn.Sequential(collections.OrderedDict(bn=torch.nn.BatchNorm1d(3))), name=name)
    x = torch.randn(4, 3, requires_grad=True)
    y = model(x)
    if rank != 0:
        return None
    try:
        y.sum().backward()
    except hsbn.HsbnError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def one_value_in_the_scope(name):
    """Rank 0 has one sample, rank 1 none: one value per channel in the whole scope."""
    rank = hsbn.default_client().rank
    model = hsbn.torch.convert_sync_batchnorm(
        torch.nn.Sequential(collections.OrderedDict(bn=torch.nn.BatchNorm1d(3))), name=name)
    try:
        model(torch.randn(1 if rank == 0 else 0, 3))
    except ValueError as e:
        return str(e)
    return None


def train_with_rank_zero_extras(initial_state, batches_by_rank):
    """Rank 0 alone first builds an extra directly constructed SyncBatchNorm, a converted
    teacher model (run in eval mode every step) and, after conversion, an EMA copy of the model
    (updated and evaluated every step). Then every rank trains SmallCNN with DDP in global
    scope. Returns the final state of the trained model."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    extras = {}
    if rank == 0:
        extras["direct"] = hsbn.torch.SyncBatchNorm(8)       # shifts the construction count
        extras["teacher"] = hsbn.torch.convert_sync_batchnorm(hsbn_cases.SmallCNN(),
                                                             name="teacher").eval()
    model = hsbn_cases.SmallCNN()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial_state.items()})
    model = hsbn.torch.convert_sync_batchnorm(model, scope="global")
    if rank == 0:
        extras["ema"] = copy.deepcopy(model).eval()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches_by_rank[rank]:
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        if rank == 0:
            with torch.no_grad():
                extras["teacher"](x)
                for e, p in zip(extras["ema"].parameters(), model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
                extras["ema"](x)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return hsbn_cases.state_numpy(model)


def ddp_broadcast_buffer_warnings():
    """Trains a converted SmallCNN under DDP in four configurations (scope, broadcast_buffers),
    in this order; returns the hsbn broadcast_buffers warnings each one raised."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = []
    for scope, broadcast in (("global", True), ("node", False), ("node", True),
                             ("shadow", True)):
        torch.manual_seed(0)
        model = hsbn.torch.convert_sync_batchnorm(hsbn_cases.SmallCNN(), scope=scope,
                                                  name="%s-%s" % (scope, broadcast))
        ddp = DistributedDataParallel(model, broadcast_buffers=broadcast)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                ddp(torch.randn(4, 3, 6, 6)).sum().backward()
        out.append([str(w.message) for w in caught if "broadcast_buffers" in str(w.message)])
    return out


def synchronized_forward():
    """One synchronized forward through the implicit default client, then a normal return of
    the job's id and the node's transport (Client.stats())."""
    bn = hsbn.torch.SyncBatchNorm(3, name="exit-test")
    bn(torch.randn(4, 3))
    client = hsbn.default_client()
    return client.job_id, client.stats().transport
