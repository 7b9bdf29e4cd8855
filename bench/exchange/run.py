#!/usr/bin/env python3
"""Exchange benchmark driver (issue 6): hsbn against raw sockets, gRPC, Open MPI, Gloo, torch.

Starts every topology itself on this machine (aggregators, servers, worker processes), runs the
same plan on each (see bench_common.h), pools the per-rank samples and writes:
  - a text table on stdout (latency per implementation, ratios of hsbn to every baseline, goals),
  - a JSON file with every row and the machine (--json),
  - a Markdown report (--markdown) that docs/results/PERFORMANCE.md's "Exchange" section quotes.

Every loop is bounded: rounds and steps are fixed counts, every launch has a wall-clock limit
after which its processes are killed and the row is reported as failed.

  bench/exchange/run.py --build-dir BUILD [--quick] [--json F] [--markdown F]
Standard library only; torch.distributed runs under --torch-python (default /usr/bin/python3).
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------------------------
# Modes


def mode_params(quick):
    # rounds / resnet_steps are the most per case; an implementation measured slow at a smaller
    # worker count gets fewer at the next (case_budget_s, step_budget_s), never below the minima.
    if quick:
        return dict(channels=[256], workers=[2], rounds=60, warmup=10, resnet_steps=3,
                    resnet_warmup=1, resnet_workers=[2], pingpong=True, timeout=40,
                    load_seconds=1.5, min_rounds=60, min_steps=3, case_budget_s=1.0,
                    step_budget_s=2.0)
    return dict(channels=[64, 256, 1024, 2048], workers=[2, 4, 8], rounds=400, warmup=40,
                resnet_steps=30, resnet_warmup=2, resnet_workers=[4, 8], pingpong=True,
                timeout=240, load_seconds=5.0, min_rounds=100, min_steps=6, case_budget_s=1.2,
                step_budget_s=4.0)


# --------------------------------------------------------------------------------------------
# Process helpers


class Launch:
    """A group of processes started for one measurement; killed as a group when done."""

    def __init__(self, workdir, timeout):
        self.workdir = workdir
        self.deadline = time.monotonic() + timeout
        self.servers = []
        self.server_names = []
        self.workers = []
        self.logs = []

    def _popen(self, cmd, name, env=None):
        log = open(os.path.join(self.workdir, name + ".log"), "w")
        self.logs.append(log)
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)

    def server(self, cmd, name, ready_file=None, env=None):
        p = self._popen(cmd, name, env)
        self.servers.append(p)
        self.server_names.append(name)
        if ready_file is None:
            return None
        while time.monotonic() < self.deadline:
            if os.path.exists(ready_file):
                with open(ready_file) as f:
                    lines = [l.strip() for l in f if l.strip()]
                if lines:
                    return lines
            if p.poll() is not None:
                raise RuntimeError("%s exited with %s before it was ready: %s"
                                   % (name, p.returncode, self.tail(name)))
            time.sleep(0.02)
        raise RuntimeError("%s not ready in time" % name)

    def worker(self, cmd, name, env=None):
        self.workers.append((name, self._popen(cmd, name, env)))

    def tail(self, name, n=800):
        try:
            with open(os.path.join(self.workdir, name + ".log")) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def wait_workers(self):
        for name, p in self.workers:
            left = self.deadline - time.monotonic()
            try:
                rc = p.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                raise RuntimeError("timed out waiting for %s" % name)
            if rc != 0:
                raise RuntimeError("%s exited with %s: %s" % (name, rc, self.tail(name)))

    def close(self):
        procs = [p for _, p in self.workers] + self.servers
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        end = time.monotonic() + 3
        for p in procs:
            try:
                p.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait()
        for log in self.logs:
            log.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_samples(paths):
    """Pools the sample files of all ranks: {("lat", C, phase, scope) | ("step", scope): [ns]}."""
    pooled = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if not parts:
                    continue
                if parts[0] == "lat":
                    key = ("lat", int(parts[1]), parts[2], parts[3])
                    vals = parts[4:]
                elif parts[0] == "step":
                    key = ("step", parts[1])
                    vals = parts[2:]
                elif parts[0] == "cost":
                    pooled.setdefault(("cost",), []).append(tuple(int(v) for v in parts[1:6]))
                    continue
                else:
                    continue
                pooled.setdefault(key, []).extend(int(v) for v in vals)
    return pooled


def percentile(sorted_vals, q):
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, int(round(q / 100.0 * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[i]


def proc_cost(pid):
    """(CPU seconds, context switches of its live threads) of a process, from /proc. A process
    that already exited (a zombie) still has its CPU time but no threads: csw is None."""
    csw = 0
    try:
        with open("/proc/%d/stat" % pid) as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return cpu_seconds(pid), None
        for t in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/status" % (pid, t)) as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        csw += int(line.split()[1])
    except (OSError, ValueError):
        pass
    return cpu_seconds(pid), csw


def cpu_seconds(pid):
    """User + system CPU time of a live process, from /proc."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def read_server_stats(path, launch):
    """The bare gRPC server's own counters (its --stats-file, written when its streams have
    ended; see grpc_star.cc), per round it answered: the server has usually exited before the
    driver's /proc sample, which then has no context switches. Waits for the file briefly (the
    server writes it as the last worker ends); None if it never comes."""
    end = min(launch.deadline, time.monotonic() + 3)
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.01)
    try:
        with open(path) as f:
            v = f.read().split()
    except OSError:
        return None
    if len(v) != 12 or v[0] != "server" or int(v[1]) <= 0:
        return None
    rounds, wall, user, sys_, vcsw, icsw, tuser, tsys, tvcsw, ticsw, threads = map(int, v[1:])
    return dict(srv_rounds=rounds, srv_wall_s=wall / 1e9,
                srv_cpu_us=(user + sys_) / 1e3 / rounds, srv_csw=(vcsw + icsw) / rounds,
                srv_vcsw=vcsw / rounds, srv_icsw=icsw / rounds,
                srv_main_cpu_us=(tuser + tsys) / 1e3 / rounds,
                srv_main_busy=(tuser + tsys) / wall if wall > 0 else float("nan"),
                srv_cpu_busy=(user + sys_) / wall if wall > 0 else float("nan"),
                srv_threads=threads)


# --------------------------------------------------------------------------------------------
# The implementations. Each returns the sample files of its ranks.


