"""A trainer for test_torchrun.py, launched by torchrun: a one-layer model converted with
hsbn.torch.convert_sync_batchnorm, two training steps on this rank's batches, its outputs,
gradients and running statistics saved for the test to compare with BatchNorm over the scope's
batch.

    torchrun ... torchrun_trainer.py DATA.npz OUT_DIR SCOPE
"""

import json
import os
import sys

import numpy as np
import torch

import hsbn
import hsbn.torch


def main(data_path, out_dir, scope):
    rank = int(os.environ["RANK"])
    data = np.load(data_path)
    steps = int(data["steps"])
    model = hsbn.torch.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.BatchNorm2d(int(data["C"])).double()), scope=scope)
    bn = model[0]
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(data["weight"]))
        bn.bias.copy_(torch.from_numpy(data["bias"]))
    out = {}
    for s in range(steps):
        x = torch.from_numpy(data["x_%d_%d" % (rank, s)]).requires_grad_()
        bn.zero_grad()
        y = model(x)
        (y * torch.from_numpy(data["g_%d_%d" % (rank, s)])).sum().backward()
        for key, t in (("y", y), ("dx", x.grad), ("dw", bn.weight.grad), ("db", bn.bias.grad)):
            out["%s_%d" % (key, s)] = t.detach().numpy().copy()  # grads are reused in place
    out["running_mean"] = bn.running_mean.numpy()
    out["running_var"] = bn.running_var.numpy()
    np.savez(os.path.join(out_dir, "rank%d.npz" % rank), **out)
    client = hsbn.default_client()
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID", "HSBN_JOB_ID", "HSBN_ADDRESS")},
            "client": {"rank": client.rank, "node_rank": client.node_rank,
                       "job_id": client.job_id, "num_nodes": client.num_nodes}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
