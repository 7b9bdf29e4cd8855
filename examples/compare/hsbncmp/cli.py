"""The comparison: flags, data preparation, the distributed runs in a LocalCluster, the
one-process references, the global vs reference check, and the report."""

import _thread
import argparse
import faulthandler
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time

import numpy as np

from . import data, models, report, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
ALL_MODES = ["local", "node", "shadow", "group", "auto", "renorm", "lagged", "global",
             "reference"]
DIST_MODES = ["local", "node", "shadow", "group", "auto", "renorm", "lagged", "global"]
DEFAULT_MODES = ["local", "node", "group", "auto", "renorm", "lagged", "global", "reference"]
# The simulated cross-node link of the default run, in ms each way (docs/results/COMPARISON.md says
# why this value).
LINK_DELAY_MS = 1
# One rack hop, sidecar <-> group aggregator: TCP and gRPC framing through a top-of-rack switch
# (docs/results/COMPARISON.md, "Group tier", says why 100 us).
GROUP_LINK_DELAY_US = 100
DEFAULT_LR = {"cls": 0.05, "seg": 0.05}
CHECK_FACTOR = 10.0
# What a run keeps for the check only (arrays), not written to results.json.
RAW_KEYS = ("state", "first_step", "first_step_f64")
CHECK_FLOOR = {"stats": 1e-6, "grads": 1e-5, "running": 1e-6}
# The largest distance (in units of the channel's root mean square) of a float64 input from a
# ReLU's 0 or a max-pool's tie at which global may take the other branch than float64: the
# flips round-off makes are ~1e-6 (as far as float32 moves an element), a wrong statistic
# moves elements by its own size (1e-2 in --perturb-mean's test).
KINK_MARGIN = 1e-4

DESCRIPTION = """\
Compare BatchNorm synchronization scopes on real data, with hsbn on this machine.

A LocalCluster (a root aggregator and one sidecar per simulated node) runs NODES x
WORKERS_PER_NODE worker processes that train the same model, from the same initial weights,
on the same items in the same order, with the same global SGD batch, in each mode:
  local      plain BatchNorm over each worker's own batch (DDP's default)
  node       statistics of the node's batch (hsbn scope "node")
  shadow     node statistics; the root records per layer how far they are from global
  group      statistics of a group of --group-nodes consecutive nodes (hsbn scope "group")
  auto       hsbn scope "auto": shadow for a warm-up, then per layer node (or group) where
             its statistics stayed close to the global ones, global where they did not
  renorm     node statistics renormalized toward the job's global statistics of the
             previous call, merged off the critical path (hsbn scope "renorm"; --renorm)
  lagged     the job's statistics in both passes, the other nodes' share one call old, with
             hsbn.torch's default damping and trip guard (hsbn scope "lagged")
  global     statistics of the global batch (hsbn scope "global")
  reference  one process, plain BatchNorm over the concatenated global batch
Gradients are averaged with DDP over gloo. `global` must match `reference` up to
floating-point round-off; the program checks it (PASS/FAIL, exit status 1 on FAIL).

Tasks (Fashion-MNIST from Debian's dataset-fashion-mnist):
  cls  classification of 28x28 items, small CNN with BN after every conv; test accuracy
  seg  semantic segmentation of 56x56 mosaics of 2x2 items (pixels labelled with their
       item's class or background), small encoder-decoder with BN; test mIoU
Each node's workers see class-skewed data (--skew): every class has a home node (classes
split into contiguous blocks over the nodes), so node statistics differ from global ones;
with --skew 0 the nodes see the same distribution. The sidecars reach the root through a
simulated cross-node link (--link-delay-ms each way); with the group and auto modes, through a
group aggregator per --group-nodes nodes (--group-tier, 100 us from its sidecars), where group
rounds complete.

The test metric is scored three ways: with rank 0's running statistics (what a checkpoint
saved by rank 0 holds), after hsbn.torch.sync_running_stats (running statistics pooled over
the job) and after hsbn.torch.precise_bn (recomputed over every worker's last training
inputs, --precise-items each).

Writes to --out: results.md (the table, per-layer divergence, the check), compare.png
(learning curves, metric vs time per step), results.json and runs.csv (raw results).
The defaults took 17 minutes on a shared 2-core machine (load average 28;
docs/results/COMPARISON.md), before lagged joined them (about 1/7 more runs).

--sweep runs the study on classification instead: per-worker batch x skew cells
(--sweep-batches, --sweep-skews), --sweep-seeds seeds per cell and --sweep-default-seeds in
the default cell (--batch, --skew), paired by seed; writes sweep.md, sweep.json, runs.csv and
two plots (gap_vs_batch.svg, acc_vs_sync.svg) to --out (default results/sweep).
"""

