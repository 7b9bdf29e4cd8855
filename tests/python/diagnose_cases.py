"""What tests/python/test_diagnose.py runs on every rank of a 2 nodes x 2 workers pool:
hsbn.torch.diagnose inside a job, on data where the verdict must be yes or no, and on a model
with every configuration smell."""

import os

import torch
import torch.nn as nn

import hsbn
import hsbn.torch
from hsbn.torch._layer_check import _book

PER_NODE = 2


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))


def _batches(rank, n, size, shift, count=2):
    """`count` batches of n images of size x size, this rank's own; node 1's shifted by
    `shift` (skewed nodes)."""
    g = torch.Generator().manual_seed(100 + rank)
    node = rank // PER_NODE
    return [torch.randn(n, 3, size, size, generator=g) + shift * node for _ in range(count)]


def _training_state(model, client):
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            out[name] = (m.running_mean.clone(), m.running_var.clone(),
                         int(m.num_batches_tracked), getattr(m, "samples_seen", None),
                         getattr(m, "_seq", None), m.training)
    # The next training seq of every layer key (an itertools.count: its repr, read without
    # taking a value).
    book = _book(client)
    out["seqs"] = [repr(book.seqs.get(int(m.op))) for m in model.modules()
                   if isinstance(m, hsbn.torch.SyncBatchNorm)]
    return out


def _same(a, b):
    for k in a:
        for x, y in zip(a[k], b[k]):
            if torch.is_tensor(x):
                if not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


def verdict_case(scope, n, size, shift, name):
    """Trains one step in `scope`, diagnoses two batches, checks that training state did not
    move (running statistics, counters, round seqs, RNG, modes) and that a training step
    still works; returns the report's dict."""
    rank = int(os.environ["RANK"])
    client = hsbn.default_client()
    model = hsbn.torch.convert_sync_batchnorm(_net(), scope=scope, name=name)
    model.train()
    batches = _batches(rank, n, size, shift)
    model(batches[0]).sum().backward()
    before = _training_state(model, client)
    rng = torch.get_rng_state()
    report = hsbn.torch.diagnose(model, batches)
    after = _training_state(model, client)
    out = report.as_dict()
    out["untouched"] = _same(before, after) and torch.equal(rng, torch.get_rng_state())
    out["seqs"] = after["seqs"]
    model(batches[1]).sum().backward()   # the next training step's rounds still match
    out["text"] = report.text()
    return out


class SmellNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.bn_node = nn.BatchNorm2d(8)
        self.bn_untracked = nn.BatchNorm2d(8, track_running_stats=False)
        self.bn_momentum = nn.BatchNorm2d(8, momentum=0.99)
        self.bn_frozen = nn.BatchNorm2d(8)
        self.head = nn.BatchNorm1d(8)

    def forward(self, x):
        x = self.bn_frozen(self.bn_momentum(self.bn_untracked(self.bn_node(self.conv(x)))))
        if hasattr(self, "plain"):
            x = self.plain(x)
        return self.head(x.mean((2, 3)))


def smells_case():
    """A model with every smell: wrapped in DDP (broadcast_buffers=True) before conversion to
    node scope, a plain BatchNorm added afterwards, track_running_stats=False, momentum 0.99,
    a frozen (eval-mode) layer, and a head that sees one sample per channel on rank 0.
    The pool's worker joins gloo once and keeps it (destroy_process_group() can hang in torch
    2.x, docs/PYTORCH.md; the worker leaves with os._exit)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = SmellNet()
    ddp = DistributedDataParallel(net, broadcast_buffers=True)
    hsbn.torch.convert_sync_batchnorm(net, scope="node", name="smelly")
    net.plain = nn.BatchNorm2d(8)
    net.train()
    net.bn_frozen.eval()
    g = torch.Generator().manual_seed(rank)
    n = 1 if rank == 0 else 2
    report = hsbn.torch.diagnose(ddp, [torch.randn(n, 3, 4, 4, generator=g)])
    modes = {name: m.training for name, m in net.named_modules()}
    return {"report": report.as_dict(), "modes": modes}


def group_case():
    """4 nodes x 1 worker in groups of 2 nodes; nodes 1 and 3 shifted by 1.5, so each group
    holds both kinds and its statistics are close to the job's while each node's are not.
    Trained in node scope: the doctor must recommend group."""
    rank = int(os.environ["RANK"])
    client = hsbn.Client.from_env(group_nodes=2, job_id=os.environ["HSBN_JOB_ID"] + "-groups")
    try:
        model = hsbn.torch.convert_sync_batchnorm(_net(), scope="node", client=client,
                                                  name="doctor-groups")
        g = torch.Generator().manual_seed(200 + rank)
        batches = [torch.randn(16, 3, 4, 4, generator=g) + 1.5 * (rank % 2) for _ in range(2)]
        return hsbn.torch.diagnose(model, batches).as_dict()
    finally:
        client.close()


def lagged_guard_case(trip, name):
    """Trains 4 calls in lagged scope with the absolute trip guard at `trip` (0: off), the
    batches of calls 2 and 3 shifted by 3 on every rank (a jump of the job's statistics), then
    diagnoses; returns the report's dict, its text and each layer's own trip record."""
    rank = int(os.environ["RANK"])
    model = hsbn.torch.convert_sync_batchnorm(_net(), scope="lagged", name=name,
                                              lagged_trip=trip, lagged_trip_rel=0.0,
                                              lagged_trip_calls=2, lagged_warmup=1)
    model.train()
    batches = _batches(rank, 4, 2, 1.5, count=4)
    for i, b in enumerate(batches):
        model(b + (3.0 if i >= 2 else 0.0)).sum().backward()
    report = hsbn.torch.diagnose(model, batches[:2])
    out = report.as_dict()
    out["text"] = report.text()
    out["own"] = {n: m.lagged_trips for n, m in model.named_modules()
                  if isinstance(m, hsbn.torch.SyncBatchNorm)}
    return out


def mismatched_call():
    """Rank 0 asks for one batch, the others for two: every rank must raise at the first
    round, before any layer's round."""
    rank = int(os.environ["RANK"])
    model = hsbn.torch.convert_sync_batchnorm(_net(), scope="global", name="doctor-mismatch")
    try:
        hsbn.torch.diagnose(model, _batches(rank, 2, 2, 0.0), num_batches=1 if rank == 0 else 2)
    except hsbn.InvalidArgumentError as e:
        return str(e)
    return None
