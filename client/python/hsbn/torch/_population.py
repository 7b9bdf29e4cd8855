"""Running statistics that do not depend on the rank: sync_running_stats and precise_bn.

Both pool per-channel statistics over a scope with hsbn's own forward rounds: a forward round
is Chan's merge of every member's (count, mean, m2), so it returns exactly the pooled count,
mean and sum of squared deviations.

Round keys. Every call first makes a check round (backward phase, a sum) on CALL_OP (and
sync_running_stats a forward round there too, for the layers without a record), then one
forward round per layer on the layer's own op. All of them use seq = SEQ_BASE + n, where n
counts this client's calls of either function: layer rounds count their seqs from 0 and never
get near 2**62, so the keys cannot collide with training rounds (op is 32 bits and every value
of it may be some layer's, which is why the range is in seq). Every rank must make the same
calls in the same order with the same model and scope; the check round tells when they do not.
"""

import hashlib
import warnings

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import client as _client
from ..client import default_client
from ..errors import ConfigurationError, HsbnError, InvalidArgumentError, INVALID_ARGUMENT
from .modules import SyncBatchNorm
from ._inspect import model_client
from ._layer_check import _book
from ._ops import ops_for
from ._keys import _CHECK_BASE, _hash64

SEQ_BASE = 1 << 62
CALL_OP = _CHECK_BASE | (_hash64("hsbn.torch running statistics") & (_CHECK_BASE - 1))
_client.set_op_label(CALL_OP, "hsbn.torch's running-statistics check")
_CALLS = ("running statistics", )   # the book's counter of these calls
_DIGEST_SLOTS = 4   # 16 bits each: sums of their squares stay exact up to 2**20 ranks


def _pool_scopes():
    return tuple(s for s in ("node", "group", "global") if s in _client.SCOPES)


def _check_pool_scope(scope, what):
    scopes = _pool_scopes()
    if scope not in scopes:
        raise ConfigurationError("%s: scope must be one of %s, not %r"
                                 % (what, ", ".join(repr(s) for s in scopes), scope))


def _layers(model):
    """(name, layer) of every hsbn SyncBatchNorm of `model` that keeps running statistics, in
    module order."""
    out = []
    for qualified, m in model.named_modules():
        if (isinstance(m, SyncBatchNorm) and m.track_running_stats
                and m.running_mean is not None and m.running_var is not None):
            if m.op is None:
                raise ConfigurationError("layer %r has no round key yet" % qualified)
            out.append((m.layer_name or qualified or type(m).__name__, m))
    return out


def _client_for(model, client):
    if client is not None:
        return client
    c = model_client(model)
    return c if c is not None else default_client()


def _digest(kind, scope, layers):
    h = hashlib.blake2b(digest_size=8)
    h.update(("%s\0%s\0" % (kind, scope)).encode("utf-8"))
    for name, m in layers:
        h.update(("%s\0%d\0%d\0" % (name, int(m.op), m.num_features)).encode("utf-8"))
    d = int.from_bytes(h.digest(), "little")
    return [(d >> (16 * i)) & 0xFFFF for i in range(_DIGEST_SLOTS)]


def _fail(e, what, scope, seq, round_name):
    if isinstance(e, ConfigurationError):
        return e
    hint = (" (%s of %s: every rank in scope %r must call %s at the same point, with the same "
            "model and scope; a rank that did not call it, or called it with another model, "
            "shows as a missing or mismatched member of this round, key op=%d seq=%d)"
            % (round_name, what, scope, what, CALL_OP, seq))
    err = type(e)(str(e) + hint, e.code)
    err.reason = e.reason
    return err


