"""hsbn.torch.SyncBatchNorm, convert_sync_batchnorm and revert_sync_batchnorm.

SyncBatchNorm is torch.nn.SyncBatchNorm with a `scope` instead of a process group: the batch
statistics are reduced by the node's sidecar aggregator over the worker's node ("node"), a
group of group_nodes consecutive nodes ("group"), the whole job ("global"), or not at all
("local"); "shadow" normalizes with node statistics while the root measures how far they are
from the global ones; "auto" runs shadow for a warm-up, then keeps node (group) or takes global
per layer, as the root decides from that record (the same decision on every rank).

Round keys. A round is keyed by (op, seq, phase). `op` names the layer:
  - a layer of a converted model: a 31-bit hash of "<model name>.<qualified name>" (e.g.
    "ResNet.layer2.0.bn1"), in [2**31, 2**32), so it depends on the layer's place in its model
    only, never on what else the process constructed;
  - a layer constructed with name="...": the hash of that name, in the same range;
  - any other directly constructed layer: its construction index in this process, in
    [0, 2**30) (what every layer was keyed by before names);
  - the layer check of a converted model (below): a hash of the model name, in [2**30, 2**31).
`seq` counts the layer's synchronized forward calls; its backward round reuses its forward's.

The layer check. At the first synchronized forward of a converted model, every rank compares
the model's list of synchronized layers (name, scope, channels) through the aggregator, with
backward-phase (summation) rounds on the model's check op: each rank contributes small integer
hashes h and h*h, and W * sum(h*h) == sum(h)**2 holds exactly iff all W ranks sent the same h.
A mismatch is narrowed to its first differing position by bisection over prefixes, the ranks'
layer names there are gathered (each rank writes its name into its own slot of a sum), and
every rank raises LayerMismatchError naming them. See docs/PYTORCH.md.
"""

import fnmatch
import hashlib
import itertools
import math
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .. import client as _client
from ..client import ClientStats, default_client
from ..errors import ConfigurationError, HsbnError, InvalidArgumentError, INVALID_ARGUMENT
from ._function import SyncBatchNormFunction

SCOPES = ("local", "node", "global", "shadow", "group", "auto")
_AUTO_DECISIONS = ("node", "group", "global")
_METADATA_KEY = "hsbn_auto"  # in a layer's state_dict metadata: its auto-scope decision

_COUNTER_OPS = 1 << 30      # directly constructed layers: [0, 2**30)
_CHECK_BASE = 1 << 30       # layer checks of converted models: [2**30, 2**31)
_NAMED_BASE = 1 << 31       # named layers: [2**31, 2**32)

_KEYED_AT_CONVERSION = object()  # op= of a layer that convert_sync_batchnorm keys right after

_op_lock = threading.Lock()
_op_counter = itertools.count()


def next_op():
    """The next construction index of this process (0, 1, 2, ...): the op of a directly
    constructed SyncBatchNorm given neither name= nor op=."""
    with _op_lock:
        return next(_op_counter) % _COUNTER_OPS


def _hash64(text):
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def op_for_name(key):
    """The op of a layer keyed by `key` ("<model name>.<qualified name>", or a name= given at
    construction): a hash of it in [2**31, 2**32)."""
    return _NAMED_BASE | (_hash64(key) & (_NAMED_BASE - 1))


def _check_op_for_model(model_name):
    return _CHECK_BASE | (_hash64("check:" + model_name) & (_CHECK_BASE - 1))


def _check_scope(scope, where=""):
    if scope not in SCOPES:
        raise ConfigurationError("scope%s must be one of %s, not %r"
                                 % (where, ", ".join(repr(s) for s in SCOPES), scope))
    return scope


def _check_group_nodes(group_nodes, where=""):
    if group_nodes is None:
        return None
    if isinstance(group_nodes, bool) or not isinstance(group_nodes, int) or group_nodes < 0:
        raise ConfigurationError("group_nodes%s must be a non-negative int (the nodes per group; "
                                 "0: no groups), not %r" % (where, group_nodes))
    return group_nodes


