"""hsbn.Client: one trainer worker's connection to its node's sidecar aggregator.

A Client joins a job at the sidecar and opens one round stream. Its rounds are blocking calls
that release the GIL; several threads may use one Client at once (rounds are matched by key).
Most users never touch it: hsbn.torch.SyncBatchNorm uses hsbn.default_client(), created from
the torchrun environment at the first synchronized forward.
"""

import atexit
import collections.abc
import contextlib
import ctypes
import dataclasses
import json
import math
import multiprocessing.util
import os
import signal
import sys
import threading
import time

import numpy as np

from . import _lib
from . import env as _env
from .errors import ConfigurationError, UnavailableError, error_for, UNAVAILABLE

class _Scopes(collections.abc.Mapping):
    """name -> hsbn_scope value of every scope, read from the library's table on first use
    (_lib.scope_table(); importing hsbn needs no library)."""

    _cache = None

    def _map(self):
        # Built once: the library's table does not change (rounds look scopes up every call).
        if self._cache is None:
            self._cache = {s.name: s.value for s in _lib.scope_table()}
        return self._cache

    def __getitem__(self, name):
        return self._map()[name]

    def __iter__(self):
        return iter(self._map())

    def __len__(self):
        return len(_lib.scope_table())

    def __repr__(self):
        return repr(self._map())


class _Names(collections.abc.Sequence):
    """`prefix`, then the names of the library's scopes that have `flag` (a ScopeInfo field;
    None: every scope), read on first use."""

    def __init__(self, flag, prefix=()):
        self._flag, self._prefix = flag, tuple(prefix)
        self._cache = None

    def _names(self):
        if self._cache is None:  # built once, as _Scopes'
            self._cache = self._prefix + tuple(
                s.name for s in _lib.scope_table()
                if self._flag is None or getattr(s, self._flag))
        return self._cache

    def __getitem__(self, i):
        return self._names()[i]

    def __contains__(self, name):
        return name in self._names()

    def __len__(self):
        return len(self._names())

    def __repr__(self):
        return repr(self._names())


SCOPES = _Scopes()
# Scopes rounds are counted under (an "auto" round counts as the scope it went as).
STAT_SCOPES = _Names("round_stats")
# Scopes whose forward is answered with the node's statistics, the job's following later.
LATE_SCOPES = _Names("late")
# Scopes with a round that waits on other nodes.
CROSS_NODE_SCOPES = _Names("cross_node")
PHASES = {"forward": _lib.PHASE_FORWARD, "backward": _lib.PHASE_BACKWARD}

DEFAULT_ADDRESS = "unix:/tmp/hsbn.sock"

_ENV_LAYOUT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")

# What each round `op` of this process stands for ("layer 'layer1.0.bn1' of model 'ResNet'"),
# so that a failed round names the module, not only its number. Filled by hsbn.torch.
_op_labels = {}


def set_op_label(op, label):
    """Names round `op` in this process's error messages (hsbn.torch does it for its layers)."""
    _op_labels[int(op) & 0xFFFFFFFF] = str(label)


def op_label(op):
    """What round `op` stands for: the label given with set_op_label, or "layer op=N"."""
    label = _op_labels.get(int(op) & 0xFFFFFFFF)
    return label if label is not None else "layer op=%d" % op


def _check_layout(rank, world_size, local_rank, local_world_size, node_rank, source,
                  group_nodes=0):
    """Raises ConfigurationError unless the five numbers describe one worker of a job with
    LOCAL_WORLD_SIZE workers on every node, ranked node by node as torchrun ranks them, and
    group_nodes (HSBN_GROUP_NODES) is 0 or divides the number of nodes. The check is the
    library's (hsbn_check_layout_groups), the one the C++ client and the aggregator use."""
    lib = _lib.lib()
    layout = (int(rank), int(world_size), int(local_rank), int(local_world_size), int(node_rank))
    if lib.hsbn_check_layout_groups(*layout, int(group_nodes)) != 0:
        if lib.hsbn_check_layout(*layout) == 0:  # the five agree: the group size is what is wrong
            lib.hsbn_check_layout_groups(*layout, int(group_nodes))
            raise ConfigurationError("inconsistent %s: %s" % (source, _lib.last_error()))
        raise ConfigurationError(
            "inconsistent %s: %s (RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s LOCAL_WORLD_SIZE=%s "
            "GROUP_RANK=%s). Launch the trainer with torchrun, or set all five as torchrun "
            "does: RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK."
            % (source, _lib.last_error(), rank, world_size, local_rank, local_world_size,
               node_rank))


