"""The comparison's outputs: a Markdown report (table, per-layer divergence, the global vs
reference check), a PNG plot, and the raw results as JSON and CSV."""

import csv
import json
import math
import os

import numpy as np

from . import data

MODE_ORDER = ["local", "node", "shadow", "group", "auto", "renorm", "lagged", "global",
              "reference"]
TASK_NAME = {"cls": "classification", "seg": "segmentation"}
METRIC_NAME = {"cls": "test accuracy", "seg": "test mIoU"}


def _mean_std(values):
    v = np.asarray(values, np.float64)
    if len(v) == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def norm_batch(mode, cfg):
    """The normalization batch of a mode; auto's is per layer: its smallest choice."""
    b = cfg["batch"]
    group = b * cfg["workers_per_node"] * max(1, cfg.get("group_nodes") or 1)
    return {"local": b, "node": b * cfg["workers_per_node"], "shadow": b * cfg["workers_per_node"],
            "group": group, "auto": group if cfg.get("group_nodes", 0) > 1
            else b * cfg["workers_per_node"],
            "renorm": b * cfg["workers_per_node"], "lagged": b * cfg["world"],
            "global": b * cfg["world"], "reference": b * cfg["world"],
            "reference-reversed": b * cfg["world"]}[mode]


def _norm_batch_text(mode, cfg):
    if mode == "auto":
        return "%d–%d" % (norm_batch("auto", cfg), norm_batch("global", cfg))
    if mode == "renorm":
        return "%d, toward %d" % (norm_batch("renorm", cfg), norm_batch("global", cfg))
    if mode == "lagged":
        return "%d, others 1 call old" % norm_batch("lagged", cfg)
    return "%d" % norm_batch(mode, cfg)


def _opt(values):
    v = [x for x in values if x is not None]
    return _mean_std(v) if v else (float("nan"), float("nan"))