class Bench:
    def __init__(self, args, params):
        self.args = args
        self.p = params
        self.bin = os.path.join(args.build_dir, "bench", "exchange")
        self.rows = []
        self.skipped = {}
        self.failures = []
        self.est = {}  # est_key -> (workers, mean round us) of the last measurement
        self.tmp = tempfile.mkdtemp(prefix="hsbn-bench-")
        self.aggregator = args.aggregator or self._find_aggregator()

    def _find_aggregator(self):
        for root, _, files in os.walk(self.args.build_dir):
            if "hsbn-aggregator" in files:
                path = os.path.join(root, "hsbn-aggregator")
                if os.access(path, os.X_OK):
                    return path
        return None

    def have(self, exe):
        return os.access(os.path.join(self.bin, exe), os.X_OK)

    def plan_flags(self, channels, resnet, phases="fwd", scopes="node", est_key=None,
                   workers=None):
        rounds, steps, warmup = self.p["rounds"], self.p["resnet_steps"], self.p["warmup"]
        prev = self.est.get(est_key)
        if prev and workers:
            # Mean round time at the last (smaller) worker count, scaled linearly in workers: a
            # deliberate over-estimate on an oversubscribed machine, so counts only shrink.
            est_s = prev[1] * 1e-6 * workers / prev[0]
            rounds = max(self.p["min_rounds"], min(rounds, int(self.p["case_budget_s"] / est_s)))
            steps = max(self.p["min_steps"], min(steps, int(self.p["step_budget_s"] / (106 * est_s))))
            warmup = max(10, min(warmup, rounds // 10))
        flags = ["--channels=" + ",".join(map(str, channels)), "--rounds=%d" % rounds,
                 "--warmup=%d" % warmup, "--phases=" + phases, "--scopes=" + scopes]
        if resnet:
            flags += ["--resnet-steps=%d" % steps,
                      "--resnet-warmup=%d" % self.p["resnet_warmup"]]
        return flags

    def new_dir(self, name):
        d = os.path.join(self.tmp, name)
        os.makedirs(d, exist_ok=True)
        return d

    # One measurement: run `body(launch, dir)` -> sample files; record rows.
    def measure(self, impl, transport, workers, nodes, body, est_key=None, stats_file=None,
                scopes=None):
        name = "%s-w%d-n%d" % (impl, workers, nodes)
        d = self.new_dir(name)
        launch = Launch(d, self.p["timeout"])
        t0 = time.monotonic()
        stats = None
        try:
            files = body(launch, d)
            s0 = [proc_cost(p.pid) for p in launch.servers]
            launch.wait_workers()
            s1 = [proc_cost(p.pid) for p in launch.servers]
            pooled = read_samples(files)
            if stats_file:
                stats = read_server_stats(stats_file, launch)
        except Exception as e:  # a failed launch is a failed row, not a failed benchmark
            self.failures.append("%s: %s" % (name, e))
            print("  FAILED %s: %s" % (name, e), file=sys.stderr)
            return None
        finally:
            launch.close()
        costs = pooled.pop(("cost",), [])
        if costs:
            rounds = costs[0][0]
            self.rows.append(dict(
                kind="cost", impl=impl, transport=transport, workers=workers, nodes=nodes,
                rounds=rounds, scopes=scopes,
                client_cpu_us=sum((c[1] + c[2]) / c[0] for c in costs) / len(costs) / 1e3,
                client_csw=sum((c[3] + c[4]) / c[0] for c in costs) / len(costs),
                server_cpu_us=(sum(b[0] - a[0] for a, b in zip(s0, s1)) * 1e6 / rounds
                               if s0 else 0.0),
                server_csw=(sum(b[1] - a[1] for a, b in zip(s0, s1)) / rounds
                            if s0 and all(x[1] is not None for x in s0 + s1) else None),
                # Per server process (hsbn: "root", "node0", ...), CPU us per round.
                server_cpu_us_by_process={
                    n: (b[0] - a[0]) * 1e6 / rounds
                    for n, a, b in zip(launch.server_names, s0, s1)}))
            if stats:
                self.rows[-1].update(stats)
        for key, vals in sorted(pooled.items(), key=lambda kv: str(kv[0])):
            vals.sort()
            row = dict(impl=impl, transport=transport, workers=workers, nodes=nodes,
                       n=len(vals))
            if key[0] == "lat":
                row.update(kind="lat", channels=key[1], phase=key[2], scope=key[3])
                us = [v / 1e3 for v in vals]
                row.update(p50_us=percentile(us, 50), p90_us=percentile(us, 90),
                           p99_us=percentile(us, 99), max_us=us[-1], mean_us=sum(us) / len(us))
            else:
                row.update(kind="step", scope=key[1])
                ms = [v / 1e6 for v in vals]
                row.update(p50_ms=percentile(ms, 50), p99_ms=percentile(ms, 99),
                           max_ms=ms[-1], mean_ms=sum(ms) / len(ms))
            self.rows.append(row)
        lat = [v for k, v in pooled.items() if k[0] == "lat"]
        if lat:
            means = [sum(v) / len(v) / 1e3 for v in lat]
            self.est[est_key or impl] = (workers, sum(means) / len(means))
        print("  %-14s workers=%d nodes=%d  %5.1f s" % (impl, workers, nodes,
                                                        time.monotonic() - t0), file=sys.stderr)
        return True

    # ---- raw sockets and bare gRPC: one server, W workers ---------------------------------
    def star(self, exe, impl, transport, workers, resnet, extra=(), server_extra=()):
        # The gRPC server reports its own counters (see read_server_stats).
        stats = (os.path.join(self.tmp, "%s-w%d-n1" % (impl, workers), "server.stats")
                 if exe == "bench_grpc_star" else None)

        def body(launch, d):
            if stats and os.path.exists(stats):
                os.remove(stats)
            listen = ("unix:" + os.path.join(d, "s.sock")) if transport == "unix" else (
                ("tcp:" if exe == "bench_raw_star" else "") + "127.0.0.1:0")
            ready = os.path.join(d, "server.ready")
            addr = launch.server([os.path.join(self.bin, exe), "--role=server",
                                  "--listen=" + listen, "--workers=%d" % workers,
                                  "--ready-file=" + ready]
                                 + (["--stats-file=" + stats] if stats else [])
                                 + list(server_extra), "server", ready)[0]
            files = []
            for r in range(workers):
                out = os.path.join(d, "rank%d.txt" % r)
                files.append(out)
                launch.worker([os.path.join(self.bin, exe), "--role=worker", "--connect=" + addr,
                               "--rank=%d" % r, "--out=" + out] + list(extra)
                              + self.plan_flags(self.p["channels"], resnet, est_key=impl,
                                                workers=workers), "worker%d" % r)
            return files
        return self.measure(impl, transport, workers, 1, body, stats_file=stats)

    # ---- Open MPI ---------------------------------------------------------------------------
    def mpi(self, btl, impl, transport, workers, resnet):
        mpirun = shutil.which("mpirun")

        def body(launch, d):
            cmd = [mpirun, "-np", str(workers), "--oversubscribe", "--bind-to", "none",
                   "--mca", "pml", "ob1", "--mca", "btl", btl]
            if transport == "tcp":
                cmd += ["--mca", "btl_tcp_if_include", "lo"]
            if os.geteuid() == 0:
                cmd += ["--allow-run-as-root"]
            out = os.path.join(d, "rank%r.txt")
            cmd += [os.path.join(self.bin, "bench_mpi_allreduce"), "--out=" + out]
            cmd += self.plan_flags(self.p["channels"], resnet, est_key=impl, workers=workers)
            launch.worker(cmd, "mpirun", env={"OMPI_MCA_rmaps_base_oversubscribe": "1"})
            return [os.path.join(d, "rank%d.txt" % r) for r in range(workers)]
        return self.measure(impl, transport, workers, 1, body)

    # ---- Gloo ---------------------------------------------------------------------------------
    def gloo(self, algorithm, impl, workers, resnet):
        def body(launch, d):
            store = self.new_dir(os.path.join(os.path.basename(d), "store"))
            files = []
            for r in range(workers):
                out = os.path.join(d, "rank%d.txt" % r)
                files.append(out)
                launch.worker([os.path.join(self.bin, "bench_gloo_allreduce"), "--rank=%d" % r,
                               "--world=%d" % workers, "--store-dir=" + store,
                               "--algorithm=" + algorithm, "--out=" + out]
                              + self.plan_flags(self.p["channels"], resnet, est_key=impl,
                                                workers=workers), "worker%d" % r)
            return files
        return self.measure(impl, "tcp", workers, 1, body)

    # ---- torch.distributed gloo ---------------------------------------------------------
    def torch(self, workers, resnet):
        py = self.args.torch_python

        def body(launch, d):
            init = "tcp://127.0.0.1:%d" % free_port()
            files = []
            for r in range(workers):
                out = os.path.join(d, "rank%d.txt" % r)
                files.append(out)
                launch.worker([py, os.path.join(HERE, "torch_allreduce.py"), "--rank=%d" % r,
                               "--world=%d" % workers, "--init=" + init, "--out=" + out]
                              + self.plan_flags(self.p["channels"], resnet, est_key="torch-gloo",
                                                workers=workers), "worker%d" % r,
                              env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
            return files
        return self.measure("torch-gloo", "tcp", workers, 1, body)

    # ---- hsbn -----------------------------------------------------------------------------
    def start_hsbn_topology(self, launch, d, nodes):
        """Starts the root (when nodes > 1) and one sidecar per node; returns sidecar addresses."""
        upstream = None
        if nodes > 1:
            ready = os.path.join(d, "root.ready")
            upstream = launch.server([self.aggregator, "--role=root", "--listen=127.0.0.1:0",
                                      "--ready-file=" + ready, "--id=root"]
                                     + (self.args.root_flag or []), "root", ready)[0]
        addrs = []
        for n in range(nodes):
            ready = os.path.join(d, "node%d.ready" % n)
            cmd = [self.aggregator, "--role=node",
                   "--listen=unix:" + os.path.join(d, "node%d.sock" % n),
                   "--ready-file=" + ready, "--id=node%d" % n]
            if upstream:
                cmd.append("--upstream=" + upstream)
            cmd += self.args.sidecar_flag or []
            addrs.append(launch.server(cmd, "node%d" % n, ready)[0])
        return addrs

    def hsbn(self, workers, nodes, resnet, impl="hsbn"):
        """impl "hsbn": the node path through shared memory (the default where the node can use
        it); "hsbn-grpc": the same workers with HSBN_TRANSPORT=grpc (the Exchange stream)."""
        env = {"HSBN_TRANSPORT": "grpc"} if impl == "hsbn-grpc" else {"HSBN_TRANSPORT": "auto"}

        def body(launch, d):
            addrs = self.start_hsbn_topology(launch, d, nodes)
            scopes = self.args.multi_node_scopes if nodes > 1 else "node"
            local = workers // nodes
            files = []
            for r in range(workers):
                out = os.path.join(d, "rank%d.txt" % r)
                files.append(out)
                launch.worker([os.path.join(self.bin, "bench_hsbn_worker"),
                               "--address=" + addrs[r // local], "--job=bench-%d-%d" % (workers, nodes),
                               "--rank=%d" % r, "--world=%d" % workers,
                               "--local-rank=%d" % (r % local), "--local-world=%d" % local,
                               "--node-rank=%d" % (r // local), "--out=" + out]
                              + self.plan_flags(self.p["channels"], resnet, "fwd,bwd", scopes,
                                                est_key="hsbn-%d" % nodes, workers=workers),
                              "worker%d" % r, env=env)
            return files
        transport = ("shm" if impl == "hsbn" else "unix") + ("" if nodes == 1 else "+tcp")
        return self.measure(impl, transport, workers, nodes, body, est_key="hsbn-%d" % nodes,
                            scopes=self.args.multi_node_scopes if nodes > 1 else "node")

    def hsbn_load(self, role):
        """Aggregator throughput: many concurrent jobs against one sidecar (node scope) or, through
        two sidecars, one root (global scope). Reports rounds/s and the aggregator's CPU/round."""
        jobs, ranks, inflight = self.args.load_jobs, 2, 4
        d = self.new_dir("load-" + role)
        launch = Launch(d, self.p["timeout"])
        nodes = 1 if role == "node" else 2
        try:
            addrs = self.start_hsbn_topology(launch, d, nodes)
            target = launch.servers[0] if role == "root" else launch.servers[-1]
            outs = []
            for n in range(nodes):
                out = os.path.join(d, "load%d.json" % n)
                outs.append(out)
                launch.worker([os.path.join(self.bin, "bench_hsbn_load"), "--address=" + addrs[n],
                               "--jobs=%d" % jobs, "--local-world=%d" % ranks,
                               "--nodes=%d" % nodes, "--node-rank=%d" % n,
                               "--scope=" + ("node" if role == "node" else "global"),
                               "--channels=256", "--inflight=%d" % inflight,
                               "--seconds=%g" % self.p["load_seconds"], "--out=" + out],
                              "load%d" % n)
            cpu0 = None
            # Sample the aggregator's CPU time over the loaders' measuring window: they report
            # their own start, so take the counters around the whole run and scale by rounds.
            cpu0 = cpu_seconds(target.pid)
            t0 = time.monotonic()
            launch.wait_workers()
            cpu1 = cpu_seconds(target.pid)
            wall = time.monotonic() - t0
            results = []
            for out in outs:
                with open(out) as f:
                    results.append(json.load(f))
        except Exception as e:
            self.failures.append("load-%s: %s" % (role, e))
            print("  FAILED load-%s: %s" % (role, e), file=sys.stderr)
            return
        finally:
            launch.close()
        total_rounds = sum(r["rounds_total"] for r in results)  # all rounds, warm-up included
        timed_rounds = results[0]["rounds"]  # rounds of one node in the timed window
        seconds = results[0]["seconds"]
        rounds_per_s = timed_rounds / seconds / (1 if role == "node" else 1)
        # Units the aggregator handles: a sidecar answers local-world workers per round; the root
        # receives one partial per node per round.
        per_round_units = ranks if role == "node" else nodes
        agg_rounds = total_rounds / (1 if role == "node" else nodes)
        cpu = cpu1 - cpu0
        row = dict(kind="load", impl="hsbn", role=role, jobs=jobs, ranks_per_node=ranks,
                   nodes=nodes, inflight=inflight, channels=256, seconds=seconds,
                   rounds_per_s=rounds_per_s,
                   units_per_s=rounds_per_s * per_round_units,
                   unit=("contributions" if role == "node" else "node partials"),
                   cpu_s=cpu, wall_s=wall, rounds_total=agg_rounds,
                   cpu_us_per_round=1e6 * cpu / agg_rounds if agg_rounds else float("nan"),
                   units_per_cpu_s=(agg_rounds * per_round_units / cpu) if cpu > 0 else float("nan"))
        self.rows.append(row)
        print("  load-%-9s %.0f rounds/s, %.1f us CPU/round" % (role, rounds_per_s,
                                                                 row["cpu_us_per_round"]),
              file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Reporting

BASELINES = [
    ("raw-unix", "raw socket star, Unix"), ("raw-tcp", "raw socket star, TCP"),
    ("grpc-unix", "bare gRPC stream, Unix"), ("grpc-tcp", "bare gRPC stream, TCP"),
    ("grpc-unix-async", "bare gRPC stream, Unix, async 1 thread"),
    ("grpc-tcp-async", "bare gRPC stream, TCP, async 1 thread"),
    ("grpc-unix-hop", "bare gRPC, Unix, + reader thread"),
    ("mpi-shm", "Open MPI Allreduce, shm"), ("mpi-tcp", "Open MPI Allreduce, TCP"),
    ("gloo-default", "Gloo allreduce (default)"), ("gloo-ring", "Gloo AllreduceRing"),
    ("gloo-hd", "Gloo halving-doubling"), ("torch-gloo", "torch.distributed gloo"),
]


def find(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def hsbn_variants(rows):
    """(label, selector) of every hsbn latency variant present."""
    out = []
    for nodes, scope, phase in ((1, "node", "fwd"), (1, "node", "bwd"), (2, "node", "fwd"),
                                (2, "node", "bwd"), (2, "global", "fwd"), (2, "global", "bwd")):
        if any(r["impl"] == "hsbn" and r["kind"] == "lat" and r["nodes"] == nodes
               and r["scope"] == scope and r["phase"] == phase for r in rows):
            out.append(("hsbn %s %s, %d node%s" % (scope, phase, nodes, "s" if nodes > 1 else ""),
                        dict(impl="hsbn", nodes=nodes, scope=scope, phase=phase)))
    return out


def fmt(x, digits=0):
    if x is None or x != x:
        return "—"
    return ("%%.%df" % digits) % x


def ratio(a, b):
    if not a or not b:
        return None
    return a / b


def goals(rows):
    g = []
    # 1. node-scope p50, 4 workers, C=256 vs the bare gRPC floor with the same workers (Unix).
    h = find(rows, impl="hsbn", kind="lat", nodes=1, workers=4, channels=256, scope="node",
             phase="fwd")
    # The floor is the faster of the two bare gRPC servers (callback API, and async API on one
    # thread), whichever this run measured lower.
    def floor(impls, workers):
        got = [x for x in (find(rows, impl=i, kind="lat", workers=workers, channels=256)
                           for i in impls) if x]
        return min(got, key=lambda x: x["p50_us"]) if got else None
    f = floor(("grpc-unix", "grpc-unix-async"), 4)
    f1 = floor(("grpc-unix", "grpc-unix-async"), 1)
    r = ratio(h and h["p50_us"], f and f["p50_us"])
    g.append(dict(goal="node-scope p50 (4 workers, C=256) within 1.3x bare gRPC floor",
                  measured=("%.2fx (hsbn %s us / gRPC 4-worker star %s us, %s; 1-worker ping-pong %s us)"
                            % (r, fmt(h["p50_us"], 1), fmt(f["p50_us"], 1), f["impl"],
                               fmt(f1 and f1["p50_us"], 1))) if r else "not measured",
                  met=(r is not None and r <= 1.3)))
    # 2. global p50 (2 nodes x 2, C=256) <= node p50 (same topology) + 1.3 x sidecar<->root RTT,
    #    the RTT being the bare gRPC TCP star with 2 members (the root's fan-in) at the same C.
    hg = find(rows, impl="hsbn", kind="lat", nodes=2, workers=4, channels=256, scope="global",
              phase="fwd")
    hn = find(rows, impl="hsbn", kind="lat", nodes=2, workers=4, channels=256, scope="node",
              phase="fwd")
    rt = floor(("grpc-tcp", "grpc-tcp-async"), 2)
    if hg and hn and rt:
        bound = hn["p50_us"] + 1.3 * rt["p50_us"]
        g.append(dict(goal="global p50 (2 nodes x 2, C=256) <= node p50 + 1.3x sidecar-root RTT",
                      measured="%.1f us vs bound %.1f us (node %.1f + 1.3 x %.1f, %s); excess over node %.2fx RTT"
                      % (hg["p50_us"], bound, hn["p50_us"], rt["p50_us"], rt["impl"],
                         (hg["p50_us"] - hn["p50_us"]) / rt["p50_us"]),
                      met=hg["p50_us"] <= bound))
    else:
        g.append(dict(goal="global p50 <= node p50 + 1.3x sidecar-root RTT", measured="not measured",
                      met=False))
    # Issue 36: CPU per global round at 2 nodes x 2, all hsbn processes (root, sidecars, the four
    # workers) <= 2x the bare gRPC TCP star's (its server and its four clients), the same plan.
    # Only from a launch that ran global rounds alone (--multi-node-scopes=global); the star's
    # server CPU is its own count (its --stats-file), the lower of its two servers'.
    hc = find(rows, impl="hsbn", kind="cost", nodes=2, workers=4, scopes="global")
    stars = [x for x in (find(rows, impl=i, kind="cost", workers=4)
                         for i in ("grpc-tcp", "grpc-tcp-async")) if x and x.get("srv_rounds")]
    if hc and stars:
        total = hc["server_cpu_us"] + 4 * hc["client_cpu_us"]
        best = min(stars, key=lambda x: x["srv_cpu_us"] + 4 * x["client_cpu_us"])
        star = best["srv_cpu_us"] + 4 * best["client_cpu_us"]
        g.append(dict(goal="CPU per global round (2 nodes x 2, all hsbn processes) <= 2x the bare "
                      "gRPC star's (server and 4 clients)",
                      measured="%.0f us (aggregators %.0f: %s; workers 4 x %.1f) vs %s %.0f us "
                      "(server %.0f, clients 4 x %.1f): %.2fx"
                      % (total, hc["server_cpu_us"],
                         ", ".join("%s %.0f" % kv for kv in
                                   sorted(hc["server_cpu_us_by_process"].items())),
                         hc["client_cpu_us"], best["impl"], star, best["srv_cpu_us"],
                         best["client_cpu_us"], total / star),
                      met=total <= 2 * star))
    elif any(r["kind"] == "cost" and r["impl"] == "hsbn" and r["nodes"] == 2 for r in rows):
        g.append(dict(goal="CPU per global round <= 2x the bare gRPC star's",
                      measured="not measured (needs --multi-node-scopes=global, 4 workers and "
                      "grpc-tcp-async or grpc-tcp in the same run)", met=False))
    # 3. p99 within 3x p50, every hsbn latency row.
    hr = [r for r in rows if r["impl"] == "hsbn" and r["kind"] == "lat"]
    if hr:
        ok = [r for r in hr if r["p99_us"] <= 3 * r["p50_us"]]
        worst = max(hr, key=lambda r: r["p99_us"] / r["p50_us"])
        g.append(dict(goal="p99 within 3x p50 (every hsbn row)",
                      measured="%d of %d rows; worst %.2fx (%s %s, %d workers, %d nodes, C=%d)"
                      % (len(ok), len(hr), worst["p99_us"] / worst["p50_us"], worst["scope"],
                         worst["phase"], worst["workers"], worst["nodes"], worst["channels"]),
                      met=len(ok) == len(hr)))
    else:
        g.append(dict(goal="p99 within 3x p50", measured="not measured", met=False))
    # 4. ResNet-50 step at 2 nodes x 4 workers below torch gloo and Gloo default.
    hs = find(rows, impl="hsbn", kind="step", nodes=2, workers=8, scope="global")
    tg = find(rows, impl="torch-gloo", kind="step", workers=8)
    gd = find(rows, impl="gloo-default", kind="step", workers=8)
    if hs and tg and gd:
        g.append(dict(goal="ResNet-50 step sync (2 nodes x 4, global) below torch gloo and Gloo default",
                      measured="p50 %.1f ms vs torch %.1f ms (%.2fx), Gloo default %.1f ms (%.2fx)"
                      % (hs["p50_ms"], tg["p50_ms"], hs["p50_ms"] / tg["p50_ms"], gd["p50_ms"],
                         hs["p50_ms"] / gd["p50_ms"]),
                      met=hs["p50_ms"] < tg["p50_ms"] and hs["p50_ms"] < gd["p50_ms"]))
    else:
        g.append(dict(goal="ResNet-50 step below torch gloo and Gloo default", measured="not measured",
                      met=False))
    # Issue 13 (the shared-memory node path): node p50 at 2 and 4 workers vs Open MPI's shm
    # MPI_Allreduce; ResNet-50 node-scope step vs the gRPC path; global excess over node in
    # sidecar-root round trips (goal 2 above measures the bound).
    for w in (2, 4):
        h = find(rows, impl="hsbn", kind="lat", nodes=1, workers=w, channels=256, scope="node",
                 phase="fwd")
        hg_ = find(rows, impl="hsbn-grpc", kind="lat", nodes=1, workers=w, channels=256,
                   scope="node", phase="fwd")
        m = find(rows, impl="mpi-shm", kind="lat", workers=w, channels=256)
        if h and m:
            g.append(dict(goal="shm node p50 (%d workers, C=256) <= Open MPI shm Allreduce" % w,
                          measured="%.1f us vs MPI %.1f us (%.2fx); gRPC path %s us"
                          % (h["p50_us"], m["p50_us"], h["p50_us"] / m["p50_us"],
                             fmt(hg_ and hg_["p50_us"], 1)),
                          met=h["p50_us"] <= m["p50_us"]))
        else:
            g.append(dict(goal="shm node p50 (%d workers) <= Open MPI shm" % w,
                          measured="not measured", met=False))
    hs_ = [r for r in rows if r["impl"] == "hsbn" and r["kind"] == "step" and r["nodes"] == 1]
    for st in hs_:
        sg = find(rows, impl="hsbn-grpc", kind="step", nodes=1, workers=st["workers"],
                  scope=st["scope"])
        if sg:
            g.append(dict(goal="ResNet-50 node-scope step (%d workers): shm >= 5x below gRPC path"
                          % st["workers"],
                          measured="p50 %.1f ms vs gRPC %.1f ms (%.1fx)"
                          % (st["p50_ms"], sg["p50_ms"], sg["p50_ms"] / st["p50_ms"]),
                          met=sg["p50_ms"] >= 5 * st["p50_ms"]))
    # 5. Root: node partials per CPU-second.
    ld = find(rows, kind="load", role="root")
    if ld:
        g.append(dict(goal="one root sustains >= 50,000 node partials/s on one core",
                      measured="%.0f partials per root CPU-second (sustained %.0f partials/s, "
                      "load-limited on 2 cores)" % (ld["units_per_cpu_s"], ld["units_per_s"]),
                      met=ld["units_per_cpu_s"] >= 50000))
    else:
        g.append(dict(goal="root >= 50,000 node partials/s on one core", measured="not measured",
                      met=False))
    return g


def report(bench, params, machine, command):
    rows = bench.rows
    lines = []
    lines.append("Machine: %s" % machine["summary"])
    lines.append("Command: `%s`" % command)
    lines.append("Plan: %d timed rounds per case after %d warm-up rounds, samples pooled over all"
                 " ranks; ResNet-50 steps: %d timed after %d warm-up."
                 % (params["rounds"], params["warmup"], params["resnet_steps"],
                    params["resnet_warmup"]))
    lines.append("")
    variants = hsbn_variants(rows)
    base_present = [(k, n) for k, n in BASELINES if any(r["impl"] == k for r in rows)]
    # Latency tables, one per worker count.
    for w in params["workers"] + ([1] if params["pingpong"] and 1 not in params["workers"] else []):
        if not any(r["kind"] == "lat" and r["workers"] == w for r in rows):
            continue
        lines.append("### Round latency, %d worker%s: p50 / p99 (us)" % (w, "s" if w > 1 else ""))
        lines.append("")
        chans = params["channels"]
        lines.append("| implementation | " + " | ".join("C=%d" % c for c in chans) + " |")
        lines.append("|---|" + "---|" * len(chans))
        entries = [(lbl, dict(sel, workers=w)) for lbl, sel in variants] + \
                  [(n, dict(impl=k, workers=w)) for k, n in base_present]
        for lbl, sel in entries:
            cells = []
            for c in chans:
                r = find(rows, kind="lat", channels=c, **sel)
                cells.append("%s / %s" % (fmt(r["p50_us"]), fmt(r["p99_us"])) if r else "—")
            if any(c != "—" for c in cells):
                lines.append("| %s | %s |" % (lbl, " | ".join(cells)))
        lines.append("")
    # Ratios: hsbn node fwd (1 node) and global fwd (2 nodes) p50 over each baseline's p50.
    for lbl_h, sel_h in (("hsbn node fwd, 1 node", dict(impl="hsbn", nodes=1, scope="node", phase="fwd")),
                         ("hsbn global fwd, 2 nodes", dict(impl="hsbn", nodes=2, scope="global", phase="fwd"))):
        if not base_present or not any(find(rows, kind="lat", workers=w, **sel_h)
                                       for w in params["workers"]):
            continue
        lines.append("### Ratio p50(%s) / p50(baseline), same workers and C" % lbl_h)
        lines.append("")
        cols = [(w, c) for w in params["workers"] for c in params["channels"]]
        lines.append("| baseline | " + " | ".join("W=%d C=%d" % wc for wc in cols) + " |")
        lines.append("|---|" + "---|" * len(cols))
        for k, n in base_present:
            cells = []
            for w, c in cols:
                h = find(rows, kind="lat", workers=w, channels=c, **sel_h)
                b = find(rows, kind="lat", impl=k, workers=w, channels=c)
                rr = ratio(h and h["p50_us"], b and b["p50_us"])
                cells.append(fmt(rr, 2) if rr else "—")
            lines.append("| %s | %s |" % (n, " | ".join(cells)))
        lines.append("")
    # ResNet-50 step.
    steps = [r for r in rows if r["kind"] == "step"]
    if steps:
        lines.append("### ResNet-50 step: 106 rounds in order, total sync time per step (ms)")
        lines.append("")
        lines.append("| workers | implementation | p50 | p99 | max | hsbn global p50 / this p50 |")
        lines.append("|---|---|---|---|---|---|")
        for w in params["resnet_workers"]:
            hs = find(rows, kind="step", impl="hsbn", nodes=2, workers=w, scope="global")
            ws = [r for r in steps if r["workers"] == w]
            for r in sorted(ws, key=lambda r: (r["impl"] != "hsbn", r["impl"], r["nodes"], r["scope"])):
                name = ("hsbn %s, %d node%s" % (r["scope"], r["nodes"], "s" if r["nodes"] > 1 else "")
                        if r["impl"] == "hsbn" else dict(BASELINES).get(r["impl"], r["impl"]))
                rr = ratio(hs and hs["p50_ms"], r["p50_ms"]) if r["impl"] != "hsbn" else None
                lines.append("| %d | %s | %s | %s | %s | %s |" % (w, name, fmt(r["p50_ms"], 2),
                                                               fmt(r["p99_ms"], 2), fmt(r["max_ms"], 2),
                                                               fmt(rr, 2) if rr else ""))
        lines.append("")
    costs = [r for r in rows if r["kind"] == "cost"]
    if costs:
        lines.append("### CPU and context switches per round (all cases of a launch, warm-up included)")
        lines.append("")
        lines.append("Client: per worker process, all its threads. Server: the aggregators (sidecars"
                     " and root) or the baseline's server; none for MPI, Gloo and torch, which have"
                     " no server.")
        lines.append("")
        lines.append("| workers | implementation | client CPU us | client csw | server CPU us | server csw |")
        lines.append("|---|---|---|---|---|---|")
        for r in sorted(costs, key=lambda r: (r["workers"], r["impl"] != "hsbn", r["impl"], r["nodes"])):
            name = ("hsbn, %d node%s%s" % (r["nodes"], "s" if r["nodes"] > 1 else "",
                                           ", global rounds only" if r.get("scopes") == "global"
                                           else "")
                    if r["impl"] == "hsbn" else dict(BASELINES).get(r["impl"], r["impl"]))
            lines.append("| %d | %s | %.1f | %.2f | %s | %s |" % (
                r["workers"], name, r["client_cpu_us"], r["client_csw"],
                fmt(r["server_cpu_us"], 1) if r["server_cpu_us"] else "—",
                fmt(r["server_csw"], 2) if r["server_cpu_us"] and r["server_csw"] is not None
                else "—"))
        lines.append("")
        per = [r for r in costs if r["impl"] == "hsbn" and r.get("server_cpu_us_by_process")]
        if per:
            lines.append("hsbn's server CPU per round by process (us; `/proc` of each aggregator, "
                         "the same window): " + "; ".join(
                             "%d workers, %d node%s: %s" % (
                                 r["workers"], r["nodes"], "s" if r["nodes"] > 1 else "",
                                 ", ".join("%s %s" % (n, fmt(v, 1)) for n, v in
                                           sorted(r["server_cpu_us_by_process"].items())))
                             for r in sorted(per, key=lambda r: (r["workers"], r["nodes"]))) + ".")
            lines.append("")
    srv = [r for r in costs if r.get("srv_rounds")]
    if srv:
        lines.append("### Bare gRPC servers, their own counters per round (first stream to last)")
        lines.append("")
        lines.append("getrusage of the server process (all threads, ended ones included) over its"
                     " streams' life, divided by the rounds it answered; `main thread busy`: the main"
                     " thread's CPU over that wall time (the async server's only working thread;"
                     " the callback server's main thread just waits).")
        lines.append("")
        lines.append("| workers | implementation | rounds | CPU us | csw (vol + invol) | main thread busy | process CPU / wall | threads |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in sorted(srv, key=lambda r: (r["workers"], r["impl"])):
            lines.append("| %d | %s | %d | %.1f | %.2f (%.2f + %.2f) | %.0f%% | %.0f%% | %d |" % (
                r["workers"], dict(BASELINES).get(r["impl"], r["impl"]), r["srv_rounds"],
                r["srv_cpu_us"], r["srv_csw"], r["srv_vcsw"], r["srv_icsw"],
                100 * r["srv_main_busy"], 100 * r["srv_cpu_busy"], r["srv_threads"]))
        lines.append("")
    loads = [r for r in rows if r["kind"] == "load"]
    if loads:
        lines.append("### Aggregator throughput (C=256, %d jobs x %d ranks/node, %d rounds in flight per worker)"
                     % (loads[0]["jobs"], loads[0]["ranks_per_node"], loads[0]["inflight"]))
        lines.append("")
        lines.append("| aggregator | rounds/s | %s | CPU us / round | per CPU-second |" % "units/s")
        lines.append("|---|---|---|---|---|")
        for r in loads:
            lines.append("| %s | %.0f | %.0f %s | %.1f | %.0f %s |"
                         % (r["role"], r["rounds_per_s"], r["units_per_s"], r["unit"],
                            r["cpu_us_per_round"], r["units_per_cpu_s"], r["unit"]))
        lines.append("")
    g = goals(rows) if any(r["impl"] == "hsbn" for r in rows) else []
    if g:
        lines.append("### Goals")
        lines.append("")
        lines.append("| goal | measured | met |")
        lines.append("|---|---|---|")
        for x in g:
            lines.append("| %s | %s | %s |" % (x["goal"], x["measured"], "yes" if x["met"] else "no"))
        lines.append("")
    if bench.skipped:
        lines.append("Skipped: " + "; ".join("%s (%s)" % kv for kv in bench.skipped.items()))
    if bench.failures:
        lines.append("Failed: " + "; ".join(bench.failures))
    return "\n".join(lines) + "\n", g


def machine_info(torch_python, quick):
    info = {"cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        pass

    def out(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    info["grpc"] = out(["pkg-config", "--modversion", "grpc++"])
    info["openmpi"] = (out(["mpirun", "--version"]).splitlines() or [""])[0]
    info["gloo"] = out(["dpkg-query", "-W", "-f=${Version}", "libgloo-dev"])
    info["commit"] = out(["git", "-C", HERE, "rev-parse", "--short", "HEAD"])
    if not quick:
        info["torch"] = out([torch_python, "-c", "import torch; print(torch.__version__)"])
    info["summary"] = "commit %s; %s, %s cores, %s GiB, Linux %s; gRPC %s, %s, Gloo %s%s" % (
        info["commit"] or "?",
        info.get("cpu", "?"), info["cores"], info.get("mem_gib", "?"), info["kernel"],
        info["grpc"] or "?", info["openmpi"] or "no Open MPI", info["gloo"] or "?",
        (", torch " + info["torch"]) if info.get("torch") else "")
    return info


def check(rows, failures):
    """Quick-mode validation: every row well-formed with positive numbers, no failed launch."""
    problems = list(failures)
    if not rows:
        problems.append("no rows")
    for r in rows:
        keys = {"lat": ("p50_us", "p90_us", "p99_us", "max_us"), "step": ("p50_ms", "p99_ms"),
                "load": ("rounds_per_s", "cpu_us_per_round"), "cost": ("client_cpu_us",)}[r["kind"]]
        for k in keys:
            v = r.get(k)
            if not isinstance(v, (int, float)) or not v > 0:
                problems.append("%s %s: %s = %r" % (r["impl"], r["kind"], k, v))
        if r["kind"] in ("lat", "step") and r["n"] <= 0:
            problems.append("%s: no samples" % r["impl"])
        if r["kind"] == "cost" and r["impl"] == "hsbn" and r.get("scopes") == "global":
            # A global-only launch: its CPU is counted per aggregator (the root and each sidecar)
            # and it ran no other scope's rounds.
            per = r.get("server_cpu_us_by_process") or {}
            if len(per) != r["nodes"] + 1 or not all(v > 0 for v in per.values()):
                problems.append("hsbn global-only cost: aggregators' CPU %r" % per)
            other = [x for x in rows if x["impl"] == "hsbn" and x["kind"] in ("lat", "step")
                     and x["nodes"] == r["nodes"] and x["workers"] == r["workers"]
                     and x["scope"] != "global"]
            if other:
                problems.append("hsbn global-only launch ran %s rounds" % other[0]["scope"])
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--quick", action="store_true", help="seconds: prove it works, numbers are noise")
    ap.add_argument("--json", help="write all rows and the machine here")
    ap.add_argument("--markdown", help="write the Markdown report here")
    ap.add_argument("--only", help="comma-separated implementations (default: all available)")
    ap.add_argument("--workers", help="override the worker counts, e.g. 2,4")
    ap.add_argument("--channels", help="override the channel counts, e.g. 256")
    ap.add_argument("--rounds", type=int, help="override timed rounds per case")
    ap.add_argument("--resnet-steps", type=int, help="override timed ResNet-50 steps")
    ap.add_argument("--load-jobs", type=int, default=16, help="concurrent jobs in the throughput run")
    ap.add_argument("--aggregator", help="path of hsbn-aggregator (default: found in --build-dir)")
    ap.add_argument("--sidecar-flag", action="append", metavar="FLAG",
                    help="a flag for every hsbn sidecar (repeatable), e.g. --sidecar-flag=--shm-ring=4")
    ap.add_argument("--root-flag", action="append", metavar="FLAG",
                    help="a flag for the hsbn root (repeatable), e.g. --root-flag=--poll-us=200")
    ap.add_argument("--multi-node-scopes", default="node,global", choices=("node,global", "global"),
                    help="the scopes an hsbn launch of 2 nodes runs; \"global\" makes its CPU "
                    "row a global round's (the CPU goal)")
    ap.add_argument("--torch-python", default="/usr/bin/python3")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless every row is well-formed with positive numbers")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = ap.parse_args()

    p = mode_params(args.quick)
    if args.workers:
        p["workers"] = [int(x) for x in args.workers.split(",")]
        p["resnet_workers"] = [w for w in p["resnet_workers"] if w in p["workers"]] or p["workers"][-1:]
    if args.channels:
        p["channels"] = [int(x) for x in args.channels.split(",")]
    if args.rounds:
        p["rounds"] = args.rounds
    if args.resnet_steps is not None:
        p["resnet_steps"] = args.resnet_steps
    only = set(args.only.split(",")) if args.only else None

    def want(name):
        return only is None or name in only or name.split("-")[0] in only

    bench = Bench(args, p)
    started = time.monotonic()
    load_before = os.getloadavg()
    have_torch = subprocess.run([args.torch_python, "-c", "import torch.distributed as d; "
                                 "assert d.is_available() and d.is_gloo_available()"],
                                capture_output=True).returncode == 0 if want("torch-gloo") else False
    have_hsbn = bench.have("bench_hsbn_worker") and bench.aggregator is not None
    for name, ok, why in (("mpi", bench.have("bench_mpi_allreduce") and shutil.which("mpirun"),
                           "Open MPI not built or mpirun missing"),
                          ("gloo", bench.have("bench_gloo_allreduce"), "Gloo not built"),
                          ("torch-gloo", have_torch, "no torch.distributed gloo in " + args.torch_python),
                          ("hsbn", have_hsbn, "bench_hsbn_worker or hsbn-aggregator not built")):
        if not ok and want(name):
            bench.skipped[name] = why
            print("skipping %s: %s" % (name, why), file=sys.stderr)

    worker_counts = list(p["workers"])
    if p["pingpong"] and 1 not in worker_counts:
        # The classic two-process ping-pong, raw and gRPC only. Once: a second launch of a case
        # would reuse its directory, and with it the first launch's ready file (a stale port).
        worker_counts.append(1)
    for w in worker_counts:
        resnet = w in p["resnet_workers"]
        print("workers=%d" % w, file=sys.stderr)
        for impl in ("hsbn", "hsbn-grpc"):
            if w > 1 and have_hsbn and (only is None or impl in only):
                bench.hsbn(w, 1, resnet, impl)
                if w % 2 == 0:
                    bench.hsbn(w, 2, resnet, impl)
        for exe, fam in (("bench_raw_star", "raw"), ("bench_grpc_star", "grpc")):
            for tr in ("unix", "tcp"):
                if want("%s-%s" % (fam, tr)) and bench.have(exe):
                    bench.star(exe, "%s-%s" % (fam, tr), tr, w, resnet)
        # The bare gRPC server on the async API, one thread, no callback executor.
        for tr in ("unix", "tcp"):
            if want("grpc-%s-async" % tr) and bench.have("bench_grpc_star"):
                bench.star("bench_grpc_star", "grpc-%s-async" % tr, tr, w, resnet,
                           server_extra=["--async"])
        # The bare gRPC worker with hsbn's client shape (a reader thread): prices that hop.
        if (only is None or "grpc-unix-hop" in only) and bench.have("bench_grpc_star"):
            bench.star("bench_grpc_star", "grpc-unix-hop", "unix", w, False, ["--reader-thread"])
        if w == 1:
            continue
        if "mpi" not in bench.skipped:
            for btl, impl, tr in (("self,vader", "mpi-shm", "shm"), ("self,tcp", "mpi-tcp", "tcp")):
                if want(impl):
                    bench.mpi(btl, impl, tr, w, resnet)
        if "gloo" not in bench.skipped:
            for alg in ("default", "ring", "hd"):
                if want("gloo-" + alg):
                    bench.gloo(alg, "gloo-" + alg, w, resnet)
        if have_torch and want("torch-gloo"):
            bench.torch(w, resnet)
    if have_hsbn and bench.have("bench_hsbn_load") and want("hsbn"):
        print("throughput", file=sys.stderr)
        bench.hsbn_load("node")
        bench.hsbn_load("root")

    machine = machine_info(args.torch_python, args.quick)
    # Other work on the machine skews every number: say how busy it was.
    machine["loadavg_before"] = [round(x, 2) for x in load_before]
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    machine["summary"] += "; load average %.1f before, %.1f after (1 min)" % (
        load_before[0], machine["loadavg_after"][0])
    command = "bench/exchange/run.sh" + (" --quick" if args.quick else "")
    text, g = report(bench, p, machine, command)
    print(text)
    print("total %.0f s" % (time.monotonic() - started), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                           quick=args.quick, machine=machine, params=p, command=command,
                           rows=bench.rows, goals=g, skipped=bench.skipped,
                           failures=bench.failures), f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if not args.keep:
        shutil.rmtree(bench.tmp, ignore_errors=True)
    else:
        print("logs kept in " + bench.tmp, file=sys.stderr)
    if args.check:
        problems = check(bench.rows, bench.failures)
        for x in problems:
            print("check: " + x, file=sys.stderr)
        print("check: %d rows, %s" % (len(bench.rows), "ok" if not problems else "%d problems" % len(problems)),
              file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
