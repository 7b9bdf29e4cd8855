"""hsbn.torch.SyncBatchNorm and convert_sync_batchnorm.

SyncBatchNorm is torch.nn.SyncBatchNorm with a `scope` instead of a process group: the batch
statistics are reduced by the node's sidecar aggregator over the worker's node ("node"), the
whole job ("global"), or not at all ("local"); "shadow" normalizes with node statistics while
the root measures how far they are from the global ones.

Round keys: a layer's `op` is its index, assigned at construction from a process-wide counter
(convert_sync_batchnorm constructs in module order, so every worker that builds the same model
the same way gets the same indices); `seq` counts the layer's synchronized forward calls on
this worker, and its backward round reuses its forward's seq. Every worker of a job must
therefore run the same synchronized layers, in training mode, the same number of times: a layer
that runs on some workers only leaves the others waiting until the round's deadline.
"""

import fnmatch
import itertools
import threading
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..client import ClientStats, default_client
from ..errors import ConfigurationError
from ._function import SyncBatchNormFunction

SCOPES = ("local", "node", "global", "shadow")

_op_lock = threading.Lock()
_op_counter = itertools.count()


def next_op():
    """The next layer index of this process (0, 1, 2, ... in construction order)."""
    with _op_lock:
        return next(_op_counter) & 0xFFFFFFFF


def _check_scope(scope, where=""):
    if scope not in SCOPES:
        raise ConfigurationError("scope%s must be one of %s, not %r"
                                 % (where, ", ".join(repr(s) for s in SCOPES), scope))
    return scope


