#!/usr/bin/env python3
"""Fault injection under load: while jobs run rounds (node, global and shadow, forward and
backward, every result checked by hsbn-soak-worker), kill (-9), stop (SIGSTOP/SIGCONT),
terminate (SIGTERM) and restart workers, sidecars and the root, and cut, stall or delay a
sidecar's link to the root through its hsbn-linkproxy. Asserts, per fault:

  - no wrong result is ever returned (a worker checks every result against the direct
    computation; a result from a round of an earlier incarnation of the job is wrong too);
  - every failed round names its cause: a status code of the failure kinds (UNAVAILABLE,
    DEADLINE_EXCEEDED, ...; never UNKNOWN, INTERNAL or OK) and a message that names a rank, a
    node, the root/sidecar/link, or the deadline; no worker dies without saying why (unless
    this script killed it). Failures of a restarted job's round that its previous incarnation
    had completed (INVALID_ARGUMENT, "already completed with a different contribution") are
    counted apart as stale-round conflicts;
  - the job recovers within --recovery-bound seconds after the fault ends: every rank of every
    job completes steps again;
  - no aggregator leaks: once the jobs run again, every aggregator's open fds are back to what
    they were before the fault; at the end, with no job left, back to the baseline, and RSS
    within max(5%, 4 MiB) of what it was after the first round of faults.

A worker whose round fails exits, as a trainer does; the script then restarts the whole job as
torchrun does (all its workers, a new incarnation: seq counts from 0 again, the same job id).
The other workers of the job get the client's round wait (round timeout + 5 s) to fail on their
own, so that their failures, and the causes they name, are seen; then they are killed.

Prints a table of faults x outcomes, and writes it (--out, JSON plus a .md table beside it).

  bench/soak/faults.py --repeats 5 --out bench/soak/results/faults.json
  bench/soak/faults.py --repeats 1 --hold 1          # the test suite's short mode
  bench/soak/faults.py --group-tier --nodes 4 --workers-per-node 1   # through a group tier
"""

import argparse
import json
import os
import random
import re
import signal
import sys
import time

import soaklib

# A failure's message names its cause: a rank, a node, the root or sidecar or link, or the
# deadline (checked together with its status code).
CAUSE = re.compile(r"rank \d+|node \d+|group \d+|root|sidecar|aggregator|upstream|link|deadline|"
                   r"connect|stream|shutting down|restart", re.I)
GOOD_CODES = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "NOT_FOUND", "ALREADY_EXISTS",
              "FAILED_PRECONDITION", "CANCELLED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}
# A restarted job (same job id, seq from 0, as under torchrun) meeting its previous
# incarnation's rounds, still held by an aggregator: named, and counted apart (docs/results/RELIABILITY.md).
STALE = "already completed with a different contribution"

# -kill: SIGKILL, then a restart; -stop: SIGSTOP, then SIGCONT; -term: a polite stop (SIGTERM,
# as a pod roll or `systemctl restart` sends), then a restart.
FAULTS = ["worker-kill", "worker-stop", "sidecar-kill", "sidecar-stop", "sidecar-term",
          "root-kill", "root-stop", "root-term", "link-drop", "link-stall", "link-delay"]
# With --group-tier: a group aggregator killed (and restarted), stopped or terminated.
TIER_FAULTS = ["group-kill", "group-stop", "group-term"]


class Job:
    def __init__(self, name):
        self.name = name
        self.incarnation = 0
        self.workers = []
        self.restart_at = None  # when all workers of the incarnation are gone
        self.kill_at = None     # when the incarnation's survivors are killed
        self.progress = {}      # rank -> monotonic time of its last progress line
        self.restarts = 0


