"""hsbn.cluster.LocalCluster: a whole hsbn deployment on one machine, for trying hsbn, examples
and tests.

    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=4) as cluster:
        env = cluster.worker_env(rank)        # for subprocess.Popen(..., env=env), or
        results = cluster.run(train, arg)     # train(arg) in every worker, results by rank

It starts real aggregator processes: a root listening on 127.0.0.1 (TCP, as across machines)
and one sidecar per simulated node on a Unix socket, forwarding global rounds to the root.
Worker ranks are laid out as torchrun lays them out: rank = node * workers_per_node + local_rank.

With link_delay_ms (or link_proxy=True) every sidecar reaches the root through its own
hsbn-linkproxy, which holds every chunk link_delay_ms in each direction: a simulated cross-node
link on one machine (node rounds never cross it; global and shadow rounds cross it up and
down). link_command(node, "drop" | "stall" | "resume" | "delay MS" | ...) cuts, stalls or
re-delays one node's link; link_stats(node) reads the proxy's counters.

With group_tier=True (and group_nodes=K) a group aggregator (--role=group) sits between each K
consecutive nodes' sidecars and the root: group rounds complete there and never reach the root.
Then link_delay_us / link_delay_ms delay each group aggregator's link to the root, and
group_link_delay_us each sidecar's link to its group aggregator.
"""

import ast
import multiprocessing
import os
import pickle
import queue as queue_module
import shutil
import socket
import tempfile
import time
import traceback
import uuid

from . import _lib
from ._procs import ClusterError, ManagedProcess, free_port as _free_port

# The helper's old name here (tests start single aggregators with it).
_Aggregator = ManagedProcess


_GUARD_HINT = (
    "LocalCluster.run starts its workers with multiprocessing's \"spawn\": each one imports "
    "your main module (%s) again before it runs the function, so the code that creates the "
    "LocalCluster must sit under `if __name__ == \"__main__\":` (docs/PYTORCH.md, \"Try it on "
    "one machine\")")