def _auto_policy(warmup, max_mean_shift, max_log_var_ratio, recheck_every, where=""):
    """The auto-scope policy a layer was given ({} when all are None: the client's defaults,
    HSBN_AUTO_* or 50 / 0.05 / 0.05 / 0); ConfigurationError naming a bad one."""
    given = {"warmup_rounds": warmup, "max_mean_shift": max_mean_shift,
             "max_log_var_ratio": max_log_var_ratio, "recheck_every": recheck_every}
    if all(v is None for v in given.values()):
        return {}
    policy = {"warmup_rounds": 50, "max_mean_shift": 0.05, "max_log_var_ratio": 0.05,
              "recheck_every": 0}
    for k, v in given.items():
        if v is None:
            continue
        if k in ("warmup_rounds", "recheck_every"):
            low = 1 if k == "warmup_rounds" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigurationError("auto scope%s: %s must be an int >= %d, not %r"
                                         % (where, "auto_warmup" if k == "warmup_rounds"
                                            else "auto_recheck_every", low, v))
        else:
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v < 0):
                raise ConfigurationError("auto scope%s: auto_%s must be a finite number >= 0, "
                                         "not %r" % (where, k, v))
            v = float(v)
        policy[k] = v
    return policy


def _check_process_group(process_group, what):
    if process_group is None:
        return
    if isinstance(process_group, str) and process_group in SCOPES:
        raise TypeError("%s: scope is a keyword argument (scope=%r); the positional argument in "
                        "its place is torch's process_group" % (what, process_group))
    raise ConfigurationError(
        "%s does not take a torch.distributed process group: hsbn synchronizes through its "
        "aggregators over a scope. Pass process_group=None (or leave it out) and choose "
        "scope='node' (the workers of this node, what a per-node group is for), "
        "scope='global' (every worker of the job) or scope='local' (no synchronization)"
        % what)


class LayerMismatchError(InvalidArgumentError):
    """The ranks of a job do not have the same synchronized layers in a converted model (raised
    on every rank by the layer check at the model's first synchronized forward).

    model: the model's name; position: the index (in module order) of the first synchronized
    layer that differs; layers: {rank: what that rank has there} when gathered, else only this
    rank's entry."""

    def __init__(self, message, model=None, position=None, layers=None):
        super().__init__(message, INVALID_ARGUMENT)
        self.model = model
        self.position = position
        self.layers = layers or {}


# --- per-client bookkeeping: the next seq of every op, which layer checks passed -----------------

class _ClientBook:
    """What this process has done through one client. seq counts per op, not per layer object:
    a model converted again under the same name (the same keys) goes on where the last one
    stopped, so its rounds never reuse a finished round's key at the aggregator."""

    def __init__(self):
        self.lock = threading.Lock()       # held while a layer check runs
        self.seqs_lock = threading.Lock()
        self.seqs = {}     # op -> itertools.count of its next seq
        self.checks = {}   # (check op, digest) -> None when passed, its LayerMismatchError if not
        self.auto = {}     # op -> the auto-scope policy given to the client (a dict)

    def next_seq(self, op):
        counter = self.seqs.get(op)
        if counter is None:
            with self.seqs_lock:
                counter = self.seqs.setdefault(op, itertools.count())
        return next(counter)


_books = weakref.WeakKeyDictionary()
_books_lock = threading.Lock()


def _book(client):
    try:
        return _books[client]
    except KeyError:
        pass
    with _books_lock:
        book = _books.get(client)
        if book is None:
            book = _ClientBook()
            _books[client] = book
        return book


