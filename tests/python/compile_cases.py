"""Worker-side halves of test_compile.py (torch >= 2.4): hsbn layers under torch.compile,
compared with the same model run eagerly, in the same worker, on the same data."""

import copy

import numpy as np
import torch
import torch.nn as nn

import hsbn
import hsbn.torch


def _np(t):
    return t.detach().to(device="cpu", dtype=torch.float64).numpy().copy()


# Options that make renorm correct from its second call (its defaults wait 5 calls and ramp over
# 20: a 6-step case would hardly leave the warm-up), and lagged from its second (its default
# warm-up is 20 calls).
SCOPE_OPTIONS = {"renorm": {"renorm_warmup": 1, "renorm_ramp": 2}, "lagged": {"lagged_warmup": 1}}


def _bn(c, scope, **kw):
    return hsbn.torch.SyncBatchNorm(c, scope=scope, **SCOPE_OPTIONS.get(scope, {}), **kw)


class Explicit(nn.Module):
    """A model with its own forward: a stem, then two independent branches (as ResNet's
    downsample path), each with an hsbn layer, added."""

    def __init__(self, scope, prefix="explicit"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = _bn(4, scope, name=prefix + ".bn1")
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        # momentum=None (the cumulative average) is taken on the device by the ops; in local
        # scope it is F.batch_norm's, which reads num_batches_tracked on the host (a graph break,
        # as with torch's BatchNorm), so local keeps 0.1.
        self.bn2 = _bn(6, scope, name=prefix + ".bn2", momentum=0.1 if scope == "local" else None)
        self.conv3 = nn.Conv2d(4, 6, 1)
        self.bn3 = _bn(6, scope, name=prefix + ".bn3", affine=False)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h))) + self.bn3(self.conv3(h))
        return self.fc(h.mean((2, 3)))


def build(kind, scope, prefix="explicit", ops=True, device="cpu"):
    """The model `kind` ("sequential", "explicit", "resnet18", "torch_bn": the sequential one
    with torch.nn.BatchNorm2d) with hsbn layers of `scope`, initialized from seed 0; the
    process's path is use_custom_ops(ops) whatever the environment says, for CUDA inputs too
    when `device` is "cuda" (the opt-in, use_custom_ops(ops, cuda=True))."""
    hsbn.torch.use_custom_ops(ops, cuda=(device == "cuda") if ops else None)
    torch.manual_seed(0)
    if kind in ("sequential", "torch_bn"):
        # torch's BatchNorm with momentum=None reads num_batches_tracked on the host (a graph
        # break), so the torch reference keeps momentum=0.1 there.
        bn = ((lambda c, momentum=0.1: nn.BatchNorm2d(c, momentum=0.1)) if kind == "torch_bn" else
              (lambda c, **kw: _bn(c, scope, **kw)))
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bn(4), nn.ReLU(),
                             nn.Conv2d(4, 6, 3, padding=1), bn(6, momentum=None), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
    if kind == "explicit":
        return Explicit(scope, prefix)
    if kind == "resnet18":
        import torchvision
        return hsbn.torch.convert_sync_batchnorm(torchvision.models.resnet18(num_classes=3),
                                                 scope=scope, name="resnet18-" + prefix)
    raise ValueError(kind)


def _state(model):
    return {k: _np(v) for k, v in model.state_dict().items() if v.is_floating_point()}


def _counts():
    from torch._dynamo.utils import counters
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "break_reasons": [str(k)[:300] for k in counters["graph_break"]]}


def _inductor_patch(settings):
    """A context applying inductor config `settings` (a dict; None or {}: none)."""
    import contextlib
    if not settings:
        return contextlib.nullcontext()
    import torch._inductor.config
    return torch._inductor.config.patch(settings)


def torch_model_drift(backend, settings, steps):
    """How far torch's own compilation strays here, without hsbn: the Sequential with
    torch.nn.BatchNorm2d (kind "torch_bn") trained on `steps` eagerly and compiled (no
    optimizer step between them, so both see the same weights); returns (the largest
    |compiled - eager| over outputs and gradients, relative to the largest eager value,
    ignoring NaN; whether a NaN was seen)."""
    import torch._dynamo
    torch._dynamo.reset()
    with _inductor_patch(settings):
        eager, model = build("torch_bn", "local"), build("torch_bn", "local")
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        drift, nan = 0.0, False
        for x_np, g_np in steps:
            res = {}
            for name, m, fn in (("eager", eager, eager), ("compiled", model, compiled)):
                for p in m.parameters():
                    p.grad = None
                y = fn(torch.from_numpy(x_np))
                (y * torch.from_numpy(g_np)).sum().backward()
                res[name] = [_np(y)] + [_np(p.grad) for p in m.parameters()]
            for a, b in zip(res["eager"], res["compiled"]):
                nan = nan or bool(np.isnan(a).any() or np.isnan(b).any())
                d = np.abs(a - b)
                if np.isfinite(d).any():
                    scale = max(1.0, float(np.nanmax(np.abs(a))))
                    drift = max(drift, float(np.nanmax(d)) / scale)
    torch._dynamo.reset()
    return drift, nan


