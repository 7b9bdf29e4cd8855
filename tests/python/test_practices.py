"""Training practices with hsbn layers on a real job (1 node x 2 workers, global scope, float64),
each against one process running torch's BatchNorm over the concatenated batch
(docs/PYTORCH.md, "Training practices")."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import practices_cases as cases
from workerpool import started

WORLD = cases.WORLD


@pytest.fixture(scope="module")
def pool():
    with started(nodes=1, workers_per_node=2, root=False, round_timeout_ms=5000) as p:
        yield p


def one_process(xs_per_step, ckpt=False):
    """torch BatchNorm over the ranks' batches concatenated, step by step: the model after
    (y * y).sum().backward() of every step (gradients accumulate), and the input gradients."""
    model = cases.net().double()
    dxs = []
    for xs in xs_per_step:
        x = torch.cat(xs).requires_grad_()
        y = checkpoint(model, x, use_reentrant=True) if ckpt else model(x)
        (y * y).sum().backward()
        dxs.append(x.grad)
    return model, dxs


def bn_state(model):
    return {k: v for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def assert_state(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.allclose(got[k].double(), want[k].double(), rtol=1e-12, atol=1e-12), k


def test_activation_checkpointing_keeps_rounds_matched_and_updates_like_torch(pool):
    out = pool.call(cases.checkpointed, [("ckpt",)] * WORLD)
    for r in out:
        # Recomputation in backward gives the same statistics: the same gradients, bit for bit.
        assert torch.equal(r["checkpoint"]["dx"], r["plain"]["dx"])
        assert all(torch.equal(a, b) for a, b in zip(r["checkpoint"]["grads"],
                                                     r["plain"]["grads"]))
        # 2 layers x (forward + backward) + the layer check; checkpointing adds the two
        # recomputed forwards, and their running-statistics updates, as torch's BatchNorm does.
        assert (r["plain"]["rounds"], r["checkpoint"]["rounds"]) == (5, 7)
        assert int(r["checkpoint"]["bn"]["1.num_batches_tracked"]) == 2
    plain, _ = one_process([[cases.data(k) for k in range(WORLD)]])
    ckpt, _ = one_process([[cases.data(k) for k in range(WORLD)]], ckpt=True)
    for r in out:
        assert_state(r["plain"]["bn"], bn_state(plain))
        assert_state(r["checkpoint"]["bn"], bn_state(ckpt))


def test_gradient_accumulation_normalizes_each_micro_batch_over_the_job(pool):
    out = pool.call(cases.accumulated, [("accumulate", 2)] * WORLD)
    steps = [[cases.data(k, 4).split(2)[m] for k in range(WORLD)] for m in range(2)]
    want, _ = one_process(steps)
    for r in out:
        assert_state(r["bn"], bn_state(want))
        assert int(r["bn"]["1.num_batches_tracked"]) == 2   # once per micro-batch
    # Each rank holds its share of the weight gradients; summed (as DDP does) they are the
    # one process's.
    for i, p in enumerate(want.parameters()):
        assert torch.allclose(sum(r["grads"][i] for r in out), p.grad, rtol=1e-10, atol=1e-12)


def test_eval_passes_make_no_rounds_and_no_grad_training_passes_do(pool):
    out = pool.call(cases.eval_and_no_grad_between_steps, [("between",)] * WORLD)
    for r in out:
        # step (check + 2 x 2), eval (nothing), no_grad in train mode (2 forwards), step (4)
        assert r["rounds"] == [5, 0, 2, 4]
        assert int(r["bn"]["1.num_batches_tracked"]) == 3
    model = cases.net().double()
    for seed in (1, 3, 4):
        model(torch.cat([cases.data(k, seed=seed) for k in range(WORLD)]))
    for r in out:
        assert_state(r["bn"], bn_state(model))


def test_two_models_in_one_process_run_in_the_same_order_on_every_rank(pool):
    out = pool.call(cases.two_models, [(["ab", "ab"],)] * WORLD)
    x = torch.cat([cases.data(k, seed=5) for k in range(WORLD)])
    a, b = cases.net().double(), cases.net().double()
    a(x)
    b(x * 2)
    for r in out:
        assert_state(r["a"], bn_state(a))
        assert_state(r["b"], bn_state(b))


def test_two_models_in_opposite_orders_wait_for_each_other_until_the_deadline(pool):
    """Each rank blocks in its first model's round until every rank contributes to it: with
    one rank running a then b and the other b then a, both wait, and the round deadline
    names the missing rank. Names keep the keys apart, not the order."""
    from workerpool import WorkerError
    with pytest.raises(WorkerError, match="DEADLINE_EXCEEDED"):
        pool.call(cases.two_models, [(["ab", "ba"],)] * WORLD)