EPILOG = """\
scaling up: more data and steps (--train-size 60000 --epochs 3), more seeds (--seeds 5),
a bigger topology (--nodes 4 --workers-per-node 8 on a machine with the cores for it).
A smoke run: --steps 3 --seeds 1 --test-size 64 (a minute).
A run that seems stuck: kill -USR1 PID of the program or of any of its workers prints that
process's Python stacks (every thread) to stderr and lets it go on.
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="hsbn_compare.py", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("topology and batch")
    g.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    g.add_argument("--workers-per-node", type=int, default=2,
                   help="worker processes per node (default 2)")
    g.add_argument("--group-nodes", type=int, default=2,
                   help="nodes per group for the group mode, and auto's alternative to "
                        "global (default 2; must divide --nodes)")
    g.add_argument("--link-delay-ms", type=int, default=None,
                   help="simulated cross-node link delay in ms each way: sidecar-root, or with "
                        "the group tier group aggregator-root (default %d; 0 = loopback)"
                        % LINK_DELAY_MS)
    g.add_argument("--group-tier", choices=["on", "off"], default=None,
                   help="group and auto modes: a group aggregator per --group-nodes nodes "
                        "between their sidecars and the root, so group rounds never reach the "
                        "root (default on where hsbn has it)")
    g.add_argument("--group-link-delay-us", type=int, default=GROUP_LINK_DELAY_US,
                   help="with the group tier: the sidecar-group aggregator link delay in us "
                        "each way, one rack hop (default %d)" % GROUP_LINK_DELAY_US)
    g.add_argument("--batch", type=int, default=4,
                   help="images (mosaics) per worker per step (default 4); the global batch is "
                        "nodes x workers-per-node x batch")
    g = p.add_argument_group("what to run")
    g.add_argument("--task", choices=["both", "cls", "seg"], default="both",
                   help="classification, segmentation or both (default both)")
    g.add_argument("--modes", default=None,
                   help="comma-separated modes to run, from %s (default %s)"
                        % (",".join(ALL_MODES), ",".join(DEFAULT_MODES)))
    g.add_argument("--seeds", type=int, default=2,
                   help="seeds per mode (default 2); each seed changes the initial weights, "
                        "the data order and the node shards")
    g.add_argument("--first-seed", type=int, default=0, help="first seed (default 0)")
    g.add_argument("--model", default=None, metavar="NAME",
                   help="classification with a torchvision classifier by name instead of the "
                        "small CNN (e.g. resnet18; randomly initialized, gray items repeated "
                        "to 3 channels; needs python3-torchvision; with --task cls)")
    g.add_argument("--renorm", default=None, metavar="KEY=VALUE,...",
                   help="options of the renorm mode, from %s (default: hsbn.torch's "
                        "defaults, recorded in the results' config), e.g. "
                        "warmup=5,ramp=50,r_max=3,d_max=5" % ",".join(RENORM_KEYS))
    g.add_argument("--lagged", default=None, metavar="KEY=VALUE,...",
                   help="options of the lagged mode, from %s (default: hsbn.torch's "
                        "defaults, recorded in the results' config), e.g. "
                        "warmup=1,damping=1" % ",".join(LAGGED_KEYS))
    g = p.add_argument_group("training budget")
    g.add_argument("--train-size", type=int, default=4800,
                   help="training items drawn from Fashion-MNIST's 60000 (default 4800)")
    g.add_argument("--epochs", type=float, default=1.0,
                   help="passes over the training items (default 1); one step consumes one "
                        "global batch; a segmentation epoch has one mosaic per training item")
    g.add_argument("--steps", type=int, default=None,
                   help="train exactly this many steps instead (overrides --epochs)")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate, cosine-decayed to 0 (default %s)"
                        % ", ".join("%s %g" % kv for kv in DEFAULT_LR.items()))
    g.add_argument("--skew", type=float, default=0.8,
                   help="probability that an item goes to its class's home node rather than "
                        "to a random node (default 0.8; 0 = the same distribution everywhere, "
                        "1 = disjoint classes)")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--test-size", type=int, default=None,
                   help="test items (classification, default all 10000) and test mosaics "
                        "(segmentation, default 1000)")
    g.add_argument("--evals", type=int, default=5,
                   help="points on the learning curve (evaluations during training; default 5)")
    g.add_argument("--precise-items", type=int, default=256,
                   help="training items (mosaics) per worker that precise_bn recomputes the "
                        "running statistics over: each worker's last ones (default 256)")
    g.add_argument("--out", default=None,
                   help="output folder (default results/compare in the repository, "
                        "results/sweep with --sweep)")
    g.add_argument("--data-dir", default=data.DEFAULT_DATA_DIR,
                   help="folder with Fashion-MNIST's *-ubyte.gz files (default %s)"
                        % data.DEFAULT_DATA_DIR)
    g.add_argument("--round-timeout-ms", type=int, default=120000,
                   help="aggregators' round deadline (default 120000; workers on an "
                        "oversubscribed CPU can be slow)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--stall-minutes", type=float, default=30.0, metavar="M",
                   help="stop the run when no training step finished for M minutes (default "
                        "30; 0: never), after printing every process's Python stacks: a hang "
                        "is named, not waited for")
    g.add_argument("--debug-stall-at-step", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--perturb-mean", default=None, metavar="LAYER,K",
                   help="for testing the global vs reference check: in global's first step, "
                        "move BatchNorm layer LAYER's (index in module order) merged mean by K "
                        "of its standard deviations on every worker; the check must then FAIL")
    g = p.add_argument_group("the one-process study (issue #41; hsbncmp/oneproc.py)")
    g.add_argument("--one-process", action="store_true",
                   help="simulate every rank of the cell in one process instead (no cluster, "
                        "no native parts): each BatchNorm's forward and backward written out in "
                        "float64 per scope, the same data plan, model, optimizer and schedule; "
                        "writes oneproc.md, oneproc.json and oneproc.csv to --out (default "
                        "results/oneproc)")
    g.add_argument("--sim-modes", default=None, metavar="MODE,...",
                   help="one-process modes (default %s), from local, node, group, global, "
                        "renorm, lagged, lagged-fwd, lagged-damped:LAMBDA, lagged-guard; options "
                        "after a colon, e.g. lagged:warmup=75, lagged-guard:tau=1,delay=2, "
                        "lagged:trip=0.5,trip_calls=8 (the trip guard), "
                        "lagged:trip_rel=4,trip_hist=20 (its relative form), "
                        "lagged:trip_rel=4,trip_model=1 (a trip of any layer sends every "
                        "layer exact global), lagged:ema=0.5 "
                        "(the backward's stale share averaged; ema_fwd=1 the forward's too), "
                        "lagged:ef=1 (error feedback), lagged:exact_bwd=1 "
                        "(the job's fresh sums in the backward), lagged:only=2 (lagged in the "
                        "second BatchNorm only, the others exact global), lagged:stop=300 (calls "
                        "300 and later exact global), lagged:wfix=2 (the convolution's weight gradient "
                        "before each BatchNorm corrected to the job's fresh sums a step late; "
                        "wfix=1 the same step, wfix_mean=1 the sum dy term only), "
                        "lagged:oracle=1 (the stale share recomputed at this step's weights: "
                        "no weight drift; a bound, a second pass per step), lagged:oracle=2 "
                        "(this step's batch at the previous step's weights: no batch change), "
                        "lagged:oracle=3 (the next step's batch at this step's weights), "
                        "oracle_bwd=0 (the oracle's forward partials only)"
                        % "node,global,renorm,lagged,lagged-damped:0.25,lagged-damped:0.5,"
                          "lagged-guard")
    g.add_argument("--lr-spike", default=None, metavar="STEP:FACTOR:STEPS",
                   help="a forced instability: the learning rate times FACTOR for STEPS steps "
                        "from STEP on (one-process only), e.g. 60:20:3")
    g.add_argument("--jobs", type=int, default=None,
                   help="one-process runs at a time (default: the CPU count)")
    g = p.add_argument_group("the sweep (classification)")
    g.add_argument("--sweep", action="store_true",
                   help="run the study: every (batch, skew) cell, paired by seed")
    g.add_argument("--sweep-batches", default="2,4,8",
                   help="per-worker batches of the sweep (default 2,4,8)")
    g.add_argument("--sweep-skews", default="0,0.8", help="skews of the sweep (default 0,0.8)")
    g.add_argument("--sweep-seeds", type=int, default=3,
                   help="seeds per cell (default 3)")
    g.add_argument("--sweep-default-seeds", type=int, default=5,
                   help="seeds in the default cell (--batch, --skew; default 5)")
    args = p.parse_args(argv)
    if args.modes is None:
        modes = [m for m in DEFAULT_MODES if _mode_available(m)]
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        p.error("--modes: unknown %s; choose from %s" % (", ".join(bad) or "(none)",
                                                         ", ".join(ALL_MODES)))
    missing = [m for m in modes if not _mode_available(m)]
    if missing:
        p.error("--modes: this hsbn has no scope %s" % ", ".join(repr(m) for m in missing))
    args.modes = [m for m in ALL_MODES if m in modes]
    for name in ("nodes", "workers_per_node", "batch", "seeds", "evals", "group_nodes",
                 "sweep_seeds", "sweep_default_seeds", "precise_items"):
        if getattr(args, name) < 1:
            p.error("--%s must be at least 1" % name.replace("_", "-"))
    if args.nodes % args.group_nodes:
        p.error("--group-nodes %d does not divide --nodes %d" % (args.group_nodes, args.nodes))
    if args.link_delay_ms is None:
        args.link_delay_ms = LINK_DELAY_MS if _cluster_has_link_delay() else 0
    elif args.link_delay_ms < 0:
        p.error("--link-delay-ms must be >= 0")
    elif args.link_delay_ms and not _cluster_has_link_delay():
        p.error("--link-delay-ms: this hsbn's LocalCluster has no simulated link")
    if args.group_tier is None:
        args.group_tier = "on" if _cluster_has("group_tier") else "off"
    elif args.group_tier == "on" and not _cluster_has("group_tier"):
        p.error("--group-tier on: this hsbn's LocalCluster has no group tier")
    if args.group_tier == "on" and args.nodes // args.group_nodes < 2 and (
            "group" in args.modes or "auto" in args.modes):
        args.group_tier = "off"  # one group is the whole job: no tier between
    if not 0 <= args.group_link_delay_us <= 600000000:
        p.error("--group-link-delay-us must be within [0, 600000000]")
    try:
        args.sweep_batches = [int(v) for v in args.sweep_batches.split(",") if v.strip()]
        args.sweep_skews = [float(v) for v in args.sweep_skews.split(",") if v.strip()]
    except ValueError:
        p.error("--sweep-batches and --sweep-skews are comma-separated numbers")
    if args.sweep and (not args.sweep_batches or not args.sweep_skews
                       or min(args.sweep_batches) < 1
                       or not all(0 <= v <= 1 for v in args.sweep_skews)):
        p.error("--sweep-batches need values >= 1 and --sweep-skews values in [0, 1]")
    if args.out is None:
        args.out = os.path.join(REPO, "results", "sweep" if args.sweep else
                                "oneproc" if args.one_process else "compare")
    if args.jobs is None:
        args.jobs = os.cpu_count() or 1
    elif args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be at least 1")
    if not 0.0 <= args.skew <= 1.0:
        p.error("--skew must be in [0, 1]")
    if args.nodes * args.workers_per_node * args.batch < 2:
        p.error("the global batch needs at least 2 items")
    if args.model is not None:
        if args.task != "cls" and not args.sweep:
            p.error("--model applies to classification: add --task cls")
        try:
            models.torchvision_model(args.model)
        except models.UnknownModel as e:
            p.error(str(e))
    try:
        args.renorm = renorm_options(args.renorm)
    except ValueError as e:
        p.error("--renorm: %s" % e)
    try:
        args.lagged = lagged_options(args.lagged)
    except ValueError as e:
        p.error("--lagged: %s" % e)
    if args.stall_minutes < 0 or args.stall_minutes != args.stall_minutes:
        p.error("--stall-minutes: %r is not a number of minutes >= 0 (0: never)"
                % args.stall_minutes)
    if args.perturb_mean is not None:
        try:
            layer, k = args.perturb_mean.split(",")
            args.perturb_mean = (int(layer), float(k))
        except ValueError:
            p.error("--perturb-mean takes LAYER,K (an int and a number), e.g. 1,0.01")
    return args


RENORM_KEYS = ("lag", "momentum", "warmup", "r_max", "d_max", "ramp")
LAGGED_KEYS = ("damping", "warmup", "trip", "trip_rel", "trip_calls", "ema")


def renorm_options(text):
    """"key=value,..." (None: none) -> every renorm option, hsbn.torch's defaults for the ones
    not given; ValueError naming a bad one. An hsbn without the renorm scope gives {}."""
    return _scope_options("renorm", text, RENORM_KEYS, ("lag", "warmup", "ramp"))


def lagged_options(text):
    """The same for the lagged mode's options."""
    return _scope_options("lagged", text, LAGGED_KEYS, ("warmup", "trip_calls"))


