"""Worker-side halves of the group and auto scope tests (test_group_auto.py): run inside worker
processes of a WorkerPool. Each case joins a job of its own (its own client), so that every
case can choose its nodes per group."""

import io

import torch

import hsbn
import hsbn.torch
import hsbn_cases


def _client(job_suffix, group_nodes=0):
    base = hsbn.default_client().job_id
    return hsbn.Client.from_env(job_id="%s-%s" % (base, job_suffix), group_nodes=group_nodes)


def group_bn_steps(spec, steps, job_suffix, group_nodes):
    """hsbn_cases.bn_steps through a client of a new job with `group_nodes` nodes per group;
    also returns the running statistics' raw bytes (bitwise comparisons)."""
    client = _client(job_suffix, group_nodes)
    try:
        out = hsbn_cases.bn_steps(spec, steps, client=client, op=7)
    finally:
        client.close()
    out["running_bytes"] = out["running_mean"].tobytes() + out["running_var"].tobytes()
    return out


def join_error(group_nodes):
    """The error of joining with `group_nodes` nodes per group (None if it joins)."""
    try:
        _client("join-%d" % group_nodes, group_nodes).close()
    except hsbn.HsbnError as e:
        return "%s: %s" % (type(e).__name__, e)
    return None


# --- auto scope --------------------------------------------------------------------------------

class Net(torch.nn.Module):
    """"skewed" sees each node's data as it comes (offset by node); "even" sees that data
    normalized, during the warm-up by node statistics (shadow scope answers with them): every
    node's batch then has the same mean and, up to eps, the same spread."""

    def __init__(self):
        super().__init__()
        self.skewed = torch.nn.BatchNorm2d(3)
        self.even = torch.nn.BatchNorm2d(3)

    def forward(self, x):
        return self.even(self.skewed(x))


def _plain_net():
    torch.manual_seed(11)
    return Net().double()


def _batch(client, step, spread_by_node=None, offset_by_node=None):
    gen = torch.Generator().manual_seed(1000 * client.rank + step)
    node = client.node_rank
    offset = 3.0 * node if offset_by_node is None else offset_by_node[node]
    spread = 1.0 if spread_by_node is None else spread_by_node[node]
    return torch.randn(4, 3, 16, 16, dtype=torch.float64, generator=gen) * spread + offset


def _forward_rounds(client):
    s = client.stats()
    return {scope: s.get(scope, "forward").completed for scope in ("node", "group", "global",
                                                                    "shadow")}


_target = torch.linspace(-1.0, 1.0, 3, dtype=torch.float64).view(1, 3, 1, 1)


def _train(model, client, steps, first=0, **data):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(first, first + steps):
        opt.zero_grad()
        (model(_batch(client, step, **data)) * _target).sum().backward()
        opt.step()


def auto_decides_per_layer(job_suffix, warmup=None, group_nodes=0, offsets=None):
    """Trains Net converted to scope="auto" (warm-up `warmup`, None: the default 50) until
    just past the decision round, and reports what each rank saw: scopes during the warm-up and
    after, the decisions with the root's numbers, the rounds made by scope after the decision,
    the divergence record and the state_dict metadata (saved to bytes)."""
    client = _client(job_suffix, group_nodes)
    try:
        kw = {} if warmup is None else {"auto_warmup": warmup}
        model = hsbn.torch.convert_sync_batchnorm(_plain_net(), scope="auto", client=client,
                                                  name="autonet", **kw)
        w = 50 if warmup is None else warmup
        _train(model, client, w, offset_by_node=offsets)
        during = hsbn.torch.scopes(model)
        before = _forward_rounds(client)
        _train(model, client, 1, first=w, offset_by_node=offsets)  # the decision round
        decided = hsbn.torch.scopes(model)
        after_decision = _forward_rounds(client)
        _train(model, client, 3, first=w + 1, offset_by_node=offsets)
        after = _forward_rounds(client)
        div = hsbn.torch.divergence(model, groups=group_nodes > 0)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        return {
            "during": during,
            "decided": decided,
            "decisions": hsbn.torch.auto_decisions(model),
            "decision_round": {k: after_decision[k] - before[k] for k in before},
            "after": {k: after[k] - after_decision[k] for k in after},
            "divergence": div,
            "state": buf.getvalue(),
            "rank": client.rank,
        }
    finally:
        client.close()


def resume_from_state(state, job_suffix, steps=3):
    """Loads a state_dict saved by auto_decides_per_layer into a fresh auto-scope Net of a new
    job (strictly) and trains `steps` steps: the decisions must hold from the first step, with
    no shadow round. Also loads the same state_dict strictly into plain torch BatchNorm models
    (the unconverted Net, and a reverted one)."""
    sd = torch.load(io.BytesIO(state))
    plain = _plain_net()
    plain.load_state_dict(sd, strict=True)
    client = _client(job_suffix)
    try:
        model = hsbn.torch.convert_sync_batchnorm(_plain_net(), scope="auto", client=client,
                                                  name="autonet")
        model.load_state_dict(sd, strict=True)
        loaded = hsbn.torch.scopes(model)
        before = _forward_rounds(client)
        _train(model, client, steps)
        after = _forward_rounds(client)
        out = {"loaded": loaded, "scopes": hsbn.torch.scopes(model),
               "decisions": hsbn.torch.auto_decisions(model),
               "rounds": {k: after[k] - before[k] for k in after}}
        again = io.BytesIO()
        torch.save(model.state_dict(), again)
        out["saved_again"] = again.getvalue()
        reverted = hsbn.torch.revert_sync_batchnorm(model)  # in place below the top module
        _plain_net().load_state_dict(reverted.state_dict(), strict=True)
        out["reverted_types"] = sorted({type(m).__name__ for m in reverted.modules()})
        return out
    finally:
        client.close()


def group_nodes_mismatch_error():
    """The error of a layer asking for group_nodes=2 in a process whose client joined without
    groups (the pool's default client)."""
    bn = hsbn.torch.SyncBatchNorm(3, scope="group", group_nodes=2, name="mismatch")
    try:
        bn(torch.randn(4, 3, 2, 2, dtype=torch.float32))
    except hsbn.ConfigurationError as e:
        return str(e)
    return None