class _LayerCheck:
    """The list of synchronized layers of one converted model, compared across ranks once.
    Plain data (picklable; copies compare equal and share the client's record of it)."""

    def __init__(self, model, entries):
        self.model = model
        self.entries = tuple(entries)   # (qualified name, op, scope, channels), module order
        self.op = _check_op_for_model(model)
        self.scope = ("global" if any(e[2] in ("global", "shadow", "group", "auto")
                                      for e in self.entries)
                      else "node")
        self.digest = self._prefix_digest(len(self.entries))

    def _prefix_digest(self, p):
        h = hashlib.blake2b(digest_size=8)
        h.update(self.model.encode("utf-8") + b"\0")
        for e in self.entries[:p]:
            h.update(("%s\0%d\0%s\0%d\0" % e).encode("utf-8"))
        h.update(b"\1" * max(0, p - len(self.entries)))  # past the end: one marker per place
        return int.from_bytes(h.digest(), "little")

    @staticmethod
    def _slots(values):
        """Small integers as (h, h*h) arrays; sums over up to 2**20 ranks stay exact."""
        a = np.array(values, dtype=np.float64)
        return a, a * a

    @staticmethod
    def _all_equal(count, sums, squares):
        return all(count * int(q) == int(s) * int(s) for s, q in zip(sums, squares))

    @staticmethod
    def _digest_slots(d):
        return [(d >> (16 * i)) & 0xFFFF for i in range(4)]

    def _round(self, client, book, values):
        a, b = self._slots(values)
        try:
            return client.backward(self.op, book.next_seq(self.op), self.scope, 1, a, b)
        except ConfigurationError:
            raise
        except HsbnError as e:
            hint = ""
            if e.code == INVALID_ARGUMENT:
                hint = (" The ranks disagree on the check itself: some have global or shadow "
                        "layers in model %r where others have only node layers (its scope here "
                        "is %s)." % (self.model, self.scope))
            elif "rank" in str(e):
                hint = (" The ranks named did not run model %r in training mode: every rank "
                        "must convert and run the same models, under the same name=."
                        % self.model)
            raise type(e)(str(e) + hint, e.code) from None

    def describe(self, i):
        if i < len(self.entries):
            name, _, scope, channels = self.entries[i]
            return "%r (%s, %d channels)" % (name, scope, channels)
        return "no layer (its model has %d synchronized layers)" % len(self.entries)

    def run(self, client, book):
        """Compares this list with every rank's; raises LayerMismatchError on all ranks when
        they differ. Every rank makes the same rounds: the decisions depend on sums only."""
        n = len(self.entries)
        count, sums, squares = self._round(
            client, book, [n & 0xFFFF, n >> 16] + self._digest_slots(self.digest))
        if self._all_equal(count, sums, squares):
            return
        # Bisection over prefix lengths: "prefix p equal everywhere" holds for p = 0 and fails
        # for p = the longest list (bounded by the sum of the lengths). Every rank sees the
        # same sums, so all take the same steps.
        lo, hi = 0, max(1, int(sums[0]) + 65536 * int(sums[1]))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            c, s, q = self._round(client, book, self._digest_slots(self._prefix_digest(mid)))
            if self._all_equal(c, s, q):
                lo = mid
            else:
                hi = mid
        pos = hi - 1
        mine = self.describe(pos)
        layers = self._gather(client, book, count, mine)
        me = getattr(client, "rank", 0)
        if layers:
            groups = {}
            for r in sorted(layers):
                groups.setdefault(layers[r], []).append(r)
            there = "; ".join("%s %s: %s" % ("rank" if len(rs) == 1 else "ranks",
                                             _ranges(rs), text) for text, rs in groups.items())
        else:
            layers = {me: mine}
            there = "rank %d (this one): %s; the others have something else" % (me, mine)
        raise LayerMismatchError(
            "the ranks do not have the same synchronized BatchNorm layers in model %r: they "
            "differ first at its synchronized layer #%d (in module order): %s. Every rank must "
            "build and convert the same model with the same scopes and channel counts (look "
            "for rank-dependent code where the model is built)." % (self.model, pos, there),
            model=self.model, position=pos, layers=layers)

    def _gather(self, client, book, count, text, width=16):
        """{rank: text} of every rank in the check's scope: each rank writes its text (6 bytes
        per double, exact) into its own slot of a sum. {} when that would exceed the
        aggregator's channel limit."""
        if count * width > getattr(client, "max_channels", 0):
            return {}
        if self.scope == "global":
            slot = client.rank
        else:
            slot = client.local_rank
        raw = text.encode("utf-8")[:6 * width]
        values = np.zeros(count * width)
        for i in range(0, len(raw), 6):
            values[slot * width + i // 6] = int.from_bytes(raw[i:i + 6], "little")
        _, sums, _ = client.backward(self.op, book.next_seq(self.op), self.scope, 1, values,
                                     values * 0)
        out = {}
        for s in range(count):
            chunk = b"".join(int(v).to_bytes(6, "little")
                             for v in sums[s * width:(s + 1) * width])
            rank = s if self.scope == "global" else \
                client.node_rank * client.local_world_size + s
            out[rank] = chunk.rstrip(b"\0").decode("utf-8", "replace")
        return out


def _ranges(ranks):
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else "%d-%d" % (start, r))
            start = None
    return ", ".join(out)


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
        "shadow" or "auto" (docs/PYTORCH.md, "Group and auto scope").
      group_nodes: nodes per group, for the job (one number per job: it is sent when the
        process's client joins). None: HSBN_GROUP_NODES. Needed by scope="group"; with
        scope="auto" it makes auto choose between group and global instead of node and global.
      auto_warmup, auto_max_mean_shift, auto_max_log_var_ratio, auto_recheck_every: scope="auto"'s
        policy (None: the client's defaults, HSBN_AUTO_* or 50 rounds, 0.05, 0.05, 0 = never).
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
                 scope="global", client=None, name=None, op=None, group_nodes=None,
                 auto_warmup=None, auto_max_mean_shift=None, auto_max_log_var_ratio=None,
                 auto_recheck_every=None):
        _check_process_group(process_group, "hsbn.torch.SyncBatchNorm")
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.scope = _check_scope(scope)
        self.group_nodes = _check_group_nodes(group_nodes)
        self.auto_policy = _auto_policy(auto_warmup, auto_max_mean_shift, auto_max_log_var_ratio,
                                        auto_recheck_every)
        self._auto_decision = None  # {"scope": ..., ...} once decided (or restored)
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

    def forward(self, input):
        if isinstance(input, torch.fx.Proxy):
            # A leaf for torch.fx: one call_module node, whatever the tracer.
            tracer = input.tracer
            return tracer.create_proxy("call_module", tracer.path_of_module(self), (input,), {})
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError("expected input with %d channels, got shape %s"
                             % (self.num_features, list(input.shape)))
        self._input_dim = input.dim()
        sync = self.training and self.scope != "local"
        # Resolve the client before touching any state: a missing sidecar changes nothing.
        client = None
        if sync:
            client = self._client()
            book = _book(client)
            self._check_model(client, book)
            self._warn_about_ddp()
            if self.scope == "auto":
                self._prepare_auto(client, book)
        # Exponential average factor, exactly as torch.nn.modules.batchnorm._BatchNorm.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.samples_seen += input.numel() // max(1, input.shape[1])
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
        return convert_sync_batchnorm(module, process_group, **kwargs)


def _save_auto_decision(module, state_dict, prefix, local_metadata):
    """A state_dict hook: an auto-scope layer's decision goes into its metadata entry (which
    torch.save keeps and load_state_dict hands back), not into a key, so the state_dict still
    loads, strictly, into torch.nn.BatchNorm*d and into models of other scopes."""
    if getattr(module, "scope", None) == "auto" and module._auto_decision is not None:
        local_metadata[_METADATA_KEY] = dict(module._auto_decision)


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
                           auto_recheck_every=None):
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
    group_nodes, auto_warmup, auto_max_mean_shift, auto_max_log_var_ratio, auto_recheck_every:
      given to every new layer (see SyncBatchNorm).

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
    if layer_scopes is not None and not (callable(layer_scopes)
                                         or isinstance(layer_scopes, Mapping)):
        raise ConfigurationError("layer_scopes must be a mapping or a callable, not %r"
                                 % type(layer_scopes).__name__)
    model = type(module).__name__ if name is None else str(name)
    names_seen = set()
    layers = []   # (qualified name, hsbn layer), module order

    def key(qualified):
        return "%s.%s" % (model, qualified) if qualified and model else (qualified or model)

    def convert(mod, qualified):
        out = mod
        if isinstance(mod, _BatchNorm) and not isinstance(mod, SyncBatchNorm):
            if hasattr(mod, "has_uninitialized_params") and mod.has_uninitialized_params():
                raise ConfigurationError(
                    "layer %r is a lazy BatchNorm that has not seen an input yet; run one "
                    "forward pass (or use BatchNorm*d) before converting" % qualified)
            names_seen.add(qualified)
            out = SyncBatchNorm(mod.num_features, mod.eps, mod.momentum, mod.affine,
                                mod.track_running_stats,
                                scope=_layer_scope(qualified, mod, scope, layer_scopes),
                                client=client, op=_KEYED_AT_CONVERSION,
                                group_nodes=group_nodes, **auto_kw)
            _copy_state(mod, out)
            out._revert_to = type(mod)
        if isinstance(out, SyncBatchNorm):
            layers.append((qualified, out))
        for child_name, child in mod.named_children():
            out.add_module(child_name, convert(child, qualified + "." + child_name
                                               if qualified else child_name))
        return out

    result = convert(module, "")
    # Key the layers by name. Two names whose hashes collide get deterministic second
    # choices, the same on every rank that converts the same model.
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
    if isinstance(layer_scopes, Mapping):
        unused = [k for k in layer_scopes
                  if k not in names_seen and not any(fnmatch.fnmatchcase(n, k)
                                                     for n in names_seen)]
        if unused:
            raise ConfigurationError(
                "layer_scopes names no BatchNorm layer for %s; the layers are: %s"
                % (", ".join(repr(k) for k in unused), ", ".join(sorted(names_seen)) or "none"))
    return result


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


