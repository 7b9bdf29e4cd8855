"""Worker-side halves of the tests: run inside worker processes (see workerpool.py and
LocalCluster.run). Each takes plain data (numpy arrays, dicts) and returns plain data."""

import os
import signal
import time

import torch

import hsbn
import hsbn.torch


def _dtype(name):
    return getattr(torch, name)


def _np(t):
    # A copy: a float64 CPU tensor's numpy() is a view, and gradients accumulate in place.
    return t.detach().to(device="cpu", dtype=torch.float64).numpy().copy()


def bn_steps(spec, steps, client=None, op=None):
    """Builds one hsbn SyncBatchNorm from `spec` and runs `steps` training steps (forward, then
    backward of sum(y * g)); then, if spec asks, one eval-mode forward. Returns per-step outputs
    and gradients and the final running statistics, as float64 numpy arrays."""
    dtype = _dtype(spec["dtype"])
    affine = spec.get("affine", True)
    bn = hsbn.torch.SyncBatchNorm(spec["C"], eps=spec.get("eps", 1e-5),
                                  momentum=spec.get("momentum", 0.1), affine=affine,
                                  track_running_stats=spec.get("track_running_stats", True),
                                  scope=spec["scope"], client=client, op=op,
                                  **spec.get("renorm", {}), **spec.get("options", {}))
    device = torch.device(spec.get("device", "cpu"))
    bn.to(device=device, dtype=_dtype(spec.get("param_dtype", spec["dtype"])))
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.from_numpy(spec["weight"]))
            bn.bias.copy_(torch.from_numpy(spec["bias"]))
    out = {"y": [], "dx": [], "dw": [], "db": [], "channels_last": [], "y_dtype": None,
           "op": bn.op}
    for x_np, g_np in steps:
        x = torch.from_numpy(x_np).to(device=device, dtype=dtype)
        if spec.get("channels_last"):
            fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
            x = x.contiguous(memory_format=fmt)
        x.requires_grad_()
        bn.zero_grad()
        y = bn(x)
        (y * torch.from_numpy(g_np).to(device=device, dtype=dtype)).sum().backward()
        out["y"].append(_np(y))
        out["dx"].append(_np(x.grad))
        if affine:
            out["dw"].append(_np(bn.weight.grad))
            out["db"].append(_np(bn.bias.grad))
        if spec.get("channels_last"):
            fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
            out["channels_last"].append((y.is_contiguous(memory_format=fmt),
                                         x.grad.is_contiguous(memory_format=fmt)))
        out["y_dtype"] = str(y.dtype)
        out["grad_dtype"] = str(x.grad.dtype)
    if bn.track_running_stats:
        out["running_mean"] = _np(bn.running_mean)
        out["running_var"] = _np(bn.running_var)
        out["running_dtype"] = str(bn.running_mean.dtype)
        out["num_batches_tracked"] = int(bn.num_batches_tracked)
    if spec.get("eval_input") is not None:
        rounds_before = _rounds_completed()
        bn.eval()
        with torch.no_grad():
            out["y_eval"] = _np(bn(torch.from_numpy(spec["eval_input"]).to(device=device,
                                                                            dtype=dtype)))
        out["rounds_before_eval"] = rounds_before
        out["rounds_after_eval"] = _rounds_completed()
    return out


def bn_steps_over_both_transports(cases, job_prefix):
    """Runs bn_steps for each (spec, steps) of `cases` once in job `job_prefix`-shm, whose node
    rounds travel through shared memory, then in `job_prefix`-grpc, on the gRPC stream: a client
    for each, joined with HSBN_TRANSPORT set for it. Returns, per transport, what its client's
    stats() said and the results."""
    import transports
    out = {}
    for name in transports.NAMES:
        saved = os.environ.get("HSBN_TRANSPORT")
        os.environ["HSBN_TRANSPORT"] = transports.ENV[name]
        try:
            client = hsbn.Client.from_env(job_id="%s-%s" % (job_prefix, name))
        finally:
            if saved is None:
                del os.environ["HSBN_TRANSPORT"]
            else:
                os.environ["HSBN_TRANSPORT"] = saved
        try:
            results = [bn_steps(spec, steps, client=client, op=100 + i)
                       for i, (spec, steps) in enumerate(cases)]
            out[name] = {"transport": client.stats().transport, "results": results}
        finally:
            client.close()
    return out


def _job_status(status, job_id):
    for job in status.get("jobs", []):
        if job.get("jobId") == job_id:
            return job
    return None


def _rounds_completed():
    client = hsbn.default_client()
    job = _job_status(client.status(include_upstream=False), client.job_id)
    return int(job.get("roundsCompleted", 0)) if job else None