def _bootstrapping():
    """True in a process started by multiprocessing while it imports the parent's main
    module (the guard-less script case), when starting processes is refused."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _main_module_lacks_guard():
    """The path of the main module when it is a script without an `if __name__ ==
    "__main__":` block at its top level (so spawned workers would run it all again), else
    None. A main module that cannot be read (an interactive session, python -c) passes."""
    import sys
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py") or getattr(main, "__spec__", None) is not None:
        return None  # python -m pkg.mod: spawn imports it by name, as its own module
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.dump(node.test) \
                and "__name__" in ast.dump(node.test):
            return None
    return path


class LocalCluster:
    """A root aggregator and one sidecar per simulated node, as local processes.

    Args:
      nodes: simulated nodes (one sidecar each).
      workers_per_node: workers on each node (LOCAL_WORLD_SIZE).
      job_id: the job id given to workers (default: a fresh unique one).
      round_timeout_ms: passed to every aggregator's --round-timeout-ms (default: theirs).
      root: start a root aggregator; default True. Without one only node-scope rounds work.
      aggregator: path of hsbn-aggregator (default: found as hsbn.aggregator_path() finds it).
      workdir: where sockets, ready files and logs go (default: a fresh temporary folder,
        removed on exit; a given folder is kept).
      startup_timeout: seconds to wait for the aggregators to be listening.
      link_delay_ms: a simulated cross-node link: each sidecar reaches the root through its own
        hsbn-linkproxy, holding every chunk this many milliseconds in each direction, so a
        global round pays about 2 x link_delay_ms more than on loopback and a node round
        nothing (default None: sidecars connect to the root directly).
      link_delay_us: the same in microseconds (give one of the two).
      link_proxy: put the proxies in place even without a delay (fault injection).
      linkproxy: path of hsbn-linkproxy (default: found as hsbn._lib.linkproxy_path() finds it).
      group_nodes: HSBN_GROUP_NODES for the workers (worker_env sets it): nodes per group.
      group_tier: start one group aggregator per group_nodes consecutive nodes, between their
        sidecars and the root (needs group_nodes and a root). The delays then apply per level:
        link_delay_* to each group aggregator's link to the root, group_link_delay_us to each
        sidecar's link to its group aggregator.
      group_link_delay_us: the sidecar <-> group aggregator delay, in microseconds.
      aggregator_args: more flags for every aggregator (root, group aggregators and sidecars).
      isolate_signals: start the aggregators and link proxies in their own session (a
        terminal's Ctrl-C reaches only the caller, which stops them) and have each get SIGTERM
        when the thread that started it exits (none is left behind if the caller is killed).
        `hsbn run` does; off by default.
    """

    def __init__(self, nodes=2, workers_per_node=4, job_id=None, round_timeout_ms=None,
                 root=True, aggregator=None, workdir=None, startup_timeout=30.0,
                 link_delay_ms=None, link_proxy=False, linkproxy=None, link_delay_us=None,
                 group_nodes=None, group_tier=False, group_link_delay_us=None,
                 aggregator_args=None, isolate_signals=False):
        if _bootstrapping():
            raise ClusterError("a LocalCluster was created while a worker process was importing "
                               "the main module: " + _GUARD_HINT % "the script")
        if nodes < 1 or workers_per_node < 1:
            raise ValueError("LocalCluster needs at least one node and one worker per node")
        if link_delay_ms is not None and not (
                isinstance(link_delay_ms, int) and 0 <= link_delay_ms <= 600000):
            raise ValueError("link_delay_ms must be an int within [0, 600000], got %r"
                             % (link_delay_ms,))
        for name, value in (("link_delay_us", link_delay_us),
                            ("group_link_delay_us", group_link_delay_us)):
            if value is not None and not (
                    isinstance(value, int) and not isinstance(value, bool)
                    and 0 <= value <= 600000000):
                raise ValueError("%s must be an int within [0, 600000000], got %r"
                                 % (name, value))
        if link_delay_ms is not None and link_delay_us is not None:
            raise ValueError("give link_delay_ms or link_delay_us, not both")
        if group_nodes is not None and not (
                isinstance(group_nodes, int) and group_nodes >= 1 and nodes % group_nodes == 0):
            raise ValueError("group_nodes must be a positive int that divides nodes=%d, got %r"
                             % (nodes, group_nodes))
        if group_tier and (group_nodes is None or nodes < 2 or not root):
            raise ValueError("group_tier=True needs group_nodes, at least two nodes and a root")
        if group_link_delay_us is not None and not group_tier:
            raise ValueError("group_link_delay_us is the delay to a group aggregator: it needs "
                             "group_tier=True")
        self.nodes = int(nodes)
        self.workers_per_node = int(workers_per_node)
        self.world_size = self.nodes * self.workers_per_node
        self.job_id = job_id or "local-%s" % uuid.uuid4().hex[:12]
        self.round_timeout_ms = round_timeout_ms
        self._aggregator_args = list(aggregator_args or [])
        self._isolate = bool(isolate_signals)
        self._with_root = root
        self._aggregator = aggregator
        self._workdir = workdir
        self._own_workdir = workdir is None
        self._startup_timeout = startup_timeout
        self.link_delay_ms = link_delay_ms
        self.link_delay_us = (link_delay_us if link_delay_us is not None
                              else (link_delay_ms or 0) * 1000)
        self.group_nodes = group_nodes
        self.group_tier = bool(group_tier)
        self.group_link_delay_us = group_link_delay_us or 0
        self._link_proxy = (bool(link_proxy) or link_delay_ms is not None
                            or link_delay_us is not None or group_link_delay_us is not None)
        self._linkproxy = linkproxy
        self.root = None
        self.groups = []        # the group aggregators (group_tier)
        self.group_proxies = []  # their links to the root
        self.group_addresses = []
        self.proxies = []
        self.sidecars = []
        self.root_address = None
        self.node_addresses = []
        self.master_port = None

    # --- lifetime --------------------------------------------------------------------------------

    def start(self):
        binary = self._aggregator or _lib.aggregator_path()
        if self._own_workdir:
            self._workdir = tempfile.mkdtemp(prefix="hsbn-")
        else:
            os.makedirs(self._workdir, exist_ok=True)
        common = []
        if self.round_timeout_ms is not None:
            common.append("--round-timeout-ms=%d" % self.round_timeout_ms)
        common += self._aggregator_args
        try:
            deadline = time.monotonic() + self._startup_timeout
            if self._with_root:
                self.root = ManagedProcess("root", [binary, "--role=root",
                                                    "--listen=127.0.0.1:0"] + common,
                                           self._workdir, isolate=self._isolate)
                self.root.start()
                self.root.wait_ready(deadline)
                self.root_address = self.root.addresses[0]
            def proxy(name, target, delay_us):
                p = ManagedProcess(name, [
                    self._linkproxy or _lib.linkproxy_path(), "--target=" + target, "--listen=127.0.0.1:0",
                    "--delay-us=%d" % delay_us,
                    "--control=" + self._control_path(name)],
                    self._workdir, id_flag=False, isolate=self._isolate)
                p.start()
                return p

            upstreams = [self.root_address] * self.nodes
            if self.group_tier:
                for g in range(self.nodes // self.group_nodes):
                    up = self.root_address
                    if self._link_proxy:
                        self.group_proxies.append(
                            proxy("link-group%d" % g, self.root_address, self.link_delay_us))
                        self.group_proxies[-1].wait_ready(deadline)
                        up = self.group_proxies[-1].addresses[0]
                    self.groups.append(ManagedProcess("group%d" % g, [
                        binary, "--role=group", "--listen=127.0.0.1:0", "--upstream=" + up]
                        + common, self._workdir, isolate=self._isolate))
                    self.groups[-1].start()
                for agg in self.groups:
                    agg.wait_ready(deadline)
                    self.group_addresses.append(agg.addresses[0])
                upstreams = [self.group_addresses[n // self.group_nodes]
                             for n in range(self.nodes)]
            if self._link_proxy and self.root_address:
                for n in range(self.nodes):
                    self.proxies.append(proxy(
                        "link%d" % n, upstreams[n],
                        self.group_link_delay_us if self.group_tier else self.link_delay_us))
                for n, p in enumerate(self.proxies):
                    p.wait_ready(deadline)
                    upstreams[n] = p.addresses[0]
            for n in range(self.nodes):
                sock = os.path.join(self._workdir, "node%d.sock" % n)
                args = [binary, "--role=node", "--listen=unix:" + sock] + common
                if upstreams[n]:
                    args.append("--upstream=" + upstreams[n])
                self.sidecars.append(ManagedProcess("node%d" % n, args, self._workdir,
                                                    isolate=self._isolate))
                self.sidecars[-1].start()
            for agg in self.sidecars:
                agg.wait_ready(deadline)
                self.node_addresses.append(agg.addresses[0])
        except BaseException:
            self.stop()
            raise
        self.master_port = _free_port()
        return self

    def stop(self):
        for agg in (self.sidecars + self.proxies + self.groups + self.group_proxies
                    + ([self.root] if self.root else [])):
            agg.stop()
        if self._own_workdir and self._workdir and os.path.isdir(self._workdir):
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # --- workers ---------------------------------------------------------------------------------

    def node_of(self, rank):
        return rank // self.workers_per_node

    def worker_env(self, rank, base=None, job_id=None):
        """The full environment of worker `rank`: `base` (default os.environ) plus torchrun's
        RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT
        (for torch.distributed's env:// rendezvous) and hsbn's HSBN_JOB_ID (`job_id`, default
        the cluster's) and HSBN_ADDRESS (the sidecar of the worker's node)."""
        if not 0 <= rank < self.world_size:
            raise ValueError("rank %d is outside this cluster's %d workers"
                             % (rank, self.world_size))
        if not self.node_addresses:
            raise ClusterError("the LocalCluster is not started; use it as a context manager")
        env = dict(os.environ if base is None else base)
        node = self.node_of(rank)
        env.update({
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank % self.workers_per_node),
            "LOCAL_WORLD_SIZE": str(self.workers_per_node),
            "GROUP_RANK": str(node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.master_port),
            "HSBN_JOB_ID": job_id or self.job_id,
            "HSBN_ADDRESS": self.node_addresses[node],
        })
        if self.group_nodes is not None:
            env["HSBN_GROUP_NODES"] = str(self.group_nodes)
        return env

    def run(self, fn, *args, timeout=None, job_id=None):
        """Runs fn(*args) in world_size fresh processes (multiprocessing "spawn"), each with its
        worker_env, and returns their return values by rank. `fn` must be importable (a
        module-level function). Each call is a new job (`job_id`, default a fresh one) with its
        own MASTER_PORT. If a worker raises or dies, the others get 15 seconds to finish, then
        ClusterError reports every failure.

        Return values travel pickled as plain bytes, so tensors come back as copies (not as
        shared memory of a process that has exited). The script that calls run() needs an `if
        __name__ == "__main__":` guard, since every worker imports it; without one, run()
        raises ClusterError at once and says so."""
        unguarded = _main_module_lacks_guard()
        if unguarded:
            raise ClusterError(_GUARD_HINT % unguarded)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = []
        job_id = job_id or "%s-run-%s" % (self.job_id, uuid.uuid4().hex[:8])
        port = str(_free_port())
        for rank in range(self.world_size):
            env = self.worker_env(rank, {}, job_id=job_id)
            env["MASTER_PORT"] = port
            p = ctx.Process(target=_run_worker, args=(env, rank, fn, args, queue), daemon=True)
            p.start()
            procs.append(p)
        results, failures, exited_at = {}, {}, {}
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end = None  # after the first failure, the others get 15 s to finish
        try:
            while len(results) + len(failures) < self.world_size:
                now = time.monotonic()
                if (deadline is not None and now > deadline) or (
                        grace_end is not None and now > grace_end):
                    break
                try:
                    rank, ok, value = queue.get(timeout=0.2)
                except queue_module.Empty:
                    # A worker that exited without a message (killed, os._exit) failed; give
                    # its last message a second to arrive first.
                    for r, p in enumerate(procs):
                        if p.exitcode is None or r in results or r in failures:
                            continue
                        if now - exited_at.setdefault(r, now) > 1.0:
                            failures[r] = "worker exited with status %s without a result" % (
                                p.exitcode)
                            grace_end = grace_end or now + 15
                    continue
                if ok:
                    results[rank] = pickle.loads(value)
                else:
                    failures[rank] = value
                    grace_end = grace_end or now + 15
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
        missing = [r for r in range(self.world_size) if r not in results and r not in failures]
        for r in missing:
            failures[r] = "did not finish in time"
        if failures:
            raise ClusterError("LocalCluster.run: %d of %d workers failed:\n%s"
                               % (len(failures), self.world_size,
                                  "\n".join("--- rank %d ---\n%s" % (r, failures[r])
                                            for r in sorted(failures))))
        return [results[r] for r in range(self.world_size)]

    def logs(self):
        """The aggregators' and link proxies' output so far, by id (for diagnosing a failure)."""
        aggs = (([self.root] if self.root else []) + self.groups + self.sidecars + self.proxies
                + self.group_proxies)
        return {a.name: a.log_tail(100000) for a in aggs}

    # --- the simulated link and restarts (fault injection) ---------------------------------------

    @property
    def workdir(self):
        """The folder of the sockets, ready files and logs."""
        return self._workdir

    def _control_path(self, name):
        return os.path.join(self._workdir, name + ".control")

    def link_command(self, node, command, timeout=30.0):
        """Sends one command line to node `node`'s link proxy (`hsbn-linkproxy --help`: drop,
        reset, stall, resume, delay UP [DOWN], delay-us UP [DOWN], stats, stats-reset) and
        returns its answer without the leading "ok". An "error ..." answer raises ClusterError.
        With the group tier, a node's link is the one to its group aggregator."""
        if not self.proxies:
            raise ClusterError("this LocalCluster has no link proxies (link_delay_ms or "
                               "link_proxy=True)")
        if not 0 <= node < self.nodes:
            raise ValueError("no node %d in this cluster" % node)
        return self._proxy_command("link%d" % node, command, timeout)

    def group_link_command(self, group, command, timeout=30.0):
        """The same for group aggregator `group`'s link to the root (group_tier with a delay
        or link_proxy=True)."""
        if not self.group_proxies:
            raise ClusterError("this LocalCluster has no group tier links (group_tier=True with "
                               "a delay or link_proxy=True)")
        if not 0 <= group < len(self.group_proxies):
            raise ValueError("no group %d in this cluster" % group)
        return self._proxy_command("link-group%d" % group, command, timeout)

    def _proxy_command(self, name, command, timeout):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(self._control_path(name))
            s.sendall(command.encode() + b"\n")
            answer = b""
            while not answer.endswith(b"\n"):
                part = s.recv(4096)
                if not part:
                    break
                answer += part
        answer = answer.decode().strip()
        if not answer.startswith("ok"):
            raise ClusterError("link proxy %s: %s" % (name, answer or "no answer"))
        return answer[3:]

    @staticmethod
    def _stats(answer):
        stats = {}
        for word in answer.split():
            key, _, value = word.partition("=")
            stats[key] = value if key == "mode" else int(value)
        return stats

    def link_stats(self, node):
        """Node `node`'s link proxy counters: mode, open, accepted, refused, reset, delays, and
        per direction (up: sidecar -> root; down) bytes, chunks and held_min/max/sum_us, the
        time each chunk was held before it was written on."""
        return self._stats(self.link_command(node, "stats"))

    def group_link_stats(self, group):
        """The same counters for group aggregator `group`'s link to the root."""
        return self._stats(self.group_link_command(group, "stats"))

    def pids(self):
        """The process ids of the running aggregators and link proxies, by id."""
        procs = (([self.root] if self.root else []) + self.groups + self.sidecars + self.proxies
                 + self.group_proxies)
        return {p.name: p.proc.pid for p in procs if p.proc is not None and p.proc.poll() is None}

    def stop_sidecar(self, node):
        """Stops node `node`'s sidecar politely (SIGTERM) and returns once it exited (its exit
        status); restart_sidecar starts it again."""
        agg = self.sidecars[node]
        agg.stop()
        return agg.proc.returncode

    def restart_sidecar(self, node):
        """Stops node `node`'s sidecar (SIGTERM; nothing if it already died) and starts it
        again on the same socket."""
        agg = self.sidecars[node]
        agg.stop()
        agg.start()
        agg.wait_ready(time.monotonic() + self._startup_timeout)

    def restart_group(self, group):
        """Stops group `group`'s aggregator (SIGTERM; nothing if it already died) and starts it
        again on the same address, so its sidecars reconnect to it."""
        if not 0 <= group < len(self.groups):
            raise ValueError("this LocalCluster has no group aggregator %d" % group)
        agg = self.groups[group]
        agg.stop()
        agg.args = [a if not a.startswith("--listen=") else "--listen=" + self.group_addresses[group]
                    for a in agg.args]
        agg.start()
        agg.wait_ready(time.monotonic() + self._startup_timeout)

    def restart_root(self):
        """Stops the root (SIGTERM; nothing if it already died) and starts it again on the
        same address, so sidecars (and link proxies) reconnect to it."""
        if not self.root:
            raise ClusterError("this LocalCluster has no root")
        self.root.stop()
        self.root.args = [a if not a.startswith("--listen=") else "--listen=" + self.root_address
                          for a in self.root.args]
        self.root.start()
        self.root.wait_ready(time.monotonic() + self._startup_timeout)


def _run_worker(env, rank, fn, args, queue):
    os.environ.update(env)
    try:
        # Plain pickle, not the queue's: torch registers reducers there that would send a
        # tensor as shared memory owned by this process, gone once it exits.
        value = pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    else:
        queue.put((rank, True, value))