def _scope_options(scope, text, keys, ints):
    """"key=value,..." of `keys` (those in `ints` whole numbers, the others numbers), checked
    and completed by hsbn.torch's `<scope>_options` (its _renorm or _lagged module)."""
    given = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in keys:
            raise ValueError("%r is not KEY=VALUE with KEY from %s" % (item, ", ".join(keys)))
        try:
            given[key] = int(value) if key in ints else float(value)
        except ValueError:
            raise ValueError("%s=%s is not a number%s" % (
                key, value.strip(), " (an int)" if key in ints else ""))
    if not _mode_available(scope):
        if given:
            raise ValueError("this hsbn has no scope '%s'" % scope)
        return {}
    import importlib
    from hsbn.errors import ConfigurationError
    module = importlib.import_module("hsbn.torch._" + scope)
    try:
        return getattr(module, scope + "_options")(**given)
    except ConfigurationError as e:
        raise ValueError(str(e))


def _mode_available(mode):
    """group, auto, renorm and lagged need an hsbn with those scopes."""
    if mode not in ("group", "auto", "renorm", "lagged"):
        return True
    import hsbn.client
    return mode in hsbn.client.SCOPES


def _cluster_has_link_delay():
    return _cluster_has("link_delay_ms")


def _cluster_has(parameter):
    import inspect
    import hsbn.cluster
    return parameter in inspect.signature(hsbn.cluster.LocalCluster).parameters


