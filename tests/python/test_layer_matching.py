"""Layers matched by their names across ranks, through real aggregators and worker processes:
the layer check at a model's first synchronized forward, errors that name the module, a
one-rank-only extra module, DDP's broadcast_buffers warning, and a normal exit that leaves.
The tests on worker pools and the normal exit run over both transports of the node's rounds
([shm], [grpc]: transports.py). The DDP ones train in fresh processes once, over the default
(shared memory): they are about layer keys and a warning, and test_ddp.py runs DDP training
over both."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import hsbn
import hsbn.cluster
import hsbn_cases
import names_cases
from bnref import rel_err
from workerpool import on_transport, started

ROUND_TIMEOUT_MS = 30000


@pytest.fixture(scope="module")
def workers():
    with started(nodes=2, workers_per_node=2, round_timeout_ms=ROUND_TIMEOUT_MS) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool(workers, transport):
    yield from on_transport(workers, transport)


# variant -> (first differing position, {rank: what it has there})
MISMATCHES = {
    "renamed": (1, {0: "'block_bn' (global, 4 channels)", 1: "'block_norm' (global, 4 channels)",
                    2: "'block_bn' (global, 4 channels)", 3: "'block_bn' (global, 4 channels)"}),
    "wider": (1, {0: "'block_bn' (global, 4 channels)", 1: "'block_bn' (global, 4 channels)",
                  2: "'block_bn' (global, 6 channels)", 3: "'block_bn' (global, 4 channels)"}),
    "extra": (3, {0: "no layer (its model has 3 synchronized layers)",
                  1: "no layer (its model has 3 synchronized layers)",
                  2: "no layer (its model has 3 synchronized layers)",
                  3: "'tail_bn' (global, 4 channels)"}),
    "scoped": (2, {0: "'head_bn' (node, 4 channels)", 1: "'head_bn' (global, 4 channels)",
                   2: "'head_bn' (global, 4 channels)", 3: "'head_bn' (global, 4 channels)"}),
}


@pytest.mark.parametrize("variant", sorted(MISMATCHES))
def test_an_architecture_mismatch_fails_on_every_rank_at_once_naming_the_layers(pool, variant):
    name = "mismatch-" + variant
    results = pool.call(names_cases.mismatch_forward, [(variant, name)] * 4, timeout=120)
    position, expected = MISMATCHES[variant]
    for rank, r in enumerate(results):
        assert r["raised"] == "LayerMismatchError", (rank, r)
        assert r["model"] == name and r["position"] == position, (rank, r)
        assert r["layers"] == expected, (rank, r["layers"])
        for text in set(expected.values()):
            assert text in r["message"], (rank, r["message"])
        assert "synchronized layer #%d" % position in r["message"]
    # Every rank knows as soon as the last one reaches the model: the check makes a handful of
    # rounds. The bound is far below the 30 s round deadline, so the error cannot come from it.
    last_arrival = max(r["t0"] for r in results)
    latency = max(r["t1"] for r in results) - last_arrival
    print("mismatch %s: every rank raised %.3f s after the last one started" % (variant, latency))
    assert latency < ROUND_TIMEOUT_MS / 1000.0 / 3


def test_ranks_that_disagree_on_the_check_itself_are_told_in_words_which_layers(pool):
    # Rank 0 converted every layer with node scope, the others with global: the check's own
    # round has ranks of one node in node and global scope, which the aggregator refuses.
    results = pool.call(names_cases.mismatch_forward, [("nodeonly", "check-scope")] * 4,
                        timeout=120)
    for rank, r in enumerate(results):
        assert r["raised"] == "InvalidArgumentError" and r["reason"] == "INVALID_CONTRIBUTION", r
        msg = r["message"]
        assert msg.startswith("hsbn: the layer check of model 'check-scope' failed. The ranks "
                              "disagree on the check itself"), msg
        assert "seq" not in msg and "op " not in msg, msg  # no internal round numbers
        here = ("this rank has only node-scope layers" if rank == 0 else
                "this rank's layers with a scope wider than node: 'stem_bn', 'block_bn', "
                "'head_bn'")
        assert here in msg, (rank, msg)


def test_the_same_model_on_every_rank_passes_the_check_and_trains(pool):
    results = pool.call(names_cases.mismatch_forward, [("same", "matching")] * 4, timeout=120)
    assert all(r["raised"] is None for r in results), results


def test_a_one_rank_only_extra_module_trains_normally():
    torch.manual_seed(0)
    model = hsbn_cases.SmallCNN()
    initial = hsbn_cases.state_numpy(model)
    initial = {k: v.astype(np.float32) if "num_batches" not in k else v.astype(np.int64)
               for k, v in initial.items()}
    rng = np.random.default_rng(1)
    batches = [[(rng.standard_normal((4, 3, 6, 6)).astype(np.float32) + np.float32(r // 2),
                 rng.integers(0, 5, 4).astype(np.int64)) for _ in range(3)] for r in range(4)]
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=2,
                                   round_timeout_ms=ROUND_TIMEOUT_MS) as c:
        states = c.run(names_cases.train_with_rank_zero_extras, initial, batches, timeout=240)
    hsbn_cases.train(model, [(np.concatenate([batches[r][s][0] for r in range(4)]),
                              np.concatenate([batches[r][s][1] for r in range(4)]))
                             for s in range(3)])
    expected = hsbn_cases.state_numpy(model)
    for rank, state in enumerate(states):
        for key in expected:
            err = rel_err(state[key], expected[key])
            assert err <= 1e-5, "rank %d, %s: relative error %.3g" % (rank, key, err)
    assert rel_err(initial["conv1.weight"], expected["conv1.weight"]) > 1e-3


@pytest.fixture(scope="module")
def short_deadline_workers():
    with started(nodes=1, workers_per_node=2, root=False, round_timeout_ms=3000) as pool:
        yield pool


@pytest.fixture(scope="module")
def short_deadline_pool(short_deadline_workers, transport):
    yield from on_transport(short_deadline_workers, transport)


def test_a_forward_round_that_fails_names_the_layer_and_its_model(short_deadline_pool):
    results = short_deadline_pool.call(names_cases.one_rank_runs_a_layer_alone,
                                       [("WithAux",)] * 2, timeout=60)
    assert results[1] is None
    assert results[0]["type"] == "DeadlineExceededError", results[0]
    assert "forward round of layer 'aux' of model 'WithAux'" in results[0]["message"], results[0]


def test_a_backward_round_that_fails_names_the_layer_and_its_model(short_deadline_pool):
    results = short_deadline_pool.call(names_cases.one_rank_skips_backward,
                                       [("NoBackward",)] * 2, timeout=60)
    assert results[0]["type"] == "DeadlineExceededError", results[0]
    assert "backward round of layer 'bn' of model 'NoBackward'" in results[0]["message"], \
        results[0]


def test_too_few_values_in_the_scope_names_the_layer(short_deadline_pool):
    results = short_deadline_pool.call(names_cases.one_value_in_the_scope, [("Tiny",)] * 2,
                                       timeout=60)
    for message in results:
        assert "Expected more than 1 value per channel" in message, message
        assert "layer 'bn' of model 'Tiny'" in message, message


def test_ddp_broadcast_buffers_warns_once_for_node_and_shadow_scope():
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1,
                                   round_timeout_ms=ROUND_TIMEOUT_MS) as c:
        results = c.run(names_cases.ddp_broadcast_buffer_warnings, timeout=240)
    for rank, (global_true, node_false, node_true, shadow_true) in enumerate(results):
        assert global_true == [] and node_false == [], (rank, results[rank])
        assert len(node_true) == 1, (rank, node_true)
        assert "node scope" in node_true[0] and "broadcast_buffers=False" in node_true[0]
        assert "model 'node-True'" in node_true[0], node_true[0]
        assert shadow_true == [], "warned more than once: %s" % shadow_true


def _wait_for_exit_line(cluster, job_id):
    """The node's log line about rank 0 of `job_id` leaving or disconnecting, once written."""
    import time
    left = "job '%s': rank 0 (node 0, local rank 0) left" % job_id
    broke = "job '%s': rank 0 (node 0, local rank 0) disconnected" % job_id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        log = cluster.logs()["node0"]
        for line in (left, broke):
            if line in log:
                return line, log
        time.sleep(0.05)
    return None, cluster.logs()["node0"]


