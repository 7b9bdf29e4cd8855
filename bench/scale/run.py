#!/usr/bin/env python3
"""The root at scale (issue 25): one job of N simulated nodes against a real root, flat or
through group aggregators, at a fixed offered load; optionally the same against an old binary.

For every configuration (nodes, tree, --event-threads, binary) it starts a fresh root (and,
for the tier, N/K group aggregators: real hsbn-aggregator processes), then --generators
hsbn_scale processes that each play N/G sidecars over the real sidecar->parent protocol, one
TCP connection each (Join, Exchange stream, Attach, one partial per round, ResNet-50's 106
rounds per step, strictly in sequence). Steps start on a fixed schedule: the offered load is
--partials-per-s node partials per second whatever N is (steps per second = that / 106 / N),
so a root that batches more cannot hide a cost. Measured over the timed steps' window:
  - root CPU (utime + stime from /proc, all threads) per node partial and per step, and node
    partials per root CPU-second (a node partial: one node's share of a completed round; through
    a tier the root receives one per group, each carrying K nodes);
  - sustained steps per second against the offered rate, and how far the schedule fell behind;
  - round latency p50/p99 (first partial sent to last result received, over all generators),
    and the per-node round trip;
  - the root's peak RSS and open fds; the group aggregators' CPU too.
Configurations of the old and new binary alternate, so that drift in this machine's load falls
on both alike.

  bench/scale/run.py --build-dir build [--old-aggregator OLD/hsbn-aggregator]
                     [--nodes 64,256,1024] [--trees flat,tier] [--event-threads 1,2]
                     [--json F] [--markdown F] [--quick]
Standard library only.
"""

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROUNDS_PER_STEP = 106
TICK = os.sysconf("SC_CLK_TCK")


def raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cpu_seconds(pid):
    """utime + stime of every thread of pid, in seconds (None once it is gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_and_fds(pid):
    rss = hwm = 0
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
        fds = len(os.listdir("/proc/%d/fd" % pid))
    except OSError:
        return 0, 0, 0
    return rss, hwm, fds


class Aggregator:
    def __init__(self, name, args, workdir):
        self.name = name
        self.ready = os.path.join(workdir, name + ".ready")
        self.log_path = os.path.join(workdir, name + ".log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args + ["--ready-file=" + self.ready], stdout=self.log,
                                     stderr=subprocess.STDOUT, preexec_fn=raise_fd_limit)

    def address(self, timeout=60):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if os.path.exists(self.ready):
                with open(self.ready) as f:
                    lines = [l.strip() for l in f if l.strip()]
                if lines:
                    return lines[0]
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited with %s:\n%s" % (self.name, self.proc.returncode,
                                                               open(self.log_path).read()))
            time.sleep(0.02)
        raise RuntimeError("%s was not ready within %d s" % (self.name, timeout))

    def metrics_url(self):
        with open(self.ready) as f:
            for line in f:
                if line.startswith("metrics="):
                    return line.strip()[len("metrics="):] + "/metrics"
        raise RuntimeError("%s has no metrics line in its ready file" % self.name)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def scrape(url):
    """The root's /metrics: {name: value summed over its label sets}."""
    out = {}
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


class Sampler(threading.Thread):
    """Samples the CPU seconds of some processes every 20 ms, with monotonic timestamps, and the
    root's metrics (when given) every 0.5 s: the peak of its memory budget's use and the message
    counters."""

    def __init__(self, pids, metrics_url=None):
        super().__init__(daemon=True)
        self.pids = pids
        self.metrics_url = metrics_url
        self.samples = []  # (t_ns, [cpu_s per pid])
        self.metrics = []  # (t_ns, {name: value})
        self.peak = (0, 0, 0)
        self.memory_used_peak = 0
        self.stop_event = threading.Event()

    def run(self):
        i = 0
        while not self.stop_event.is_set():
            self.samples.append((time.monotonic_ns(), [cpu_seconds(p) for p in self.pids]))
            rss, hwm, fds = rss_and_fds(self.pids[0])
            self.peak = (max(self.peak[0], rss), max(self.peak[1], hwm), max(self.peak[2], fds))
            if self.metrics_url and i % 25 == 0:
                try:
                    m = scrape(self.metrics_url)
                    self.metrics.append((time.monotonic_ns(), m))
                    self.memory_used_peak = max(self.memory_used_peak,
                                                m.get("hsbn_memory_used_bytes", 0))
                except OSError:
                    pass
            i += 1
            self.stop_event.wait(0.02)

    def metric_delta(self, name, t0_ns, t1_ns):
        """Growth of a counter between the samples nearest to two times (None without them)."""
        inside = [(t, m.get(name, 0.0)) for t, m in self.metrics if t0_ns <= t <= t1_ns]
        if len(inside) < 2:
            return None
        return (inside[-1][1] - inside[0][1]), (inside[-1][0] - inside[0][0]) / 1e9

    def cpu_at(self, t_ns, i):
        """CPU seconds of pid i at time t_ns, interpolated between samples."""
        prev = None
        for t, cpus in self.samples:
            if cpus[i] is None:
                continue
            if t >= t_ns:
                if prev is None:
                    return cpus[i]
                (t0, c0) = prev
                return c0 + (cpus[i] - c0) * (t_ns - t0) / max(1, t - t0)
            prev = (t, cpus[i])
        return prev[1] if prev else 0.0


