"""hsbn_compare.py --sweep: the study on classification. Every (per-worker batch, skew) cell
trains every mode on the same seeds (paired by seed: the same initial weights, data and order
in every mode); per cell it reports mean ± std over seeds and paired differences with 95%
t-intervals, and draws the accuracy gap against batch size and accuracy against sync time.
The results are rewritten after every cell, so an interrupted sweep keeps what it finished."""

import math
import os
import shutil
import tempfile
import time

import numpy as np

from . import cli, data, report

# Two-sided 95% quantiles of Student's t, t_{0.975, df}, df = 1..30.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
GOAL_SHARE = 0.8   # auto and renorm >= node + 0.8 * (global - node)
GOAL_TIME = 0.6    # auto at <= 60% of global's sync time
GOAL_RENORM_TIME = 1.2   # renorm and lagged at <= 1.2 x node's sync time, paired by seed
SCORINGS = [("metric", "rank 0"), ("metric_sync_stats", "sync_running_stats"),
            ("metric_precise_bn", "precise_bn")]


def t975(df):
    if df < 1:
        return float("nan")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def paired(a, b):
    """Mean, std, 95% t-interval and n of the differences a[s] - b[s] over the seeds both
    have (dicts seed -> value)."""
    seeds = sorted(set(a) & set(b))
    d = np.array([a[s] - b[s] for s in seeds], np.float64)
    if len(d) == 0:
        return {"n": 0, "mean": float("nan"), "std": float("nan"), "lo": float("nan"),
                "hi": float("nan")}
    mean = float(d.mean())
    std = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    half = t975(len(d) - 1) * std / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return {"n": len(d), "mean": mean, "std": std, "lo": mean - half, "hi": mean + half,
            "seeds": seeds}


def _by_seed(runs, mode, key="metric"):
    return {r["seed"]: r[key] for r in runs if r["mode"] == mode and r.get(key) is not None}


def _cpu_total(cpu):
    """CPU ms per step of the trainers and the aggregators, the simulated links left out."""
    return sum(v for k, v in cpu.items() if k != "links")


def _cpu_by_seed(runs, mode):
    return {r["seed"]: _cpu_total(r["cpu_ms_per_step"]) for r in runs
            if r["mode"] == mode and r.get("cpu_ms_per_step")}


