"""Which renorm layers wait for their global statistics: the compare tool's CNN in scope renorm
(this hsbn's defaults), 4 nodes x 2 workers behind the 1 ms link, 40 steps of random data;
per worker and layer, how many of the calls that used global statistics found them not yet
there, and the time spent in client.global_stats over all its fetches (the first ones
included, which can wait for the job's first global round).
Run from the repository: PYTHONPATH=client/python HSBN_LIBRARY=... HSBN_AGGREGATOR=...
/usr/bin/python3 examples/compare/measured/renorm/waits_by_layer.py"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def worker(steps):
    import torch
    import torch.distributed as dist
    import hsbn
    import hsbn.torch
    from hsbn.torch import _renorm
    from hsbncmp import models
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    client = hsbn.Client.from_env()
    hsbn.set_default_client(client)
    rec = []
    real = _renorm.fetch_global

    def fetch(c, op, seq):
        rec.append((int(op), int(seq), bool(c.global_stats_ready(op, seq))))
        return real(c, op, seq)
    _renorm.fetch_global = fetch
    torch.manual_seed(0)
    model = hsbn.torch.convert_sync_batchnorm(models.build("cls"), scope="renorm", client=client,
                                              name="diag")
    names = {int(m.op): n for n, m in model.named_modules() if getattr(m, "op", None) is not None}
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for s in range(steps):
        x = torch.randn(4, 1, 28, 28)
        y = torch.randint(0, 10, (4,))
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    st = hsbn.torch.sync_stats()
    out = {"ms": 1e3 * st.renorm_wait_seconds}
    for op, seq, ready in rec:
        k = names.get(op, op)
        a = out.setdefault(k, [0, 0])
        assert isinstance(a, list)
        a[0] += 1
        a[1] += 0 if ready else 1
    client.close()
    return out


if __name__ == "__main__":
    import hsbn.cluster
    with hsbn.cluster.LocalCluster(nodes=4, workers_per_node=2, link_delay_ms=1) as c:
        res = c.run(worker, 40)
    for r, o in enumerate(res):
        ms = o.pop("ms")
        print("rank %d: %s; %.1f ms in global_stats over all fetches"
              % (r, ", ".join("%s %d/%d waited" % (k, v[1], v[0]) for k, v in sorted(o.items())),
                 ms))
