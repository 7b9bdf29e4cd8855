"""hsbn.torch.diagnose in a real job (2 nodes x 2 workers: a root, two sidecars, four worker
processes): verdict "yes" on skewed nodes with a small per-rank batch, "no" on the same
distribution everywhere with a large one, every configuration smell named with its layers, the
training state left as it was, and `hsbn doctor` rendering a saved report."""

import json
import subprocess
import sys

import pytest

import diagnose_cases as cases
from workerpool import started

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with started(nodes=2, workers_per_node=2, round_timeout_ms=60000) as p:
        yield p


def _same_on_every_rank(reports):
    """Every rank gets the same numbers (the round times are each rank's own)."""
    timed = ("round_ms", "training_round_ms", "cost", "summary", "text")
    strip = [dict({k: v for k, v in r.items() if k not in timed}, job=dict(r["job"], rank=None),
                  layers=[dict(e, cost_ms_per_step=None) for e in r["layers"]])
             for r in reports]
    for k in strip[0]:
        assert all(s[k] == strip[0][k] for s in strip), k


def test_skewed_nodes_and_a_small_batch_say_yes_and_global(pool, tmp_path):
    # 2 images of 2x2 per rank (8 values per channel), node 1's inputs shifted by 1.5.
    out = pool.call(cases.verdict_case, [("node", 2, 2, 1.5, "doctor-yes")] * WORLD)
    _same_on_every_rank(out)
    r = out[0]
    assert r["verdict"] == "yes" and r["batches"] == 2 and r["levels"] == ["local", "node",
                                                                           "global"]
    assert all(o["untouched"] for o in out), "diagnose moved the training state"
    first = r["layers"][0]
    assert first["name"] == "1" and first["training_scope"] == "node"
    assert first["counts"]["local_mean"] == 8 and first["counts"]["node"] == 16
    assert first["counts"]["global"] == 32
    assert first["explains"] and first["recommended"] == "global"
    assert first["divergence"]["node"]["mean_shift"] > 0.3
    assert first["divergence"]["local"]["mean_shift"] >= first["divergence"]["node"][
        "mean_shift"]
    assert r["round_ms"]["node"] > 0 and r["round_ms"]["global"] > 0
    # Sync cost per step: two rounds per layer at the measured round time of the level.
    assert r["cost"]["recommended_ms"] == pytest.approx(sum(
        e["cost_ms_per_step"][e["recommended"]] for e in r["layers"]))
    assert first["cost_ms_per_step"]["global"] == pytest.approx(2 * r["round_ms"]["global"])
    # Node is beyond the thresholds, global within: lagged is offered at node rounds' cost.
    assert first["alternative"] == "lagged"
    assert first["cost_ms_per_step"]["lagged"] == pytest.approx(2 * r["round_ms"]["node"])
    assert r["cost"]["alternative_ms"] == pytest.approx(sum(
        e["cost_ms_per_step"][e["alternative"] or e["recommended"]] for e in r["layers"]))
    assert "scope='lagged'" in r["summary"]
    assert r["smells"] == [] and r["lagged_guard"] == []
    assert "lagged trip guard" not in r["text"]
    assert "VERDICT: YES" in r["text"] and "'1', trained in node scope" in r["text"]
    # The batch column shows what the layer normalizes with as trained: its node's 16 values.
    row = next(line for line in r["text"].splitlines() if line.startswith("1 "))
    assert row.split()[1:3] == ["node", "16"], row
    assert " global (" in row and " or lagged (" in row, row
    # The saved report renders without the job: text, JSON and a picture.
    path = tmp_path / "report.json"
    path.write_text(json.dumps({k: v for k, v in r.items()
                                if k not in ("untouched", "text", "seqs")}))
    png = tmp_path / "report.png"
    proc = subprocess.run([sys.executable, "-m", "hsbn.cli", "doctor", str(path), "--plot",
                           str(png)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hsbn doctor: is a multi-GPU accuracy gap")
    assert "VERDICT: YES" in proc.stdout and r["summary"] in proc.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "hsbn.cli", "doctor", str(bad)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 1 and "not an hsbn doctor report" in proc.stderr


def test_the_same_distribution_and_a_large_batch_say_no(pool):
    # 64 images of 8x8 per rank (4096 values per channel), no shift, trained locally.
    out = pool.call(cases.verdict_case, [("local", 64, 8, 0.0, "doctor-no")] * WORLD)
    _same_on_every_rank(out)
    r = out[0]
    assert r["verdict"] == "no", r["text"]
    assert all(o["untouched"] for o in out), "diagnose moved the training state"
    for e in r["layers"]:
        assert e["training_scope"] == "local" and not e["explains"]
        assert e["recommended"] == "local" and e["counts"]["local_mean"] == 4096
        assert e["alternative"] is None
        assert e["divergence"]["local"]["mean_shift"] < 0.05
        assert e["divergence"]["local"]["log_var_ratio"] < 0.05
    assert r["cost"]["as_trained_ms"] == r["cost"]["recommended_ms"] == 0.0
    assert "VERDICT: NO" in r["text"] and "smells: none found" in r["text"]


def test_the_lagged_trip_guard_is_reported_per_layer(pool):
    # Inputs shifted from the third call on: with the absolute trip on, both layers trip at
    # their fourth call (training call 3, counted from 0), whose last two training calls (the
    # second and third) straddle the jump; the same on every rank.
    out = pool.call(cases.lagged_guard_case, [(0.5, "doctor-trip")] * WORLD)
    _same_on_every_rank([{k: v for k, v in o.items() if k != "own"} for o in out])
    r = out[0]
    guard = r["lagged_guard"]
    assert [g["name"] for g in guard] == ["1", "4"], guard
    for g in guard:
        own = out[0]["own"][g["name"]]
        assert g["trips"] == len(own) >= 1 and g["last_call"] == own[-1][0] == 3, (g, own)
        assert g["last_drift"] == pytest.approx(own[-1][2]) and g["last_drift"] > 0.5
        assert (g["trip"], g["trip_rel"], g["trip_calls"]) == (0.5, 0.0, 2)
        assert all(o["own"] == out[0]["own"] for o in out)
    assert "2 of 2 lagged layers tripped so far: 1 " in r["text"], r["text"]
    assert "train it in global scope" in r["text"]
    # Trip guard off: listed, no trip.
    out = pool.call(cases.lagged_guard_case, [(0.0, "doctor-notrip")] * WORLD)
    r = out[0]
    assert [g["trips"] for g in r["lagged_guard"]] == [0, 0]
    assert "(relative off, absolute off; a trip runs the layer exact global for 2 calls): " \
           "0 of 2 lagged layers tripped so far" in r["text"], r["text"]


def test_ranks_that_call_it_differently_all_fail_at_once(pool):
    out = pool.call(cases.mismatched_call, [()] * WORLD)
    assert all(m and "did not call it alike" in m for m in out), out


def test_every_smell_is_named_with_its_layers_and_its_fix(pool):
    out = pool.call(cases.smells_case, [()] * WORLD)
    r = out[0]["report"]
    smells = {s["kind"]: s["layers"] for s in r["smells"]}
    assert smells == {
        "unconverted": ["plain"],
        "converted_after_ddp": ["bn_node", "bn_untracked", "bn_momentum", "bn_frozen", "head"],
        "broadcast_buffers": ["bn_node", "bn_momentum", "head"],
        "track_running_stats_false": ["bn_untracked"],
        "frozen": ["bn_frozen"],
        "momentum": ["bn_momentum"],
        "batch_of_one": ["head"],
    }
    assert all(s["fix"] for s in r["smells"])
    scopes = {e["name"]: e["training_scope"] for e in r["layers"]}
    assert scopes == {"bn_node": "node", "bn_untracked": "node", "bn_momentum": "node",
                      "bn_frozen": "frozen", "plain": "local", "head": "node"}
    # The frozen layer is still in eval mode, everything else back in training mode.
    for o in out:
        assert o["modes"] == {k: k != "bn_frozen" for k in o["modes"]}


def reference_divergence(n, size, shift, eps=1e-5):
    """The doctor's numbers computed in one process from every rank's batches: per layer and
    level, the mean over ranks and batches of the channel-averaged mean shift and |log var
    ratio| against the job's statistics, each layer normalizing with the job's statistics
    (as during the doctor's pass)."""
    import numpy as np
    import torch
    net = cases._net().double()
    per_node = cases.PER_NODE
    batches = [cases._batches(r, n, size, shift) for r in range(WORLD)]
    out = {}
    for b in range(2):
        xs = [batches[r][b].double() for r in range(WORLD)]
        for idx in (1, 4):
            xs = [net[idx - 1](x) for x in xs]                  # the conv before the layer
            flat = [x.transpose(0, 1).reshape(x.shape[1], -1) for x in xs]
            allv = torch.cat(flat, 1)
            gm, gv = allv.mean(1), allv.var(1, unbiased=False)
            for level, groups in (("local", [[r] for r in range(WORLD)]),
                                  ("node", [[0, 1], [2, 3]])):
                for members in groups:
                    v = torch.cat([flat[r] for r in members], 1)
                    shift_ = ((v.mean(1) - gm).abs() / (gv + eps).sqrt()).mean().item()
                    logv = ((v.var(1, unbiased=False) + eps) / (gv + eps)).log().abs().mean()
                    acc = out.setdefault((str(idx), level), [])
                    acc += [(shift_, logv.item())] * len(members)   # one entry per rank
            xs = [(x - gm.view(1, -1, 1, 1)) / (gv + eps).sqrt().view(1, -1, 1, 1) for x in xs]
            if idx == 1:
                xs = [torch.relu(x) for x in xs]
    return {k: tuple(np.mean(v, 0)) for k, v in out.items()}


@pytest.mark.parametrize("scope, n, size, shift", [("node", 2, 2, 1.5), ("local", 64, 8, 0.0)])
def test_the_numbers_are_those_of_one_process_over_every_ranks_batches(pool, scope, n, size,
                                                                       shift):
    out = pool.call(cases.verdict_case, [(scope, n, size, shift, "doctor-ref-" + scope)] * WORLD)
    want = reference_divergence(n, size, shift)
    for e in out[0]["layers"]:
        for level in ("local", "node"):
            got = e["divergence"][level]
            ms, lv = want[(e["name"], level)]
            assert got["mean_shift"] == pytest.approx(ms, rel=1e-5), (e["name"], level)
            assert got["log_var_ratio"] == pytest.approx(lv, rel=1e-5), (e["name"], level)


def test_groups_that_hold_both_kinds_of_nodes_get_group_scope():
    with started(nodes=4, workers_per_node=1, round_timeout_ms=60000) as four:
        out = four.call(cases.group_case, [()] * 4)
    _same_on_every_rank(out)
    r = out[0]
    assert r["levels"] == ["local", "node", "group", "global"] and r["job"]["group_nodes"] == 2
    assert r["verdict"] == "yes"
    for e in r["layers"]:
        assert e["training_scope"] == "node" and e["explains"]
        assert e["recommended"] == "group" and e["alternative"] == "lagged", e
        assert e["counts"]["group"] == 2 * e["counts"]["node"] == 2 * e["counts"]["local_mean"]
        assert e["divergence"]["group"]["mean_shift"] < 0.05 < e["divergence"]["node"][
            "mean_shift"]


def test_the_lagged_offer_names_what_was_measured_for_a_model_that_deep():
    from hsbn.torch import _diagnose
    shallow = _diagnose._lagged_note(_diagnose.STUDY_LAYERS, 1.5)
    assert "1.50 ms of sync per step" in shallow and "4-layer CNN" in shallow
    assert "ResNet-18" not in shallow
    deep = _diagnose._lagged_note(20, 1.5)
    assert deep.startswith(shallow)
    assert "This model has 20 BatchNorm layers" in deep and "29 % of its calls" in deep
    assert "first 20 calls exact global" in shallow