def _start(kind, model, scope, client, no_record=None):
    """The call's seq and its check round: every rank in the scope must have the same layers
    (names, keys, channels) and call the same function with the same scope. With `no_record`
    (1 per layer where this rank has no sample count), a second round (forward phase, same
    key) tells every rank which layers lack a record somewhere in the scope. Returns (seq,
    layers, per layer: whether some rank of the scope has no record)."""
    layers = _layers(model)
    book = _book(client)
    seq = SEQ_BASE + book.next_seq(_CALLS)
    a = np.array(_digest(kind, scope, layers), dtype=np.float64)
    try:
        count, sums, squares = client.backward(CALL_OP, seq, scope, 1, a, a * a)
    except HsbnError as e:
        raise _fail(e, kind, scope, seq, "the check round") from None
    if not all(count * int(q) == int(s) * int(s) for s, q in zip(sums, squares)):
        raise InvalidArgumentError(
            "%s: the %d ranks of scope %r did not call it alike: they differ in the function "
            "called (sync_running_stats or precise_bn), its scope, or the model's layers with "
            "running statistics (names, round keys, channels; this rank has %d). Every rank "
            "in the scope must make the same calls with the same model"
            % (kind, count, scope, len(layers)), INVALID_ARGUMENT)
    lacking = [False] * len(layers)
    if no_record is not None and layers:
        flags = np.array(no_record, dtype=np.float64)
        try:
            _, share, _ = client.forward(CALL_OP, seq, scope, 1, flags, np.zeros_like(flags))
        except HsbnError as e:
            raise _fail(e, kind, scope, seq, "the record round") from None
        lacking = [bool(v > 0) for v in share]
    return seq, layers, lacking

def _pool(client, kind, scope, seq, name, m, count, mean, m2):
    """One forward round of layer m: returns the scope's (count, mean, m2) as float64 numpy."""
    try:
        return client.forward(int(m.op), seq, scope, int(count), mean, m2)
    except HsbnError as e:
        raise _fail(e, kind, scope, seq, "the round of layer %r" % name) from None


def _to_numpy(t):
    return t.detach().to("cpu", torch.float64).numpy().copy()


def _store(buf, values):
    with torch.no_grad():
        buf.copy_(torch.from_numpy(values).to(device=buf.device, dtype=buf.dtype))


def sync_running_stats(model, scope="global", *, client=None):
    """Pools the running mean and variance of every hsbn SyncBatchNorm of `model` (any scope,
    local ones included) over `scope` ("node", "group" where the job has groups, or "global"),
    so that every rank in the scope ends with the same statistics, whoever saves the
    checkpoint.

    Each rank's running statistics stand for the data it normalized in training, weighted by
    what it saw: w = the layer's samples_seen (values per channel of this rank's own inputs
    that went into its running statistics since the layer object was made). The result is the
    law of total variance over the ranks' records:
        mean = sum(w_r * mean_r) / W
        var  = sum(w_r * (var_r + (mean_r - mean)**2)) / W,   W = sum(w_r)
    (one forward round per layer: Chan's merge of (w_r, mean_r, w_r * var_r) gives exactly
    these). Pooling again changes nothing. A layer for which some rank of the scope has no
    record (samples_seen == 0: a model loaded from a checkpoint, a plain torch one included,
    and not trained since in this process) is pooled with equal weights on every rank, and a
    RuntimeWarning says so.

    Every rank in the scope must call it at the same point with the same model and scope: the
    first round compares them and raises InvalidArgumentError on every rank when they differ;
    a rank that never calls it makes the others fail after the round timeout with an error
    that names the missing ranks. Returns {layer name: W}."""
    what = "hsbn.torch.sync_running_stats"
    _check_pool_scope(scope, what)
    client = _client_for(model, client)
    layers = _layers(model)
    no_record = [1 if m.samples_seen <= 0 else 0 for _, m in layers]
    seq, layers, lacking = _start(what, model, scope, client, no_record)
    equal = [name for (name, _), n in zip(layers, lacking) if n]
    if equal:
        warnings.warn(
            "%s: %d layer(s) have no record of samples seen on some rank of scope %r (%s); "
            "they are pooled with equal weights per rank" % (
                what, len(equal), scope, ", ".join(equal[:5]) + (", ..." if len(equal) > 5
                                                                 else "")),
            RuntimeWarning, stacklevel=2)
    out = {}
    for (name, m), n_lacking in zip(layers, lacking):
        w = 1 if n_lacking else int(m.samples_seen)
        mean = _to_numpy(m.running_mean)
        var = _to_numpy(m.running_var)
        total, pooled_mean, pooled_m2 = _pool(client, what, scope, seq, name, m, w, mean,
                                              w * var)
        _store(m.running_mean, pooled_mean)
        _store(m.running_var, pooled_m2 / float(total))
        out[name] = int(total)
    return out