# --- progress ----------------------------------------------------------------------------------

class _Watcher:
    """A daemon thread that runs self._loop() for the length of a `with` block, when
    self._wanted(); self._stop is set at the block's end, and self._ended() runs once the thread
    has joined."""

    def __enter__(self):
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if self._wanted():
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()
            self._ended()

    def _ended(self):
        pass


class Progress(_Watcher):
    """A progress bar on stderr over a shared counter [steps done, current job] that the
    training processes advance."""

    def __init__(self, counter, labels, totals, enabled):
        self.counter = counter
        self.labels = labels
        self.totals = totals
        self.total = sum(totals)
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last_pct = -1

    def _wanted(self):
        return self.enabled

    def _ended(self):
        self._draw(final=True)

    def _loop(self):
        while not self._stop.wait(0.5):
            self._draw()

    def _draw(self, final=False):
        done, job = int(self.counter[0]), int(self.counter[1])
        frac = done / max(self.total, 1)
        el = time.monotonic() - self.start
        eta = el / frac - el if frac > 0.01 else float("nan")
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        label = self.labels[min(job, len(self.labels) - 1)] if self.labels else ""
        text = "[%s] %3d%% %d/%d steps | %s | %s elapsed, %s left" % (
            bar, 100 * frac, done, self.total, label, _clock(el), _clock(eta))
        if self.tty:
            sys.stderr.write("\r" + text.ljust(110)[:130] + ("\n" if final else ""))
            sys.stderr.flush()
        else:
            pct = int(100 * frac) // 10 * 10
            if pct != self._last_pct:
                self._last_pct = pct
                sys.stderr.write(text + "\n")
                sys.stderr.flush()


