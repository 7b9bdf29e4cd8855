"""Functions tests/python/test_cluster_run.py runs in LocalCluster workers (importable, as
LocalCluster.run needs)."""

import os

import torch


def tensors_of_rank():
    rank = int(os.environ["RANK"])
    return {"rank": rank, "full": torch.full((3,), float(rank)),
            "nested": [torch.arange(4, dtype=torch.float64) * rank]}