def compiled_vs_eager(kind, scope, steps, backend, eval_input=None, lr=0.05, settings=None,
                      eager_function=False, resync=False, dtype="float32", ops=True,
                      device="cpu"):
    with _inductor_patch(settings):
        return _compiled_vs_eager(kind, scope, steps, backend, eval_input, lr, eager_function,
                                  resync, getattr(torch, dtype), ops, device)


def _compiled_vs_eager(kind, scope, steps, backend, eval_input=None, lr=0.05,
                       eager_function=False, resync=False, dtype=torch.float32, ops=True,
                       device="cpu"):
    """Builds `kind` twice (same initial weights) under use_custom_ops(ops): one run eagerly
    (through the custom ops with ops=True, through each layer's autograd.Function, the path
    without ops, with ops="compiled" or with eager_function), one
    through torch.compile(fullgraph=True, backend=a counting `backend`). For each (x, g) of `steps`
    runs a training step on both (forward, backward of sum(out * g), SGD with lr), recording
    outputs and gradients; a step whose x is None switches to eval for one forward of
    eval_input under no_grad, then back to train. Models, inputs and upstream gradients are of
    `dtype`, on `device`. With resync, each step starts the compiled model from the eager one's
    parameters and buffers (copied in place: no recompile), so a step compares one step's
    arithmetic, not two trajectories that round-off may part (the last step's running
    statistics and SGD update are then the final states compared). Returns both runs' records,
    final states, the compiled frame count after each step, dynamo's graph-break counters and
    how many hsbn ops each run passed (ops_calls)."""
    import torch._dynamo
    import torch._dynamo.testing
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    # Named layers get a prefix per model: two layers of one name share round keys.
    eager = build(kind, scope, "eager", ops, device).to(device=device, dtype=dtype)
    model = build(kind, scope, "compiled", ops, device).to(device=device, dtype=dtype)
    from hsbn.torch import _custom_op

    def tensor(a):
        return torch.from_numpy(a).to(device=device, dtype=dtype)

    if eager_function:
        import types
        for m in eager.modules():
            if isinstance(m, hsbn.torch.SyncBatchNorm):
                m.forward = types.MethodType(hsbn.torch.SyncBatchNorm._forward_function, m)
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = (model if backend == "eager" else torch.compile(model, backend=cnt, fullgraph=True))
    out = {"eager": {"y": [], "grads": []}, "compiled": {"y": [], "grads": []}, "frames": [],
           "ops_calls": {"eager": 0, "compiled": 0}}   # (hsbn ops run, by the order token)
    opts = {name: torch.optim.SGD(m.parameters(), lr=lr) for name, m in
            (("eager", eager), ("compiled", model))}
    for x_np, g_np in steps:
        if resync:
            model.load_state_dict(eager.state_dict())
        for name, m, fn in (("eager", eager, eager), ("compiled", model, compiled)):
            order = int(_custom_op.ORDER)
            _step(name, m, fn, x_np, g_np, out, opts, tensor, eval_input)
            out["ops_calls"][name] += int(_custom_op.ORDER) - order
        out["frames"].append(cnt.frame_count)
    out["eager"]["state"] = _state(eager)
    out["compiled"]["state"] = _state(model)
    out.update(_counts())
    layers = [m for m in model.modules() if isinstance(m, hsbn.torch.SyncBatchNorm)]
    eager_layers = [m for m in eager.modules() if isinstance(m, hsbn.torch.SyncBatchNorm)]
    out["samples_seen"] = ([m.samples_seen for m in eager_layers],
                           [m.samples_seen for m in layers])
    out["seqs"] = ([m._seq for m in eager_layers], [m._seq for m in layers])
    return out


def _step(name, m, fn, x_np, g_np, out, opts, tensor, eval_input):
    """One training step (or, for x_np None, one eval forward) of one of the two models."""
    if x_np is None:
        m.eval()
        with torch.no_grad():
            out[name]["y"].append(_np(fn(tensor(eval_input))))
        out[name]["grads"].append(None)
        m.train()
        return
    opts[name].zero_grad()
    y = fn(tensor(x_np))
    (y * tensor(g_np)).sum().backward()
    out[name]["y"].append(_np(y))
    out[name]["grads"].append({k: _np(p.grad) for k, p in m.named_parameters()
                               if p.grad is not None})
    opts[name].step()


def batch_sizes(kind, scope, sizes, backend, settings=None):
    """Training steps of the compiled `kind` with batches of `sizes` (dynamic=None); the frame
    count after each and the recompile reasons."""
    with _inductor_patch(settings):
        return _batch_sizes(kind, scope, sizes, backend)


def _batch_sizes(kind, scope, sizes, backend):
    import torch._dynamo
    import torch._dynamo.testing
    torch._dynamo.reset()
    model = build(kind, scope)
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = (model if backend == "eager" else torch.compile(model, backend=cnt, fullgraph=True))
    frames = []
    rng = np.random.default_rng(5)
    for n in sizes:
        x = torch.from_numpy(rng.standard_normal((n, 3, 8, 8)).astype(np.float32))
        compiled(x).square().sum().backward()
        frames.append(cnt.frame_count)
    return {"frames": frames}
