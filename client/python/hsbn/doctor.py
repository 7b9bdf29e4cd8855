"""What hsbn.torch.diagnose found, as an object that renders itself: text, JSON and a picture.

    report = hsbn.torch.diagnose(model, batches)     # on every rank (needs PyTorch)
    print(report)                                    # the verdict and its evidence
    report.save("bn-doctor.json")                    # for an issue report, or:
    report.plot("bn-doctor.png")                     # per-layer divergence by level
    hsbn doctor bn-doctor.json [--plot bn-doctor.png] [--json]   # later, without PyTorch

This module needs neither PyTorch nor the native library: a saved report renders anywhere.

The numbers (docs/PYTORCH.md, "Is my accuracy drop BatchNorm's fault?"): per BatchNorm layer,
the values per channel it normalizes with at each level (a rank, its node, its group, the
job), and how far each level's statistics are from the job's: mean shift = |mean_level -
mean_job| / sqrt(var_job + eps) and |log var ratio| = |log((var_level + eps) / (var_job + eps))|,
averaged over channels and batches (the metrics of shadow scope), then over ranks. A layer
explains a multi-GPU gap when the level it trains with is further from the job than the
thresholds (auto scope's defaults, 0.05 each); the narrowest level within them is the scope
that would remove it.
"""

import json
import sys

FORMAT = "hsbn-doctor/1"
LEVELS = ("local", "node", "group", "global")