def _clock(seconds):
    if seconds != seconds:  # nan
        return "?"
    seconds = int(seconds)
    return "%d:%02d" % (seconds // 60, seconds % 60)


def python_descendants(pid):
    """The Python processes below `pid` (workers), from /proc (none without one);
    multiprocessing's resource tracker left out."""
    children = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                stat = f.read()
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append((int(entry), cmdline))
    out, todo = [], [pid]
    while todo:
        for child, cmdline in children.get(todo.pop(), []):
            todo.append(child)
            if b"python" in cmdline and b"resource_tracker" not in cmdline:
                out.append(child)
    return out


def dump_stacks(pids):
    """SIGUSR1 to each of `pids` in turn (train.dump_stacks_on_sigusr1: its Python stacks to
    the shared stderr), a second apart so that the dumps do not interleave."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        time.sleep(1)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


class Watchdog(_Watcher):
    """Stops a phase of the run (with it: `counter` [steps done, job index], as Progress) when no
    step finished for `minutes` (0: never): prints why, this process's and every worker's
    Python stacks, then interrupts the main thread; the phase's caller passes the
    KeyboardInterrupt to stalled(), which turns it into SystemExit naming the stall."""

    def __init__(self, counter, minutes, labels):
        self.counter, self.limit, self.labels = counter, 60.0 * minutes, labels
        self.fired = None
        self._old_handler = None

    def _wanted(self):
        return self.limit > 0

    # The interrupt is a SIGUSR2 sent to the main thread, whose handler (installed for the
    # block, from the main thread) raises KeyboardInterrupt: it does not depend on SIGINT's
    # disposition, which a parent can have set to ignored (a shell's background job: then both
    # _thread.interrupt_main() and a SIGINT do nothing, and the run hung after naming its
    # stall), and it interrupts a main thread blocked in a wait for the workers (EINTR).
    def __enter__(self):
        if self._wanted() and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGUSR2, _raise_keyboard_interrupt)
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self._old_handler is not None:
            signal.signal(signal.SIGUSR2, self._old_handler)
            self._old_handler = None

    def _loop(self):
        last, since = int(self.counter[0]), time.monotonic()
        while not self._stop.wait(min(5.0, self.limit / 4)):
            done, now = int(self.counter[0]), time.monotonic()
            if done != last:
                last, since = done, now
            elif now - since >= self.limit:
                break
        else:
            return
        job = int(self.counter[1])
        label = self.labels[min(job, len(self.labels) - 1)] if self.labels else ""
        self.fired = ("no training step finished in %s (%d steps done, %s): a hang, or steps "
                      "slower than --stall-minutes %g allows; the run stopped" % (
                          _clock(now - since), done, label, self.limit / 60.0))
        print("hsbn_compare: %s. Every process's Python stacks follow." % self.fired,
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        dump_stacks(python_descendants(os.getpid()))
        if self._old_handler is not None:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
        else:  # (not entered from the main thread: the best it can do)
            _thread.interrupt_main()

    def stalled(self):
        """Called with a KeyboardInterrupt in flight: SystemExit(1) naming the stall when this
        watchdog raised it; returns otherwise (a real Ctrl-C goes on)."""
        if self.fired:
            raise SystemExit("hsbn_compare: " + self.fired)


# --- the parts ---------------------------------------------------------------------------------

def prepare(args, tasks, tmp):
    """Loads Fashion-MNIST and writes the arrays the workers read (memory-mapped) to `tmp`."""
    d = data.load(args.data_dir)
    cache = {}

    def save(name, arr):
        path = os.path.join(tmp, name + ".npy")
        np.save(path, np.ascontiguousarray(arr))
        cache[name] = path

    save("train_x", d["train_x"])
    save("train_y", d["train_y"])
    if "cls" in tasks:
        n = min(args.test_size or len(d["test_y"]), len(d["test_y"]))
        save("cls_test_x", d["test_x"][:n])
        save("cls_test_y", d["test_y"][:n])
        c = min(n, 2000)
        save("cls_curve_x", d["test_x"][:c])
        save("cls_curve_y", d["test_y"][:c])
    if "seg" in tasks:
        n = args.test_size or 1000
        img, lab = data.test_mosaics(d["test_x"], d["test_y"], n)
        save("seg_test_x", img)
        save("seg_test_y", lab)
        c = min(n, 250)
        save("seg_curve_x", img[:c])
        save("seg_curve_y", lab[:c])
    return d, cache


def initial_state(task, seed, model_name=None):
    import torch
    torch.manual_seed(seed)
    model = models.build(task, model_name)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


_REF_PROGRESS = None


def _ref_init(progress):
    global _REF_PROGRESS
    train.dump_stacks_on_sigusr1()
    _REF_PROGRESS = progress


def _ref_entry(job):
    return train.reference_run(*job[:-1], _REF_PROGRESS, job[-1])


def run_references(ref_jobs, processes, progress):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes, initializer=_ref_init, initargs=(progress,)) as pool:
        return pool.map(_ref_entry, ref_jobs, chunksize=1)


def rel_gap(a, b):
    """||a - b|| / ||b|| over the whole state (all weights and running statistics as one
    vector). Per tensor would be fragile: some tensors (the first BN layer's bias) stay near
    zero, so their relative error is round-off divided by almost nothing."""
    keys = sorted(b)
    x = np.concatenate([np.asarray(a[k], np.float64).ravel() for k in keys])
    y = np.concatenate([np.asarray(b[k], np.float64).ravel() for k in keys])
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def stats_gap(a, b):
    """How far the per-layer BatchNorm statistics `a` are from `b` ({layer index: (mean[C],
    biased var[C])}): the largest over layers and channels of |mean_a - mean_b| / sqrt(var_b +
    eps) and |var_a - var_b| / (var_b + eps), i.e. in units of the layer's own scale."""
    worst = 0.0
    for i, (mb, vb) in b.items():
        ma, va = a[i]
        vb = np.asarray(vb, np.float64)
        worst = max(worst, float(np.max(np.abs(np.asarray(ma) - mb) / np.sqrt(vb + train.BN_EPS))),
                    float(np.max(np.abs(np.asarray(va) - vb) / (vb + train.BN_EPS))))
    return worst


# What the check compares at the first step, and how: name -> (gap function, what it is).
CHECK_PARTS = (
    ("stats", stats_gap, "each BatchNorm layer's merged mean and variance"),
    ("grads", rel_gap, "every parameter's gradient"),
    ("running", rel_gap, "the running statistics after the step"),
)


def _truth(truth, name, label):
    """The float64 part `name` a run `label` is measured against: for gradients, float64's
    gradient on the run's own branch (its ReLU and max-pool decisions) where it was recorded,
    else float64's own."""
    if name == "grads":
        return (truth.get("grads_on_branch") or {}).get(label, truth["grads"])
    return truth[name]


def global_reference_check(runs, tasks, seeds):
    """`global` vs a float64 one-process run of the first step, against the float32
    reference's distance from the same run (see the explanation)."""
    by = {(r["task"], r["seed"], r["mode"]): r for r in runs}
    rows = []
    for task in tasks:
        for seed in seeds:
            g, ref = by.get((task, seed, "global")), by.get((task, seed, "reference"))
            if g is None or ref is None or not g.get("first_step"):
                continue
            truth = ref["first_step_f64"]
            node = by.get((task, seed, "node"))
            row = {"task": task, "seed": seed}
            ok = True
            for name, gap, _ in CHECK_PARTS:
                row[name + "_gap"] = gap(g["first_step"][name], _truth(truth, name, "global"))
                row[name + "_ref"] = gap(ref["first_step"][name],
                                         _truth(truth, name, "reference"))
                row[name + "_tolerance"] = max(CHECK_FACTOR * row[name + "_ref"],
                                               CHECK_FLOOR[name])
                row[name + "_node"] = (gap(node["first_step"][name], truth[name])
                                       if node and node.get("first_step") else None)
                ok = ok and row[name + "_gap"] <= row[name + "_tolerance"]
            # The kinks where each float32 run took another branch than float64 (see
            # kinks.py): round-off flips only those within round-off of the kink.
            flips = truth.get("kink_flips") or {}
            row["kink_flips"] = flips.get("global", {}).get("count")
            row["kink_margin"] = flips.get("global", {}).get("margin")
            row["kink_flips_ref"] = flips.get("reference", {}).get("count")
            row["kink_margin_ref"] = flips.get("reference", {}).get("margin")
            ok = ok and (row["kink_margin"] is None or row["kink_margin"] <= KINK_MARGIN)
            # Shown, not judged: training amplifies round-off by an amount that depends on the
            # seed and on the machine's arithmetic.
            row["weight_gap"] = rel_gap(g["state"], ref["state"])
            row["loss_gap"] = float(np.max(np.abs(np.subtract(g["loss"], ref["loss"]))))
            row["node_gap"] = rel_gap(node["state"], g["state"]) if node else None
            row["pass"] = bool(ok)
            rows.append(row)
    if not rows:
        return None
    explanation = (
        "`global` and `reference` start from the same weights, see the same items in the same "
        "order and take the same SGD steps: mathematically one computation, which differs in "
        "floating point only by round-off (hsbn merges per-worker statistics in float64; DDP "
        "averages the workers' gradients; the reference sums over the whole batch in "
        "float32). The check compares the first step, before training has amplified any "
        "round-off, with the same step computed in float64 in one process: %s. Statistics "
        "gaps are the largest over layers and channels of |Δmean| / sqrt(var + eps) and "
        "|Δvar| / (var + eps); gradient and running-statistics gaps are ||a − b|| / ||b|| over "
        "all of them as one vector. A run's gradients are measured against the float64 "
        "gradients on the run's own branch: where a ReLU's input, or the two largest "
        "elements of a max-pool window, lie within round-off of the kink, float32 can decide "
        "the other way than float64, and the gradient then takes another branch of the same "
        "function, far more than round-off away (behind BatchNorm, which couples every item "
        "of a channel, one flipped ReLU moves every gradient upstream of it: 2e-3 to 8e-3 of "
        "ResNet-18's), so the float64 step replays the run's ReLU and max-pool decisions. "
        "`global` passes when each gap is within %g× the float32 reference's own gap from the "
        "float64 run (floors: %s) and every decision in which it differs from float64 lies "
        "within %g of the kink in float64 (in units of the channel's root mean square; "
        "round-off flips decisions within ~1e-6): round-off of float32 arithmetic, whatever "
        "the CPU's instruction set, is of the reference's size, while a wrong statistic is "
        "orders of magnitude larger (node–global, shown for scale) and flips decisions as far "
        "from the kink as its own error. The final weights and the training loss are shown, "
        "not judged: SGD amplifies round-off over the run by an amount that depends on the "
        "seed and the machine."
        % ("; ".join(what for _, _, what in CHECK_PARTS), CHECK_FACTOR,
           ", ".join("%s %g" % kv for kv in CHECK_FLOOR.items()), KINK_MARGIN))
    return {"rows": rows, "pass": all(r["pass"] for r in rows), "factor": CHECK_FACTOR,
            "floor": dict(CHECK_FLOOR), "kink_margin": KINK_MARGIN,
            "explanation": explanation}


# Variables that change the CPU arithmetic of torch (and so the last digits of every result).
ARITHMETIC_ENV = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA",
                  "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_description():
    """The CPU model and flags (from /proc/cpuinfo) and the vector instruction set torch's CPU
    kernels use here (torch.__config__.show()'s "CPU capability usage"): two machines with
    the same model name can still differ in these, and then in the last digits of results."""
    import torch
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine()):
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.split()
    except OSError:
        pass
    m = re.search(r"CPU capability usage: (\S+)", torch.__config__.show())
    return {"model": model, "flags": " ".join(flags),
            "torch_capability": m.group(1) if m else "unknown"}


def environment():
    import torch
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    cpus = os.cpu_count()
    # How node rounds travel (the workers inherit it): shared memory unless HSBN_TRANSPORT=grpc.
    transport = os.environ.get("HSBN_TRANSPORT", "") or "auto"
    cpu = cpu_description()
    return {"torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "cpus": cpus,
            "cpu_model": cpu["model"], "cpu_flags": cpu["flags"],
            "torch_cpu_capability": cpu["torch_capability"],
            "arithmetic_env": {k: os.environ[k] for k in ARITHMETIC_ENV if k in os.environ},
            "platform": platform.platform(), "loadavg_start": list(load),
            "transport": transport,
            "machine": "%s, %d CPU core(s), torch CPU capability %s%s, 1-minute load average "
                       "%.1f at the start%s; node rounds over %s"
                       % (cpu["model"], cpus, cpu["torch_capability"],
                          "".join(" %s=%s" % (k, os.environ[k]) for k in ARITHMETIC_ENV
                                  if k in os.environ),
                          load[0], " (shared: timings are noisy)"
                          if load[0] > 0.5 * cpus else "",
                          "the gRPC stream (HSBN_TRANSPORT=grpc)" if transport == "grpc"
                          else "shared memory (HSBN_TRANSPORT=auto)")}


def make_cfg(args, tasks, seeds, batch, skew):
    world = args.nodes * args.workers_per_node
    lr = {t: args.lr if args.lr is not None else DEFAULT_LR[t] for t in tasks}
    return {"nodes": args.nodes, "workers_per_node": args.workers_per_node, "world": world,
            "batch": batch, "tasks": tasks, "seeds": seeds, "skew": skew,
            "evals": args.evals, "lr": lr, "train_size": args.train_size,
            "epochs": args.epochs, "modes": args.modes,
            "group_nodes": args.group_nodes if "group" in args.modes or "auto" in args.modes
            else 0,
            "link_delay_ms": args.link_delay_ms, "precise_items": args.precise_items,
            "group_tier": args.group_tier == "on" and ("group" in args.modes
                                                       or "auto" in args.modes),
            "group_link_delay_us": args.group_link_delay_us,
            "perturb_mean": args.perturb_mean, "model": args.model,
            "renorm": dict(args.renorm) if "renorm" in args.modes else None,
            "lagged": dict(args.lagged) if "lagged" in args.modes else None,
            **({"debug_stall_at_step": args.debug_stall_at_step}
               if args.debug_stall_at_step is not None else {})}


def run_cell(args, cfg, d, pool, cache, label=""):
    """Trains every (task, seed, mode) of `cfg` (distributed runs in one LocalCluster, then the
    one-process references); returns the runs."""
    import hsbn.cluster
    tasks, seeds = cfg["tasks"], cfg["seeds"]
    plans, inits = {}, {}
    for task in tasks:
        for seed in seeds:
            plans[(task, seed)] = data.make_plan(
                task, seed, d["train_y"], pool, cfg["nodes"], cfg["workers_per_node"],
                cfg["batch"], args.epochs, args.steps, cfg["skew"])
            inits[(task, seed)] = initial_state(task, seed, cfg.get("model"))
    cfg["steps"] = {t: plans[(t, seeds[0])]["steps"] for t in tasks}
    cfg["params"] = {t: models.parameter_count(t, cfg.get("model")) for t in tasks}
    print("hsbn_compare: %s%s" % (label, "; ".join(
        "%s: %d steps (%d per epoch), %d parameters" % (
            report.TASK_NAME[t], cfg["steps"][t], plans[(t, seeds[0])]["per_epoch"],
            cfg["params"][t]) for t in tasks)))
    # Seeds in the middle loop, modes in the inner one: load drifts hit every mode alike.
    dist_jobs = [(t, s, m) for t in tasks for s in seeds for m in cfg["modes"]
                 if m in DIST_MODES]
    runs = []
    ctx = multiprocessing.get_context("spawn")
    if dist_jobs:
        counter = ctx.Array("q", 2)
        labels = ["%s%s seed %d %s" % (label, report.TASK_NAME[t], s, m)
                  for t, s, m in dist_jobs]
        totals = [plans[(t, s)]["steps"] for t, s, m in dist_jobs]
        tier = cfg.get("group_tier")
        print("hsbn_compare: %d distributed runs in a LocalCluster (a root, %s%d sidecars, "
              "%d workers, link delay %d ms each way%s)"
              % (len(dist_jobs), "%d group aggregators, " % (cfg["nodes"] // cfg["group_nodes"])
                 if tier else "", cfg["nodes"], cfg["world"], cfg["link_delay_ms"],
                 ", sidecar-group %d us" % cfg["group_link_delay_us"] if tier else ""))
        kwargs = {}
        if cfg["link_delay_ms"]:
            kwargs["link_delay_ms"] = cfg["link_delay_ms"]
        if tier:
            kwargs.update(group_tier=True, group_nodes=cfg["group_nodes"],
                          group_link_delay_us=cfg["group_link_delay_us"])
        watchdog = Watchdog(counter, args.stall_minutes, labels)
        try:
            with hsbn.cluster.LocalCluster(nodes=cfg["nodes"],
                                           workers_per_node=cfg["workers_per_node"],
                                           round_timeout_ms=args.round_timeout_ms,
                                           **kwargs) as cluster:
                # For the workers' CPU accounting (train._proc_cpu); where pids() is missing
                # (an older hsbn), no CPU is reported.
                wcfg = dict(cfg, cluster_pids=getattr(cluster, "pids", dict)())
                with Progress(counter, labels, totals, not args.no_progress), watchdog:
                    out = cluster.run(train.cluster_worker, wcfg, dist_jobs, inits, plans,
                                      cache, counter)
        except KeyboardInterrupt:
            watchdog.stalled()
            raise
        runs += out[0]
    # The references run after the distributed runs: each gets global's first-step kink
    # decisions, for the float64 gradient on global's branch (the check).
    ref_jobs = []
    if "reference" in cfg["modes"]:
        by = {(r["task"], r["seed"], r["mode"]): r for r in runs}
        for t in tasks:
            for s in seeds:
                g = by.get((t, s, "global"))
                ref_jobs.append((cfg, t, s, "reference", "forward", inits[(t, s)],
                                 plans[(t, s)], cache,
                                 (g.get("first_step") or {}).get("kinks") if g else None))
    if ref_jobs:
        counter = ctx.Array("q", 2)
        procs = max(1, min(len(ref_jobs), os.cpu_count() or 1))
        labels = ["%sreference runs (%d at a time)" % (label, procs)]
        totals = [j[6]["steps"] for j in ref_jobs]
        print("hsbn_compare: %d one-process reference runs" % len(ref_jobs))
        watchdog = Watchdog(counter, args.stall_minutes, labels)
        try:
            with Progress(counter, labels, totals, not args.no_progress), watchdog:
                runs += run_references([j + (0,) for j in ref_jobs], procs, counter)
        except KeyboardInterrupt:
            watchdog.stalled()
            raise
    return runs


def _command(argv):
    return shlex.join(["python3", os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
                       if argv is None else "hsbn_compare.py"]
                      + (sys.argv[1:] if argv is None else list(argv)))


def main(argv=None):
    args = parse_args(argv)
    train.dump_stacks_on_sigusr1()
    try:
        data.check_data_dir(args.data_dir)
    except data.DataMissingError as e:
        print("hsbn_compare: %s" % e, file=sys.stderr)
        return 2
    if args.one_process:
        from . import oneproc
        if args.sim_modes is None:
            args.sim_modes = ",".join(oneproc.DEFAULT_MODES)
        return oneproc.run(args, _command(argv))
    if args.sweep:
        from . import sweep
        return sweep.run(args, _command(argv))
    tasks = ["cls", "seg"] if args.task == "both" else [args.task]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    env = environment()
    os.makedirs(args.out, exist_ok=True)
    cfg = make_cfg(args, tasks, seeds, args.batch, args.skew)
    command = _command(argv)
    print("hsbn_compare: %d nodes x %d workers, %d per worker, tasks %s, modes %s, seeds %s; "
          "%s" % (args.nodes, args.workers_per_node, args.batch, ",".join(tasks),
                  ",".join(args.modes), ",".join(map(str, seeds)), env["machine"]))
    tmp = tempfile.mkdtemp(prefix="hsbn-compare-")
    t_start = time.monotonic()
    try:
        d, cache = prepare(args, tasks, tmp)
        pool = data.training_pool(d["train_y"], args.train_size)
        runs = run_cell(args, cfg, d, pool, cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - t_start
    check = global_reference_check(runs, tasks, seeds)
    summary = report.summarize(runs, cfg)
    divergence = report.divergence_table(runs, cfg)
    try:
        env["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    env["wall_s"] = wall
    md = report.markdown(summary, divergence, check, cfg, command, env)
    md += "\nTotal wall time %s.\n" % _clock(wall)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    report.write_csv(os.path.join(args.out, "runs.csv"), runs, cfg)
    report.write_json(os.path.join(args.out, "results.json"), {
        "command": command, "config": cfg, "environment": env, "summary": summary,
        "divergence": divergence, "check": check,
        "runs": [{k: v for k, v in r.items() if k not in RAW_KEYS} for r in runs]})
    try:
        report.plot(os.path.join(args.out, "compare.png"), runs, summary, cfg)
    except Exception as e:  # the numbers are written already; say what went wrong
        print("hsbn_compare: could not draw compare.png: %r" % e, file=sys.stderr)
        plot_failed = True
    else:
        plot_failed = False
    print()
    print(md)
    print("hsbn_compare: wrote %s/{results.md,results.json,runs.csv,compare.png}" % args.out)
    if check is not None and not check["pass"]:
        print("hsbn_compare: FAIL: global does not match reference beyond round-off noise; "
              "that is a bug in the synchronization", file=sys.stderr)
        return 1
    return 1 if plot_failed else 0