def status(include_upstream=True):
    client = hsbn.default_client()
    return {"job_id": client.job_id, "status": client.status(include_upstream=include_upstream)}


def wait_for_divergence(op, nodes, timeout=10.0):
    """The root's divergence entries for layer `op` of this job, once every node has one."""
    client = hsbn.default_client()
    deadline = time.monotonic() + timeout
    while True:
        st = client.status(include_upstream=True)
        up = st.get("upstream") or {}
        job = _job_status(up, client.job_id) or {}
        entries = [d for d in job.get("divergence", []) if int(d.get("op", 0)) == op]
        if len({int(d.get("node", 0)) for d in entries}) >= nodes or time.monotonic() > deadline:
            return {"entries": entries, "status": st}
        time.sleep(0.05)


def client_info():
    c = hsbn.default_client()
    return dict(rank=c.rank, world_size=c.world_size, local_rank=c.local_rank,
                local_world_size=c.local_world_size, node_rank=c.node_rank,
                num_nodes=c.num_nodes, job_id=c.job_id)


def forward_round_timed(C, scope="global"):
    """One synchronized forward of a fresh layer; returns how it ended and how long it took."""
    bn = hsbn.torch.SyncBatchNorm(C, scope=scope)
    x = torch.randn(4, C, 3, dtype=torch.float64)
    t0 = time.monotonic()
    try:
        bn.double()(x)
    except Exception as e:  # the point of the case: which exception, how fast
        return {"raised": type(e).__name__, "is_hsbn": isinstance(e, hsbn.HsbnError),
                "message": str(e), "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0}


def hang_then_die():
    """Joins like the others, then never contributes; the test kills this process."""
    hsbn.default_client()
    bn = hsbn.torch.SyncBatchNorm(2)  # keep the op counter in step with the other ranks
    del bn
    time.sleep(600)


def pid():
    return os.getpid()


# --- DDP -----------------------------------------------------------------------------------------

class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(6)
        self.conv2 = torch.nn.Conv2d(6, 8, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)
        self.bn3 = torch.nn.BatchNorm1d(5)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = x.mean(dim=(2, 3))
        return self.bn3(self.fc(x))


def train(model, batches, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()


def state_numpy(model):
    return {k: v.detach().double().numpy().copy() for k, v in model.state_dict().items()}


def ddp_train(initial_state, batches_by_rank, scope="global", options=None):
    """Converts SmallCNN to hsbn BatchNorm of `scope` (with convert_sync_batchnorm's `options`),
    wraps it in DDP (gloo) and trains it on this rank's batches; returns the final state.
    Like every LocalCluster worker of these tests it leaves gloo by exiting, without
    destroy_process_group(), which can hang in torch 2.x (docs/PYTORCH.md)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = SmallCNN()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial_state.items()})
    model = hsbn.torch.convert_sync_batchnorm(model, scope=scope, **(options or {}))
    ddp = DistributedDataParallel(model)
    train(ddp, batches_by_rank[dist.get_rank()])
    return state_numpy(model)


def and_transport(fn, *args):
    """fn(*args), and the transport of this process's default client's node (Client.stats())."""
    value = fn(*args)
    return value, hsbn.default_client().stats().transport


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def shadow_divergence_by_name(nodes, timeout=30.0):
    """Trains a converted two-layer model in shadow scope on this rank's data (shifted by its
    node) and returns hsbn.torch.divergence(model) once the root has a record of every node,
    with the root's own record under "_root": {op: layer name it shows}."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3),
                                torch.nn.ReLU(), torch.nn.Conv2d(3, 3, 1), torch.nn.BatchNorm2d(3))
    model = hsbn.torch.convert_sync_batchnorm(model.double(), scope="shadow", name="divnet")
    client = hsbn.default_client()
    gen = torch.Generator().manual_seed(100 + client.rank)
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64, generator=gen) + 3.0 * client.node_rank
    for _ in range(2):
        model(x).sum().backward()
    deadline = time.monotonic() + timeout
    while True:
        div = hsbn.torch.divergence(model)
        if (len(div) == 2 and all(len(rows) >= nodes and all(r["rounds"] >= 2 for r in rows)
                                  for rows in div.values())) or time.monotonic() > deadline:
            root = _job_status(client.status(include_upstream=True).get("upstream", {}),
                               client.job_id) or {}
            ops = {int(m.op) for m in model.modules() if getattr(m, "op", None) is not None}
            div["_root"] = {int(d["op"]): d.get("layer", "") for d in root.get("divergence", [])
                            if int(d["op"]) in ops}
            return div
        time.sleep(0.05)