def analyze(cells):
    """cells: [{"batch", "skew", "seeds", "runs"}] -> per cell summaries and paired
    comparisons."""
    out = []
    for cell in cells:
        runs = cell["runs"]
        modes = [m for m in report.MODE_ORDER if any(r["mode"] == m for r in runs)]
        summary = {}
        for m in modes:
            rs = [r for r in runs if r["mode"] == m]
            row = {"seeds": len(rs)}
            for key, _ in SCORINGS:
                vals = [r[key] for r in rs if r.get(key) is not None]
                mean, std = report._mean_std(vals) if vals else (float("nan"), float("nan"))
                row[key] = {"mean": mean, "std": std}
            for key in ("sync_ms", "step_ms"):
                mean, std = report._mean_std([r[key] for r in rs])
                row[key] = {"mean": mean, "std": std}
            cpus = [r["cpu_ms_per_step"] for r in rs if r.get("cpu_ms_per_step")]
            if cpus and len(cpus) == len(rs):
                row["cpu_ms_per_step"] = {k: float(np.mean([c.get(k, 0.0) for c in cpus]))
                                          for k in sorted(set().union(*cpus))}
            if m == "auto":
                row["auto_global_share"] = _auto_share(rs)
            if m == "renorm":
                row.update(report.renorm_summary(rs))
            if m == "lagged":
                row.update(report.lagged_summary(rs))
            summary[m] = row
        pairs = {}
        acc = {m: _by_seed(runs, m) for m in modes}
        for a, b in (("global", "node"), ("global", "local"), ("global", "group"),
                     ("group", "node"), ("auto", "node"), ("global", "auto"),
                     ("renorm", "node"), ("global", "renorm"), ("lagged", "node"),
                     ("global", "lagged"), ("lagged", "renorm"), ("global", "reference")):
            if a in acc and b in acc:
                pairs["%s-%s" % (a, b)] = paired(acc[a], acc[b])
        for m in ("renorm", "lagged"):
            # renorm's and lagged's running statistics are global ones; node's pooled over
            # the job (sync_running_stats) are the nearest node-trained model scored alike.
            pooled = _by_seed(runs, "node", "metric_sync_stats")
            if m in acc and "node" in acc and pooled:
                pairs["%s-node sync_running_stats" % m] = paired(acc[m], pooled)
        if "node" in acc and "global" in acc:
            target = {s: acc["node"][s] + GOAL_SHARE * (acc["global"][s] - acc["node"][s])
                      for s in acc["node"] if s in acc["global"]}
            for m in ("auto", "renorm"):
                if m in acc:
                    pairs["%s-target" % m] = paired(acc[m], target)
            if "lagged" in acc:
                # The share of the paired node -> global gap that lagged recovers.
                gap = paired(acc["global"], acc["node"])
                got = paired(acc["lagged"], acc["node"])
                pairs["lagged gap share"] = {
                    "share": got["mean"] / gap["mean"] if gap["n"] and gap["mean"] else
                    float("nan")}
        for m in ("local", "node", "group", "auto", "renorm", "lagged"):
            for key, name in SCORINGS[1:]:
                other = _by_seed(runs, m, key)
                if m in acc and other:
                    pairs["%s %s-rank0" % (m, name)] = paired(other, acc[m])
        if "node" in acc and "global" in acc:
            precise = _by_seed(runs, "node", "metric_precise_bn")
            gap = paired(acc["global"], acc["node"])
            closed = paired(precise, acc["node"]) if precise else None
            pairs["precise closes"] = {
                "share": closed["mean"] / gap["mean"] if closed and gap["mean"] else
                float("nan")}
        sync = {m: summary[m]["sync_ms"]["mean"] for m in summary}
        ratios = {"%s/global" % m: sync[m] / sync["global"]
                  for m in ("node", "group", "auto") if m in sync and sync.get("global")}
        ratios.update({"%s/global" % m: sync[m] / sync["global"]
                       for m in ("renorm", "lagged") if m in sync and sync.get("global")})
        paired_ratios = {}
        for m in ("renorm", "lagged"):
            if m in summary and "node" in summary:
                paired_ratios["%s/node" % m] = paired_ratio(_by_seed(runs, m, "sync_ms"),
                                                            _by_seed(runs, "node", "sync_ms"))
                # The whole step: the scope's host-side work (its arithmetic, the fetches)
                # is outside sync.
                paired_ratios["%s/node step" % m] = paired_ratio(
                    _by_seed(runs, m, "step_ms"), _by_seed(runs, "node", "step_ms"))
                cpu_m, cpu_n = _cpu_by_seed(runs, m), _cpu_by_seed(runs, "node")
                if cpu_m and cpu_n:
                    paired_ratios["%s/node cpu" % m] = paired_ratio(cpu_m, cpu_n)
        out.append({"batch": cell["batch"], "skew": cell["skew"], "seeds": cell["seeds"],
                    "summary": summary, "pairs": pairs, "sync_ratios": ratios,
                    "paired_sync_ratios": paired_ratios, "check": cell.get("check")})
    return out


def paired_ratio(a, b):
    """Mean, std, 95% t-interval and n of the ratios a[s] / b[s] over the seeds both have
    (dicts seed -> value): each seed's runs share the machine's load of their moment, so the
    ratio per seed cancels what load moves in both."""
    seeds = [s for s in sorted(set(a) & set(b)) if b[s] > 0]
    one = {s: 0.0 for s in seeds}
    return paired({s: a[s] / b[s] for s in seeds}, one)


def _auto_share(runs):
    """Fraction of auto's layers that ended in global scope, over the runs that report it."""
    shares = []
    for r in runs:
        sc = r.get("scopes") or {}
        if sc:
            shares.append(np.mean([("global" in str(v)) for v in sc.values()]))
    return float(np.mean(shares)) if shares else None


def _pct(v):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else "%.2f" % (100 * v)


