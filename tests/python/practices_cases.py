"""Training practices users ask about, run on every rank of tests/python/test_practices.py's
job (1 node x 2 workers, global scope) and compared with one process over the concatenated
batch: activation checkpointing, gradient accumulation, no_grad / eval passes between steps,
two models in one process."""

import os

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hsbn.torch

WORLD = 2


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))


def data(rank, n=3, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, 3, 5, 5, generator=g, dtype=torch.float64)


def _bn_state(model):
    return {k: v.clone() for k, v in model.state_dict().items()
            if "running" in k or "num_batches" in k}


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def checkpointed(name):
    """The same step with and without torch.utils.checkpoint over the whole model: the
    input gradient, the parameter gradients and the running statistics after the step."""
    rank = int(os.environ["RANK"])
    out = {}
    for mode in ("plain", "checkpoint"):
        model = hsbn.torch.convert_sync_batchnorm(net().double(), scope="global",
                                                  name="%s-%s" % (name, mode))
        x = data(rank).requires_grad_()
        before = hsbn.default_client().stats().get(scope="global").completed
        y = (checkpoint(model, x, use_reentrant=True) if mode == "checkpoint"
             else model(x))
        (y * y).sum().backward()
        out[mode] = {"dx": x.grad.clone(), "grads": _grads(model), "bn": _bn_state(model),
                     "rounds": hsbn.torch.stats(model).get(scope="global").completed - before}
    return out


def accumulated(name, micro):
    """One optimizer step of `micro` micro-batches of 2 items each: the gradient and the
    running statistics."""
    rank = int(os.environ["RANK"])
    model = hsbn.torch.convert_sync_batchnorm(net().double(), scope="global", name=name)
    xs = data(rank, 2 * micro).split(2)
    for x in xs:
        (model(x) ** 2).sum().backward()
    return {"grads": _grads(model), "bn": _bn_state(model)}


def eval_and_no_grad_between_steps(name):
    """train step, eval pass, no_grad training-mode pass, train step: the running statistics
    and the rounds each made."""
    rank = int(os.environ["RANK"])
    model = hsbn.torch.convert_sync_batchnorm(net().double(), scope="global", name=name)
    client = hsbn.default_client()
    rounds = []

    def count():
        rounds.append(client.stats().get(scope="global").completed)
    count()
    (model(data(rank, seed=1)) ** 2).sum().backward()
    count()
    model.eval()
    with torch.no_grad():
        model(data(rank, seed=2))
    count()
    model.train()
    with torch.no_grad():
        model(data(rank, seed=3))
    count()
    (model(data(rank, seed=4)) ** 2).sum().backward()
    count()
    return {"rounds": [b - a for a, b in zip(rounds, rounds[1:])], "bn": _bn_state(model)}


def two_models(order):
    """Two models with their own names in one process, run in a rank-dependent order: each
    one's running statistics after one training forward."""
    rank = int(os.environ["RANK"])
    a = hsbn.torch.convert_sync_batchnorm(net().double(), scope="global", name="model-a")
    b = hsbn.torch.convert_sync_batchnorm(net().double(), scope="global", name="model-b")
    first, second = (a, b) if order[rank] == "ab" else (b, a)
    x = data(rank, seed=5)
    first(x)
    second(x * 2)
    return {"a": _bn_state(a), "b": _bn_state(b)}