# The hsbn_options fields the library takes from the environment when they are left unset.
_ENV_OPTIONS = (("HSBN_STRICT_FINITE", "strict_finite"), ("HSBN_TRANSPORT", "transport"),
                ("HSBN_INCARNATION", "incarnation"), ("HSBN_AUTO_WARMUP", "auto_warmup"),
                ("HSBN_AUTO_MAX_MEAN_SHIFT", "auto_max_mean_shift"),
                ("HSBN_AUTO_MAX_LOG_VAR_RATIO", "auto_max_log_var_ratio"),
                ("HSBN_AUTO_RECHECK_EVERY", "auto_recheck_every"))


def _explicit_options(strict_finite, transport, incarnation, auto_warmup, auto_max_mean_shift,
                      auto_max_log_var_ratio, auto_recheck_every):
    """{hsbn_options field: value} of the arguments given (not None); ConfigurationError for a
    value the C ABI would take as "unset" or that is of the wrong type."""
    out = {}

    def integer(name, v, low):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigurationError("%s must be an int >= %d, not %r" % (name, low, v))
        return v

    if strict_finite is not None:
        out["strict_finite"] = 1 if strict_finite else 0
    if transport is not None:
        if transport not in ("auto", "grpc"):
            raise ConfigurationError("transport must be 'auto' or 'grpc', not %r" % (transport,))
        out["transport"] = transport
    if incarnation is not None:
        out["incarnation"] = integer("incarnation", incarnation, 0)
    if auto_warmup is not None:
        out["auto_warmup"] = integer("auto_warmup", auto_warmup, 1)
    if auto_recheck_every is not None:
        out["auto_recheck_every"] = integer("auto_recheck_every", auto_recheck_every, 0)
    for name, v in (("auto_max_mean_shift", auto_max_mean_shift),
                    ("auto_max_log_var_ratio", auto_max_log_var_ratio)):
        if v is None:
            continue
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or v < 0):
            raise ConfigurationError("%s must be a finite number >= 0, not %r" % (name, v))
        out[name] = float(v)
    return out


def _check_address(address, connect_timeout_ms):
    if not address or not isinstance(address, str):
        raise ConfigurationError("the sidecar address is empty; set HSBN_ADDRESS to "
                                 "unix:/path/to.sock or host:port")
    # The library's check (wire::AddressError): a bare path is answered with its unix: spelling.
    lib = _lib.lib()
    if lib.hsbn_check_address(address.encode("utf-8", "surrogateescape"), b"HSBN_ADDRESS") != 0:
        raise ConfigurationError(_lib.last_error())
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        # A trainer may start before its sidecar: wait for the socket as long as the connect
        # timeout allows (as the C ABI does), then say plainly what is missing.
        deadline = time.monotonic() + (connect_timeout_ms if connect_timeout_ms > 0 else 10000) / 1e3
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.exists(path):
            raise UnavailableError(
                "UNAVAILABLE: no sidecar at %s: the socket file %s does not exist. Start the "
                "node's aggregator (hsbn-aggregator --role=node --listen=%s), or point "
                "HSBN_ADDRESS at the one that runs." % (address, path, address), UNAVAILABLE)


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """Counters of one kind of round (a scope and phase, or a sum of several); see Client.stats.

    completed: rounds whose result arrived.
    failed: rounds whose call raised an error from the library (refused by the aggregator, past
      the deadline, lost with a broken stream, refused before sending).
    blocked_seconds: wall time callers spent blocked in these rounds' calls, completed and
      failed: the whole forward()/backward() call (measured in the library, so without this
      package's small argument conversion). Threads blocked at the same time each count theirs.
    max_blocked_seconds: the longest single call.
    """
    completed: int = 0
    failed: int = 0
    blocked_seconds: float = 0.0
    max_blocked_seconds: float = 0.0

    @property
    def rounds(self):
        """completed + failed."""
        return self.completed + self.failed

    def __add__(self, other):
        if not isinstance(other, RoundStats):
            return NotImplemented
        return RoundStats(self.completed + other.completed, self.failed + other.failed,
                          self.blocked_seconds + other.blocked_seconds,
                          max(self.max_blocked_seconds, other.max_blocked_seconds))