class FaultRun:
    def __init__(self, args, cluster, worker_bin):
        self.args, self.cluster, self.worker_bin = args, cluster, worker_bin
        self.ws = soaklib.WorkerSet()
        self.jobs = {"job%d" % j: Job("job%d" % j) for j in range(args.jobs)}
        self.events = []  # (time, kind, job, detail)
        for job in self.jobs.values():
            self.start_job(job)

    def start_job(self, job):
        job.workers = []
        job.restart_at = None
        job.kill_at = None
        job.progress = {}
        for node in range(self.cluster.nodes):
            for lr in range(self.cluster.workers_per_node):
                w = soaklib.Worker(self.worker_bin, self.cluster, job.name, node, steps=0,
                                   layers=4 if self.cluster.groups else 3, channels=8,
                                   local_ranks=[lr],
                                   scopes=("node,global,shadow,group" if self.cluster.groups
                                           else "node,global,shadow"),
                                   incarnation=job.incarnation, progress_every=2,
                                   round_timeout_ms=0, connect_timeout_ms=5000)
                w.rank = node * self.cluster.workers_per_node + lr
                w.incarnation = job.incarnation
                w.saw_fail = False
                job.workers.append(self.ws.add(w))

    def on_line(self, w, line):
        now = time.monotonic()
        job = self.jobs[w.job]
        if line is None:
            self.on_exit(w, job, now)
            return
        parts = line.split(" ", 8)
        if parts[0] == "P" and w.incarnation == job.incarnation:
            job.progress[w.rank] = now
        elif parts[0] == "FAIL":
            w.saw_fail = True
            code, message = (parts[7], parts[8]) if len(parts) > 8 else ("?", line)
            # The cluster's temporary folder is no part of the cause (nor of a result file).
            message = message.replace(self.cluster.workdir, "<cluster dir>")
            named = code in GOOD_CODES and bool(CAUSE.search(message))
            self.events.append((now, "fail", w.job, {"rank": w.rank, "code": code,
                                                     "message": message[:300],
                                                     "named": named}))
        elif parts[0] == "WRONG":
            self.events.append((now, "wrong", w.job, {"rank": w.rank, "line": line[:400]}))
        elif parts[0] not in ("P", "DONE"):
            self.events.append((now, "output", w.job, {"rank": w.rank, "line": line[:300]}))

    def on_exit(self, w, job, now):
        if w.expected_death is None and not (w.returncode == 3 and w.saw_fail):
            self.events.append((now, "unexplained-exit", w.job, {
                "rank": w.rank, "returncode": w.returncode, "tail": w.lines[-3:]}))
        if w.incarnation != job.incarnation:
            return
        # torchrun: one worker gone ends the incarnation; the others are stopped (after they
        # had the time to fail on their own), then all restart.
        if job.kill_at is None:
            job.kill_at = now + self.args.round_timeout_ms / 1000 + 6
        if all(o.returncode is not None for o in job.workers):
            job.restart_at = now + 0.2

    def kill_survivors(self, job):
        for other in job.workers:
            if other.returncode is None and other.expected_death is None:
                other.expected_death = "supervisor"
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        other.proc.send_signal(sig)
                    except ProcessLookupError:
                        pass

    def pump(self, seconds=None, until=None, limit=None):
        """Runs the event loop for `seconds`, or until until() is true (False at `limit`)."""
        end = time.monotonic() + (seconds if seconds is not None else limit)
        while True:
            now = time.monotonic()
            for job in self.jobs.values():
                if job.kill_at is not None and now >= job.kill_at and job.restart_at is None:
                    self.kill_survivors(job)
                    job.kill_at = float("inf")
                if job.restart_at is not None and now >= job.restart_at:
                    job.incarnation += 1
                    job.restarts += 1
                    self.start_job(job)
            if until is not None and until():
                return True
            if now >= end:
                return seconds is not None
            self.ws.poll(min(0.1, max(0.0, end - now)), self.on_line)

    def all_progress_since(self, t):
        return all(len(j.progress) == len(j.workers) and j.restart_at is None
                   and min(j.progress.values()) > t for j in self.jobs.values())

    def stop(self):
        for w in self.ws.running():
            w.expected_death = "end"
            try:
                w.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.ws.kill_all()
        while self.ws.running():
            self.ws.poll(1.0, self.on_line)


