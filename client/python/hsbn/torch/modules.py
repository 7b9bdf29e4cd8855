"""hsbn.torch.SyncBatchNorm: torch.nn.SyncBatchNorm with a `scope` instead of a process group.

The batch statistics are reduced by the node's sidecar aggregator over the worker's node
("node"), a group of group_nodes consecutive nodes ("group"), the whole job ("global"), or not
at all ("local"); "shadow" normalizes with node statistics while the root measures how far they
are from the global ones; "auto" runs shadow for a warm-up, then keeps node (group) or takes
global per layer, as the root decides from that record (the same decision on every rank);
"renorm" normalizes as with global statistics at the cost of a node round (Batch
Renormalization with the job's statistics of earlier calls; _renorm.py); "lagged" normalizes
and back-propagates with the job's statistics, the other nodes' share one call old, at the
cost of node rounds (_lagged.py).

Round keys are in _keys.py, the layer check in _layer_check.py, conversion in _convert.py,
what a model reports (stats, scopes, divergence) in _inspect.py.
"""

import sys
import warnings
from collections.abc import Mapping

import torch
import torch.fx
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .. import client as _client
from ..client import default_client
from ..errors import ConfigurationError
from ._function import SyncBatchNormFunction, capturing, opaque_to_dynamo, refuse_capture
from . import _custom_op
from ._renorm import RenormFunction, RenormState, recomputing, renorm_options
from ._lagged import LaggedFunction, LaggedState, lagged_options
from ._keys import (_AUTO_DECISIONS, _METADATA_KEY, _KEYED_AT_CONVERSION, next_op,
                    op_for_name, _check_scope, _check_group_nodes, _auto_policy,
                    _check_process_group)
from ._layer_check import LayerMismatchError, _book


_ddp_warned = False


def _ddp_broadcasting_buffers():
    """True when this forward runs inside DistributedDataParallel with broadcast_buffers."""
    ddp_type = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    if ddp_type is None:
        return False
    frame, depth = sys._getframe(2), 0
    while frame is not None and depth < 64:
        obj = frame.f_locals.get("self")
        if isinstance(obj, ddp_type):
            return bool(getattr(obj, "broadcast_buffers", False))
        frame, depth = frame.f_back, depth + 1
    return False


