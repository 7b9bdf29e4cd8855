"""The client-side arithmetic of SyncBatchNorm alone: worker threads in this process, rounds
reduced by an in-process stand-in for the aggregator (Chan's merge in rank order, sums for
backward). Separates "the layer's math is right" from "the service delivers the right sums";
the process-level tests in test_sync_batchnorm.py check both together."""

import contextlib
import threading

import pytest

import hsbn
import hsbn.torch
import hsbn_cases
from hsbn.torch import _ops
from bnref import assert_group_matches, make_spec


def chan_merge(a, b):
    (ca, ma, m2a), (cb, mb, m2b) = a, b
    if cb == 0:
        return a
    if ca == 0:
        return b
    n = ca + cb
    delta = mb - ma
    return n, ma + delta * (cb / n), m2a + m2b + delta * delta * ca * (cb / n)


class InProcessRounds:
    """Blocks each member until all `size` members of a round contributed, like a sidecar."""

    def __init__(self, size):
        self.size = size
        self.cond = threading.Condition()
        self.rounds = {}

    def reduce(self, key, rank, payload, merge):
        with self.cond:
            r = self.rounds.setdefault(key, {})
            r[rank] = payload
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(r) >= self.size or "result" in r, timeout=30):
                raise TimeoutError("round %s: only ranks %s arrived" % (key, sorted(r)))
            if "result" not in r:
                acc = r[0]
                for i in range(1, self.size):
                    acc = merge(acc, r[i])
                r["result"] = acc
            return r["result"]


class ThreadClient:
    def __init__(self, rounds, rank):
        self.rounds, self.rank = rounds, rank

    def forward(self, op, seq, scope, count, mean, m2):
        return self.rounds.reduce((op, seq, 1), self.rank, (count, mean, m2), chan_merge)

    def backward(self, op, seq, scope, count, a, b):
        return self.rounds.reduce((op, seq, 2), self.rank, (count, a, b),
                                  lambda x, y: (x[0] + y[0], x[1] + y[1], x[2] + y[2]))


def run_threads(spec, data, per_thread=contextlib.nullcontext):
    """bn_steps of every rank on a thread of its own, inside `per_thread()` (a context manager
    entered on that thread)."""
    world = len(data)
    rounds = InProcessRounds(world)
    results, errors = [None] * world, []
    op = hsbn.torch.next_op()

    def worker(rank):
        try:
            with per_thread():
                results[rank] = hsbn_cases.bn_steps(spec, data[rank], ThreadClient(rounds, rank),
                                                    op)
        except BaseException as e:  # reported below
            errors.append((rank, e))
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0][1]
    return results


@pytest.fixture(params=["torch", "kernels"])
def cpu_ops(request):
    """Both CPU backends: float64 torch ops, and hsbn's CPU kernels through their C ABI (the
    same binding the CUDA path uses for CUDA tensors)."""
    if request.param == "kernels" and hsbn._lib.bn_kernels() is None:
        pytest.fail("%s does not export the hsbn_bn_ kernels' C ABI (version %d); the client "
                    "library should link hsbn_kernels" % (hsbn.library_path(),
                                                          hsbn._lib.BN_ABI_VERSION))
    _ops.set_cpu_ops(request.param)
    yield request.param
    _ops.set_cpu_ops("torch")


@pytest.mark.parametrize("spatial,channels_last", [((4, 5), False), ((4, 5), True), ((7,), False),
                                                   ((), False), ((2, 3, 2), True)])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 1e-6)])
def test_layer_math_equals_batchnorm_over_the_concatenated_batch(cpu_ops, spatial,
                                                                 channels_last, dtype, tol):
    spec, data = make_spec("global", dtype, spatial=spatial, channels_last=channels_last, seed=11)
    results = run_threads(spec, data)
    assert_group_matches(results, spec, data, [[0, 1, 2, 3]], tol)


@pytest.mark.parametrize("affine,track", [(False, True), (True, False), (False, False)])
def test_without_affine_parameters_or_running_statistics(cpu_ops, affine, track):
    spec, data = make_spec("global", "float64", seed=12, affine=affine,
                           track_running_stats=track)
    results = run_threads(spec, data)
    assert_group_matches(results, spec, data, [[0, 1, 2, 3]], 1e-12)
    assert all(("running_mean" in r) == track and bool(r["dw"]) == affine for r in results)


def test_one_value_per_channel_in_the_scope_is_an_error_like_batchnorm():
    spec, data = make_spec("global", "float64", spatial=(), sizes=[1, 0], steps=1)
    with pytest.raises(ValueError, match="more than 1 value per channel.*got 1"):
        run_threads(spec, data)
