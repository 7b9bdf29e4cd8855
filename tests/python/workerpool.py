"""A pool of long-lived worker processes, one per rank of a LocalCluster, that run test cases.

Starting a Python process with PyTorch costs seconds, so each test module starts its workers
once and sends them cases: module-level functions of hsbn_cases, called with per-rank
arguments. A worker keeps its hsbn client (and its layers' op counter) between cases, as a
trainer would between steps.
"""

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback

import transports


class WorkerError(AssertionError):
    pass


def _serve(env, conn):
    os.environ.update(env)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            # Leave the job, then exit at once: interpreter teardown with PyTorch loaded takes
            # seconds and there is nothing left to flush.
            import hsbn.client
            if hsbn.client._default is not None:
                hsbn.client._default.close()
            conn.close()
            os._exit(0)
        fn, args = msg
        try:
            conn.send((True, fn(*args)))
        except BaseException:
            conn.send((False, traceback.format_exc()))


def _warm_up(join=True):
    # Import PyTorch and join the job before any case runs: under load, process start-up takes
    # seconds and a round must not wait for a worker that is still importing.
    import torch  # noqa: F401
    import hsbn
    import hsbn.torch  # noqa: F401
    return hsbn.default_client().rank if join else int(os.environ["RANK"])


def _rejoin(job_id, transport_env):
    """Leaves this worker's job and joins `job_id` with HSBN_TRANSPORT=transport_env; one node
    round decides the node's transport. Returns it as Client.stats() says."""
    import itertools
    import numpy as np
    import hsbn
    import hsbn.client
    import hsbn.torch._keys
    if hsbn.client._default is not None:
        hsbn.client._default.close()
    # Directly constructed layers take their op from a count of constructions in the process:
    # in the new job it starts at 0 in every worker, as in a fresh trainer, so that a worker
    # started afresh (use_transport) counts in step with the others.
    with hsbn.torch._keys._op_lock:
        hsbn.torch._keys._op_counter = itertools.count()
    os.environ["HSBN_JOB_ID"] = job_id
    os.environ["HSBN_TRANSPORT"] = transport_env
    client = hsbn.default_client()
    client.forward(transports.PROBE_OP, 0, "node", 1, np.zeros(1), np.zeros(1))
    return client.stats().transport


def _transport_now():
    import hsbn
    return hsbn.default_client().stats().transport