class DoctorReport:
    """A diagnosis. `data` is its JSON form (as_dict()); load() reads a saved one."""

    def __init__(self, data):
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not an hsbn doctor report (expected \"format\": %r)" % FORMAT)
        self.data = data

    # --- access ---------------------------------------------------------------------------------

    @property
    def verdict(self):
        """"yes" (BatchNorm explains a multi-GPU gap here) or "no"."""
        return self.data["verdict"]

    @property
    def layers(self):
        """Per layer (module order): a dict with name, kind, training_scope, counts, divergence
        by level, running-statistics spread, explains, recommended scope, cost."""
        return self.data["layers"]

    @property
    def smells(self):
        """Configuration smells: dicts with kind, layers, message and fix."""
        return self.data["smells"]

    def smell_kinds(self):
        return sorted({s["kind"] for s in self.smells})

    def layer(self, name):
        for entry in self.layers:
            if entry["name"] == name:
                return entry
        raise KeyError(name)

    def as_dict(self):
        return json.loads(json.dumps(self.data))

    def to_json(self, indent=1):
        return json.dumps(self.data, indent=indent, sort_keys=True)

    def save(self, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    # --- text -----------------------------------------------------------------------------------

    def text(self):
        d = self.data
        t = d["thresholds"]
        job = d["job"]
        lines = []
        lines.append("hsbn doctor: is a multi-GPU accuracy gap BatchNorm's fault here?")
        lines.append("job: %d ranks on %d nodes%s; %d batch(es) per rank measured; thresholds: "
                     "mean shift %.3g, |log var ratio| %.3g"
                     % (job["world_size"], job["num_nodes"],
                        ", groups of %d nodes" % job["group_nodes"] if job["group_nodes"] else "",
                        d["batches"], t["mean_shift"], t["log_var_ratio"]))
        lines.append("")
        lines.append("VERDICT: %s. %s" % (d["verdict"].upper(), d["summary"]))
        lines.append("")
        levels = [lv for lv in LEVELS if lv in d["levels"]]
        head = "%-28s %-8s %-7s" % ("layer", "trains", "batch")
        for lv in levels[:-1]:
            head += " %-15s" % ("%s shift/logvar" % lv)
        head += " %-13s %-9s %s" % ("running sprd", "explains", "use (ms/step)")
        lines.append(head)
        for e in d["layers"]:
            # What the layer normalizes with as trained: its scope's count where the doctor
            # measured that level (node, group, global), else the rank's own batch.
            trained = e["counts"].get(e["training_scope"])
            row = "%-28s %-8s %-7s" % (_cut(e["name"], 28), e["training_scope"],
                                       _fmt_count(e["counts"].get("local_mean")
                                                  if trained is None else trained))
            for lv in levels[:-1]:
                dv = e["divergence"].get(lv)
                row += " %-15s" % ("—" if dv is None else "%.3f/%.3f" % (dv["mean_shift"],
                                                                       dv["log_var_ratio"]))
            spread = e.get("running_spread")
            row += " %-13s" % ("—" if spread is None else "%.3f/%.3f" % (
                spread["mean"], spread["log_var"]))
            cost = e["cost_ms_per_step"].get(e["recommended"])
            row += " %-9s %s%s" % ("YES" if e["explains"] else "no", e["recommended"],
                                   "" if cost is None else " (%.2f)" % cost)
            alt = e.get("alternative")  # (absent in reports saved before it existed)
            if alt:
                cost = e["cost_ms_per_step"].get(alt)
                row += " or %s%s" % (alt, "" if cost is None else " (%.2f)" % cost)
            lines.append(row)
        lines.append("")
        lines.append("batch: values per channel a layer normalizes with as trained (samples x "
                     "positions: its rank's own for local, its node's for node, ...), mean over "
                     "ranks and batches; shift/logvar: the level's distance from the "
                     "job's statistics; running sprd: spread of the running mean (in running "
                     "std) and of log running var across ranks.")
        rt = d["round_ms"]
        if rt:
            lines.append("measured round time on this job (median of the doctor's own forward "
                         "rounds, each after a job round that lines the ranks up): " + ", ".join("%s %.3f ms" % (k, v) for k, v in rt.items()))
        tr = d.get("training_round_ms") or {}
        if tr:
            lines.append("this job's training rounds so far (client stats, mean): " + ", ".join(
                "%s %.3f ms" % (k, v) for k, v in tr.items()))
        c = d["cost"]
        lines.append("sync cost per step (2 rounds per layer and step): as trained %.2f ms, "
                     "recommended %.2f ms, all global %.2f ms%s"
                     % (c["as_trained_ms"], c["recommended_ms"], c["all_global_ms"],
                        "" if c.get("alternative_ms") in (None, c["recommended_ms"]) else
                        ", lagged where offered %.2f ms" % c["alternative_ms"]))
        guard = d.get("lagged_guard") or []
        if guard:
            tripped = [g for g in guard if g["trips"]]
            g0 = guard[0]
            lines.append(
                "lagged trip guard (relative %s, absolute %s; a trip runs the layer exact global "
                "for %s calls): %d of %d lagged layers tripped so far%s"
                % (g0["trip_rel"] or "off", g0["trip"] or "off", g0["trip_calls"], len(tripped),
                   len(guard), "" if not tripped else ": " + ", ".join(
                       "%s %d (last at call %d, drift %.3g)" % (g["name"], g["trips"],
                                                               g["last_call"], g["last_drift"])
                       for g in tripped[:6]) + (", ..." if len(tripped) > 6 else "")))
            if tripped:
                lines.append("  a layer that trips again and again has statistics that move "
                             "too fast for one call's lag: train it in global scope "
                             "(layer_scopes=...), or look for learning-rate spikes.")
        lines.append("")
        if d["smells"]:
            lines.append("configuration smells (%d):" % len(d["smells"]))
            for s in d["smells"]:
                names = s["layers"]
                which = "" if not names else " [%s%s]" % (", ".join(names[:4]),
                                                          ", ..." if len(names) > 4 else "")
                lines.append("- %s%s: %s" % (s["kind"], which, s["message"]))
                lines.append("  fix: %s" % s["fix"])
        else:
            lines.append("configuration smells: none found")
        return "\n".join(lines)

    __str__ = text

    # --- picture --------------------------------------------------------------------------------

    def plot(self, path):
        """Per-layer bars of the mean shift and |log var ratio| of each level against the job,
        with the thresholds: a PNG or SVG (by the extension) for an issue report. Needs
        matplotlib."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        d = self.data
        levels = [lv for lv in LEVELS if lv in d["levels"] and lv != "global"]
        names = [e["name"] for e in d["layers"]]
        n = max(1, len(names))
        fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.5 * n + 2), 6.5), sharex=True)
        width = 0.8 / max(1, len(levels))
        for ax, key, thr in ((axes[0], "mean_shift", d["thresholds"]["mean_shift"]),
                             (axes[1], "log_var_ratio", d["thresholds"]["log_var_ratio"])):
            for k, lv in enumerate(levels):
                vals = [(e["divergence"].get(lv) or {}).get(key, 0.0) for e in d["layers"]]
                ax.bar([i + (k - (len(levels) - 1) / 2) * width for i in range(len(names))],
                       vals, width, label=lv)
            ax.axhline(thr, color="k", linestyle="--", linewidth=0.8, label="threshold")
            ax.set_ylabel(key.replace("_", " ") + " vs job")
            ax.legend(fontsize=8)
        axes[1].set_xticks(range(len(names)))
        axes[1].set_xticklabels(names, rotation=60, ha="right", fontsize=7)
        axes[0].set_title("hsbn doctor: verdict %s" % d["verdict"].upper())
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _cut(s, n):
    return s if len(s) <= n else "…" + s[-(n - 1):]


def _fmt_count(v):
    if v is None:
        return "—"
    return "%d" % round(v) if v < 1e5 else "%.1e" % v


def main(argv):
    """`hsbn doctor REPORT.json [--plot FILE] [--json]`: renders a saved report."""
    import argparse
    p = argparse.ArgumentParser(
        prog="hsbn doctor",
        description="Render a report that hsbn.torch.diagnose(...) saved (report.save(path)): "
                    "the verdict, per-layer evidence and configuration smells.",
        epilog="Exit status: 0 rendered, 1 the file is not a report, 2 bad arguments.")
    p.add_argument("report", help="the JSON file report.save() wrote")
    p.add_argument("--plot", metavar="FILE", help="also draw the per-layer bars (PNG or SVG)")
    p.add_argument("--json", action="store_true", help="print the report's JSON instead")
    args = p.parse_args(argv)
    try:
        report = DoctorReport.load(args.report)
    except (OSError, ValueError, KeyError) as e:
        print("hsbn doctor: cannot read %s: %s" % (args.report, e), file=sys.stderr)
        return 1
    print(report.to_json() if args.json else report.text())
    if args.plot:
        report.plot(args.plot)
        print("hsbn doctor: wrote %s" % args.plot)
    return 0