@dataclasses.dataclass(frozen=True)
class ClientStats:
    """What a Client did since it connected or since its last reset_stats() (Client.stats).

    rounds: {(scope, phase): RoundStats} for every scope in "node", "global", "shadow",
      "group", "renorm", "lagged" and phase in "forward", "backward" (all twelve keys always
      present); an
      auto-scope layer's rounds count under the scope each was sent with. There is no "local"
      entry: a local BatchNorm layer makes no rounds.
    global_stats: RoundStats of the global_stats() and global_sums() calls (renorm and lagged
      scope): completed, failed, seconds blocked in them; global_stats_waited: how many of them
      had to wait for the global result (it had not arrived when asked).
    late_dropped: late results the sidecar sent for rounds this client did not start with
      renorm or lagged scope (or sent twice): dropped, never kept.
    bytes_sent, bytes_received: serialized bytes of the frames written to and read from the
      round stream (contributions and results; gRPC/HTTP/2 framing not included).
    elapsed_seconds: wall time since the client connected or its last reset_stats().
    transport: how the node's rounds travel: "shm" (the node's shared-memory segment),
      "grpc: <why>", or "pending" until the sidecar has heard from every local rank.
    """
    rounds: dict
    bytes_sent: int = 0
    bytes_received: int = 0
    elapsed_seconds: float = 0.0
    transport: str = ""
    global_stats: RoundStats = RoundStats()
    global_stats_waited: int = 0
    late_dropped: int = 0

    def get(self, scope=None, phase=None):
        """RoundStats of one scope and phase; None sums over all scopes (or phases)."""
        if scope is not None and scope not in STAT_SCOPES:
            raise ConfigurationError("scope must be one of %s, not %r"
                                     % (sorted(STAT_SCOPES), scope))
        if phase is not None and phase not in PHASES:
            raise ConfigurationError("phase must be one of %s, not %r" % (sorted(PHASES), phase))
        total = RoundStats()
        for (s, p), r in self.rounds.items():
            if (scope is None or s == scope) and (phase is None or p == phase):
                total = total + r
        return total

    @property
    def total(self):
        """RoundStats summed over every scope and phase."""
        return self.get()

    def as_dict(self):
        """Plain nested dicts (JSON-ready): {"node": {"forward": {...}, ...}, ..., "bytes_sent":
        ..., "bytes_received": ..., "elapsed_seconds": ...}."""
        out = {}
        for (s, p), r in self.rounds.items():
            out.setdefault(s, {})[p] = dataclasses.asdict(r)
        out.update(bytes_sent=self.bytes_sent, bytes_received=self.bytes_received,
                   elapsed_seconds=self.elapsed_seconds, transport=self.transport,
                   global_stats=dataclasses.asdict(self.global_stats),
                   global_stats_waited=self.global_stats_waited)
        return out

    @classmethod
    def empty(cls):
        """All zeros (what a model whose layers make no rounds has)."""
        return cls({(s, p): RoundStats() for s in STAT_SCOPES for p in PHASES})