class _Moments:
    """Per-channel (count, mean, m2) of everything seen, in float64 on the input's device,
    merged batch by batch with Chan's formula. Each batch's moments come from the layer's op
    set (the same local_moments as a training forward), so no float64 copy of a whole input is
    made."""

    def __init__(self):
        self.n = 0
        self.mean = None
        self.m2 = None

    def add(self, layer, x):
        nb, packed = ops_for(x, getattr(layer, "cuda_ops", None)).local_moments(x.detach(),
                                                                                layer.eps)
        if nb == 0:
            return
        mb, m2b = packed[0], packed[1]
        if self.n == 0:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta.pow(2) * (self.n * nb / n)
        self.n = n


def precise_bn(model, batches, scope="global", *, num_batches=None, forward=None, client=None):
    """Recomputes the population statistics of every hsbn SyncBatchNorm of `model` over the
    batches of every rank in `scope` ("node", "group" where the job has groups, or "global"),
    as Detectron2's PreciseBN does, but pooled exactly.

    batches: an iterable of inputs; each is run as model(batch), or forward(model, batch) when
      `forward` is given (for a loader that yields (input, target) pairs:
      forward=lambda m, b: m(b[0])). num_batches: use at most this many. Ranks may run
      different numbers of batches of different sizes, none included.

    One pass in training mode under torch.no_grad(): every layer's input is accumulated (each
    batch's per-channel count, mean and sum of squared deviations from the layer's op set, as
    in a training forward, merged in float64 with Chan's formula), all layers at once. During the pass the layers normalize with each
    batch's own statistics and exchange nothing (plain BatchNorm in training mode, as
    PreciseBN on one device), so it is this rank's inputs as training mode sees them. Then one
    forward round per layer pools the accumulators over the scope, and each layer's running
    mean and running variance become the mean and the unbiased variance of all its inputs on
    all ranks of the scope. The model's modes and all other state are restored: the pass's own
    momentum updates (of these layers and of any other BatchNorm) do not leak into the result.
    Layers that saw no input on any rank keep their statistics.

    Every rank in the scope must call it at the same point with the same model and scope (see
    sync_running_stats). Returns {layer name: values per channel pooled}."""
    what = "hsbn.torch.precise_bn"
    _check_pool_scope(scope, what)
    if num_batches is not None and int(num_batches) < 0:
        raise ConfigurationError("%s: num_batches must be >= 0, not %r" % (what, num_batches))
    client = _client_for(model, client)
    layers = _layers(model)
    moments = [_Moments() for _ in layers]
    modes = [(m, m.training) for m in model.modules()]
    saved = []
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            saved.append((m, [(k, b.detach().clone()) for k, b in m.named_buffers(recurse=False)
                              if b is not None],
                          getattr(m, "samples_seen", None), getattr(m, "scope", None)))
    hooks = []
    try:
        for (_, m), acc in zip(layers, moments):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, inputs, acc=acc: acc.add(mod, inputs[0])))
            m.scope = "local"
        model.train()
        with torch.no_grad():
            for i, b in enumerate(batches):
                if num_batches is not None and i >= int(num_batches):
                    break
                if forward is None:
                    model(b)
                else:
                    forward(model, b)
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for m, bufs, seen, scope_was in saved:
                for k, b in bufs:
                    getattr(m, k).copy_(b)
                if seen is not None:
                    m.samples_seen = seen
                if scope_was is not None:
                    m.scope = scope_was
    seq, layers, _ = _start(what, model, scope, client)
    out = {}
    for (name, m), acc in zip(layers, moments):
        c = m.num_features
        if acc.n == 0:
            mean, m2 = np.zeros(c), np.zeros(c)
        else:
            mean, m2 = _to_numpy(acc.mean), _to_numpy(acc.m2)
        total, pooled_mean, pooled_m2 = _pool(client, what, scope, seq, name, m, acc.n, mean,
                                              m2)
        out[name] = int(total)
        if total == 0:
            continue
        if total == 1:
            raise ValueError("%s: layer %r saw 1 value per channel in scope %r; the unbiased "
                             "variance needs at least 2" % (what, name, scope))
        _store(m.running_mean, pooled_mean)
        _store(m.running_var, pooled_m2 / float(total - 1))
        m.samples_seen = int(acc.n)
    return out
