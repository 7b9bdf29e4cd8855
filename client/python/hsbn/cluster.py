"""hsbn.cluster.LocalCluster: a whole hsbn deployment on one machine, for trying hsbn, examples
and tests.

    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=4) as cluster:
        env = cluster.worker_env(rank)        # for subprocess.Popen(..., env=env), or
        results = cluster.run(train, arg)     # train(arg) in every worker, results by rank

It starts real aggregator processes: a root listening on 127.0.0.1 (TCP, as across machines)
and one sidecar per simulated node on a Unix socket, forwarding global rounds to the root.
Worker ranks are laid out as torchrun lays them out: rank = node * workers_per_node + local_rank.
"""

import multiprocessing
import os
import queue as queue_module
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback
import uuid

from . import _lib


class ClusterError(RuntimeError):
    """An aggregator of the LocalCluster failed to start, or a worker of run() failed."""


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Aggregator:
    def __init__(self, name, args, workdir):
        self.name = name
        self.ready_file = os.path.join(workdir, name + ".ready")
        self.log_path = os.path.join(workdir, name + ".log")
        self.args = args + ["--id=" + name, "--ready-file=" + self.ready_file]
        self.proc = None
        self.addresses = []

    def start(self):
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def wait_ready(self, deadline):
        while True:
            if os.path.exists(self.ready_file):
                with open(self.ready_file) as f:
                    text = f.read()
                lines = [line.strip() for line in text.splitlines() if line.strip()]
                if lines and text.endswith("\n"):
                    self.addresses = lines
                    return
            if self.proc.poll() is not None:
                raise ClusterError("aggregator %s exited with status %s before it was ready "
                                   "(%s):\n%s" % (self.name, self.proc.returncode,
                                                  " ".join(self.args), self.log_tail()))
            if time.monotonic() > deadline:
                raise ClusterError("aggregator %s was not ready in time (%s):\n%s"
                                   % (self.name, " ".join(self.args), self.log_tail()))
            time.sleep(0.01)

    def log_tail(self, chars=4000):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-chars:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()


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
    """

    def __init__(self, nodes=2, workers_per_node=4, job_id=None, round_timeout_ms=None,
                 root=True, aggregator=None, workdir=None, startup_timeout=30.0):
        if nodes < 1 or workers_per_node < 1:
            raise ValueError("LocalCluster needs at least one node and one worker per node")
        self.nodes = int(nodes)
        self.workers_per_node = int(workers_per_node)
        self.world_size = self.nodes * self.workers_per_node
        self.job_id = job_id or "local-%s" % uuid.uuid4().hex[:12]
        self.round_timeout_ms = round_timeout_ms
        self._with_root = root
        self._aggregator = aggregator
        self._workdir = workdir
        self._own_workdir = workdir is None
        self._startup_timeout = startup_timeout
        self.root = None
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
        try:
            deadline = time.monotonic() + self._startup_timeout
            if self._with_root:
                self.root = _Aggregator("root", [binary, "--role=root", "--listen=127.0.0.1:0"]
                                        + common, self._workdir)
                self.root.start()
                self.root.wait_ready(deadline)
                self.root_address = self.root.addresses[0]
            for n in range(self.nodes):
                sock = os.path.join(self._workdir, "node%d.sock" % n)
                args = [binary, "--role=node", "--listen=unix:" + sock] + common
                if self.root_address:
                    args.append("--upstream=" + self.root_address)
                self.sidecars.append(_Aggregator("node%d" % n, args, self._workdir))
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
        for agg in self.sidecars + ([self.root] if self.root else []):
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
        return env

    def run(self, fn, *args, timeout=None, job_id=None):
        """Runs fn(*args) in world_size fresh processes (multiprocessing "spawn"), each with its
        worker_env, and returns their return values by rank. `fn` must be importable (a
        module-level function). Each call is a new job (`job_id`, default a fresh one) with its
        own MASTER_PORT. If a worker raises or dies, the others get 15 seconds to finish, then
        ClusterError reports every failure."""
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
                    results[rank] = value
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
        """The aggregators' output so far, by aggregator id (for diagnosing a failure)."""
        aggs = ([self.root] if self.root else []) + self.sidecars
        return {a.name: a.log_tail(100000) for a in aggs}


def _run_worker(env, rank, fn, args, queue):
    os.environ.update(env)
    try:
        value = fn(*args)
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    else:
        queue.put((rank, True, value))