def inject(run, cluster, fault, rng, hold):
    """Injects one fault, holds it `hold` seconds (serving the event loop), ends it; returns
    (what, end time, extra outcome fields)."""
    extra = {}
    if fault.startswith("worker"):
        job = run.jobs[rng.choice(sorted(run.jobs))]
        w = rng.choice([w for w in job.workers if w.returncode is None])
        what = "%s rank %d (pid %d)" % (job.name, w.rank, w.proc.pid)
        if fault == "worker-kill":
            w.expected_death = "fault"
            w.proc.send_signal(signal.SIGKILL)
        else:
            w.proc.send_signal(signal.SIGSTOP)
            run.pump(seconds=hold)
            # The job may have been restarted meanwhile (its members failed at the round
            # deadline) and this worker killed; SIGCONT reaches it only if it is alive.
            try:
                w.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        return what, time.monotonic(), extra
    if fault.startswith(("sidecar", "root", "group")):
        node = rng.randrange(cluster.nodes)
        group = rng.randrange(len(cluster.groups)) if cluster.groups else 0
        name = ("root" if fault.startswith("root") else
                "group%d" % group if fault.startswith("group") else "node%d" % node)
        agg = (cluster.root if name == "root" else
               cluster.groups[group] if fault.startswith("group") else cluster.sidecars[node])
        what = "%s (pid %d)" % (name, agg.proc.pid)
        if fault.endswith(("kill", "term")):
            agg.proc.send_signal(signal.SIGKILL if fault.endswith("kill") else signal.SIGTERM)
            agg.proc.wait()
            run.pump(seconds=hold)
            if name == "root":
                cluster.restart_root()
            elif fault.startswith("group"):
                cluster.restart_group(group)
            else:
                cluster.restart_sidecar(node)
        else:
            agg.proc.send_signal(signal.SIGSTOP)
            run.pump(seconds=hold)
            agg.proc.send_signal(signal.SIGCONT)
        return what, time.monotonic(), extra
    node = rng.randrange(cluster.nodes)
    what = "link of node%d" % node
    if fault == "link-drop":
        cluster.link_command(node, "drop")
        run.pump(seconds=hold)
        cluster.link_command(node, "resume")
    elif fault == "link-stall":
        cluster.link_command(node, "stall")
        run.pump(seconds=hold)
        cluster.link_command(node, "resume")
    elif fault == "link-delay":
        delay = run.args.link_delay_ms
        cluster.link_command(node, "stats-reset")
        cluster.link_command(node, "delay %d" % delay)
        run.pump(seconds=hold)
        st = cluster.link_stats(node)
        cluster.link_command(node, "delay 0")
        # Chunks read before the delay was set may leave within it; every later one is held.
        extra = {"delay_ms": delay, "chunks": st["up_chunks"] + st["down_chunks"],
                 "held_max_ms": max(st["up_held_max_us"], st["down_held_max_us"]) / 1000}
        what += " +%d ms" % delay
    return what, time.monotonic(), extra


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="times each fault is injected")
    p.add_argument("--faults", default=None, help="comma list, of: " +
                   ", ".join(FAULTS + TIER_FAULTS) + " (default: all that apply)")
    p.add_argument("--group-tier", action="store_true",
                   help="a group aggregator per --group-nodes nodes between the sidecars and the "
                   "root (the link faults then cut a sidecar's link to its group aggregator); "
                   "the workers run group rounds too")
    p.add_argument("--group-nodes", type=int, default=2, help="nodes per group (--group-tier)")
    p.add_argument("--hold", type=float, default=5.0,
                   help="seconds each fault lasts (longer than the round timeout, so stops and "
                   "stalls fail rounds)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--workers-per-node", type=int, default=2)
    p.add_argument("--round-timeout-ms", type=int, default=3000,
                   help="the aggregators' --round-timeout-ms")
    p.add_argument("--link-delay-ms", type=int, default=100, help="the link-delay fault's delay")
    p.add_argument("--recovery-bound", type=float, default=30.0,
                   help="seconds after a fault ends within which every job must run again")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="write the results here (JSON; the table beside it as .md)")
    soaklib.add_binary_args(p)
    args = p.parse_args(argv)
    worker_bin, agg_bin, proxy_bin = soaklib.binaries(args)
    known = FAULTS + (TIER_FAULTS if args.group_tier else [])
    faults = [f for f in (args.faults or ",".join(known)).split(",") if f]
    for f in faults:
        if f not in known:
            p.error("unknown fault %r%s" % (f, "" if f not in TIER_FAULTS else
                                            " (it needs --group-tier)"))
    if args.group_tier and (args.nodes % args.group_nodes or args.nodes // args.group_nodes < 2):
        p.error("--group-tier needs at least two groups: --nodes a multiple of --group-nodes")
    rng = random.Random(args.seed)
    injections = []
    soaklib.exit_on_sigterm()
    with soaklib.LocalCluster(nodes=args.nodes, workers_per_node=args.workers_per_node,
                              aggregator=agg_bin, linkproxy=proxy_bin, link_proxy=True,
                              round_timeout_ms=args.round_timeout_ms,
                              group_tier=args.group_tier,
                              group_nodes=args.group_nodes if args.group_tier else None
                              ) as cluster:
        run = FaultRun(args, cluster, worker_bin)
        try:
            end, fds_home, base_fds, rss_first = run_faults(args, cluster, run, faults, rng,
                                                            injections)
        finally:
            run.stop()
        total_restarts = sum(j.restarts for j in run.jobs.values())
        wrong_total = sum(e[1] == "wrong" for e in run.events)
    return report(args, faults, injections, end, base_fds, rss_first, total_restarts,
                  wrong_total)


def run_faults(args, cluster, run, faults, rng, injections):
    """Injects every fault --repeats times, appending a row per injection to `injections`."""
    t0 = time.monotonic()
    if not run.pump(until=lambda: run.all_progress_since(t0), limit=120):
        sys.exit("faults: the jobs did not start:\n%s" % "\n".join(
            str(e) for e in run.events[-10:]))
    base_fds = {k: v["fds"] for k, v in soaklib.sample_all(cluster).items()}
    rss_first = None
    for rep in range(args.repeats):
        for fault in faults:
            # A steady state first: every rank of every job progressing.
            t_ready = time.monotonic()
            steady = run.pump(until=lambda: run.all_progress_since(t_ready), limit=120)
            pre = soaklib.sample_all(cluster)
            n_events = len(run.events)
            what, t_end, extra = inject(run, cluster, fault, rng, args.hold)
            recovered = run.pump(until=lambda: run.all_progress_since(t_end),
                                 limit=max(2 * args.recovery_bound, 60))
            recovery = None
            if recovered:
                recovery = max(min(j.progress.values()) for j in run.jobs.values()) - t_end
            # Leaks: the same workers are connected again, so the same fds.
            post, fds_back = soaklib.wait_fds_settled(
                cluster, quiet_s=1.0, limit_s=20,
                at_most={k: v["fds"] for k, v in pre.items()})
            # The event loop did not run while fds settled: catch up (and make sure the jobs
            # are still running).
            run.pump(seconds=0.5)
            evs = run.events[n_events:]
            fails = [e for e in evs if e[1] == "fail"]
            row = {
                "fault": fault, "repeat": rep, "target": what, "steady_before": steady,
                "hold_s": args.hold, "wrong": sum(e[1] == "wrong" for e in evs),
                "failed_rounds": len(fails),
                "codes": sorted({e[3]["code"] for e in fails}),
                "unnamed": [e[3] for e in fails if not e[3]["named"]][:5],
                "unexplained_exits": [e[3] for e in evs if e[1] == "unexplained-exit"][:5],
                "recovered": recovered, "recovery_s": recovery,
                "fds_delta": {k: post[k]["fds"] - pre[k]["fds"] for k in post if k in pre},
                "rss_kib": {k: post[k]["rss_kib"] for k in post},
                "example": fails[0][3]["message"][:200] if fails else "",
                "examples": {},
                "stale_conflicts": sum(STALE in e[3]["message"] for e in fails),
                "wrong_lines": [e[3]["line"] for e in evs if e[1] == "wrong"][:3],
            }
            for e in fails:
                row["examples"].setdefault(e[3]["code"], e[3]["message"][:300])
            row.update(extra)
            problems = []
            if row["wrong"]:
                problems.append("wrong results")
            if row["unnamed"] or row["unexplained_exits"]:
                problems.append("unnamed failure")
            if not recovered or recovery > args.recovery_bound:
                problems.append("no recovery within %.0f s" % args.recovery_bound)
            if not fds_back:
                problems.append("fds not back: %s" % row["fds_delta"])
            if fault == "link-delay" and row.get("chunks", 0) == 0:
                problems.append("no traffic crossed the delayed link")
            row["problems"] = problems
            injections.append(row)
            print("faults: %-13s %-32s failed %3d codes %-40s recovery %s %s" % (
                fault, what, len(fails), ",".join(row["codes"]) or "-",
                "%.1f s" % recovery if recovery is not None else "NONE",
                "; ".join(problems) or "ok"), flush=True)
        if rss_first is None:
            rss_first = {k: v["rss_kib"] for k, v in soaklib.sample_all(cluster).items()}
    run.stop()
    end, fds_home = soaklib.wait_fds_settled(cluster, at_most=base_fds)
    return end, fds_home, base_fds, rss_first


def report(args, faults, injections, end, base_fds, rss_first, total_restarts, wrong_total):
    """Prints the table of faults x outcomes, writes --out; returns the exit code."""
    rows = []
    # One row per fault kind.
    for fault in faults:
        rs = [r for r in injections if r["fault"] == fault]
        recs = [r["recovery_s"] for r in rs if r["recovery_s"] is not None]
        rows.append({
            "fault": fault, "injected": len(rs), "wrong": sum(r["wrong"] for r in rs),
            "failed_rounds": sum(r["failed_rounds"] for r in rs),
            "stale_conflicts": sum(r["stale_conflicts"] for r in rs),
            "codes": sorted({c for r in rs for c in r["codes"]}),
            "all_named": all(not r["unnamed"] and not r["unexplained_exits"] for r in rs),
            "recovered": sum(bool(r["recovered"]) for r in rs),
            "recovery_max_s": max(recs) if recs else None,
            "fds_back": all("fds not back" not in " ".join(r["problems"]) for r in rs),
            "ok": all(not r["problems"] for r in rs),
        })
    end_problems = []
    for name, n in base_fds.items():
        if name in end and end[name]["fds"] > n:
            end_problems.append("%s: %d fds at the end, baseline %d" % (name, end[name]["fds"], n))
    rss_end = {k: v["rss_kib"] for k, v in end.items()}
    for name, first in (rss_first or {}).items():
        if name in rss_end and rss_end[name] - first > max(0.05 * first, 4096):
            end_problems.append("%s: RSS %d KiB at the end, %d after the first round of faults"
                                % (name, rss_end[name], first))
    ok = all(r["ok"] for r in rows) and not end_problems and wrong_total == 0
    table = ["| fault | injected | wrong results | failed rounds (of them stale-round "
             "conflicts) | status codes | every failure named | recovered | max recovery (s) | "
             "fds back | outcome |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append("| %s | %d | %d | %d (%d) | %s | %s | %d/%d | %s | %s | %s |" % (
            r["fault"], r["injected"], r["wrong"], r["failed_rounds"], r["stale_conflicts"],
            ", ".join(r["codes"]) or "-", "yes" if r["all_named"] else "NO",
            r["recovered"], r["injected"],
            "%.1f" % r["recovery_max_s"] if r["recovery_max_s"] is not None else "-",
            "yes" if r["fds_back"] else "NO", "pass" if r["ok"] else "FAIL"))
    print("\n".join(table))
    print("faults: %d injections, %d job restarts, %d wrong results; end: fds %s (baseline %s), "
          "RSS KiB %s (after the first round of faults %s)" % (
              len(injections), total_restarts, wrong_total,
              {k: v["fds"] for k, v in end.items()}, base_fds, rss_end, rss_first))
    for prob in end_problems:
        print("faults: FAIL: " + prob)
    print("faults: %s" % ("PASS" if ok else "FAIL"))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"config": vars(args) | {"faults": faults}, "ok": ok, "rows": rows,
                       "injections": injections, "end_problems": end_problems,
                       "fds_baseline": base_fds, "fds_end": {k: v["fds"] for k, v in end.items()},
                       "rss_kib_after_first_round": rss_first, "rss_kib_end": rss_end,
                       "job_restarts": total_restarts}, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write("\n".join(table) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