def summarize(runs, cfg):
    """{task: {mode: {...}}}: metric mean/std over seeds, mean step and sync time."""
    out = {}
    for task in cfg["tasks"]:
        out[task] = {}
        for mode in MODE_ORDER:
            rs = [r for r in runs if r["task"] == task and r["mode"] == mode]
            if not rs:
                continue
            m, s = _mean_std([r["metric"] for r in rs])
            ma, sa = _mean_std([r["metric_avg_stats"] for r in rs])
            ms, ss = _opt([r.get("metric_sync_stats") for r in rs])
            mp, sp = _opt([r.get("metric_precise_bn") for r in rs])
            out[task][mode] = {
                "seeds": len(rs), "metric_mean": m, "metric_std": s,
                "metric_avg_stats_mean": ma, "metric_avg_stats_std": sa,
                "metric_sync_stats_mean": ms, "metric_sync_stats_std": ss,
                "metric_precise_bn_mean": mp, "metric_precise_bn_std": sp,
                "step_ms": float(np.mean([r["step_ms"] for r in rs])),
                "sync_ms": float(np.mean([r["sync_ms"] for r in rs])),
                "final_loss": float(np.mean([np.mean(r["loss"][-max(1, len(r["loss"]) // 10):])
                                             for r in rs])),
                "norm_batch": norm_batch(mode, cfg),
                "cpu_ms_per_step": cpu_summary(rs),
            }
            if mode == "renorm":
                out[task][mode].update(renorm_summary(rs))
            if mode == "lagged":
                out[task][mode].update(lagged_summary(rs))
    return out


def cpu_summary(runs):
    """{kind: CPU ms per step, mean over runs} (train._proc_cpu's kinds and "workers"), or
    None unless every run has it (the one-process references, an older hsbn)."""
    cpus = [r.get("cpu_ms_per_step") for r in runs]
    if not cpus or not all(cpus):
        return None
    return {k: float(np.mean([c.get(k, 0.0) for c in cpus])) for k in sorted(set().union(*cpus))}


def cpu_line(summary, task):
    """One sentence: each mode's CPU ms per step, the trainers' and the aggregators' (the
    simulated links' proxies apart); "" when no mode has it."""
    parts = []
    for mode in MODE_ORDER:
        c = (summary[task].get(mode) or {}).get("cpu_ms_per_step")
        if c:
            parts.append("%s %.1f (links %.1f)" % (
                mode, sum(v for k, v in c.items() if k != "links"), c.get("links", 0.0)))
    if not parts:
        return ""
    return ("CPU ms per step, the trainers' in their steps summed over the workers plus the "
            "aggregators' (the simulated links' proxies apart): " + ", ".join(parts) + ".")


def lagged_summary(runs):
    """Over lagged runs: the mean share of training calls that ran exact global (warm-up and
    the trip guard's), trips per run, and the ms per step spent fetching late results."""
    rr = [r["lagged"] for r in runs if r.get("lagged")]
    if not rr:
        return {"exact_share": None, "trips": None, "lagged_wait_ms": None}
    return {"exact_share": float(np.mean([x["exact_share"] for x in rr])),
            "trips": float(np.mean([x["trips"] for x in rr])),
            "lagged_wait_ms": float(np.mean([x["wait_ms_per_step"] for x in rr]))}


def lagged_line(cfg, s):
    """One sentence on the lagged mode's options, exact calls and trips."""
    if s.get("exact_share") is None:
        return "lagged: no call counts (an hsbn without them)."
    opts = ", ".join("%s %g" % kv for kv in (cfg.get("lagged") or {}).items())
    return ("lagged (%s): %.1f%% of its training calls "
            "ran exact global (the warm-up's and the trip guard's), %.1f trips per run; "
            "%.2f ms per step fetching late results, inside its sync time."
            % (opts or "hsbn.torch's defaults", 100 * s["exact_share"], s["trips"],
               s["lagged_wait_ms"]))


def renorm_summary(runs):
    """Over renorm runs: the mean share of forward calls that waited for global statistics,
    and of those that used them (the others: warm-up)."""
    rr = [r["renorm"] for r in runs if r.get("renorm")]
    if not rr:
        return {"wait_share": None, "global_use_share": None}
    return {"wait_share": float(np.mean([x["wait_share"] for x in rr])),
            "global_use_share": float(np.mean([x["global_uses"] / max(x["calls"], 1)
                                               for x in rr]))}


def renorm_line(cfg, share, uses):
    """One sentence on the renorm mode's options and waits."""
    opts = ", ".join("%s %g" % kv for kv in (cfg.get("renorm") or {}).items())
    return ("renorm (%s): %s of its forward calls had to wait for the global statistics "
            "(%s used them; the others were warm-up); its sync time includes those waits."
            % (opts or "hsbn.torch's defaults",
               "—" if share is None else "%.1f%%" % (100 * share),
               "—" if uses is None else "%.0f%%" % (100 * uses)))


def divergence_table(runs, cfg):
    """{task: [rows]}: the shadow runs' per-layer, per-node divergence, averaged over seeds."""
    out = {}
    for task in cfg["tasks"]:
        acc = {}
        for r in runs:
            if r["task"] != task or r["mode"] != "shadow" or not r.get("divergence"):
                continue
            for d in r["divergence"]:
                key = (int(d["index"]), d["layer"], int(d.get("node", 0)))
                acc.setdefault(key, []).append(d)
        rows = []
        for (idx, layer, node), ds in sorted(acc.items()):
            def avg(field):
                return float(np.mean([float(d.get(field, 0.0)) for d in ds]))
            rows.append({"layer": layer, "node": node, "rounds": int(np.mean(
                [int(d.get("rounds", 0)) for d in ds])), "mean_shift_avg": avg("meanShiftAvg"),
                "mean_shift_max": avg("meanShiftMax"), "var_ratio_avg": avg("varRatioAvg"),
                "log_var_ratio_abs_avg": avg("logVarRatioAbsAvg"), "seeds": len(ds)})
        out[task] = rows
    return out


def _fmt_metric(mean, std):
    if math.isnan(mean):
        return "—"
    return "%.2f ± %.2f" % (100 * mean, 100 * std)


def markdown(summary, divergence, check, cfg, command, environment):
    lines = ["# hsbn sync-scope comparison", ""]
    lines.append("Command: `%s`" % command)
    lines.append("")
    lines.append(
        "Topology %d nodes × %d workers (LocalCluster on this machine), %d image(s) per worker "
        "(global batch %d), %s, seeds %s, per-node class skew %.2f. Metric: %s, as mean ± std "
        "over seeds in %%, scored with rank 0's running statistics (what a checkpoint saved by "
        "rank 0 holds). Times: mean over workers of the wall time of one training step "
        "(forward, backward, optimizer) and of the time spent in hsbn rounds within it, with "
        "the %s link delayed by %d ms each way%s; measured on %s."
        % (cfg["nodes"], cfg["workers_per_node"], cfg["batch"], cfg["world"] * cfg["batch"],
           ", ".join("%s %d steps" % (TASK_NAME[t], cfg["steps"][t]) for t in cfg["tasks"]),
           ", ".join(str(s) for s in cfg["seeds"]), cfg["skew"],
           " / ".join("%s %s" % (TASK_NAME[t], METRIC_NAME[t]) for t in cfg["tasks"]),
           "group aggregator–root" if cfg.get("group_tier") else "sidecar–root",
           cfg.get("link_delay_ms", 0),
           ("; groups of %d nodes" % cfg["group_nodes"] if cfg.get("group_nodes") else "")
           + ("; each group reduced by its own group aggregator (--role=group), its sidecars' "
              "links to it delayed by %d µs each way" % cfg["group_link_delay_us"]
              if cfg.get("group_tier") else ""),
           environment["machine"]))
    if cfg.get("model"):
        lines.append("")
        lines.append("Classification model: torchvision's `%s` (random initialization, %d "
                     "parameters), the gray items repeated to 3 channels."
                     % (cfg["model"], cfg["params"]["cls"]))
    lines.append("")
    head = "| mode | norm. batch |"
    sep = "|---|---:|"
    for t in cfg["tasks"]:
        head += " %s %s | ms/step | sync ms/step |" % (TASK_NAME[t], METRIC_NAME[t])
        sep += "---:|---:|---:|"
    lines += [head, sep]
    for mode in MODE_ORDER:
        if not any(mode in summary[t] for t in cfg["tasks"]):
            continue
        row = "| %s | %s |" % (mode, _norm_batch_text(mode, cfg))
        for t in cfg["tasks"]:
            s = summary[t].get(mode)
            if s is None:
                row += " — | — | — |"
            else:
                row += " %s | %.1f | %.1f |" % (_fmt_metric(s["metric_mean"], s["metric_std"]),
                                                 s["step_ms"], s["sync_ms"])
        lines.append(row)
    lines.append("")
    lines.append("The reference row is one process over the global batch (its ms/step is not "
                 "comparable: one process does all the work, without DDP or hsbn).")
    lines.append("")
    for t in cfg["tasks"]:
        text = cpu_line(summary, t)
        if text:
            lines += ["%s: %s" % (TASK_NAME[t].capitalize(), text), ""]
    for t in cfg["tasks"]:
        s = summary[t].get("renorm")
        if s is not None:
            lines.append("%s: %s" % (TASK_NAME[t].capitalize(), renorm_line(
                cfg, s.get("wait_share"), s.get("global_use_share"))))
            lines.append("")
        s = summary[t].get("lagged")
        if s is not None:
            lines.append("%s: %s" % (TASK_NAME[t].capitalize(), lagged_line(cfg, s)))
            lines.append("")
    lines.append("The same models scored with other running statistics: the plain average of "
                 "every worker's (naive), pooled over the job by `hsbn.torch.sync_running_stats` "
                 "(law of total variance, weighted by samples seen), and recomputed by "
                 "`hsbn.torch.precise_bn` over every worker's last %d training items "
                 "(pooled exactly over the job):" % cfg.get("precise_items", 0))
    lines.append("")
    head = "| mode |"
    sep = "|---|"
    for t in cfg["tasks"]:
        head += " %s: rank 0 | naive average | sync_running_stats | precise_bn |" % TASK_NAME[t]
        sep += "---:|---:|---:|---:|"
    lines += [head, sep]
    for mode in MODE_ORDER:
        if not any(mode in summary[t] for t in cfg["tasks"]):
            continue
        row = "| %s |" % mode
        for t in cfg["tasks"]:
            s = summary[t].get(mode)
            if s is None:
                row += " — | — | — | — |"
                continue
            row += "".join(" %s |" % _fmt_metric(s[k + "_mean"], s[k + "_std"]) for k in (
                "metric", "metric_avg_stats", "metric_sync_stats", "metric_precise_bn"))
        lines.append(row)
    lines.append("")
    if any(divergence.get(t) for t in cfg["tasks"]):
        lines.append("## Shadow mode: how far node statistics were from global, per layer")
        lines.append("")
        lines.append("From the root's record (`client.status(include_upstream=True)`) after the "
                     "shadow runs, averaged over seeds. mean shift = |mean_node − mean_global| / "
                     "sqrt(var_global + 1e-5) per channel, averaged over channels and rounds "
                     "(max: the largest of any channel in any round); var ratio = (var_node + "
                     "1e-5) / (var_global + 1e-5), averaged over channels and rounds.")
        lines.append("")
        for t in cfg["tasks"]:
            rows = divergence.get(t) or []
            if not rows:
                continue
            lines.append("**%s**" % TASK_NAME[t])
            lines.append("")
            lines.append("| layer | node | rounds | mean shift avg | mean shift max | "
                         "var ratio avg | abs log var ratio avg |")
            lines.append("|---|---:|---:|---:|---:|---:|---:|")
            for r in rows:
                lines.append("| %s | %d | %d | %.3f | %.3f | %.3f | %.3f |"
                             % (r["layer"], r["node"], r["rounds"], r["mean_shift_avg"],
                                r["mean_shift_max"], r["var_ratio_avg"],
                                r["log_var_ratio_abs_avg"]))
            lines.append("")
    if check:
        lines.append("## global vs reference")
        lines.append("")
        lines.append(check["explanation"])
        lines.append("")
        lines.append("| task | seed | statistics: global (reference, tolerance) | gradients: "
                     "global (reference, tolerance) | running statistics: global (reference, "
                     "tolerance) | kinks flipped: global (reference), global's largest "
                     "margin | node, for scale: statistics / gradients | final weights, "
                     "global vs reference | max loss gap | result |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")

        def trio(c, a):
            return "%.1e (%.1e, %.1e)" % (c[a + "_gap"], c[a + "_ref"], c[a + "_tolerance"])
        for c in check["rows"]:
            node = ("%.1e / %.1e" % (c["stats_node"], c["grads_node"])
                    if c.get("stats_node") is not None else "—")
            kinks = ("%d (%s), %.1e" % (c["kink_flips"], "—" if c.get("kink_flips_ref") is None
                                        else c["kink_flips_ref"], c["kink_margin"])
                     if c.get("kink_flips") is not None else "—")
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %.1e | %.1e | %s |"
                         % (TASK_NAME[c["task"]], c["seed"], trio(c, "stats"),
                            trio(c, "grads"), trio(c, "running"), kinks, node,
                            c["weight_gap"], c["loss_gap"], "PASS" if c["pass"] else "FAIL"))
        lines.append("")
        lines.append("**%s**" % ("PASS: global matches reference" if check["pass"]
                                 else "FAIL: global does not match reference — a bug"))
        lines.append("")
    lines.append("Outputs: `results.md` (this), `results.json`, `runs.csv`, `compare.png`.")
    lines.append("")
    return "\n".join(lines)


def write_csv(path, runs, cfg):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["task", "seed", "mode", "batch", "skew", "steps", "norm_batch", "metric",
                    "metric_name", "metric_avg_stats", "metric_sync_stats",
                    "metric_precise_bn", "step_ms", "sync_ms", "final_loss"])
        for r in runs:
            c = r.get("cfg", cfg)
            w.writerow([r["task"], r["seed"], r["mode"], c["batch"], c["skew"], r["steps"],
                        norm_batch(r["mode"], c), "%.6f" % r["metric"], METRIC_NAME[r["task"]],
                        "%.6f" % r["metric_avg_stats"],
                        "%.6f" % r.get("metric_sync_stats", float("nan")),
                        "" if r.get("metric_precise_bn") is None
                        else "%.6f" % r["metric_precise_bn"],
                        "%.3f" % r["step_ms"], "%.3f" % r["sync_ms"], "%.6f" % r["loss"][-1]])


def write_json(path, payload):
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=float)
        f.write("\n")


