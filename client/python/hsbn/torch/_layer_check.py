"""The layer check: at the first synchronized forward of a converted model, every rank compares
the model's list of synchronized layers (name, scope, channels) through the aggregator, with
backward-phase (summation) rounds on the model's check op: each rank contributes small integer
hashes h and h*h, and W * sum(h*h) == sum(h)**2 holds exactly iff all W ranks sent the same h.
A mismatch is narrowed to its first differing position by bisection over prefixes, the ranks'
layer names there are gathered (each rank writes its name into its own slot of a sum), and
every rank raises LayerMismatchError naming them. See docs/PYTORCH.md.

Also the per-client book of what this process has done through a client (seq per op, checks
passed, auto policies given).
"""

import hashlib
import itertools
import threading
import weakref

import numpy as np

from ..errors import (ConfigurationError, HsbnError, InvalidArgumentError, DEADLINE_EXCEEDED,
                      INVALID_ARGUMENT)
from .. import client as _client
from ._keys import _check_op_for_model


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
        self.named = set()  # ops whose layer name was sent to the aggregators

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
        self.scope = ("global" if any(e[2] in _client.CROSS_NODE_SCOPES for e in self.entries)
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
            # By code and reason, never by text: only errors about the check's rounds.
            if e.code == INVALID_ARGUMENT and e.reason == "INVALID_CONTRIBUTION":
                # The aggregator's words name the check's internal round, which says nothing
                # to a user: say what differs, and which layers make the difference here.
                wide = [name for name, _, scope, _ in self.entries if scope != "node"]
                here = ("this rank's layers with a scope wider than node: %s%s"
                        % (", ".join(repr(n) for n in wide[:5]),
                           " and %d more" % (len(wide) - 5) if len(wide) > 5 else "")
                        if wide else "this rank has only node-scope layers")
                msg = ("hsbn: the layer check of model %r failed. The ranks disagree on the "
                       "check itself: some have layers of a scope wider than node (global, "
                       "group, shadow, auto, renorm, lagged) in this model where others have "
                       "only node layers (%s). Convert the model with the same scopes on every "
                       "rank."
                       % (self.model, here))
            elif e.code == DEADLINE_EXCEEDED and e.reason == "TIMED_OUT":  # ranks it names
                msg = ("%s. The ranks named did not run model %r in training mode: every rank "
                       "must convert and run the same models, under the same name=."
                       % (str(e).rstrip(". "), self.model))
            else:
                raise
            err = type(e)(msg, e.code)
            err.reason = e.reason
            raise err from None

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
            _debug(client, "layer check of model %r: the %d rank(s) of the round have the same "
                           "%d synchronized layer(s)" % (self.model, count, n))
            return
        _debug(client, "layer check of model %r: the ranks' synchronized layers differ; "
                       "finding where" % (self.model,))
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


def _debug(client, what):
    """HSBN_DEBUG=INFO: one line on stderr, as the library writes its own."""
    from .. import client as _client
    _client.debug(getattr(client, "rank", "?"), what)


def _ranges(ranks):
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else "%d-%d" % (start, r))
            start = None
    return ", ".join(out)