def scopes(module):
    """{layer name: scope} of every hsbn SyncBatchNorm in `module` (names as divergence()
    gives them): the scope each uses now. An auto-scope layer shows its decision ("node",
    "group" or "global") once made or restored, "shadow" during its warm-up; auto_decisions()
    gives the numbers behind it."""
    out = {}
    for qualified, m in module.named_modules():
        if isinstance(m, SyncBatchNorm):
            out[m.layer_name or qualified or type(m).__name__] = m.current_scope()
    return out


def auto_decisions(module):
    """{layer name: decision} of the auto-scope layers of `module`: None during the warm-up,
    else {"scope", "mean_shift", "log_var_ratio", "rounds", "decided_at"}: the root's largest
    per-node (per-group) averages over the warm-up and the fewest shadow rounds recorded, and
    the seq of the deciding round (-1 for a decision restored from a state_dict)."""
    out = {}
    for qualified, m in module.named_modules():
        if isinstance(m, SyncBatchNorm) and m.scope == "auto":
            out[m.layer_name or qualified or type(m).__name__] = m.auto_decision
    return out


def divergence(module, groups=False):
    """How far each node's statistics were from the global ones, per synchronized layer of
    `module` in shadow scope (auto scope's warm-up included), as the root has recorded them so
    far: a dict from the layer's name to a list of {"node", "rounds", "mean_shift_avg",
    "mean_shift_max", "var_ratio_avg", "log_var_ratio_abs_avg"} (docs/PROTOCOL.md, "Scopes").
    groups=True: the same per group of a job with groups ("group" instead of "node"). Empty
    when no layer runs in shadow scope or the root has not seen a shadow round yet. The root can
    also keep the record after the job ends (hsbn-aggregator --divergence-dir)."""
    client = model_client(module)
    if client is None:
        return {}
    names = {}
    for qualified, m in module.named_modules():
        if isinstance(m, SyncBatchNorm) and m.op is not None:
            names[int(m.op)] = m.layer_name or qualified or type(m).__name__
    status = client.status(include_upstream=True)
    out = {}
    for job in (status.get("upstream") or {}).get("jobs", []):
        if job.get("jobId") != client.job_id:
            continue
        unit = "group" if groups else "node"
        for d in job.get("groupDivergence" if groups else "divergence", []):
            op = int(d.get("op", 0))
            if op not in names:
                continue
            out.setdefault(names[op], []).append({
                unit: int(d.get("node", 0)),
                "rounds": int(d.get("rounds", 0)),
                "mean_shift_avg": float(d.get("meanShiftAvg", 0.0)),
                "mean_shift_max": float(d.get("meanShiftMax", 0.0)),
                "var_ratio_avg": float(d.get("varRatioAvg", 0.0)),
                "log_var_ratio_abs_avg": float(d.get("logVarRatioAbsAvg", 0.0)),
            })
    for rows in out.values():
        rows.sort(key=lambda r: r["group" if groups else "node"])
    return out