def _smooth(y, k):
    y = np.asarray(y, np.float64)
    if k <= 1 or len(y) < k:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    return (c[k:] - c[:-k]) / k


def plot(path, runs, summary, cfg):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = cfg["tasks"]
    colors = {"local": "tab:red", "node": "tab:orange", "shadow": "tab:olive",
              "group": "tab:purple", "auto": "tab:green", "renorm": "tab:cyan",
              "lagged": "tab:brown", "global": "tab:blue", "reference": "black"}
    styles = {"reference": ":", "shadow": "--"}  # shadow computes what node does: dashed on it
    fig, axes = plt.subplots(len(tasks), 3, figsize=(15, 4.2 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        ax_loss, ax_curve, ax_trade = axes[i]
        for mode in MODE_ORDER:
            rs = [r for r in runs if r["task"] == task and r["mode"] == mode]
            if not rs:
                continue
            loss = np.mean([r["loss"] for r in rs], axis=0)
            k = max(1, len(loss) // 25)
            ax_loss.plot(np.arange(len(_smooth(loss, k))) + k, _smooth(loss, k),
                         color=colors[mode], ls=styles.get(mode, "-"), label=mode)
            steps = [s for s, _ in rs[0]["curve"]]
            vals = np.array([[v for _, v in r["curve"]] for r in rs]) * 100
            ax_curve.plot(steps, vals.mean(0), marker="o", ms=3, color=colors[mode],
                          ls=styles.get(mode, "-"), label=mode)
            if len(rs) > 1:
                ax_curve.fill_between(steps, vals.min(0), vals.max(0), color=colors[mode],
                                      alpha=0.12)
            s = summary[task][mode]
            if mode != "reference":
                ax_trade.errorbar(s["step_ms"], 100 * s["metric_mean"],
                                  yerr=100 * s["metric_std"], fmt="o", color=colors[mode],
                                  capsize=4, label="%s (sync %.1f ms)" % (mode, s["sync_ms"]))
        ax_loss.set_title("%s: training loss (global batch, smoothed)" % TASK_NAME[task])
        ax_loss.set_xlabel("step")
        ax_loss.set_ylabel("cross-entropy")
        ax_loss.legend()
        ax_curve.set_title("%s: %s during training (test subset)"
                           % (TASK_NAME[task], METRIC_NAME[task]))
        ax_curve.set_xlabel("step")
        ax_curve.set_ylabel("%")
        ax_curve.legend()
        ax_trade.set_title("%s: %s vs time per step" % (TASK_NAME[task], METRIC_NAME[task]))
        ax_trade.set_xlabel("ms per training step (mean over workers)")
        ax_trade.set_ylabel("%s, %% (mean ± std over seeds)" % METRIC_NAME[task])
        ax_trade.legend(fontsize=8)
        for ax in (ax_loss, ax_curve, ax_trade):
            ax.grid(alpha=0.3)
    fig.suptitle("hsbn: BatchNorm sync scope, %d nodes × %d workers, %d image(s)/worker, "
                 "class skew %.2f" % (cfg["nodes"], cfg["workers_per_node"], cfg["batch"],
                                      cfg["skew"]))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
