"""Shared by soak.py and faults.py: finding the binaries, sampling aggregator processes from
/proc, running hsbn-soak-worker processes and reading their reports."""

import atexit
import glob
import os
import selectors
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

from hsbn.cluster import LocalCluster  # noqa: E402,F401  (after the path above; for the scripts)

_ALL_SETS = []


@atexit.register
def _kill_workers_left():
    # However a script ends (an exception, SIGTERM through sys.exit), no worker outlives it.
    for ws in _ALL_SETS:
        for w in ws.running():
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    w.proc.send_signal(sig)
                except ProcessLookupError:
                    pass


def exit_on_sigterm():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))


def find_binary(flag_value, env_var, relative):
    """--flag, then $ENV, then the newest build*/relative of this checkout."""
    for candidate in (flag_value, os.environ.get(env_var)):
        if candidate:
            if not os.access(candidate, os.X_OK):
                sys.exit("%s is not an executable file" % candidate)
            return os.path.abspath(candidate)
    found = sorted(glob.glob(os.path.join(REPO, "build*", relative)), key=os.path.getmtime,
                   reverse=True)
    if not found:
        sys.exit("cannot find %s: build it (cmake --build build --target bench_soak) or set %s"
                 % (relative, env_var))
    return found[0]


def add_binary_args(p):
    p.add_argument("--worker", help="hsbn-soak-worker (default: $HSBN_SOAK_WORKER or build*/)")
    p.add_argument("--aggregator", help="hsbn-aggregator (default: $HSBN_AGGREGATOR or build*/)")
    p.add_argument("--linkproxy", help="hsbn-linkproxy (default: $HSBN_LINKPROXY or build*/)")


def binaries(args):
    return (find_binary(args.worker, "HSBN_SOAK_WORKER", "bench/soak/hsbn-soak-worker"),
            find_binary(args.aggregator, "HSBN_AGGREGATOR", "server/hsbn-aggregator"),
            find_binary(args.linkproxy, "HSBN_LINKPROXY", "tools/linkproxy/hsbn-linkproxy"))


def proc_sample(pid):
    """(RSS in KiB, open fds) of a process, or None if it is gone."""
    try:
        with open("/proc/%d/status" % pid) as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir("/proc/%d/fd" % pid))
        return rss, fds
    except (OSError, StopIteration):
        return None


def aggregator_pids(cluster):
    """Aggregators only (root, node0, node1, ...), not the link proxies."""
    return {k: v for k, v in cluster.pids().items() if not k.startswith("link")}


def sample_all(cluster):
    out = {}
    for name, pid in aggregator_pids(cluster).items():
        s = proc_sample(pid)
        if s:
            out[name] = {"rss_kib": s[0], "fds": s[1]}
    return out


def wait_fds_settled(cluster, quiet_s=2.0, limit_s=60.0, at_most=None):
    """Samples every 0.2 s until each aggregator's fd count has not changed for quiet_s (and,
    with at_most, is <= at_most[name]); returns the last sample and whether it settled."""
    start = time.monotonic()
    last, since = None, time.monotonic()
    while True:
        s = sample_all(cluster)
        fds = {k: v["fds"] for k, v in s.items()}
        if fds != last:
            last, since = fds, time.monotonic()
        ok = at_most is None or all(fds.get(k, 0) <= v for k, v in at_most.items())
        if ok and time.monotonic() - since >= quiet_s:
            return s, True
        if time.monotonic() - start > limit_s:
            return s, False
        time.sleep(0.2)


class Worker:
    """One hsbn-soak-worker process: some local ranks of one node of one job."""

    def __init__(self, binary, cluster, job, node, steps, layers=3, channels=8,
                 scopes="node,global,shadow", local_ranks=None, incarnation=0, churn=0,
                 progress_every=100, round_timeout_ms=0, connect_timeout_ms=20000):
        self.job, self.node = job, node
        self.local_ranks = list(range(cluster.workers_per_node)) if local_ranks is None \
            else list(local_ranks)
        self.args = [binary, "--address=" + cluster.node_addresses[node], "--job=" + job,
                     "--nodes=%d" % cluster.nodes,
                     "--local-world=%d" % cluster.workers_per_node, "--node-rank=%d" % node,
                     "--local-ranks=" + ",".join(map(str, self.local_ranks)),
                     "--steps=%d" % steps, "--layers=%d" % layers, "--channels=%d" % channels,
                     "--scopes=" + scopes, "--incarnation=%d" % incarnation,
                     "--churn=%d" % churn, "--progress-every=%d" % progress_every,
                     "--round-timeout-ms=%d" % round_timeout_ms,
                     "--connect-timeout-ms=%d" % connect_timeout_ms]
        if getattr(cluster, "group_nodes", None):
            self.args.append("--group-nodes=%d" % cluster.group_nodes)
        self.expected_death = None  # why we killed it, when we did
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.buf = b""
        self.lines = []
        self.returncode = None

    def read_available(self):
        """Reads what the pipe has (non-blocking after select); returns new complete lines."""
        try:
            data = os.read(self.proc.stdout.fileno(), 65536)
        except BlockingIOError:
            return []
        if not data:
            return None  # EOF
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        lines = [ln.decode("utf-8", "replace") for ln in lines]
        self.lines += lines
        return lines


class WorkerSet:
    """Workers read through one selector; on_line(worker, line) is called for every line."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.workers = []
        _ALL_SETS.append(self)

    def add(self, w):
        os.set_blocking(w.proc.stdout.fileno(), False)
        self.sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        self.workers.append(w)
        return w

    def running(self):
        return [w for w in self.workers if w.returncode is None]

    def poll(self, timeout, on_line):
        """Waits up to `timeout` for output; handles it; reaps workers whose pipe closed."""
        for key, _ in self.sel.select(timeout):
            w = key.data
            lines = w.read_available()
            if lines is None:
                self.sel.unregister(w.proc.stdout)
                w.proc.stdout.close()
                w.returncode = w.proc.wait()
                if w.buf:
                    w.lines.append(w.buf.decode("utf-8", "replace"))
                    on_line(w, w.lines[-1])
                    w.buf = b""
                on_line(w, None)  # exited
                continue
            for line in lines:
                on_line(w, line)

    def kill_all(self, sig=9):
        for w in self.running():
            try:
                w.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def linear_slope(xs, ys):
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