def pct(values, q):
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def run_config(args, binary, nodes, tree, threads, workdir):
    k = args.group_nodes(nodes) if tree == "tier" else 0
    steps_per_s = args.partials_per_s / ROUNDS_PER_STEP / nodes
    name = "%s-n%d-%s-t%d" % (os.path.basename(os.path.dirname(binary)) or "agg", nodes, tree,
                              threads)
    wd = tempfile.mkdtemp(prefix=name + "-", dir=workdir)
    aggs, gens = [], []
    try:
        root = Aggregator("root", [binary, "--role=root", "--listen=127.0.0.1:0",
                                   "--event-threads=%d" % threads, "--log-level=warn"]
                          + (["--metrics-listen=127.0.0.1:0"] if args.metrics else []), wd)
        aggs.append(root)
        root_addr = root.address()
        metrics_url = root.metrics_url() if args.metrics else None
        addresses = [root_addr]
        if k:
            groups = []
            for g in range(nodes // k):
                groups.append(Aggregator("group%d" % g, [
                    binary, "--role=group", "--listen=127.0.0.1:0", "--upstream=" + root_addr,
                    "--log-level=warn"], wd))
            aggs.extend(groups)
            addresses = [g.address() for g in groups]
        per = nodes // args.generators
        for i in range(args.generators):
            count = per if i < args.generators - 1 else nodes - per * (args.generators - 1)
            cmd = [args.scale_bin, "--address=" + ",".join(addresses), "--job=scale",
                   "--nodes=%d" % nodes, "--first-node=%d" % (i * per), "--count=%d" % count,
                   "--group-nodes=%d" % (k or args.group_nodes(nodes)),
                   "--rate=%.9f" % steps_per_s, "--warmup-steps=%d" % args.warmup_steps,
                   "--steps=%d" % args.steps, "--cooldown-steps=1",
                   "--out=" + os.path.join(wd, "gen%d.json" % i)]
            gens.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=open(os.path.join(wd, "gen%d.err" % i), "w"),
                                         text=True, preexec_fn=raise_fd_limit))
        for i, g in enumerate(gens):
            line = g.stdout.readline()
            if line.strip() != "ready":
                g.wait(30)
                raise RuntimeError("generator %d did not get ready: %s" % (
                    i, open(os.path.join(wd, "gen%d.err" % i)).read()))
        sampler = Sampler([a.proc.pid for a in aggs], metrics_url)
        sampler.start()
        t0 = time.monotonic_ns() + 200_000_000
        for g in gens:
            g.stdin.write("%d\n" % t0)
            g.stdin.flush()
        budget = 120 + (args.warmup_steps + args.steps + 1) / steps_per_s * 4
        for i, g in enumerate(gens):
            try:
                g.wait(budget)
            except subprocess.TimeoutExpired:
                for h in gens:
                    h.kill()
                raise RuntimeError("generators did not finish within %d s" % budget)
        sampler.stop_event.set()
        sampler.join()
        outs = []
        for i, g in enumerate(gens):
            with open(os.path.join(wd, "gen%d.json" % i)) as f:
                outs.append(json.load(f))
            if g.returncode != 0:
                raise RuntimeError("generator %d failed: %s" % (i, outs[-1]["failure"]))
    finally:
        for g in gens:
            if g.poll() is None:
                g.kill()
                g.wait()
        for a in aggs:
            a.stop()
    if not args.keep:
        shutil.rmtree(wd, ignore_errors=True)

    w0 = t0 + int(args.warmup_steps * 1e9 / steps_per_s)
    w1 = t0 + int((args.warmup_steps + args.steps) * 1e9 / steps_per_s)
    window_s = (w1 - w0) / 1e9
    # A round completed at the root before any generator saw its last result; it counts in the
    # window when every generator saw it there.
    done = {}
    first = {}
    for o in outs:
        for step, r, sent, got in o["rounds"]:
            key = (step, r)
            done[key] = max(done.get(key, 0), got)
            first[key] = min(first.get(key, sent), sent)
    rounds_in = sum(1 for t in done.values() if w0 <= t < w1)
    lat = [(done[k] - first[k]) / 1e3 for k in done
           if args.warmup_steps <= k[0] < args.warmup_steps + args.steps]
    root_cpu = sampler.cpu_at(w1, 0) - sampler.cpu_at(w0, 0)
    group_cpu = sum(sampler.cpu_at(w1, i) - sampler.cpu_at(w0, i) for i in range(1, len(aggs)))
    partials = rounds_in * nodes
    rss, hwm, fds = sampler.peak
    out = {
        "nodes": nodes, "tree": tree, "group_nodes": k,
        "event_threads": threads, "generators": args.generators,
        "offered_partials_per_s": args.partials_per_s, "offered_steps_per_s": steps_per_s,
        "window_s": window_s, "rounds_in_window": rounds_in, "node_partials": partials,
        "root_messages_in": rounds_in * (nodes // k if k else nodes),
        "sustained_steps_per_s": rounds_in / ROUNDS_PER_STEP / window_s,
        "sustained_partials_per_s": partials / window_s,
        "behind_max_ms": max(o["behind_max_ms"] for o in outs),
        "root_cpu_s": root_cpu, "group_cpu_s": group_cpu,
        "root_cpu_us_per_partial": root_cpu / partials * 1e6 if partials else 0,
        "root_cpu_ms_per_step": root_cpu / max(1e-9, partials / nodes / ROUNDS_PER_STEP) * 1e3,
        "partials_per_root_cpu_s": partials / root_cpu if root_cpu > 0 else 0,
        "round_p50_us": pct(lat, 0.5), "round_p99_us": pct(lat, 0.99),
        "node_rtt_p50_us": statistics.median(o["node_rtt_p50_us"] for o in outs),
        "node_rtt_p99_us": max(o["node_rtt_p99_us"] for o in outs),
        "root_rss_peak_bytes": hwm, "root_fds_peak": fds,
    }
    if args.metrics:
        out["root_memory_budget_used_peak_bytes"] = sampler.memory_used_peak
        for name, key in (("hsbn_received_messages_total", "root_messages_in_per_node_partial"),
                          ("hsbn_sent_messages_total", "root_messages_out_per_node_partial")):
            d = sampler.metric_delta(name, w0, w1)
            rounds_d = sampler.metric_delta("hsbn_rounds_total", w0, w1)
            if d and rounds_d and rounds_d[0] > 0:
                out[key] = d[0] / (rounds_d[0] * nodes)
    return out


def markdown(rows):
    out = ["| binary | nodes | tree | event threads | offered steps/s | sustained steps/s | "
           "schedule behind, max ms | root CPU us/partial | node partials per root CPU-s | "
           "root CPU ms/step | group aggregators' CPU us/partial | round p50 us | round p99 us | "
           "root RSS MiB | root fds |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        group = ("%.1f" % (r["group_cpu_s"] / r["node_partials"] * 1e6)
                 if r["group_nodes"] and r["node_partials"] else "")
        out.append("| %s | %d | %s | %d | %.3f | %.3f | %.0f | %.1f | %.0f | %.1f | %s | %.0f | "
                   "%.0f | %.0f | %d |" % (
                       r["label"], r["nodes"],
                       r["tree"] + (" (K=%d)" % r["group_nodes"] if r["group_nodes"] else ""),
                       r["event_threads"], r["offered_steps_per_s"], r["sustained_steps_per_s"],
                       r["behind_max_ms"], r["root_cpu_us_per_partial"],
                       r["partials_per_root_cpu_s"], r["root_cpu_ms_per_step"], group,
                       r["round_p50_us"], r["round_p99_us"], r["root_rss_peak_bytes"] / 2**20,
                       r["root_fds_peak"]))
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--build-dir", required=True)
    p.add_argument("--old-aggregator", help="an older hsbn-aggregator to run side by side")
    p.add_argument("--nodes", default="64,256,1024")
    p.add_argument("--trees", default="flat,tier")
    p.add_argument("--event-threads", default="1,2")
    p.add_argument("--partials-per-s", type=float, default=8000,
                   help="offered node partials per second (default 8000)")
    p.add_argument("--group-size", default="auto",
                   help="K, nodes per group aggregator in the tier (auto: 8, 16, 32 for "
                   "<= 64, <= 256, more nodes)")
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1, help="runs of every configuration")
    p.add_argument("--metrics", action="store_true",
                   help="also scrape the root's /metrics every 0.5 s: the peak use of its memory "
                   "budget and messages per node partial (the scrapes cost the root some CPU)")
    p.add_argument("--quick", action="store_true",
                   help="seconds: 16 nodes, both trees, 1 event thread, 2 steps; numbers are noise")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless every configuration completed rounds in its window")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--keep", action="store_true", help="keep logs in the temporary folder")
    p.add_argument("--render", metavar="JSON",
                   help="print the Markdown table of an earlier run's --json and exit")
    args = p.parse_args()
    if args.render:
        with open(args.render) as f:
            print(markdown(json.load(f)["rows"]), end="")
        return
    if args.quick:
        args.nodes, args.trees, args.event_threads, args.steps = "16", "flat,tier", "1", 2
    args.scale_bin = os.path.join(args.build_dir, "bench", "scale", "bench_hsbn_scale")
    new_bin = os.path.join(args.build_dir, "server", "hsbn-aggregator")
    for b in [args.scale_bin, new_bin] + ([args.old_aggregator] if args.old_aggregator else []):
        if not os.access(b, os.X_OK):
            sys.exit("run.py: %s is missing; build it (cmake --build BUILD --target bench_scale)"
                     % b)
    if args.group_size == "auto":
        args.group_nodes = lambda n: 8 if n <= 64 else 16 if n <= 256 else 32
    else:
        args.group_nodes = lambda n, k=int(args.group_size): k
    binaries = [("new", new_bin)] + ([("old", args.old_aggregator)] if args.old_aggregator else [])
    workdir = tempfile.mkdtemp(prefix="hsbn-scale-")
    rows = []
    configs = [(int(n), t, int(th)) for n in args.nodes.split(",") for t in args.trees.split(",")
               for th in args.event_threads.split(",")]
    total = len(configs) * len(binaries) * args.repeat
    i = 0
    for nodes, tree, threads in configs:
        for rep in range(args.repeat):
            order = binaries if rep % 2 == 0 else binaries[::-1]
            for label, binary in order:
                i += 1
                print("[%d/%d] %s: %d nodes, %s, %d event thread(s), %.3f steps/s offered ..." % (
                    i, total, label, nodes, tree, threads,
                    args.partials_per_s / ROUNDS_PER_STEP / nodes), flush=True)
                r = run_config(args, binary, nodes, tree, threads, workdir)
                r["label"] = label
                r["repeat"] = rep
                rows.append(r)
                print("    %.0f node partials per root CPU-s, sustained %.3f of %.3f steps/s, "
                      "round p50 %.0f us, p99 %.0f us" % (
                          r["partials_per_root_cpu_s"], r["sustained_steps_per_s"],
                          r["offered_steps_per_s"], r["round_p50_us"], r["round_p99_us"]),
                      flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    table = markdown(rows)
    print()
    print(table)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(),
               "loadavg_end": os.getloadavg()}
    if args.json:
        with open(args.json, "w") as f:
            params = {k: getattr(args, k) for k in ("nodes", "trees", "event_threads",
                                                     "partials_per_s", "group_size", "generators",
                                                     "warmup_steps", "steps", "repeat")}
            json.dump({"machine": machine, "params": params, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.check:
        bad = [r for r in rows if r["rounds_in_window"] <= 0 or r["round_p50_us"] <= 0]
        if bad:
            sys.exit("run.py: %d configuration(s) completed no round in their window" % len(bad))


if __name__ == "__main__":
    main()
