"""What a model's synchronized layers report: their client, round statistics, scopes, auto
decisions and the root's divergence record."""

from ..client import ClientStats, default_client
from ..errors import ConfigurationError
from .modules import SyncBatchNorm


def model_client(module):
    """The hsbn.Client that the synchronized layers (scope other than "local") of `module` use:
    the one given to convert_sync_batchnorm / SyncBatchNorm as client=, or else the process's
    hsbn.default_client() (created from the environment if no synchronized forward has created
    it yet, as that forward would). None when `module` has no synchronized layer. Raises
    ConfigurationError when its layers use different clients."""
    found = []
    for _, m in module.named_modules():
        if isinstance(m, SyncBatchNorm) and m.scope != "local":
            c = m.client if m.client is not None else default_client()
            if not any(c is f for f in found):
                found.append(c)
    if len(found) > 1:
        raise ConfigurationError(
            "the synchronized layers of this module use %d different clients (%s); ask each "
            "one for its .stats()" % (len(found), ", ".join(repr(c) for c in found)))
    return found[0] if found else None


def stats(module):
    """Round statistics of the client `module`'s synchronized layers use (model_client), as an
    hsbn.ClientStats: rounds completed and failed and seconds blocked in them, per scope and
    phase. They count every round made through that client, so models and threads sharing it
    share the counts; take differences (or reset_stats()) to measure one stretch of training.
    All zeros for a module without synchronized layers."""
    client = model_client(module)
    return ClientStats.empty() if client is None else client.stats()


def scopes(module):
    """{layer name: scope} of every hsbn SyncBatchNorm in `module` (names as divergence()
    gives them): the scope each uses now. An auto-scope layer shows its decision ("node",
    "group" or "global") once made or restored, "shadow" during its warm-up; auto_decisions()
    gives the numbers behind it."""
    out = {}
    for qualified, m in module.named_modules():
        if isinstance(m, SyncBatchNorm):
            out[m.layer_name or qualified or type(m).__name__] = m.current_scope()
    return out


def auto_decisions(module):
    """{layer name: decision} of the auto-scope layers of `module`: None during the warm-up,
    else {"scope", "mean_shift", "log_var_ratio", "rounds", "decided_at"}: the root's largest
    per-node (per-group) averages over the warm-up and the fewest shadow rounds recorded, and
    the seq of the deciding round (-1 for a decision restored from a state_dict)."""
    out = {}
    for qualified, m in module.named_modules():
        if isinstance(m, SyncBatchNorm) and m.scope == "auto":
            out[m.layer_name or qualified or type(m).__name__] = m.auto_decision
    return out


def divergence(module, groups=False):
    """How far each node's statistics were from the global ones, per synchronized layer of
    `module` in shadow scope (auto scope's warm-up included), as the root has recorded them so
    far: a dict from the layer's name to a list of {"node", "rounds", "mean_shift_avg",
    "mean_shift_max", "var_ratio_avg", "log_var_ratio_abs_avg"} (docs/PROTOCOL.md, "Scopes").
    groups=True: the same per group of a job with groups ("group" instead of "node"). Empty
    when no layer runs in shadow scope or the root has not seen a shadow round yet. The root can
    also keep the record after the job ends (hsbn-aggregator --divergence-dir). With a group
    tier (docs/DEPLOY.md, "Group tier") the root records per group and each group aggregator
    per node: a rank sees the nodes of its own group (and every group)."""
    client = model_client(module)
    if client is None:
        return {}
    names = {}
    for qualified, m in module.named_modules():
        if isinstance(m, SyncBatchNorm) and m.op is not None:
            names[int(m.op)] = m.layer_name or qualified or type(m).__name__
    status = client.status(include_upstream=True)
    out = {}
    unit = "group" if groups else "node"
    seen = {}  # (op, unit index) -> row: the level nearest the root wins
    level = status.get("upstream") or {}
    while level:
        for job in level.get("jobs", []):
            if job.get("jobId") != client.job_id:
                continue
            for d in job.get("groupDivergence" if groups else "divergence", []):
                op = int(d.get("op", 0))
                if op not in names:
                    continue
                seen[(op, int(d.get("node", 0)))] = {
                    unit: int(d.get("node", 0)),
                    "rounds": int(d.get("rounds", 0)),
                    "mean_shift_avg": float(d.get("meanShiftAvg", 0.0)),
                    "mean_shift_max": float(d.get("meanShiftMax", 0.0)),
                    "var_ratio_avg": float(d.get("varRatioAvg", 0.0)),
                    "log_var_ratio_abs_avg": float(d.get("logVarRatioAbsAvg", 0.0)),
                }
        level = level.get("upstream") or {}
    for (op, _), row in sorted(seen.items()):
        out.setdefault(names[op], []).append(row)
    for rows in out.values():
        rows.sort(key=lambda r: r["group" if groups else "node"])
    return out