class SyncBatchNorm(_BatchNorm):
    r"""BatchNorm over the batch of a scope of workers, synchronized through hsbn's sidecars.

    Args (as torch.nn.SyncBatchNorm, in its order):
      num_features: C of an input (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W).
      eps, momentum, affine, track_running_stats: as torch.nn.BatchNorm*; momentum=None is the
        cumulative moving average.
      process_group: must be None; a torch.distributed group is refused with an error that
        says which scope to use.
      device, dtype: as torch's.
    hsbn's (keyword only):
      scope: "local" (plain BatchNorm, no exchange), "node", "group", "global" (default),
        "shadow", "auto" (docs/PYTORCH.md, "Group and auto scope"), "renorm" (docs/PYTORCH.md,
        "Renorm scope") or "lagged" (docs/PYTORCH.md, "Lagged scope").
      group_nodes: nodes per group, for the job (one number per job: it is sent when the
        process's client joins). None: HSBN_GROUP_NODES. Needed by scope="group"; with
        scope="auto" it makes auto choose between group and global instead of node and global.
      auto_warmup, auto_max_mean_shift, auto_max_log_var_ratio, auto_recheck_every: scope="auto"'s
        policy (None: the client's defaults, HSBN_AUTO_* or 50 rounds, 0.05, 0.05, 0 = never).
      renorm_lag, renorm_momentum, renorm_warmup, renorm_r_max, renorm_d_max, renorm_ramp:
        scope="renorm"'s options (None: the measured defaults of hsbn.torch._renorm.DEFAULTS);
        lag, warmup and ramp count this layer's training calls, not steps.
      lagged_damping, lagged_warmup, lagged_trip, lagged_trip_calls, lagged_trip_rel,
      lagged_ema:
        scope="lagged"'s options (None: hsbn.torch._lagged.DEFAULTS: damping 1.0, the lagged
        input gradient alone (below 1, mixed with the node-local one); ema 0.8; warm-up: the
        first 20 calls exact global; trip guard relative 4, 30 calls, absolute off).
        lagged_ema=B in [0, 1) takes the other nodes' share, in both passes, as an exponential
        average over the layer's earlier calls (weight B on the older average; 0: their last
        call's). A layer whose job statistics moved between its last two calls more than
        lagged_trip_rel times its usual move, or more than lagged_trip standard deviations,
        runs its next lagged_trip_calls calls exact global (docs/PYTORCH.md, "Lagged scope").
      client: the hsbn.Client to use; None uses hsbn.default_client(), created from the
        environment at the first synchronized forward.
      name: the layer's round key; every rank must give the same layer the same name. Without
        it the layer is numbered in construction order, until convert_sync_batchnorm keys it
        by its qualified name in its model.
      op: a raw round key (overrides name).

    In training mode the forward pass reduces (count, mean, M2) over the scope, normalizes with
    the scope's mean and biased variance and updates the running statistics with the scope's
    mean and unbiased variance; backward reduces (sum dy, sum dy*(x - mean)) over the scope and
    returns the exact input gradient of BatchNorm over the scope's batch. The weight and bias
    gradients are this worker's share; summed over the scope (DDP's all-reduce) they are
    BatchNorm's. In eval mode the running statistics are used and nothing is exchanged.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, device=None, dtype=None, *,
                 bias=True, scope="global", client=None, name=None, op=None, group_nodes=None,
                 auto_warmup=None, auto_max_mean_shift=None, auto_max_log_var_ratio=None,
                 auto_recheck_every=None, renorm_lag=None, renorm_momentum=None,
                 renorm_warmup=None, renorm_r_max=None, renorm_d_max=None, renorm_ramp=None,
                 lagged_damping=None, lagged_warmup=None, lagged_trip=None,
                 lagged_trip_calls=None, lagged_trip_rel=None, lagged_ema=None):
        _check_process_group(process_group, "hsbn.torch.SyncBatchNorm")
        _check_bias(bias, affine, "hsbn.torch.SyncBatchNorm")
        _custom_ops_from_env()
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.scope = _check_scope(scope)
        self.group_nodes = _check_group_nodes(group_nodes)
        self.auto_policy = _auto_policy(auto_warmup, auto_max_mean_shift, auto_max_log_var_ratio,
                                        auto_recheck_every)
        self._auto_decision = None  # {"scope": ..., ...} once decided (or restored)
        self._renorm = RenormState(renorm_options(renorm_lag, renorm_momentum, renorm_warmup,
                                                  renorm_r_max, renorm_d_max, renorm_ramp))
        self._lagged = LaggedState(lagged_options(lagged_damping, lagged_warmup, lagged_trip,
                                                  lagged_trip_calls, lagged_trip_rel,
                                                  lagged_ema))
        self._auto_restore = None   # a decision loaded from a state_dict, for the client
        self._register_state_dict_hook(_save_auto_decision)
        self.client = client
        self._seq = 0  # this object's synchronized forward calls (round seqs count per op)
        self._check = None      # the _LayerCheck of the model this layer was converted in
        self._revert_to = None  # the class it was converted from
        self._input_dim = None  # the dimension of its last input (for revert)
        # Values per channel that went into the running statistics through this object (its
        # own input, N * spatial per training forward): sync_running_stats weights ranks by it.
        # Not in the state_dict (which stays torch's); 0 means "no record".
        self.samples_seen = 0
        # This object's key in _custom_op's registry (torch >= 2.4's ops find it by it).
        self._hsbn_key = _custom_op.register(self)
        if op is _KEYED_AT_CONVERSION:
            self.op, self.model_name, self.layer_name, self._key_source = None, None, None, "model"
        elif op is not None:
            self._set_key(int(op) & 0xFFFFFFFF, None, None, "op")
        elif name is not None:
            self._set_key(op_for_name(str(name)), None, str(name), "name")
        else:
            self._set_key(next_op(), None, None, "counter")

    def _set_key(self, op, model, name, source):
        self.op = op
        self.model_name = model
        self.layer_name = name
        self._key_source = source  # "counter", "model" (converted), "name" or "op"
        _client.set_op_label(op, self._label())

    def _label(self):
        if self.layer_name is None:
            if self._key_source == "op":
                return "layer op=%d" % self.op
            return "unnamed layer #%d (numbered in construction order)" % self.op
        if self.model_name is not None:
            return "layer %r of model %r" % (self.layer_name, self.model_name)
        return "layer %r" % self.layer_name

    def __setstate__(self, state):
        super().__setstate__(state)
        # Pickles from before names: keyed by their op.
        self.__dict__.setdefault("_check", None)
        self.__dict__.setdefault("_revert_to", None)
        self.__dict__.setdefault("_input_dim", None)
        self.__dict__.setdefault("model_name", None)
        self.__dict__.setdefault("layer_name", None)
        self.__dict__.setdefault("_key_source", "op")
        self.__dict__.setdefault("group_nodes", None)
        self.__dict__.setdefault("auto_policy", {})
        self.__dict__.setdefault("_auto_decision", None)
        self.__dict__.setdefault("_auto_restore", None)
        self.__dict__.setdefault("samples_seen", 0)
        self.__dict__.setdefault("_renorm", RenormState(renorm_options()))
        self.__dict__.setdefault("_lagged", LaggedState(lagged_options()))
        self._hsbn_key = _custom_op.register(self)  # a copy is a layer of its own
        _client.set_op_label(self.op, self._label())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        saved = (local_metadata or {}).get(_METADATA_KEY)
        if saved is None or self.scope != "auto":
            return
        if not isinstance(saved, Mapping) or saved.get("scope") not in _AUTO_DECISIONS:
            error_msgs.append("%s: the saved auto-scope decision %r is not one of %s"
                              % (self._label(), saved, ", ".join(_AUTO_DECISIONS)))
            return
        self._auto_decision = dict(saved)
        self._auto_decision["decided_at"] = -1  # restored, not decided in this run
        self._auto_restore = saved["scope"]

    @property
    def auto_decision(self):
        """This auto-scope layer's decision ({"scope", "mean_shift", "log_var_ratio", "rounds",
        "decided_at"}), None during its warm-up or for other scopes."""
        return dict(self._auto_decision) if self._auto_decision is not None else None

    def current_scope(self):
        """The scope this layer's next training forward uses: its scope, or for "auto" the
        decided scope ("shadow" during the warm-up)."""
        if self.scope != "auto":
            return self.scope
        return self._auto_decision["scope"] if self._auto_decision is not None else "shadow"

    @property
    def renorm_options(self):
        """The renorm options of this layer ({"lag", "momentum", "warmup", "r_max", "d_max",
        "ramp"}); used when its scope is "renorm"."""
        return dict(self._renorm.options)

    @property
    def lagged_options(self):
        """The lagged options of this layer ({"damping", "warmup", "trip", "trip_rel",
        "trip_calls", "ema"}); used
        when its scope is "lagged"."""
        return dict(self._lagged.options)

    @property
    def lagged_trips(self):
        """The trip guard's record of this lagged layer: a list of (training call, round seq,
        v), one per trip, the same on every rank."""
        return list(self._lagged.trips)

    @property
    def lagged_damping(self):
        """The weight lambda of the lagged input gradient against the node-local one that this
        lagged layer's backward uses now (its lagged_damping option until a guard changes it:
        set it alike on every rank, from values every rank has)."""
        return self._lagged.lam

    @lagged_damping.setter
    def lagged_damping(self, value):
        self._lagged.lam = lagged_options(damping=value)["damping"]

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got %dD input)" % input.dim())

    def extra_repr(self):
        key = ", name={!r}".format(self.layer_name) if self.layer_name is not None else ""
        if self.scope == "auto":
            key += ", current={!r}".format(self.current_scope())
        return super().extra_repr() + ", scope={!r}{}, op={}".format(self.scope, key, self.op)

    def _check_model(self, client, book):
        """Runs the layer check of this layer's model once per client (and again if it
        failed: every rank fails it alike)."""
        check = self._check
        if check is None:
            return
        key = (check.op, check.digest)
        if key in book.checks and book.checks[key] is None:
            return
        with book.lock:
            if key in book.checks:
                if book.checks[key] is None:
                    return
                raise book.checks[key]
            try:
                check.run(client, book)
            except LayerMismatchError as e:
                book.checks[key] = e
                raise
            book.checks[key] = None

    def _fx_leaf_or_check(self, input):
        """Under torch.fx: the layer as a leaf (one call_module node, whatever the tracer).
        Otherwise None, after the input's checks (dimensions, channels), both forwards' first."""
        if isinstance(input, torch.fx.Proxy):
            tracer = input.tracer
            return tracer.create_proxy("call_module", tracer.path_of_module(self), (input,), {})
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError("expected input with %d channels, got shape %s"
                             % (self.num_features, list(input.shape)))
        return None

    # Whether CUDA inputs take the ops path too (use_custom_ops(..., cuda=True)). Off by
    # default: the ops path has run on CPU only (no GPU was lent to #35's sessions), and code
    # that never ran on a GPU is not the default on one.
    _ops_on_cuda = False

    @classmethod
    def _ops_for_device(cls, input):
        return input.device.type == "cpu" or (cls._ops_on_cuda and input.device.type == "cuda")

    def _forward_selecting(self, input):
        """forward once use_custom_ops(True): the ops path for CPU inputs, and for CUDA inputs
        where use_custom_ops(..., cuda=True) asked for it; the function path otherwise."""
        if isinstance(input, torch.fx.Proxy) or self._ops_for_device(input):
            return self._forward_ops(input)
        return self._forward_function(input)

    def _forward_traced(self, input):
        """forward by default where torch has custom ops (use_custom_ops("compiled")): the ops
        path when torch.compile or torch.export traces the layer on CPU tensors (CUDA ones too
        with cuda=True), the function when it runs eagerly (cheaper in host time;
        docs/PYTORCH.md)."""
        if isinstance(input, torch.fx.Proxy) or (torch.compiler.is_compiling()
                                                 and self._ops_for_device(input)):
            return self._forward_ops(input)
        return self._forward_function(input)

    def _forward_ops(self, input):
        """forward on torch >= 2.4: traceable by dynamo (torch.compile(fullgraph=True),
        torch.export); a synchronized training forward is the custom op hsbn::sync_batch_norm
        (_custom_op.py), whose run does the Python-side bookkeeping of _forward_function."""
        leaf = self._fx_leaf_or_check(input)
        if leaf is not None:
            return leaf
        sync = self.training and self.scope != "local"
        compiling = torch.compiler.is_compiling()
        if sync:
            if not compiling and capturing(input):
                raise refuse_capture(self._label(), self.scope)
            # renorm and lagged count their running-statistics updates inside the op.
            if (self.track_running_stats and self.num_batches_tracked is not None
                    and self.scope not in _custom_op.LATE_SCOPES):
                self.num_batches_tracked.add_(1)
            return _custom_op.layer_forward(self, input)
        factor = 0.0 if self.momentum is None else self.momentum
        if compiling:
            if self.training:
                _custom_op.note_local_forward(self, input)
        else:
            self._input_dim = input.dim()
            if self.training and self.track_running_stats:
                self.samples_seen += input.numel() // max(1, input.shape[1])
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        return F.batch_norm(
            input,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight, self.bias, bn_training, factor, self.eps)

    def _prepare_round(self):
        """(client, book) for a synchronized forward of the ops path, after the checks and
        notes _forward_function makes before its round."""
        client = self._client()
        book = _book(client)
        self._check_model(client, book)
        self._name_for_status(client, book)
        self._warn_about_ddp()
        if self.scope == "auto":
            self._prepare_auto(client, book)
        return client, book

    def _after_auto_round(self, client):
        if self._auto_decision is None or self.auto_policy.get("recheck_every"):
            decided = client.auto_decision(self.op)
            if decided is not None:
                self._auto_decision = decided

    @opaque_to_dynamo  # its rounds and Python-side state are not for tracing (docs/PYTORCH.md)
    def forward(self, input):
        """The function path: SyncBatchNormFunction, opaque to dynamo; the forward on torch < 2.4,
        and eagerly by default on later torch (also
        SyncBatchNorm._forward_function, which the ops path calls for what it does not take)."""
        leaf = self._fx_leaf_or_check(input)
        if leaf is not None:
            return leaf
        self._input_dim = input.dim()
        sync = self.training and self.scope != "local"
        if sync and capturing(input):
            raise refuse_capture(self._label(), self.scope)
        # Resolve the client before touching any state: a missing sidecar changes nothing.
        client = None
        if sync:
            client = self._client()
            book = _book(client)
            self._check_model(client, book)
            self._name_for_status(client, book)
            self._warn_about_ddp()
            if self.scope == "auto":
                self._prepare_auto(client, book)
        # Exponential average factor, exactly as torch.nn.modules.batchnorm._BatchNorm.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.samples_seen += input.numel() // max(1, input.shape[1])
        if sync and self.scope == "renorm":
            return self._renorm_forward(input, client, book)
        if sync and self.scope == "lagged":
            return self._lagged_forward(input, client, book)
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
        seq = book.next_seq(self.op)
        self._seq += 1
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        out = SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                          running_var, self.eps, factor, client, self.op, seq,
                                          self.scope, getattr(self, "cuda_ops", None))
        if self.scope == "auto" and (self._auto_decision is None
                                     or self.auto_policy.get("recheck_every")):
            decided = client.auto_decision(self.op)
            if decided is not None:
                self._auto_decision = decided
        return out

    def _renorm_forward(self, input, client, book):
        seq = book.next_seq(self.op)
        self._seq += 1
        self._renorm.note_call(seq)
        recompute = recomputing()
        track = self.track_running_stats
        # The running statistics take the global statistics of seq - lag at the calls that use
        # them, never a recomputation's: num_batches_tracked counts those updates.
        factor = 0.0 if self.momentum is None else self.momentum
        if track and not recompute and self._renorm.uses_global(seq):
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    factor = self.num_batches_tracked
        return RenormFunction.apply(input, self.weight, self.bias,
                                    self.running_mean if track else None,
                                    self.running_var if track else None, self.eps, factor,
                                    client, self.op, seq, self._renorm, recompute,
                                    getattr(self, "cuda_ops", None))

    def _lagged_forward(self, input, client, book):
        seq = book.next_seq(self.op)
        self._seq += 1
        track = self.track_running_stats
        # The running statistics (and num_batches_tracked, which counts their updates) take
        # the job's exact statistics inside the function: one call late (_lagged.py).
        return LaggedFunction.apply(input, self.weight, self.bias,
                                    self.running_mean if track else None,
                                    self.running_var if track else None,
                                    self.num_batches_tracked if track else None, self.eps,
                                    self.momentum, client, self.op, seq, self._lagged,
                                    recomputing(), getattr(self, "cuda_ops", None))

    def _name_for_status(self, client, book):
        """Tells the aggregators this layer's name once per client, so that their Status and
        divergence record say "model:layer" instead of an op number."""
        send = getattr(client, "name_layers", None)  # None: a client without aggregators
        if send is None or self.layer_name is None or self.op in book.named:
            return
        book.named.add(self.op)
        name = (self.layer_name if self.model_name is None
                else "%s:%s" % (self.model_name, self.layer_name))
        send({self.op: name})

    def _client(self):
        if self.client is not None:
            have = getattr(self.client, "group_nodes", 0)
            if self.group_nodes is not None and self.group_nodes != have:
                raise ConfigurationError(
                    "%s asks for group_nodes=%d, but its client joined with group_nodes=%d; "
                    "create the hsbn.Client with group_nodes=%d"
                    % (self._label(), self.group_nodes, have, self.group_nodes))
            return self.client
        return default_client(group_nodes=self.group_nodes)

    def _prepare_auto(self, client, book):
        """Gives the client this layer's auto-scope policy (once) and a restored decision."""
        if self.auto_policy and book.auto.get(self.op) != self.auto_policy:
            client.set_auto_policy(self.op, **self.auto_policy)
            book.auto[self.op] = dict(self.auto_policy)
        if self._auto_restore is not None:
            client.set_auto_decision(self.op, self._auto_restore)
            self._auto_restore = None

    def _warn_about_ddp(self):
        # Looked for at the layer's 1st, 2nd, 4th, 8th, ... synchronized forward (cheap, and a
        # model wrapped in DDP after a first forward is still seen), once per process.
        global _ddp_warned
        seq = self._seq
        if (_ddp_warned or self.scope not in ("node", "shadow", "group", "auto") or seq & (seq - 1)
                or seq > 1024):
            return
        if _ddp_broadcasting_buffers():
            _ddp_warned = True
            warnings.warn(
                "hsbn: %s runs in %s scope under DistributedDataParallel with "
                "broadcast_buffers=True (DDP's default): DDP copies rank 0's running "
                "statistics to every worker at each forward, so every node ends up with node "
                "0's running mean and variance. Pass broadcast_buffers=False to "
                "DistributedDataParallel to keep each node's own." % (self._label(), self.scope),
                UserWarning, stacklevel=3)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None, **kwargs):
        """hsbn.torch.convert_sync_batchnorm, as torch.nn.SyncBatchNorm's classmethod."""
        from ._convert import convert_sync_batchnorm
        return convert_sync_batchnorm(module, process_group, **kwargs)


