#!/usr/bin/env python3
"""Where a global round's time goes at 2 nodes x 2 workers: wake-ups and CPU per thread.

Starts a root (TCP) and two sidecars (Unix sockets, the shared-memory node path), then four
bench_hsbn_worker processes that run only global forward rounds at C channels, and records the
scheduler with `perf sched record -a` for a few seconds in the middle. From `perf sched timehist`
it reports, per thread role (workers; each sidecar's shared-memory thread, event thread and
upstream writer; the root's event thread), per round: how often the thread was switched in
(wake-ups), how long it waited for a CPU after being woken (scheduling delay, mean per wake-up),
and its CPU time. A global round crosses, in order: the last worker's post -> the sidecar's
shared-memory thread (forwards the node partial) -> the root's event thread (merges, answers)
-> the sidecar's event thread (delivers into the segment) -> the workers. Each arrow is a
wake-up on the critical path; the bare gRPC ping-pong it is compared with has two.

  bench/exchange/global_hops.py --build-dir build [--rounds 20000] [--channels 256]
                                [--json FILE] [--markdown FILE]
Needs perf (linux-perf) with scheduler tracepoints; standard library otherwise.
"""

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROLE_OF_COMM = {
    "bench_hsbn_work": "worker",
    "hsbn-shm": "sidecar shared-memory thread",
    "hsbn-events": "event thread",
    "hsbn-uplink": "sidecar upstream writer",
    "hsbn-tick": "timer thread",
}


def start(cmd, name, d, ready=None):
    log = open(os.path.join(d, name + ".log"), "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    if ready:
        end = time.monotonic() + 30
        while not os.path.exists(ready):
            if p.poll() is not None or time.monotonic() > end:
                sys.exit("global_hops.py: %s did not start: %s" % (
                    name, open(os.path.join(d, name + ".log")).read()))
            time.sleep(0.01)
        with open(ready) as f:
            return p, f.readline().strip()
    return p, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--record-s", type=float, default=2.0)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    agg = os.path.join(args.build_dir, "server", "hsbn-aggregator")
    worker = os.path.join(args.build_dir, "bench", "exchange", "bench_hsbn_worker")
    perf = shutil.which("perf")
    if not perf:
        sys.exit("global_hops.py: perf is missing (apt-get install linux-perf)")
    d = tempfile.mkdtemp(prefix="hsbn-hops-")
    procs = []
    try:
        root, root_addr = start([agg, "--role=root", "--listen=127.0.0.1:0", "--id=root",
                                 "--ready-file=" + os.path.join(d, "root.ready")], "root", d,
                                os.path.join(d, "root.ready"))
        procs.append(root)
        side_pids, addrs = [], []
        for n in range(2):
            p, a = start([agg, "--role=node", "--listen=unix:" + os.path.join(d, "n%d.sock" % n),
                          "--upstream=" + root_addr, "--id=node%d" % n,
                          "--ready-file=" + os.path.join(d, "n%d.ready" % n)], "node%d" % n, d,
                         os.path.join(d, "n%d.ready" % n))
            procs.append(p)
            side_pids.append(p.pid)
            addrs.append(a)
        outs = []
        for r in range(4):
            out = os.path.join(d, "rank%d.txt" % r)
            outs.append(out)
            p, _ = start([worker, "--address=" + addrs[r // 2], "--job=hops", "--rank=%d" % r,
                          "--world=4", "--local-rank=%d" % (r % 2), "--local-world=2",
                          "--node-rank=%d" % (r // 2), "--out=" + out,
                          "--channels=%d" % args.channels, "--rounds=%d" % args.rounds,
                          "--warmup=200", "--phases=fwd", "--scopes=global"], "worker%d" % r, d)
            procs.append(p)
        time.sleep(1.5)  # joins and warm-up; then the steady state is recorded
        sched = os.path.join(d, "sched.data")
        subprocess.run([perf, "sched", "record", "-a", "-o", sched, "--", "sleep",
                        str(args.record_s)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        running = [p.poll() is None for p in procs[3:]]
        for p in procs[3:]:
            p.wait(600)
        if not all(running):
            sys.exit("global_hops.py: the workers finished before the recording ended; "
                     "raise --rounds")
        samples = []
        for out in outs:
            with open(out) as f:
                for line in f:
                    parts = line.split()
                    if parts and parts[0] == "lat":
                        samples.extend(int(v) for v in parts[4:])
        timehist = subprocess.run([perf, "sched", "timehist", "-i", sched], check=True,
                                  capture_output=True, text=True).stdout
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
    pid_role = {root.pid: "root"}
    for n, pid in enumerate(side_pids):
        pid_role[pid] = "sidecar"
    row = re.compile(r"^\s*([\d.]+)\s+\[(\d+)\]\s+(.+?)\[(\d+)(?:/(\d+))?\]\s+([\d.]+)\s+"
                     r"([\d.]+)\s+([\d.]+)\s*$")
    stats = collections.defaultdict(lambda: {"switches": 0, "delay_ms": 0.0, "run_ms": 0.0})
    t_first = t_last = None
    for line in timehist.splitlines():
        m = row.match(line)
        if not m:
            continue
        t = float(m.group(1))
        t_first = t if t_first is None else t_first
        t_last = t
        comm, pid = m.group(3).strip(), int(m.group(5) or m.group(4))
        base = next((v for k, v in ROLE_OF_COMM.items() if comm.startswith(k)), None)
        if base is None:
            if pid in pid_role:
                base = "other thread"
            else:
                continue
        role = base if base == "worker" else "%s %s" % (pid_role.get(pid, "?"),
                                                          base.replace("sidecar ", ""))
        s = stats[role]
        s["switches"] += 1
        s["delay_ms"] += float(m.group(7))
        s["run_ms"] += float(m.group(8))
    samples.sort()
    mean_ns = statistics.mean(samples)
    window_s = (t_last - t_first) if t_first is not None else args.record_s
    rounds = window_s * 1e9 / mean_ns
    rows = []
    for role in sorted(stats):
        s = stats[role]
        rows.append({"role": role, "wakeups_per_round": s["switches"] / rounds,
                     "sched_delay_us_per_wakeup": s["delay_ms"] * 1e3 / max(1, s["switches"]),
                     "cpu_us_per_round": s["run_ms"] * 1e3 / rounds})
    result = {"channels": args.channels, "p50_us": samples[len(samples) // 2] / 1e3,
              "mean_us": mean_ns / 1e3, "rounds_in_window": rounds, "window_s": window_s,
              "rows": rows}
    lines = ["Global round, 2 nodes x 2 workers, C=%d: p50 %.1f us, mean %.1f us (%.0f rounds "
             "in the %.2f s recorded)" % (args.channels, result["p50_us"], result["mean_us"],
                                          rounds, window_s),
             "",
             "| thread | wake-ups per round | scheduling delay per wake-up, us | "
             "CPU per round, us |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append("| %s | %.2f | %.1f | %.1f |" % (r["role"], r["wakeups_per_round"],
                                                     r["sched_delay_us_per_wakeup"],
                                                     r["cpu_us_per_round"]))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
