#!/usr/bin/env python3
"""Soak: many rounds against real aggregators (a root and one sidecar per node), every result
checked, the aggregators' RSS and open fds sampled from /proc through the run.

Jobs: --jobs steady jobs run for the whole soak; --churn-jobs more leave and join again as a
new job every --churn steps. Every job runs --layers layers per step with scopes node, global,
shadow in turn, a forward and a backward round each (hsbn-soak-worker checks every result
against the direct computation and stops at the first wrong or failed one).

It fails (exit 1) on any wrong result or failed round, on an aggregator whose open fds do not
return to their baseline (measured after a warm-up job came and went) once the jobs are gone,
or whose RSS at the end exceeds its RSS after the first 10% of rounds by more than
max(5%, 4 MiB). It prints and writes (--out, JSON) each aggregator's RSS slope over the run.

  bench/soak/soak.py --rounds 1000000 --out bench/soak/results/soak-1e6.json
  bench/soak/soak.py --rounds 10000                       # the test suite's short mode
"""

import argparse
import json
import math
import os
import sys
import time

import soaklib


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1000000,
                   help="rounds to run in all (each counted once per job, not per member)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--workers-per-node", type=int, default=2)
    p.add_argument("--jobs", type=int, default=2, help="steady jobs")
    p.add_argument("--churn-jobs", type=int, default=2, help="jobs that leave and rejoin")
    p.add_argument("--churn", type=int, default=50, help="steps per churn-job generation")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--sample-seconds", type=float, default=1.0)
    p.add_argument("--out", help="write the result here (JSON)")
    soaklib.add_binary_args(p)
    args = p.parse_args(argv)
    worker_bin, agg_bin, proxy_bin = soaklib.binaries(args)
    soaklib.exit_on_sigterm()

    jobs = args.jobs + args.churn_jobs
    rounds_per_step = 2 * args.layers
    steps = max(1, math.ceil(args.rounds / (jobs * rounds_per_step)))
    if args.churn_jobs:
        steps = math.ceil(steps / args.churn) * args.churn  # whole generations
    total = steps * jobs * rounds_per_step
    config = {k: getattr(args, k) for k in ("nodes", "workers_per_node", "jobs", "churn_jobs",
                                            "churn", "layers", "channels")}
    config.update(steps_per_job=steps, rounds=total, rounds_per_step=rounds_per_step)
    print("soak: %d jobs x %d steps x %d rounds = %d rounds; %d nodes x %d workers"
          % (jobs, steps, rounds_per_step, total, args.nodes, args.workers_per_node), flush=True)

    result = {"config": config, "ok": False, "problems": []}
    problems = result["problems"]
    with soaklib.LocalCluster(nodes=args.nodes, workers_per_node=args.workers_per_node,
                              aggregator=agg_bin, linkproxy=proxy_bin) as cluster:
        # Warm-up: one job of every scope comes and goes; its links (the sidecars' upstream)
        # stay, so the baseline is the idle state the soak must return to.
        warm = soaklib.WorkerSet()
        for n in range(args.nodes):
            warm.add(soaklib.Worker(worker_bin, cluster, "warmup", n, steps=20,
                                    layers=args.layers, channels=args.channels))
        while warm.running():
            warm.poll(1.0, lambda w, line: None)
        if any(w.returncode != 0 for w in warm.workers):
            sys.exit("soak: the warm-up job failed:\n" + "\n".join(
                "\n".join(w.lines[-5:]) for w in warm.workers))
        base, settled = soaklib.wait_fds_settled(cluster)
        print("soak: baseline %s" % json.dumps(base), flush=True)

        ws = soaklib.WorkerSet()
        names = (["steady%d" % j for j in range(args.jobs)]
                 + ["churn%d" % j for j in range(args.churn_jobs)])
        for j, name in enumerate(names):
            for n in range(args.nodes):
                ws.add(soaklib.Worker(worker_bin, cluster, name, n, steps=steps,
                                      layers=args.layers, channels=args.channels,
                                      churn=args.churn if name.startswith("churn") else 0,
                                      progress_every=max(1, steps // 200)))
        progress = {name: 0 for name in names}  # steps done by each job's rank 0
        wrong, failed = [], []

        def on_line(w, line):
            if line is None:
                if w.returncode != 0:
                    failed.append("%s node %d exited with %d" % (w.job, w.node, w.returncode))
                return
            parts = line.split(" ", 7)
            if parts[0] == "P" and parts[2] == "0":
                progress[w.job] = int(parts[3])
            elif parts[0] == "WRONG":
                wrong.append(line)
            elif parts[0] == "FAIL":
                failed.append(line)

        samples = []
        t0 = time.monotonic()
        rss10 = None
        next_sample = 0.0
        while ws.running():
            ws.poll(0.2, on_line)
            if wrong or failed:
                break
            done = sum(progress.values()) * rounds_per_step
            now = time.monotonic() - t0
            if rss10 is None and done >= total / 10:
                rss10 = soaklib.sample_all(cluster)
                samples.append({"t": now, "rounds": done, "aggs": rss10})
                print("soak: %d rounds (10%%) in %.0f s; RSS %s" % (done, now, {
                    k: v["rss_kib"] for k, v in rss10.items()}), flush=True)
            if now >= next_sample:
                samples.append({"t": now, "rounds": done, "aggs": soaklib.sample_all(cluster)})
                next_sample = now + args.sample_seconds
                if len(samples) % 60 == 0:
                    print("soak: %d / %d rounds, %.0f s, %.0f rounds/s" % (
                        done, total, now, done / max(now, 1e-9)), flush=True)
        ws.kill_all()
        while ws.running():
            ws.poll(1.0, on_line)
        seconds = time.monotonic() - t0
        end, settled = soaklib.wait_fds_settled(
            cluster, at_most={k: v["fds"] for k, v in base.items()})
        samples.append({"t": time.monotonic() - t0, "rounds": total if not (wrong or failed)
                        else sum(progress.values()) * rounds_per_step, "aggs": end})

        result.update(rounds=total if not (wrong or failed) else None, seconds=seconds,
                      rounds_per_second=total / seconds, wrong=wrong, failed=failed[:20])
        if wrong:
            problems.append("%d wrong results, first: %s" % (len(wrong), wrong[0]))
        if failed:
            problems.append("%d failures, first: %s" % (len(failed), failed[0]))
        if rss10 is None:
            rss10 = samples[0]["aggs"] if samples else base
        aggs = {}
        for name in sorted(base):
            rs = [s for s in samples if name in s["aggs"] and s["rounds"] >= total / 10]
            slope = soaklib.linear_slope([s["rounds"] for s in rs],
                                         [s["aggs"][name]["rss_kib"] for s in rs])
            a = {"fds_baseline": base[name]["fds"], "fds_end": end[name]["fds"],
                 "fds_max": max(s["aggs"][name]["fds"] for s in samples if name in s["aggs"]),
                 "rss_kib_baseline": base[name]["rss_kib"],
                 "rss_kib_at_10pct": rss10[name]["rss_kib"],
                 "rss_kib_end": end[name]["rss_kib"],
                 "rss_kib_max": max(s["aggs"][name]["rss_kib"] for s in samples
                                    if name in s["aggs"]),
                 "rss_slope_kib_per_1e6_rounds": slope * 1e6}
            allowed = max(0.05 * a["rss_kib_at_10pct"], 4096)
            a["rss_growth_kib"] = a["rss_kib_end"] - a["rss_kib_at_10pct"]
            a["rss_growth_allowed_kib"] = allowed
            if a["fds_end"] > a["fds_baseline"]:
                problems.append("%s: %d open fds at the end, baseline %d" % (
                    name, a["fds_end"], a["fds_baseline"]))
            if a["rss_growth_kib"] > allowed:
                problems.append("%s: RSS grew %d KiB from 10%% of the rounds to the end "
                                "(allowed %d)" % (name, a["rss_growth_kib"], allowed))
            aggs[name] = a
        result["aggregators"] = aggs
        step = max(1, len(samples) // 300)
        result["samples"] = [s for i, s in enumerate(samples)
                             if i % step == 0 or i == len(samples) - 1]
        if problems:
            for name, log in cluster.logs().items():
                print("--- %s log (tail) ---\n%s" % (name, log[-2000:]), file=sys.stderr)

    result["ok"] = not problems
    print("soak: %s rounds in %.1f s (%.0f rounds/s), %d wrong, %d failed" % (
        total, result["seconds"], result["rounds_per_second"], len(wrong), len(failed)))
    print("%-6s %8s %8s %12s %12s %12s %14s" % ("agg", "fds base", "fds end", "RSS@10% KiB",
                                                "RSS end KiB", "growth KiB", "KiB/1e6 rounds"))
    for name, a in result["aggregators"].items():
        print("%-6s %8d %8d %12d %12d %12d %14.1f" % (
            name, a["fds_baseline"], a["fds_end"], a["rss_kib_at_10pct"], a["rss_kib_end"],
            a["rss_growth_kib"], a["rss_slope_kib_per_1e6_rounds"]))
    for prob in problems:
        print("soak: FAIL: " + prob)
    print("soak: %s" % ("PASS" if result["ok"] else "FAIL"))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