def _ci(p):
    if p["n"] < 2:
        return "%s (n=%d)" % (_pct(p["mean"]), p["n"])
    return "%+.2f [%+.2f, %+.2f] (n=%d)" % (100 * p["mean"], 100 * p["lo"], 100 * p["hi"],
                                            p["n"])


def _ratio(p):
    if p["n"] < 2:
        return "%.2f (n=%d)" % (p["mean"], p["n"])
    return "%.2f [%.2f, %.2f] (n=%d)" % (p["mean"], p["lo"], p["hi"], p["n"])


def markdown(analysis, cfg, command, env, default_cell, wall):
    lines = ["# hsbn sync-scope sweep (classification)", ""]
    lines.append("Command: `%s`" % command)
    lines.append("")
    lines.append(
        "Topology %d nodes × %d workers%s, %s link delayed by %d "
        "ms each way, %d training items × %g epoch(s) per run (steps = items / global "
        "batch), test accuracy on %s test items. Seeds are paired: every mode of a seed "
        "starts from the same weights and sees the same items in the same order. Accuracies "
        "in %%, mean ± std over seeds; differences are paired by seed, mean [95%% t-interval]. "
        "Sync: ms per step blocked in hsbn rounds (mean over workers and steps). Measured on "
        "%s. Total wall time %d min."
        % (cfg["nodes"], cfg["workers_per_node"],
           " (a group = %d nodes)" % cfg["group_nodes"] if cfg["group_nodes"] else "",
           "sidecar–group aggregator link delayed by %d µs each way, group aggregator–root"
           % cfg["group_link_delay_us"] if cfg.get("group_tier") else "sidecar–root",
           cfg["link_delay_ms"], cfg["train_size"], cfg["epochs"], cfg.get("test_items", "all"),
           env["machine"], round(wall / 60)))
    lines.append("")
    if cfg.get("renorm"):
        lines.append("renorm's options: %s. Its sync time includes its waits for global "
                     "statistics." % ", ".join("%s %g" % kv for kv in cfg["renorm"].items()))
        lines.append("")
    if cfg.get("lagged"):
        lines.append("lagged's options: %s. Its sync time includes its waits for late "
                     "results." % ", ".join("%s %g" % kv for kv in cfg["lagged"].items()))
        lines.append("")
    for cell in analysis:
        s = cell["summary"]
        mark = " (default cell)" if (cell["batch"], cell["skew"]) == default_cell else ""
        lines.append("## batch %d per worker, skew %g%s: %d seeds" % (
            cell["batch"], cell["skew"], mark, len(cell["seeds"])))
        lines.append("")
        lines.append("| mode | accuracy, rank 0 stats | sync_running_stats | precise_bn | "
                     "sync ms/step | ms/step |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for m in report.MODE_ORDER:
            if m not in s:
                continue
            row = s[m]
            note = ""
            if row.get("auto_global_share") is not None:
                note = " (%.0f%% of layers global)" % (100 * row["auto_global_share"])
            elif row.get("wait_share") is not None:
                note = " (%.1f%% of calls waited)" % (100 * row["wait_share"])
            elif row.get("exact_share") is not None:
                note = " (%.1f%% of calls exact global)" % (100 * row["exact_share"])
            lines.append("| %s | %s | %s | %s | %.1f ± %.1f | %.1f |" % (
                m + note,
                report._fmt_metric(row["metric"]["mean"], row["metric"]["std"]),
                report._fmt_metric(row["metric_sync_stats"]["mean"],
                                   row["metric_sync_stats"]["std"]),
                report._fmt_metric(row["metric_precise_bn"]["mean"],
                                   row["metric_precise_bn"]["std"]),
                row["sync_ms"]["mean"], row["sync_ms"]["std"], row["step_ms"]["mean"]))
        lines.append("")
        lines.append("Paired differences (accuracy points, rank 0 statistics unless named):")
        lines.append("")
        lines.append("| difference | mean [95% CI] |")
        lines.append("|---|---:|")
        for k, p in cell["pairs"].items():
            if k in ("precise closes", "lagged gap share"):
                continue
            if k.endswith("-target"):
                label = "%s − (node + %.1f × (global − node)) (goal ≥ 0)" % (
                    k.split("-")[0], GOAL_SHARE)
            else:
                label = k.replace("-", " − ", 1)
            lines.append("| %s | %s |" % (label, _ci(p)))
        if "precise closes" in cell["pairs"]:
            lines.append("| share of the global − node gap that precise_bn closes on node | "
                         "%s |" % ("%.0f%%" % (100 * cell["pairs"]["precise closes"]["share"])
                                   if not math.isnan(cell["pairs"]["precise closes"]["share"])
                                   else "—"))
        if cell.get("sync_ratios"):
            lines.append("")
            lines.append("Sync time relative to global: " + ", ".join(
                "%s %.0f%%" % (k.split("/")[0], 100 * v)
                for k, v in cell["sync_ratios"].items()) + ".")
        for k, p in (cell.get("paired_sync_ratios") or {}).items():
            lines.append("")
            if k.endswith(" step"):
                lines.append("Step time (ms/step) %s, paired by seed: %s." % (
                    k[:-len(" step")], _ratio(p)))
            elif k.endswith(" cpu"):
                lines.append("CPU per step (trainers and aggregators) %s, paired by seed: %s."
                             % (k[:-len(" cpu")], _ratio(p)))
            else:
                lines.append("Sync time %s, paired by seed: %s." % (k, _ratio(p)))
        lines += _cpu_table(s)
        if cell.get("check") is not None:
            lines.append("")
            lines.append("global vs reference check: **%s**" % (
                "PASS" if cell["check"]["pass"] else "FAIL"))
        lines.append("")
    lines += goals(analysis, default_cell)
    lines.append("Plots (SVG and PNG): `gap_vs_batch` (global − mode accuracy gap against the "
                 "per-worker batch, paired mean and 95% CI), `acc_vs_sync` (accuracy against "
                 "sync time per step, every cell).")
    lines.append("")
    return "\n".join(lines)


def _cpu_table(summary):
    """Lines: CPU ms per step by process kind and mode (the modes that have it)."""
    modes = [m for m in report.MODE_ORDER if summary.get(m, {}).get("cpu_ms_per_step")]
    if not modes:
        return []
    kinds = [k for k in ("workers", "sidecars", "groups", "root", "links")
             if any(k in summary[m]["cpu_ms_per_step"] for m in modes)]
    lines = ["", "CPU ms per step (mean over seeds): the trainers' in their timed steps, summed "
             "over the workers; each aggregator kind's and the simulated links' proxies' "
             "over the training loop; total without the links:", "",
             "| mode | " + " | ".join(kinds) + " | total |",
             "|---|" + "---:|" * (len(kinds) + 1)]
    for m in modes:
        c = summary[m]["cpu_ms_per_step"]
        lines.append("| %s | %s | %.1f |" % (m, " | ".join("%.1f" % c.get(k, 0.0)
                                                          for k in kinds), _cpu_total(c)))
    return lines


def goals(analysis, default_cell):
    """The issue's goals, read from the default cell (and every cell for the check)."""
    lines = ["## Goals", ""]
    checks = [(c["batch"], c["skew"], c["check"]["pass"]) for c in analysis if c.get("check")]
    if checks:
        lines.append("- global ≈ reference (the program's check) in every cell: **%s** (%s)." % (
            "met" if all(ok for _, _, ok in checks) else "missed",
            ", ".join("batch %d skew %g %s" % (b, sk, "PASS" if ok else "FAIL")
                      for b, sk, ok in checks)))
    cell = next((c for c in analysis if (c["batch"], c["skew"]) == default_cell), None)
    if cell is None:
        return lines + [""]
    p, r = cell["pairs"], cell.get("sync_ratios", {})
    if "auto-target" in p:
        t = p["auto-target"]
        ratio = r.get("auto/global")
        acc = ("not assessed (the goal asks for ≥ 5 seeds)" if t["n"] < 5
               else "met" if t["mean"] >= 0 else "missed")
        time_ok = ratio is not None and ratio <= GOAL_TIME
        lines.append(
            "- auto ≥ node + %.1f × (global − node), paired over %d seeds: auto − target = %s "
            "points → **%s**%s; auto's sync time = %s of global's (goal ≤ %.0f%%) → **%s**."
            % (GOAL_SHARE, t["n"], _ci(t), acc,
               "" if t["n"] < 2 or t["lo"] >= 0 or t["hi"] < 0
               else " (the interval includes 0)",
               "%.0f%%" % (100 * ratio) if ratio is not None else "—", 100 * GOAL_TIME,
               "met" if time_ok else "missed"))
    if "renorm-target" in p:
        t = p["renorm-target"]
        ratio = (cell.get("paired_sync_ratios") or {}).get("renorm/node")
        acc = ("not assessed (the goal asks for ≥ 5 seeds)" if t["n"] < 5
               else "met" if t["mean"] >= 0 else "missed")
        time_ok = (ratio is not None and ratio["n"] >= 2
                   and ratio["mean"] <= GOAL_RENORM_TIME)
        wait = cell["summary"].get("renorm", {}).get("wait_share")
        lines.append(
            "- renorm ≥ node + %.1f × (global − node), paired over %d seeds: renorm − target = "
            "%s points → **%s**%s; renorm's sync time / node's, paired by seed = %s (goal ≤ "
            "%.1f) → **%s**; %s of renorm's forward calls waited for global statistics."
            % (GOAL_SHARE, t["n"], _ci(t), acc,
               "" if t["n"] < 2 or t["lo"] >= 0 or t["hi"] < 0
               else " (the interval includes 0)",
               _ratio(ratio) if ratio else "—", GOAL_RENORM_TIME,
               "met" if time_ok else "missed",
               "—" if wait is None else "%.1f%%" % (100 * wait)))
    if "lagged-node" in p:
        ln = p["lagged-node"]
        share = p.get("lagged gap share", {}).get("share", float("nan"))
        ratio = (cell.get("paired_sync_ratios") or {}).get("lagged/node")
        exact = cell["summary"].get("lagged", {}).get("exact_share")
        lines.append(
            "- lagged never below node (issue #41), paired over %d seeds: lagged − "
            "node = %s points → **%s**; it recovers %s of the paired node → global gap; its "
            "sync time / node's, paired by seed = %s (goal ≤ %.1f) → **%s**; %s of its "
            "training calls ran exact global."
            % (ln["n"], _ci(ln), "not assessed (fewer than 2 seeds)" if ln["n"] < 2
               else "met" if ln["lo"] >= 0 else "missed",
               "%.0f%%" % (100 * share) if share == share else "—",
               _ratio(ratio) if ratio else "—", GOAL_RENORM_TIME,
               "met" if ratio is not None and ratio["n"] >= 2
               and ratio["mean"] <= GOAL_RENORM_TIME else "missed",
               "—" if exact is None else "%.1f%%" % (100 * exact)))
    for c in analysis:
        if c["skew"] == 0 and "renorm-node" in c["pairs"]:
            rn = c["pairs"]["renorm-node"]
            ok = rn["n"] >= 2 and rn["hi"] >= 0
            lines.append("- without skew (batch %d), renorm not worse than node: renorm − node "
                         "= %s → **%s**." % (c["batch"], _ci(rn), "met" if ok else "missed"))
    if "group-node" in p and "global-group" in p:
        gn, gg = p["group-node"], p["global-group"]
        rg, rn = r.get("group/global"), r.get("node/global")
        acc_between = gn["mean"] >= 0 and gg["mean"] >= 0
        time_between = rg is not None and rn is not None and rn <= rg <= 1.0
        lines.append(
            "- group between node and global: accuracy group − node %s, global − group %s → "
            "**%s**; sync time node %s, group %s of global's → **%s**."
            % (_ci(gn), _ci(gg), "met" if acc_between else "missed",
               "%.0f%%" % (100 * rn) if rn is not None else "—",
               "%.0f%%" % (100 * rg) if rg is not None else "—",
               "met" if time_between else "missed"))
    if "precise closes" in p and "global-node" in p:
        share = p["precise closes"]["share"]
        lines.append(
            "- precise_bn on node's models closes %s of the global − node gap (%s points): "
            "node precise_bn − rank 0 = %s points; sync_running_stats: %s."
            % ("%.0f%%" % (100 * share) if share == share else "—",
               _pct(p["global-node"]["mean"]), _ci(p.get("node precise_bn-rank0",
                                                          {"n": 0, "mean": float("nan")})),
               _ci(p.get("node sync_running_stats-rank0", {"n": 0, "mean": float("nan")}))))
    lines.append("")
    return lines


def plot(out_dir, analysis, default_cell):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"local": "tab:red", "node": "tab:orange", "group": "tab:purple",
              "auto": "tab:green", "renorm": "tab:cyan", "lagged": "tab:brown",
              "global": "tab:blue", "shadow": "tab:olive"}
    skews = sorted({c["skew"] for c in analysis})
    fig, axes = plt.subplots(1, len(skews), figsize=(6 * len(skews), 4.2), squeeze=False)
    for ax, skew in zip(axes[0], skews):
        cells = sorted([c for c in analysis if c["skew"] == skew], key=lambda c: c["batch"])
        for i, m in enumerate(("local", "node", "group", "auto", "renorm")):
            xs, ys, lo, hi = [], [], [], []
            for c in cells:
                p = c["pairs"].get("global-%s" % m)
                if not p or p["n"] == 0:
                    continue
                xs.append(c["batch"] * (1 + 0.03 * (i - 2)))
                ys.append(100 * p["mean"])
                lo.append(100 * (p["mean"] - p["lo"]) if p["n"] > 1 else 0)
                hi.append(100 * (p["hi"] - p["mean"]) if p["n"] > 1 else 0)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=3, color=colors[m],
                            label="global − %s" % m)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        if len({c["batch"] for c in cells}) == 1:  # one batch: keep the offsets small
            ax.set_xlim(cells[0]["batch"] / 1.5, cells[0]["batch"] * 1.5)
        ax.set_xticks(sorted({c["batch"] for c in cells}))
        ax.set_xticklabels([str(b) for b in sorted({c["batch"] for c in cells})])
        ax.set_xlabel("per-worker batch")
        ax.set_ylabel("accuracy gap to global, points (paired, 95% CI)")
        ax.set_title("skew %g" % skew)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("hsbn sweep: how much accuracy each scope gives up against global")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "gap_vs_batch.svg"))
    fig.savefig(os.path.join(out_dir, "gap_vs_batch.png"), dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for c in analysis:
        default = (c["batch"], c["skew"]) == default_cell
        for m, row in c["summary"].items():
            if m not in colors:
                continue
            ax.errorbar(row["sync_ms"]["mean"], 100 * row["metric"]["mean"],
                        yerr=100 * row["metric"]["std"], fmt="o" if default else ".",
                        ms=8 if default else 5, capsize=3 if default else 0, color=colors[m],
                        alpha=1.0 if default else 0.35,
                        label=m if default else None)
            if default:
                ax.annotate(m, (row["sync_ms"]["mean"], 100 * row["metric"]["mean"]),
                            textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("sync ms per step (blocked in hsbn rounds)")
    ax.set_ylabel("test accuracy, % (rank 0 statistics, mean ± std)")
    ax.set_title("accuracy vs sync time: default cell (batch %d, skew %g) solid, other cells "
                 "faint" % default_cell, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "acc_vs_sync.svg"))
    fig.savefig(os.path.join(out_dir, "acc_vs_sync.png"), dpi=80)
    plt.close(fig)


def _write(args, command, env, cfg, cells, default_cell, wall, final):
    analysis = analyze(cells)
    md = markdown(analysis, cfg, command, env, default_cell, wall)
    if not final:
        md = ("**Partial: %d of the sweep's cells so far.**\n\n" % len(cells)) + md
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(md)
    runs = []
    for c in cells:
        for r in c["runs"]:
            rr = {k: v for k, v in r.items() if k not in cli.RAW_KEYS}
            rr["cfg"] = {"batch": c["batch"], "skew": c["skew"], "nodes": cfg["nodes"],
                         "workers_per_node": cfg["workers_per_node"], "world": cfg["world"],
                         "group_nodes": cfg["group_nodes"]}
            runs.append(rr)
    report.write_csv(os.path.join(args.out, "runs.csv"), runs, cfg)
    report.write_json(os.path.join(args.out, "sweep.json"), {
        "command": command, "config": cfg, "environment": env, "complete": final,
        "default_cell": list(default_cell), "analysis": analysis, "wall_s": wall,
        "runs": [{k: v for k, v in r.items() if k not in ("curve",)} for r in runs]})
    try:
        plot(args.out, analysis, default_cell)
    except Exception as e:  # the numbers are written already
        print("hsbn_compare: could not draw the sweep's plots: %r" % e)
    return md, analysis


def run(args, command):
    tasks = ["cls"]
    default_cell = (args.batch, args.skew)
    # The default cell first: the goals are read from it, and a sweep cut short keeps it.
    cells_todo = [(b, sk) for sk in args.sweep_skews for b in args.sweep_batches]
    cells_todo.sort(key=lambda c: c != default_cell)
    env = cli.environment()
    os.makedirs(args.out, exist_ok=True)
    print("hsbn_compare --sweep: %d nodes x %d workers, batches %s x skews %s, modes %s, "
          "%d seeds per cell, %d in the default cell %s; %s"
          % (args.nodes, args.workers_per_node, args.sweep_batches, args.sweep_skews,
             ",".join(args.modes), args.sweep_seeds, args.sweep_default_seeds,
             default_cell, env["machine"]))
    tmp = tempfile.mkdtemp(prefix="hsbn-sweep-")
    t0 = time.monotonic()
    cells = []
    cfg = None
    try:
        d, cache = cli.prepare(args, tasks, tmp)
        pool = data.training_pool(d["train_y"], args.train_size)
        for i, (b, sk) in enumerate(cells_todo):
            n = args.sweep_seeds
            if (b, sk) == default_cell:
                n = max(n, args.sweep_default_seeds)
            seeds = list(range(args.first_seed, args.first_seed + n))
            cfg = cli.make_cfg(args, tasks, seeds, b, sk)
            cfg["evals"] = 1   # no learning curves in the sweep
            cfg["test_items"] = int(len(np.load(cache["cls_test_y"], mmap_mode="r")))
            runs = cli.run_cell(args, cfg, d, pool, cache,
                                label="cell %d/%d (batch %d, skew %g): "
                                      % (i + 1, len(cells_todo), b, sk))
            check = cli.global_reference_check(runs, tasks, seeds)
            cells.append({"batch": b, "skew": sk, "seeds": seeds, "runs": runs,
                          "check": check})
            _write(args, command, env, cfg, cells, default_cell, time.monotonic() - t0,
                   final=i + 1 == len(cells_todo))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    md, analysis = _write(args, command, env, cfg, cells, default_cell, time.monotonic() - t0,
                          final=True)
    print()
    print(md)
    print("hsbn_compare: wrote %s/{sweep.md,sweep.json,runs.csv,gap_vs_batch.{svg,png},"
          "acc_vs_sync.{svg,png}}" % args.out)
    failed = [c for c in analysis if c.get("check") and not c["check"]["pass"]]
    if failed:
        print("hsbn_compare: FAIL: global does not match reference in %d cell(s)"
              % len(failed))
        return 1
    return 0


def render(out_dir):
    """Rewrites sweep.md, runs.csv and the plots of a finished (or cut short) sweep from its
    sweep.json, with this code's report."""
    import json
    import types
    with open(os.path.join(out_dir, "sweep.json")) as f:
        res = json.load(f)
    cells = []
    for a in res["analysis"]:
        runs = [r for r in res["runs"]
                if r["cfg"]["batch"] == a["batch"] and r["cfg"]["skew"] == a["skew"]]
        cells.append({"batch": a["batch"], "skew": a["skew"], "seeds": a["seeds"],
                      "runs": runs, "check": a.get("check")})
    args = types.SimpleNamespace(out=out_dir)
    _write(args, res["command"], res["environment"], res["config"], cells,
           tuple(res["default_cell"]), res["wall_s"], res["complete"])


if __name__ == "__main__":
    import sys
    if len(sys.argv) != 2:
        sys.exit("usage: python3 -m hsbncmp.sweep OUT_DIR  (re-renders OUT_DIR/sweep.json)")
    render(sys.argv[1])
