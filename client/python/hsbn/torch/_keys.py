"""Round keys and the options a synchronized layer is built with.

A round is keyed by (op, seq, phase). `op` names the layer:
  - a layer of a converted model: a 31-bit hash of "<model name>.<qualified name>" (e.g.
    "ResNet.layer2.0.bn1"), in [2**31, 2**32), so it depends on the layer's place in its model
    only, never on what else the process constructed;
  - a layer constructed with name="...": the hash of that name, in the same range;
  - any other directly constructed layer: its construction index in this process, in
    [0, 2**30) (what every layer was keyed by before names);
  - the layer check of a converted model (_layer_check.py): a hash of the model name, in
    [2**30, 2**31).
`seq` counts the layer's synchronized forward calls; its backward round reuses its forward's.
"""

import hashlib
import itertools
import math
import threading

from .. import client as _client
from ..errors import ConfigurationError


# Every scope a layer can have: "local" (no exchange), then the round scopes of hsbn.SCOPES
# (the library's table, read on first use).
SCOPES = _client._Names(None, prefix=("local",))
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
