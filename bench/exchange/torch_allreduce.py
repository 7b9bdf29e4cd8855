"""torch.distributed.all_reduce over the gloo backend: the same plan as bench_common.h.

One process per rank, started by run.py with /usr/bin/python3 (Debian's PyTorch). Each round is
one all_reduce(SUM) of a float64 tensor of 2*C + 1 elements, in place, as SyncBatchNorm's
exchange would be done with torch.distributed. Writes the same sample file format as
bench_common.h's RunPlan.
"""
import argparse
import os
import resource
import time

import torch
import torch.distributed as dist


def resnet50_channels():
    channels = [64]
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            channels += [width, width, width * 4]
            if b == 0:
                channels.append(width * 4)
    assert len(channels) == 53
    return channels


def contribution(rank, c):
    t = torch.empty(2 * c + 1, dtype=torch.float64)
    t[0] = 8.0 + rank
    idx = torch.arange(c, dtype=torch.float64)
    t[1:c + 1] = 0.001 * idx + 0.1 * rank
    t[c + 1:] = 1.0 + 0.01 * idx + rank
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True, help="init_method, e.g. tcp://127.0.0.1:PORT")
    ap.add_argument("--channels", default="256")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--resnet-steps", type=int, default=0)
    ap.add_argument("--resnet-warmup", type=int, default=2)
    ap.add_argument("--out", required=True)
    a, _ = ap.parse_known_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world)
    clock = time.perf_counter_ns
    rounds_total = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    with open(a.out, "w") as f:
        for c in [int(x) for x in a.channels.split(",") if x]:
            src = contribution(a.rank, c)
            buf = src.clone()
            for _ in range(a.warmup):
                buf.copy_(src)
                dist.all_reduce(buf)
            samples = []
            for _ in range(a.rounds):
                t0 = clock()
                buf.copy_(src)
                dist.all_reduce(buf)
                samples.append(clock() - t0)
            rounds_total += a.warmup + a.rounds
            f.write("lat %d fwd node %s\n" % (c, " ".join(map(str, samples))))
            f.flush()
        if a.resnet_steps > 0:
            layers = resnet50_channels()
            srcs = [contribution(a.rank, c) for c in layers]
            bufs = [s.clone() for s in srcs]
            samples = []
            for step in range(a.resnet_warmup + a.resnet_steps):
                t0 = clock()
                for l in range(len(layers)):
                    bufs[l].copy_(srcs[l])
                    dist.all_reduce(bufs[l])
                for l in reversed(range(len(layers))):
                    bufs[l].copy_(srcs[l])
                    dist.all_reduce(bufs[l])
                if step >= a.resnet_warmup:
                    samples.append(clock() - t0)
                rounds_total += 2 * len(layers)
            f.write("step node %s\n" % " ".join(map(str, samples)))
        ru = resource.getrusage(resource.RUSAGE_SELF)
        f.write("cost %d %d %d %d %d\n" % (
            rounds_total, int((ru.ru_utime - ru0.ru_utime) * 1e9),
            int((ru.ru_stime - ru0.ru_stime) * 1e9), ru.ru_nvcsw - ru0.ru_nvcsw,
            ru.ru_nivcsw - ru0.ru_nivcsw))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