def test_a_normal_exit_of_a_trainer_is_logged_as_a_leave(transport_env):
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1, root=False) as c:
        # A trainer run as a script (as torchrun runs it) ...
        env = c.worker_env(0, job_id="exit-script")
        code = "import names_cases; print(*names_cases.synchronized_forward(), sep='\\n')"
        here = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=240)
        assert proc.returncode == 0, proc.stdout.decode()
        assert proc.stdout.decode().splitlines()[-1] == transport_env, proc.stdout.decode()
        line, log = _wait_for_exit_line(c, "exit-script")
        assert line is not None and line.endswith(" left"), log
        # ... and a multiprocessing child (mp.spawn, LocalCluster.run), which skips atexit.
        job, used = c.run(names_cases.synchronized_forward, job_id="exit-spawned", timeout=240)[0]
        assert used == transport_env
        line, log = _wait_for_exit_line(c, job)
        assert line is not None and line.endswith(" left"), log
        assert "disconnected" not in log, log


def test_a_first_step_error_that_is_not_about_layers_carries_no_layer_hint(tmp_path):
    # Two nodes, no root: the model's first synchronized round (its layer check, global scope)
    # is refused at once by the sidecar (FAILED_PRECONDITION: "this sidecar has no root"). The
    # hint about ranks that did not run the model belongs to deadlines only: it was added to
    # every error whose text holds "rank", which this one does.
    with hsbn.cluster.LocalCluster(nodes=2, workers_per_node=1, root=False) as c:
        client = hsbn.Client.from_env(c.worker_env(0))
        try:
            model = hsbn.torch.convert_sync_batchnorm(
                torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3)),
                scope="global", client=client, name="hintless")
            with pytest.raises(hsbn.HsbnError) as info:
                model(torch.randn(2, 2, 3, 3))
        finally:
            client.close()
    assert info.value.code == hsbn.errors.FAILED_PRECONDITION, info.value
    assert isinstance(info.value, hsbn.FailedPreconditionError), type(info.value)
    assert not isinstance(info.value, hsbn.InvalidArgumentError), type(info.value)
    assert "--upstream" in str(info.value)
    assert "did not run model" not in str(info.value), str(info.value)