class SyncBatchNorm(_BatchNorm):
    r"""BatchNorm over the batch of a scope of workers, synchronized through hsbn's sidecars.

    Args (as torch.nn.SyncBatchNorm):
      num_features: C of an input (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W).
      eps, momentum, affine, track_running_stats: as torch.nn.BatchNorm*; momentum=None is the
        cumulative moving average.
    hsbn's:
      scope: "local" (plain BatchNorm, no exchange), "node", "global" (default) or "shadow".
      client: the hsbn.Client to use; None uses hsbn.default_client(), created from the
        environment at the first synchronized forward.
      op: the layer's round index; None takes the next one from the process-wide counter.

    In training mode the forward pass reduces (count, mean, M2) over the scope, normalizes with
    the scope's mean and biased variance and updates the running statistics with the scope's
    mean and unbiased variance; backward reduces (sum dy, sum dy*(x - mean)) over the scope and
    returns the exact input gradient of BatchNorm over the scope's batch. The weight and bias
    gradients are this worker's share; summed over the scope (DDP's all-reduce) they are
    BatchNorm's. In eval mode the running statistics are used and nothing is exchanged.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, scope="global", client=None, op=None, device=None,
                 dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.scope = _check_scope(scope)
        self.client = client
        self.op = next_op() if op is None else int(op) & 0xFFFFFFFF
        self._seq = 0  # synchronized forward calls so far; not saved: all workers restart at 0

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got %dD input)" % input.dim())

    def extra_repr(self):
        return super().extra_repr() + ", scope={!r}, op={}".format(self.scope, self.op)

    def forward(self, input):
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError("expected input with %d channels, got shape %s"
                             % (self.num_features, list(input.shape)))
        sync = self.training and self.scope != "local"
        # Resolve the client before touching any state: a missing sidecar changes nothing.
        client = None
        if sync:
            client = self.client if self.client is not None else default_client()
        # Exponential average factor, exactly as torch.nn.modules.batchnorm._BatchNorm.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                # Synchronized: 1/n is taken on the device, never read on the host.
                factor = (self.num_batches_tracked if sync
                          else 1.0 / float(self.num_batches_tracked))
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        if not sync:
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, bn_training, factor, self.eps)
        seq = self._seq
        self._seq += 1
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                           running_var, self.eps, factor, client, self.op, seq,
                                           self.scope, getattr(self, "cuda_ops", None))


def _layer_scope(name, module, default, layer_scopes):
    if layer_scopes is None:
        return default
    if callable(layer_scopes) and not isinstance(layer_scopes, Mapping):
        chosen = layer_scopes(name, module)
        return default if chosen is None else _check_scope(chosen, " for layer %r" % name)
    if name in layer_scopes:
        return _check_scope(layer_scopes[name], " for layer %r" % name)
    for pattern, chosen in layer_scopes.items():
        if fnmatch.fnmatchcase(name, pattern):
            return _check_scope(chosen, " for layer %r (pattern %r)" % (name, pattern))
    return default


def convert_sync_batchnorm(module, scope="global", client=None, layer_scopes=None):
    """Replaces every BatchNorm*d (and torch.nn.SyncBatchNorm) layer in `module` with an
    hsbn.torch.SyncBatchNorm, keeping its parameters, buffers, requires_grad and train/eval
    mode, like torch.nn.SyncBatchNorm.convert_sync_batchnorm. Returns the converted module
    (the same object unless `module` itself is a BatchNorm layer).

    Layers get consecutive op indices in module order (module.named_modules()). `scope` is
    the default scope; `layer_scopes` overrides it per layer, either as a mapping from a
    layer's qualified name (as in named_modules(), e.g. "layer1.0.bn1") or a glob pattern
    ("layer1.*") to a scope — exact names first, then patterns in the mapping's order — or as
    a callable (name, module) -> scope or None (None keeps the default). Layers already of
    type hsbn.torch.SyncBatchNorm are left as they are.
    """
    _check_scope(scope)
    if layer_scopes is not None and not (callable(layer_scopes)
                                         or isinstance(layer_scopes, Mapping)):
        raise ConfigurationError("layer_scopes must be a mapping or a callable, not %r"
                                 % type(layer_scopes).__name__)
    names_seen = set()

    def convert(mod, name):
        out = mod
        if isinstance(mod, _BatchNorm) and not isinstance(mod, SyncBatchNorm):
            if hasattr(mod, "has_uninitialized_params") and mod.has_uninitialized_params():
                raise ConfigurationError(
                    "layer %r is a lazy BatchNorm that has not seen an input yet; run one "
                    "forward pass (or use BatchNorm*d) before converting" % name)
            names_seen.add(name)
            out = SyncBatchNorm(mod.num_features, mod.eps, mod.momentum, mod.affine,
                                mod.track_running_stats,
                                scope=_layer_scope(name, mod, scope, layer_scopes),
                                client=client)
            if mod.affine:
                with torch.no_grad():
                    out.weight = mod.weight
                    out.bias = mod.bias
            out.running_mean = mod.running_mean
            out.running_var = mod.running_var
            out.num_batches_tracked = mod.num_batches_tracked
            out.training = mod.training
            if hasattr(mod, "qconfig"):
                out.qconfig = mod.qconfig
        for child_name, child in mod.named_children():
            out.add_module(child_name, convert(child, name + "." + child_name if name
                                               else child_name))
        return out

    result = convert(module, "")
    if isinstance(layer_scopes, Mapping):
        unused = [k for k in layer_scopes
                  if k not in names_seen and not any(fnmatch.fnmatchcase(n, k)
                                                     for n in names_seen)]
        if unused:
            raise ConfigurationError(
                "layer_scopes names no BatchNorm layer for %s; the layers are: %s"
                % (", ".join(repr(k) for k in unused), ", ".join(sorted(names_seen)) or "none"))
    return result


def model_client(module):
    """The hsbn.Client that the synchronized layers (scope other than "local") of `module` use:
    the one given to convert_sync_batchnorm / SyncBatchNorm as client=, or else the process's
    hsbn.default_client() (created from the environment if no synchronized forward has created
    it yet, as that forward would). None when `module` has no synchronized layer. Raises
    ConfigurationError when its layers use different clients."""
    found = []
    for _, m in module.named_modules():
        if isinstance(m, SyncBatchNorm) and m.scope != "local":
            c = m.client if m.client is not None else default_client()
            if not any(c is f for f in found):
                found.append(c)
    if len(found) > 1:
        raise ConfigurationError(
            "the synchronized layers of this module use %d different clients (%s); ask each "
            "one for its .stats()" % (len(found), ", ".join(repr(c) for c in found)))
    return found[0] if found else None


def stats(module):
    """Round statistics of the client `module`'s synchronized layers use (model_client), as an
    hsbn.ClientStats: rounds completed and failed and seconds blocked in them, per scope and
    phase. They count every round made through that client, so models and threads sharing it
    share the counts; take differences (or reset_stats()) to measure one stretch of training.
    All zeros for a module without synchronized layers."""
    client = model_client(module)
    return ClientStats.empty() if client is None else client.stats()