def _save_auto_decision(module, state_dict, prefix, local_metadata):
    """A state_dict hook: an auto-scope layer's decision goes into its metadata entry (which
    torch.save keeps and load_state_dict hands back), not into a key, so the state_dict still
    loads, strictly, into torch.nn.BatchNorm*d and into models of other scopes."""
    if getattr(module, "scope", None) == "auto" and module._auto_decision is not None:
        local_metadata[_METADATA_KEY] = dict(module._auto_decision)


# The function path under its second name; use_custom_ops makes _forward_selecting (the ops
# path for CPU inputs, torch >= 2.4) or _forward_traced (the ops where traced) the forward.
SyncBatchNorm._forward_function = SyncBatchNorm.forward


def _check_bias(bias, affine, where):
    """torch 2.14's BatchNorm takes bias=False (a weight without a bias); hsbn's layers do not
    yet: refused by name rather than given a bias the model did not ask for."""
    if bias not in (True, False):
        raise ConfigurationError("%s: bias must be True or False, not %r" % (where, bias))
    if not bias and affine:
        raise ConfigurationError(
            "%s: bias=False (a weight without a bias, torch >= 2.14) is not supported by hsbn "
            "layers yet; keep bias=True, or use affine=False and a scale of your own" % where)


def use_custom_ops(flag=True, cuda=None):
    """Which path hsbn layers on CPU tensors take (torch >= 2.4 for the ops; _custom_op.py):
    True: torch custom ops, eager and traced, which torch.compile(fullgraph=True) and
    torch.export trace whole; "compiled": the ops where torch.compile or torch.export traces the
    layer, the autograd.Function where it runs eagerly (the default where torch has custom ops:
    the function costs less host time eagerly); False: the autograd.Function everywhere, which
    dynamo does not trace (the default on older torch). HSBN_TORCH_CUSTOM_OPS=1 / 0 choose True /
    False at the first layer. ConfigurationError for the ops on a torch without them.
    CUDA inputs keep the function unless `cuda=True` (an opt-in, off by default: the ops path
    has not run on a GPU yet, issue #35); then they take the path `flag` chose for CPU ones.
    `cuda=None` keeps the CUDA choice as it is; `cuda=True` with flag False is refused."""
    global _custom_ops_chosen
    if flag not in (True, False, "compiled"):
        raise ConfigurationError("hsbn.torch.use_custom_ops: True, False or \"compiled\", not %r"
                                 % (flag,))
    if cuda not in (None, True, False):
        raise ConfigurationError("hsbn.torch.use_custom_ops: cuda is True, False or None, not %r"
                                 % (cuda,))
    if flag and not _custom_op.ENABLED:
        raise ConfigurationError(
            "hsbn.torch.use_custom_ops: torch %s has no torch.library.custom_op (torch >= 2.4 "
            "has it); hsbn layers keep their autograd.Function here" % torch.__version__)
    if cuda and not flag:
        raise ConfigurationError(
            "hsbn.torch.use_custom_ops(False, cuda=True): CUDA inputs take the ops path that "
            "CPU inputs take; choose True or \"compiled\" for them")
    _custom_ops_chosen = True
    SyncBatchNorm.forward = (SyncBatchNorm._forward_traced if flag == "compiled" else
                             SyncBatchNorm._forward_selecting if flag else
                             SyncBatchNorm._forward_function)
    if not flag:
        SyncBatchNorm._ops_on_cuda = False
    elif cuda is not None:
        SyncBatchNorm._ops_on_cuda = cuda