class WorkerPool:
    def __init__(self, cluster, job_id=None, startup_timeout=300.0):
        self.cluster = cluster
        self.world_size = cluster.world_size
        self.job_id = job_id
        self.conns, self.procs = [None] * self.world_size, [None] * self.world_size
        for rank in range(cluster.world_size):
            self._spawn(rank)
        self.broken = None
        self.transport = None  # as asked by use_transport()
        self._joins = 0
        try:
            ranks = self.call(_warm_up, [()] * self.world_size, timeout=startup_timeout)
        except BaseException:
            self.close()
            raise
        assert ranks == list(range(self.world_size)), ranks

    def _spawn(self, rank):
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_serve, args=(self.cluster.worker_env(rank, {}, self.job_id),
                                             child), daemon=True)
        p.start()
        child.close()
        self.conns[rank], self.procs[rank] = parent, p

    def use_transport(self, name, startup_timeout=300.0):
        """Moves every worker to a new job of the cluster whose node rounds travel over `name`
        (transports.NAMES), first starting afresh the workers that have exited (a failure test
        kills some); raises WorkerError unless every worker's Client.stats() then says so.
        The processes, with PyTorch imported, serve both transports in turn."""
        dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
        for r in dead:
            self.conns[r].close()
            self._spawn(r)
        if dead:
            for r in dead:
                self.conns[r].send((_warm_up, (False,)))
            answers = self.gather(ranks=dead, timeout=startup_timeout)
            failed = {r: v for r, (ok, v) in answers.items() if not ok or v != r}
            if failed:
                raise WorkerError("restarted workers failed to start: %s" % failed)
        self._joins += 1
        job = "%s-%s%d" % (self.job_id or self.cluster.job_id, name, self._joins)
        got = self.call(_rejoin, [(job, transports.ENV[name])] * self.world_size)
        self.transport = name
        self.check_transport(got)
        return self

    def check_transport(self, got=None):
        """Raises WorkerError unless every live worker's rounds travel over the transport
        use_transport() asked for (`got`: what they said, else they are asked now)."""
        if self.transport is None or self.broken:
            return
        if got is None:
            live = [r for r, p in enumerate(self.procs) if p.is_alive()]
            for r in live:
                self.conns[r].send((_transport_now, ()))
            got = {r: v for r, (ok, v) in self.gather(ranks=live).items()}
        else:
            got = dict(enumerate(got))
        want = transports.EXPECTED[self.transport]
        wrong = {r: v for r, v in got.items() if v != want}
        if wrong:
            raise WorkerError("asked for node rounds over %s (%r), but ranks say %s"
                              % (self.transport, want, wrong) + self.aggregator_report())

    def send(self, calls):
        """Starts calls[rank] = (fn, args) on every worker; collect with gather()."""
        for conn, (fn, args) in zip(self.conns, calls):
            conn.send((fn, tuple(args)))

    def gather(self, ranks=None, timeout=120.0):
        """{rank: (ok, value)} of the given ranks' current calls."""
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        out = {}
        pending = {self.conns[r]: r for r in ranks}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError("ranks %s did not answer within %.0f s"
                                  % (sorted(pending.values()), timeout))
            for conn in multiprocessing.connection.wait(list(pending), left):
                r = pending.pop(conn)
                try:
                    out[r] = conn.recv()
                except EOFError:
                    out[r] = (False, "worker process died (exit code %s)"
                              % self.procs[r].exitcode)
        return out

    def call(self, fn, per_rank_args, timeout=120.0):
        """Runs fn(*per_rank_args[rank]) on every rank; returns the values by rank, or raises
        WorkerError with every failing rank's traceback."""
        if self.broken:
            raise WorkerError("the worker pool is out of step since an earlier case: "
                              + self.broken)
        self.send([(fn, a) for a in per_rank_args])
        try:
            answers = self.gather(timeout=timeout)
        except WorkerError as e:
            self.broken = str(e)
            raise WorkerError(str(e) + self.aggregator_report())
        failed = {r: v for r, (ok, v) in answers.items() if not ok}
        if failed:
            raise WorkerError("\n".join("--- rank %d ---\n%s" % (r, failed[r])
                                        for r in sorted(failed)) + self.aggregator_report())
        return [answers[r][1] for r in range(self.world_size)]

    def aggregator_report(self):
        """The aggregators' state and the end of their logs, to explain a failed case."""
        lines = ["", "--- aggregators ---"]
        for agg in ([self.cluster.root] if self.cluster.root else []) + self.cluster.sidecars:
            lines.append("%s: %s; log tail:\n%s" % (
                agg.name, "running" if agg.proc.poll() is None
                else "EXITED with status %s" % agg.proc.returncode, agg.log_tail(1500)))
        return "\n".join(lines)

    def close(self):
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)


@contextlib.contextmanager
def started(**cluster_args):
    """A LocalCluster(**cluster_args) and a WorkerPool of one process per rank on it, closed
    (the pool, then the cluster) on the way out: the body of a module's `workers` fixture."""
    import hsbn.cluster
    with hsbn.cluster.LocalCluster(**cluster_args) as cluster:
        pool = WorkerPool(cluster)
        try:
            yield pool
        finally:
            pool.close()


def on_transport(workers, transport):
    """The body of a module's `pool` fixture (yield from it): the pool's processes moved to
    `transport` for the module's tests, and checked to have stayed on it when they are done."""
    yield workers.use_transport(transport)
    workers.check_transport()