class Client:
    """A worker's membership in a job at its node's sidecar.

    Args:
      address: the sidecar, "unix:/path.sock" or "host:port".
      job_id: any non-empty string shared by all workers of the job.
      rank, world_size, local_rank, local_world_size, node_rank: the worker's place in the job,
        as torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK.
      round_timeout_ms: how long a round waits; 0 means the aggregator's timeout plus 5 s.
      connect_timeout_ms: how long to wait for the sidecar; 0 means 10 s.
      token: the job token when the aggregator requires one.
      group_nodes: nodes per group for scope "group" (HSBN_GROUP_NODES): 0 (no groups) or a
        divisor of the number of nodes; every process of the job must give the same.
      strict_finite, transport, incarnation, auto_warmup, auto_max_mean_shift,
        auto_max_log_var_ratio, auto_recheck_every: what HSBN_STRICT_FINITE, HSBN_TRANSPORT,
        HSBN_INCARNATION and HSBN_AUTO_* set (docs/ENVIRONMENT.md); None: the variable's value in
        `env`.
      env: a mapping the variables of arguments left None are read from; None: os.environ.
    """

    def __init__(self, address, job_id, rank, world_size, local_rank, local_world_size,
                 node_rank, round_timeout_ms=0, connect_timeout_ms=0, token=None, group_nodes=0,
                 *, strict_finite=None, transport=None, incarnation=None, auto_warmup=None,
                 auto_max_mean_shift=None, auto_max_log_var_ratio=None, auto_recheck_every=None,
                 env=None):
        self._handle = None
        self._renorm_channels = {}  # op -> channels of its last renorm or lagged forward
        if not job_id:
            raise ConfigurationError("job_id is empty: give every worker of the job the same "
                                     "non-empty job id (HSBN_JOB_ID)")
        layout = [int(v) for v in (rank, world_size, local_rank, local_world_size, node_rank)]
        try:
            group_nodes = int(group_nodes or 0)
        except (TypeError, ValueError):
            raise ConfigurationError("group_nodes must be an integer, not %r" % (group_nodes,))
        _check_layout(*layout, source="worker layout", group_nodes=group_nodes)
        explicit = _explicit_options(strict_finite, transport, incarnation, auto_warmup,
                                     auto_max_mean_shift, auto_max_log_var_ratio,
                                     auto_recheck_every)
        entries = _env.Entries(env)
        # What the library will read from the environment is checked now, before any wait.
        for var, name in _ENV_OPTIONS:
            if name not in explicit:
                _env.get(var, entries)
        _check_address(address, int(connect_timeout_ms))
        lib = _lib.lib()
        opts = _lib.Options()
        lib.hsbn_options_init(ctypes.byref(opts))
        # Keep the encoded strings alive for the duration of the call.
        self._address_b = address.encode()
        self._job_b = str(job_id).encode()
        self._token_b = token.encode() if token else None
        opts.address = self._address_b
        opts.job_id = self._job_b
        (opts.rank, opts.world_size, opts.local_rank, opts.local_world_size,
         opts.node_rank) = layout
        opts.round_timeout_ms = int(round_timeout_ms)
        opts.connect_timeout_ms = int(connect_timeout_ms)
        opts.token = self._token_b
        opts.group_nodes = group_nodes
        opts.env = entries.pointer
        for name, value in explicit.items():
            setattr(opts, name, value.encode() if isinstance(value, str) else value)
        handle = ctypes.c_void_p()
        rc = lib.hsbn_client_create(ctypes.byref(opts), ctypes.byref(handle))
        if rc != 0:
            raise error_for(rc, "cannot join job %r at the sidecar %s as rank %d: %s"
                            % (job_id, address, layout[0], _lib.last_error()))
        self._handle = handle
        self._lib = lib
        self.address = address
        self.job_id = str(job_id)
        info = _lib.ClientInfo()
        rc = lib.hsbn_client_get_info(handle, ctypes.byref(info))
        if rc != 0:
            err = error_for(rc, _lib.last_error())
            self.close()
            raise err
        self.rank = info.rank
        self.world_size = info.world_size
        self.local_rank = info.local_rank
        self.local_world_size = info.local_world_size
        self.node_rank = info.node_rank
        self.num_nodes = info.num_nodes
        self.group_nodes = group_nodes
        self.max_channels = info.max_channels
        self.aggregator_round_timeout_ms = info.round_timeout_ms
        _watch_interrupts(self)

    @classmethod
    def from_env(cls, env=None, **overrides):
        """A Client from torchrun's environment plus the HSBN_* variables.

        Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and every variable of
        docs/ENVIRONMENT.md (HSBN_JOB_ID, falling back to torchrun's TORCHELASTIC_RUN_ID when
        that is not "none"; HSBN_ADDRESS, default unix:/tmp/hsbn.sock; the timeouts, the token,
        HSBN_STRICT_FINITE, HSBN_GROUP_NODES, HSBN_TRANSPORT, HSBN_INCARNATION, HSBN_AUTO_*),
        parsed by the library's one table, so a value means what it means to the C++ client.
        `env` replaces os.environ for all of them; keyword arguments override what it says.
        """
        entries = _env.Entries(env)
        present = os.environ if env is None else env
        names = {"RANK": "rank", "WORLD_SIZE": "world_size", "LOCAL_RANK": "local_rank",
                 "LOCAL_WORLD_SIZE": "local_world_size", "GROUP_RANK": "node_rank"}
        missing = [k for k in _ENV_LAYOUT if not present.get(k) and names[k] not in overrides]
        if missing:
            raise ConfigurationError(
                "the environment lacks %s: run the trainer under torchrun (which sets RANK, "
                "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK), or set them, or "
                "construct hsbn.Client(...) explicitly" % ", ".join(missing))
        kw = {}
        for var, name in names.items():
            if name not in overrides:
                kw[name] = int(_env.get(var, entries))
        if "job_id" not in overrides:
            kw["job_id"] = _env.get("HSBN_JOB_ID", entries)
        typed = (("HSBN_ADDRESS", "address", str), ("HSBN_ROUND_TIMEOUT_MS", "round_timeout_ms", int),
                 ("HSBN_CONNECT_TIMEOUT_MS", "connect_timeout_ms", int),
                 ("HSBN_TOKEN", "token", str), ("HSBN_GROUP_NODES", "group_nodes", int),
                 ("HSBN_STRICT_FINITE", "strict_finite", lambda v: v == "1"),
                 ("HSBN_TRANSPORT", "transport", str), ("HSBN_INCARNATION", "incarnation", int),
                 ("HSBN_AUTO_WARMUP", "auto_warmup", int),
                 ("HSBN_AUTO_MAX_MEAN_SHIFT", "auto_max_mean_shift", float),
                 ("HSBN_AUTO_MAX_LOG_VAR_RATIO", "auto_max_log_var_ratio", float),
                 ("HSBN_AUTO_RECHECK_EVERY", "auto_recheck_every", int))
        for var, name, convert in typed:
            if name not in overrides:
                kw[name] = convert(_env.get(var, entries))
        kw["token"] = kw.get("token") or None
        kw["env"] = env
        kw.update(overrides)
        return cls(**kw)

    # --- rounds ----------------------------------------------------------------------------------

    def _check_open(self):
        if self._handle is None:
            raise UnavailableError("UNAVAILABLE: this hsbn.Client is closed", UNAVAILABLE)

    def _round(self, phase, what, op, seq, scope, count, a, b):
        self._check_open()
        try:
            scope_code = SCOPES[scope]
        except KeyError:
            raise ConfigurationError("scope must be one of %s, not %r" % (sorted(SCOPES), scope))
        a = np.ascontiguousarray(a, dtype=np.float64)
        b = np.ascontiguousarray(b, dtype=np.float64)
        if a.ndim != 1 or b.shape != a.shape:
            raise ConfigurationError("statistics must be two 1-d arrays of the same length")
        channels = a.shape[0]
        out_a = np.empty_like(a)
        out_b = np.empty_like(b)
        out_count = ctypes.c_int64()
        if scope in LATE_SCOPES and what == "forward":
            self._renorm_channels[int(op) & 0xFFFFFFFF] = channels
        rnd = ctypes.c_void_p()
        # The arrays' addresses as ints (_lib declares double* as void*); a, b, out_a and out_b
        # stay referenced here until the calls return.
        with self._side_wait():
            rc = self._lib.hsbn_round_start(self._handle, phase, int(op), int(seq), scope_code,
                                            channels, int(count), a.ctypes.data, b.ctypes.data,
                                            ctypes.byref(rnd))
            if rc == 0:
                rc = self._wait(rnd, ctypes.byref(out_count), out_a.ctypes.data,
                                out_b.ctypes.data)
        if rc != 0:
            raise error_for(rc, "%s round of %s (op=%d, seq=%d, scope %s, rank %d of job %r) "
                            "failed: %s" % (what, op_label(op), op, seq, scope, self.rank,
                                            self.job_id, _lib.last_error()))
        return out_count.value, out_a, out_b

    @contextlib.contextmanager
    def _side_wait(self):
        """On a thread other than the main one, registers a round with the SIGINT handler
        (which aborts the client), from before the round starts until it ends: once the other
        ranks can see this rank's contribution, a Ctrl-C must find the round."""
        side = threading.current_thread() is not threading.main_thread()
        if side:
            with _waits_lock:
                _side_waits[id(self)] = _side_waits.get(id(self), 0) + 1
        try:
            yield
        finally:
            if side:
                with _waits_lock:
                    _side_waits[id(self)] -= 1

    def _wait(self, rnd, out_count, out_a, out_b):
        """Waits for a started round in slices of _WAIT_SLICE_MS: between them the main thread
        runs Python's signal handlers, so Ctrl-C raises KeyboardInterrupt here within a slice.
        An exception in the wait aborts the client (the job's other ranks learn at once)."""
        done = ctypes.c_int(0)
        try:
            while True:
                rc = self._lib.hsbn_round_wait_for(rnd, _WAIT_SLICE_MS, ctypes.byref(done),
                                                   out_count, out_a, out_b)
                if done.value:
                    return rc
        except BaseException as e:
            self.abort("%s while waiting in a round" % type(e).__name__)
            while not done.value:  # ends at once now; frees the round
                self._lib.hsbn_round_wait_for(rnd, _WAIT_SLICE_MS, ctypes.byref(done),
                                              out_count, out_a, out_b)
            raise

    def forward(self, op, seq, scope, count, mean, m2):
        """Contributes (count, mean[C], m2[C]); returns the scope's (count, mean, m2)."""
        return self._round(_lib.PHASE_FORWARD, "forward", op, seq, scope, count, mean, m2)

    def backward(self, op, seq, scope, count, sum_dy, sum_dy_xmu):
        """Contributes (sum_dy[C], sum_dy_xmu[C]); returns the scope's (count, sums...)."""
        return self._round(_lib.PHASE_BACKWARD, "backward", op, seq, scope, count, sum_dy,
                           sum_dy_xmu)

    def global_stats(self, op, seq, channels=None):
        """Renorm and lagged scope: the job's (count, mean, m2) of forward round (op, seq), which
        this client started with scope "renorm" or "lagged" (channels: its width; None: that of
        op's last renorm or lagged forward). Blocks until the root's result arrives (every
        worker of the job gets the same bits), at most the round timeout; raises the hsbn error
        naming the round when the root does not answer or the round failed, and
        FailedPreconditionError at once for a round this client did not start with a late scope
        (no result can come for it)."""
        return self._late(_lib.PHASE_FORWARD, op, seq, channels)

    def global_sums(self, op, seq, channels=None):
        """Lagged scope: the job's (count, sum_dy, sum_dy_xmu) of backward round (op, seq),
        which this client started with scope "lagged". sum_dy_xmu is the job's sum of
        dy * (x - mean) with mean the job's mean of forward round (op, seq) (global_stats'),
        whatever mean each node contributed around (its node's forward answer, by the
        protocol); count is that forward round's job count. Blocks and fails as global_stats."""
        return self._late(_lib.PHASE_BACKWARD, op, seq, channels)

    def _late(self, phase, op, seq, channels):
        self._check_open()
        op = int(op) & 0xFFFFFFFF
        what, call = (("global statistics", "hsbn_client_global_stats_for")
                      if phase == _lib.PHASE_FORWARD
                      else ("global sums", "hsbn_client_global_sums_for"))
        if channels is None:
            channels = self._renorm_channels.get(op)
            if channels is None:
                raise ConfigurationError(
                    "%s(op=%d): this client made no renorm or lagged forward round of op %d; "
                    "pass channels=" % (what.replace(" ", "_"), op, op))
        channels = int(channels)
        a = np.empty(max(channels, 1), dtype=np.float64)
        b = np.empty_like(a)
        count = ctypes.c_int64()
        args = (ctypes.byref(count), a.ctypes.data, b.ctypes.data)
        done = ctypes.c_int(0)
        # In slices, as _wait: Ctrl-C raises here within a slice (and aborts the client).
        try:
            while True:
                rc = getattr(self._lib, call)(self._handle, op, int(seq), channels,
                                              _WAIT_SLICE_MS, ctypes.byref(done), *args)
                if done.value:
                    break
        except BaseException as e:
            self.abort("%s while waiting for %s" % (type(e).__name__, what))
            raise
        if rc != 0:
            raise error_for(rc, "%s of %s (op=%d, seq=%d, rank %d of job %r): %s"
                            % (what, op_label(op), op, seq, self.rank, self.job_id,
                               _lib.last_error()))
        return count.value, a, b

    def name_layers(self, names):
        """Names layers for the aggregators' Status and divergence record ({op: name}); the
        first name given for an op is kept (printable ASCII, at most 256 bytes). hsbn.torch
        names its layers by itself ("model:layer")."""
        self._check_open()
        items = [(int(op) & 0xFFFFFFFF, str(name).encode("ascii", "replace"))
                 for op, name in dict(names).items()]
        if not items:
            return
        ops = (ctypes.c_uint32 * len(items))(*[op for op, _ in items])
        strs = (ctypes.c_char_p * len(items))(*[n for _, n in items])
        rc = self._lib.hsbn_client_name_layers(self._handle, ops, strs, len(items))
        if rc != 0:
            raise error_for(rc, "naming layers failed: %s" % _lib.last_error())

    def report_lagged_trip(self, op, seq, drift, exact_calls):
        """Tells the sidecar that lagged layer `op`'s trip guard sent it exact global at its call
        of round `seq` (drift: the v that tripped it, >= 0; exact_calls: >= 1) for its Status
        and metrics; changes no round. hsbn.torch's lagged layers call it themselves."""
        self._check_open()
        rc = self._lib.hsbn_client_report_lagged_trip(self._handle, int(op) & 0xFFFFFFFF,
                                                      int(seq), float(drift), int(exact_calls))
        if rc != 0:
            raise error_for(rc, "reporting a lagged trip failed: %s" % _lib.last_error())

    def global_stats_ready(self, op, seq):
        """True when global_stats(op, seq) would return at once (its result or its failure has
        arrived). Never blocks."""
        self._check_open()
        return self._lib.hsbn_client_global_stats_ready(self._handle, int(op) & 0xFFFFFFFF,
                                                        int(seq)) == 1

    def global_sums_ready(self, op, seq):
        """True when global_sums(op, seq) would return at once. Never blocks."""
        self._check_open()
        return self._lib.hsbn_client_global_sums_ready(self._handle, int(op) & 0xFFFFFFFF,
                                                       int(seq)) == 1

    def abort(self, reason=None):
        """Gives up on the job (like NCCL's ncclCommAbort): this client's rounds in flight and
        all later ones fail at once with RoundFailedError (ABORTED) and `reason`, and so do the
        rounds of every other rank of the job, naming this rank and `reason`. Safe from any
        thread, also while another waits in a round. Close the client afterwards."""
        handle = self._handle
        if handle is not None:
            self._lib.hsbn_client_abort(handle, str(reason or "").encode(errors="replace"))

    def status(self, include_upstream=True):
        """The sidecar's status as a dict (protobuf JSON names: jobs, upstream, divergence with
        op, node, rounds, meanShiftAvg, ...). include_upstream also asks the root."""
        self._check_open()
        size = 1 << 16
        needed = ctypes.c_size_t()
        while True:
            buf = ctypes.create_string_buffer(size)
            rc = self._lib.hsbn_status_json(self._handle, 1 if include_upstream else 0, buf,
                                            size, ctypes.byref(needed))
            if rc != 0:
                raise error_for(rc, "status call failed: %s" % _lib.last_error())
            if needed.value <= size:
                return json.loads(buf.value.decode("utf-8"))
            size = needed.value

    def stats(self):
        """This client's round statistics as a ClientStats (a frozen dataclass, not a dict;
        .as_dict() gives one): per scope and phase, rounds completed and failed and seconds
        blocked in them, since the client connected or its last reset_stats(). Counts every
        round made through this client, by every layer and thread sharing it. Cheap (one C
        call, no round trip)."""
        self._check_open()
        raw = _lib.CStats()
        raw.struct_size = ctypes.sizeof(raw)
        rc = self._lib.hsbn_client_stats(self._handle, ctypes.byref(raw))
        if rc != 0:
            raise error_for(rc, "stats call failed: %s" % _lib.last_error())
        rounds = {}
        def of(r):
            return RoundStats(int(r.completed), int(r.failed), float(r.blocked_seconds),
                              float(r.max_blocked_seconds))
        for scope in STAT_SCOPES:
            sc = SCOPES[scope]
            for phase, ph in PHASES.items():
                if scope == "group":
                    r = raw.group_rounds[ph - 1]
                elif scope == "renorm":
                    r = raw.renorm_rounds[ph - 1]
                elif scope == "lagged":
                    r = raw.lagged_rounds[ph - 1]
                else:
                    r = raw.rounds[sc - 1][ph - 1]
                rounds[(scope, phase)] = of(r)
        transport = raw.transport.decode("utf-8", "replace")
        return ClientStats(rounds, int(raw.bytes_sent), int(raw.bytes_received),
                           float(raw.elapsed_seconds), transport, of(raw.global_stats),
                           int(raw.global_stats_waited), int(raw.late_dropped))

    # --- auto scope ----------------------------------------------------------------------------

    def set_auto_policy(self, op, warmup_rounds=50, max_mean_shift=0.05, max_log_var_ratio=0.05,
                        recheck_every=0):
        """Sets how auto-scope round `op` decides (before its first auto round): shadow for
        forward rounds seq < warmup_rounds, then one global round on which the root decides
        node (group, with groups) or global from its record: global when, for some node
        (group), the average mean shift exceeds max_mean_shift or the average |log var ratio|
        exceeds max_log_var_ratio. recheck_every=N > 0 samples one round in N in shadow after
        a decision and decides again after warmup_rounds samples. Every rank must give an op
        the same policy."""
        self._check_open()
        p = _lib.AutoPolicy()
        try:
            p.warmup_rounds = int(warmup_rounds)
            p.max_mean_shift = float(max_mean_shift)
            p.max_log_var_ratio = float(max_log_var_ratio)
            p.recheck_every = int(recheck_every)
        except (TypeError, ValueError, OverflowError) as e:
            raise ConfigurationError("auto scope policy of %s: %s" % (op_label(op), e))
        rc = self._lib.hsbn_set_auto_policy(self._handle, int(op) & 0xFFFFFFFF, ctypes.byref(p))
        if rc != 0:
            raise error_for(rc, "auto scope policy of %s: %s" % (op_label(op), _lib.last_error()))

    def auto_decision(self, op):
        """What auto-scope round `op` decided: None during its warm-up, else a dict with scope
        ("node", "group" or "global"), mean_shift, log_var_ratio, rounds (the root's numbers
        behind it; 0 for a restored decision) and decided_at (seq of the deciding round, -1 if
        restored)."""
        self._check_open()
        d = _lib.AutoDecision()
        rc = self._lib.hsbn_get_auto_decision(self._handle, int(op) & 0xFFFFFFFF, ctypes.byref(d))
        if rc != 0:
            raise error_for(rc, _lib.last_error())
        if not d.decided:
            return None
        names = {s.value: s.name for s in _lib.scope_table()}
        return {"scope": names.get(d.scope, "unknown"), "mean_shift": float(d.mean_shift),
                "log_var_ratio": float(d.log_var_ratio), "rounds": int(d.rounds),
                "decided_at": int(d.decided_at)}

    def set_auto_decision(self, op, scope):
        """Restores a decision ("node", "group" or "global") for auto-scope round `op`: it
        skips its warm-up."""
        self._check_open()
        if scope not in ("node", "group", "global"):
            raise ConfigurationError("an auto-scope decision is 'node', 'group' or 'global', "
                                     "not %r" % (scope,))
        rc = self._lib.hsbn_set_auto_decision(self._handle, int(op) & 0xFFFFFFFF, SCOPES[scope])
        if rc != 0:
            raise error_for(rc, "restoring the auto-scope decision of %s: %s"
                            % (op_label(op), _lib.last_error()))

    def reset_stats(self):
        """Zeroes this client's round statistics (rounds in flight count when they end)."""
        self._check_open()
        rc = self._lib.hsbn_client_reset_stats(self._handle)
        if rc != 0:
            raise error_for(rc, "reset_stats call failed: %s" % _lib.last_error())

    # --- lifetime --------------------------------------------------------------------------------

    def close(self):
        """Leaves the job. Safe to call twice."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.hsbn_client_destroy(handle)

    @property
    def closed(self):
        return self._handle is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # A Client is a process-local connection: copies of a model share it, pickles drop it.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("an hsbn.Client is a live connection and cannot be pickled; "
                        "create one per process with hsbn.Client.from_env()")

    def __repr__(self):
        state = "closed" if self._handle is None else "open"
        return ("hsbn.Client(job=%r, rank=%s/%s, node=%s, address=%r, %s)"
                % (getattr(self, "job_id", None), getattr(self, "rank", None),
                   getattr(self, "world_size", None), getattr(self, "node_rank", None),
                   getattr(self, "address", None), state))


_debug_on = None


def debug(rank, what):
    """With HSBN_DEBUG=INFO, writes "hsbn[rank R] what" to stderr (as libhsbn does)."""
    global _debug_on
    if _debug_on is None:
        try:
            _debug_on = _env.get("HSBN_DEBUG") == "INFO"
        except Exception:
            _debug_on = False
    if _debug_on:
        sys.stderr.write("hsbn[rank %s] %s\n" % (rank, what))
        sys.stderr.flush()


# Round waits return to Python this often, so that signal handlers run (Ctrl-C).
_WAIT_SLICE_MS = 200
# Clients with a round wait in progress on a thread other than the main one (torch's autograd
# threads), by id: SIGINT aborts them, since only the main thread sees KeyboardInterrupt.
_side_waits = {}
_waits_lock = threading.RLock()  # the SIGINT handler and finalizers may run inside it
_clients = {}  # id -> weakref of every live Client, for the SIGINT handler
_interrupt_hooked = False


def _watch_interrupts(client):
    """Registers `client` with the SIGINT handler. The handler is installed once, from the
    main thread, over Python's default one only (a program's own handler is left alone): it
    aborts the clients whose rounds wait on other threads, then raises KeyboardInterrupt as
    the default handler does."""
    global _interrupt_hooked
    import weakref
    with _waits_lock:
        _clients[id(client)] = weakref.ref(client)
        weakref.finalize(client, _forget_client, id(client))
        if _interrupt_hooked or threading.current_thread() is not threading.main_thread():
            return
        _interrupt_hooked = True
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
    except (ValueError, OSError):  # not the main interpreter
        pass


def _forget_client(key):
    with _waits_lock:
        _clients.pop(key, None)
        _side_waits.pop(key, None)


def _on_sigint(signum, frame):
    with _waits_lock:
        waiting = [_clients[k]() for k, n in _side_waits.items() if n > 0 and k in _clients]
    for client in waiting:
        if client is not None:
            client.abort("interrupted (SIGINT) while a round waited on another thread")
    signal.default_int_handler(signum, frame)


_default = None
_default_implicit = False  # _default was created by default_client(), so this module owns it
_default_pid = None        # the process that created it (a forked child must not close it)
_default_lock = threading.Lock()
_exit_hooked = False


def _leave_at_exit():
    """Closes the implicit default client, so that its sidecar logs a normal leave (" left")
    rather than a broken stream ("disconnected ... probably exited or was killed")."""
    global _default, _default_implicit
    with _default_lock:
        client, implicit = _default, _default_implicit and _default_pid == os.getpid()
        if implicit:
            _default, _default_implicit = None, False
    if implicit and client is not None:
        client.close()


def default_client(group_nodes=None):
    """The process's shared Client, created from the environment on first use. A client
    created here leaves its job when the process exits normally (at interpreter exit, and at
    the end of a multiprocessing child, which skips atexit). group_nodes: the nodes per group
    a layer needs (None: whatever HSBN_GROUP_NODES says); ConfigurationError when the client
    exists with another."""
    global _default, _default_implicit, _default_pid, _exit_hooked
    with _default_lock:
        if _default is not None and not _default.closed:
            have = getattr(_default, "group_nodes", 0)
            if group_nodes is not None and int(group_nodes) != have:
                raise ConfigurationError(
                    "a layer asks for group_nodes=%d, but this process's hsbn client joined "
                    "job %r with group_nodes=%d (HSBN_GROUP_NODES); nodes per group are one "
                    "number per job: give every layer the same, or set HSBN_GROUP_NODES"
                    % (int(group_nodes), _default.job_id, have))
        if _default is None or _default.closed:
            env = _env.get("HSBN_GROUP_NODES")
            if group_nodes is not None and _env.is_set("HSBN_GROUP_NODES") and \
                    env != str(int(group_nodes)):
                raise ConfigurationError(
                    "a layer asks for group_nodes=%d but HSBN_GROUP_NODES=%s; nodes per group "
                    "are one number per job: make them agree" % (int(group_nodes), env))
            _default = (Client.from_env() if group_nodes is None
                        else Client.from_env(group_nodes=int(group_nodes)))
            _default_implicit, _default_pid = True, os.getpid()
            if not _exit_hooked:
                _exit_hooked = True
                atexit.register(_leave_at_exit)
                multiprocessing.util.Finalize(None, _leave_at_exit, exitpriority=100)
        return _default


def set_default_client(client):
    """Makes `client` the one layers without their own client use (None: recreate from env).
    A client set here is the caller's to close."""
    global _default, _default_implicit
    with _default_lock:
        _default, _default_implicit = client, False