_custom_ops_chosen = False  # use_custom_ops was called, or HSBN_TORCH_CUSTOM_OPS was read


def _custom_ops_from_env():
    """Chooses the path when the process makes its first layer, unless use_custom_ops chose it
    before: HSBN_TORCH_CUSTOM_OPS=1 the ops (refused on a torch without them), 0 the
    function, unset "compiled" where torch has the ops, else the function."""
    global _custom_ops_chosen
    if _custom_ops_chosen:
        return
    from .. import env as _env
    # (is_set first: a layer can be made where the native library is not, e.g. to load weights)
    value = _env.get("HSBN_TORCH_CUSTOM_OPS") if _env.is_set("HSBN_TORCH_CUSTOM_OPS") else ""
    _custom_ops_chosen = True
    if value == "1" and not _custom_op.ENABLED:
        raise ConfigurationError(
            "HSBN_TORCH_CUSTOM_OPS=1: torch %s has no torch.library.custom_op (torch >= 2.4 "
            "has it); unset it, hsbn layers keep their autograd.Function here"
            % torch.__version__)
    if value:
        use_custom_ops(value == "1")
    else:
        use_custom_ops("compiled" if _custom_op.ENABLED else False)


def custom_ops_on_cuda():
    """Whether CUDA inputs take the path custom_ops_in_use() names (use_custom_ops(..., cuda=
    True)) rather than the autograd.Function (the default)."""
    _custom_ops_from_env()
    return SyncBatchNorm._ops_on_cuda


def custom_ops_in_use():
    """The path layers on CPU tensors take now, as use_custom_ops takes it: True (the ops,
    eager and traced), "compiled" (the ops where traced, the function eagerly) or False (the
    function)."""
    _custom_ops_from_env()
    forward = SyncBatchNorm.forward
    if forward is SyncBatchNorm._forward_selecting:
        return True
    return "compiled" if forward is SyncBatchNorm._forward_traced else False
