"""convert_sync_batchnorm and revert_sync_batchnorm."""

import fnmatch
from collections.abc import Mapping

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import client as _client
from ..errors import ConfigurationError
from ._keys import (_KEYED_AT_CONVERSION, op_for_name, _check_scope, _check_group_nodes,
                    _auto_policy, _check_process_group)
from ._layer_check import _LayerCheck
from ._renorm import renorm_options
from ._lagged import lagged_options
from .modules import SyncBatchNorm


class _BatchNormXd(_BatchNorm):
    """What revert_sync_batchnorm gives back for a directly constructed layer that never saw an
    input: BatchNorm for any input of 2 to 5 dimensions."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got %dD input)" % input.dim())


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


def _copy_state(src, dst):
    """Shares src's parameters and buffers with dst and copies its mode (as torch's
    convert_sync_batchnorm does)."""
    if src.affine:
        with torch.no_grad():
            dst.weight = src.weight
            dst.bias = src.bias
    dst.running_mean = src.running_mean
    dst.running_var = src.running_var
    dst.num_batches_tracked = src.num_batches_tracked
    dst.training = src.training
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig


def convert_sync_batchnorm(module, process_group=None, *, scope="global", client=None,
                           layer_scopes=None, name=None, group_nodes=None, auto_warmup=None,
                           auto_max_mean_shift=None, auto_max_log_var_ratio=None,
                           auto_recheck_every=None, renorm_lag=None, renorm_momentum=None,
                           renorm_warmup=None, renorm_r_max=None, renorm_d_max=None,
                           renorm_ramp=None, lagged_damping=None, lagged_warmup=None,
                           lagged_trip=None, lagged_trip_calls=None, lagged_trip_rel=None,
                           lagged_ema=None):
    """Replaces every BatchNorm*d (and torch.nn.SyncBatchNorm) layer in `module` with an
    hsbn.torch.SyncBatchNorm, keeping its parameters, buffers, requires_grad and train/eval
    mode, like torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group). Returns the
    converted module (the same object unless `module` itself is a BatchNorm layer).

    process_group: must be None (torch's argument; hsbn uses scopes).
    scope: the default scope; `layer_scopes` overrides it per layer, either as a mapping from a
      layer's qualified name (as in named_modules(), e.g. "layer1.0.bn1") or a glob pattern
      ("layer1.*") to a scope — exact names first, then patterns in the mapping's order — or as
      a callable (name, module) -> scope or None (None keeps the default).
    name: the model's name (default: its class name, e.g. "ResNet"). Each layer's rounds are
      keyed by "<name>.<qualified name>", so two models trained in one process need different
      names, and every rank must use the same one.
    group_nodes, auto_warmup, auto_max_mean_shift, auto_max_log_var_ratio, auto_recheck_every,
      renorm_lag, renorm_momentum, renorm_warmup, renorm_r_max, renorm_d_max, renorm_ramp,
      lagged_damping, lagged_warmup, lagged_trip, lagged_trip_calls, lagged_trip_rel,
      lagged_ema: given to every new layer (see SyncBatchNorm).

    Layers already of type hsbn.torch.SyncBatchNorm keep their scope and state; those numbered
    in construction order are keyed by their qualified name here (those given name= or op= at
    construction keep it). At the model's first synchronized forward, the ranks compare its
    list of synchronized layers (names, scopes, channels) once; see LayerMismatchError.
    """
    _check_process_group(process_group, "hsbn.torch.convert_sync_batchnorm")
    _check_scope(scope)
    _check_group_nodes(group_nodes)
    auto_kw = dict(auto_warmup=auto_warmup, auto_max_mean_shift=auto_max_mean_shift,
                   auto_max_log_var_ratio=auto_max_log_var_ratio,
                   auto_recheck_every=auto_recheck_every)
    _auto_policy(*auto_kw.values())  # fails here, before anything is converted
    renorm_kw = dict(renorm_lag=renorm_lag, renorm_momentum=renorm_momentum,
                     renorm_warmup=renorm_warmup, renorm_r_max=renorm_r_max,
                     renorm_d_max=renorm_d_max, renorm_ramp=renorm_ramp)
    renorm_options(*renorm_kw.values())
    lagged_kw = dict(lagged_damping=lagged_damping, lagged_warmup=lagged_warmup,
                     lagged_trip=lagged_trip, lagged_trip_calls=lagged_trip_calls,
                     lagged_trip_rel=lagged_trip_rel, lagged_ema=lagged_ema)
    lagged_options(lagged_damping, lagged_warmup, lagged_trip, lagged_trip_calls,
                   lagged_trip_rel, lagged_ema)
    if layer_scopes is not None and not (callable(layer_scopes)
                                         or isinstance(layer_scopes, Mapping)):
        raise ConfigurationError("layer_scopes must be a mapping or a callable, not %r"
                                 % type(layer_scopes).__name__)
    model = type(module).__name__ if name is None else str(name)
    names_seen = set()
    layers = []   # (qualified name, hsbn layer), module order

    def convert(mod, qualified):
        out = mod
        if isinstance(mod, _BatchNorm) and not isinstance(mod, SyncBatchNorm):
            if hasattr(mod, "has_uninitialized_params") and mod.has_uninitialized_params():
                raise ConfigurationError(
                    "layer %r is a lazy BatchNorm that has not seen an input yet; run one "
                    "forward pass (or use BatchNorm*d) before converting" % qualified)
            if mod.affine and mod.weight is not None and mod.bias is None:
                raise ConfigurationError(
                    "layer %r has a weight but no bias (torch >= 2.14's bias=False), which "
                    "hsbn layers do not support yet; build it with bias=True to convert it"
                    % qualified)
            names_seen.add(qualified)
            out = SyncBatchNorm(mod.num_features, mod.eps, mod.momentum, mod.affine,
                                mod.track_running_stats,
                                scope=_layer_scope(qualified, mod, scope, layer_scopes),
                                client=client, op=_KEYED_AT_CONVERSION,
                                group_nodes=group_nodes, **auto_kw, **renorm_kw, **lagged_kw)
            _copy_state(mod, out)
            out._revert_to = type(mod)
        if isinstance(out, SyncBatchNorm):
            layers.append((qualified, out))
        for child_name, child in mod.named_children():
            out.add_module(child_name, convert(child, qualified + "." + child_name
                                               if qualified else child_name))
        return out

    result = convert(module, "")
    if layers and torch.distributed.is_available() and torch.distributed.is_initialized():
        from ._diagnose import _wrapping_ddp   # for hsbn.torch.diagnose's smell
        if _wrapping_ddp(module) is not None:
            for _, layer in layers:
                layer._hsbn_converted_under_ddp = True
    _key_layers(model, layers)
    if isinstance(layer_scopes, Mapping):
        _check_layer_scopes_used(layer_scopes, names_seen)
    return result


def _key_layers(model, layers):
    """Keys the converted layers by name, and gives them the model's layer check. Two names
    whose hashes collide get deterministic second choices, the same on every rank that converts
    the same model."""
    def key(qualified):
        return "%s.%s" % (model, qualified) if qualified and model else (qualified or model)
    taken = {}
    for qualified, layer in layers:
        if layer._key_source in ("name", "op"):
            taken.setdefault(layer.op, layer)
    entries = []
    for qualified, layer in layers:
        if layer._key_source in ("counter", "model"):
            k, probe = key(qualified), 0
            op = op_for_name(k)
            while op in taken and taken[op] is not layer:
                probe += 1
                op = op_for_name("%s#%d" % (k, probe))
            taken[op] = layer
            layer._set_key(op, model, qualified or model, "model")
        if layer.scope != "local":
            entries.append((layer.layer_name or qualified or model, layer.op, layer.scope,
                            layer.num_features))
    check = _LayerCheck(model, entries) if entries else None
    if check is not None:
        _client.set_op_label(check.op, "the layer check of model %r" % model)
    for qualified, layer in layers:
        layer._check = check if layer.scope != "local" else None


def _check_layer_scopes_used(layer_scopes, names_seen):
    """A layer_scopes mapping whose key names no layer (exactly or as a pattern) is a typo."""
    unused = [k for k in layer_scopes
              if k not in names_seen and not any(fnmatch.fnmatchcase(n, k) for n in names_seen)]
    if unused:
        raise ConfigurationError(
            "layer_scopes names no BatchNorm layer for %s; the layers are: %s"
            % (", ".join(repr(k) for k in unused), ", ".join(sorted(names_seen)) or "none"))


def revert_sync_batchnorm(module):
    """The inverse of convert_sync_batchnorm: replaces every hsbn.torch.SyncBatchNorm in
    `module` with the class it was converted from (torch.nn.BatchNorm1d/2d/3d or
    torch.nn.SyncBatchNorm), sharing its parameters and buffers and keeping its mode. A layer
    constructed directly becomes BatchNorm1d/2d/3d after the dimension of its last input, or a
    dimension-agnostic BatchNorm if it never ran. Returns the reverted module (the same object
    unless `module` itself is an hsbn layer)."""
    out = module
    if isinstance(module, SyncBatchNorm):
        cls = module._revert_to
        if cls is None:
            cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
                   5: torch.nn.BatchNorm3d}.get(module._input_dim, _BatchNormXd)
        args = (module.num_features, module.eps, module.momentum, module.affine,
                module.track_running_stats)
        try:
            out = cls(*args)
        except TypeError:  # a BatchNorm subclass with a constructor of its own
            out = _BatchNormXd(*args)
        _copy_state(module, out)
    for child_name, child in module.named_children():
        out.add_module(child_name, revert_sync_batchnorm(child))
    return out
