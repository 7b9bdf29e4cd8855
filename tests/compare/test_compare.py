"""The sync-scope comparison (examples/compare/hsbn_compare.py): its data plan and mosaics,
and a smoke run of every mode on both tasks through a real LocalCluster."""

import csv
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import COMPARE, REPO, run_study
from hsbncmp import cli, data

SCRIPT = os.path.join(COMPARE, "hsbn_compare.py")
# Every mode this hsbn has (group and auto come with the group scope, renorm with its own).
MODES = [m for m in cli.ALL_MODES if cli._mode_available(m)]


@pytest.fixture(scope="module")
def fmnist():
    try:
        return data.load(None)
    except data.DataMissingError as e:
        pytest.fail(str(e), pytrace=False)


def test_missing_data_says_how_to_install_it(tmp_path):
    with pytest.raises(data.DataMissingError, match="apt-get install dataset-fashion-mnist"):
        data.check_data_dir(str(tmp_path))
    proc = subprocess.run([sys.executable, SCRIPT, "--data-dir", str(tmp_path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "dataset-fashion-mnist" in proc.stderr and "scripts/setup.sh" in proc.stderr


def test_help_explains_the_flags():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    for flag in ("--nodes", "--workers-per-node", "--batch", "--epochs", "--seeds", "--task",
                 "--out", "--skew", "--data-dir", "--steps"):
        assert flag in out


def test_plan_is_deterministic_skewed_and_the_same_for_every_mode(fmnist):
    y = fmnist["train_y"]
    pool = data.training_pool(y, 4800)
    a = data.make_plan("cls", 3, y, pool, 2, 4, 4, 1.0, None, 0.8)
    b = data.make_plan("cls", 3, y, pool, 2, 4, 4, 1.0, None, 0.8)
    assert np.array_equal(a["idx"], b["idx"])
    assert a["idx"].shape == (a["steps"], 8, 4)
    # Until a node has gone through its shard no item is repeated; every item is from the pool.
    assert len(np.unique(a["idx"][:100])) == a["idx"][:100].size
    assert np.isin(a["idx"], pool).all()
    # Node 0 (ranks 0-3) mostly sees classes 0-4, node 1 mostly 5-9: with skew 0.8 about
    # 0.8 + 0.2 / 2 = 90 % of a node's items are of its home classes.
    home0 = (y[a["idx"][:, :4]] < 5).mean()
    home1 = (y[a["idx"][:, 4:]] >= 5).mean()
    assert 0.85 < home0 < 0.95 and 0.85 < home1 < 0.95
    flat = data.make_plan("cls", 3, y, pool, 2, 4, 4, 1.0, None, 0.0)
    assert 0.4 < (y[flat["idx"][:, :4]] < 5).mean() < 0.6


def test_mosaic_labels_mark_each_items_foreground_with_its_class(fmnist):
    x, y = fmnist["test_x"], fmnist["test_y"]
    cells = np.array([[0, -1, 1, 2]])
    shifts = np.zeros((1, 4, 2), np.int64)
    img, lab = data.compose(x, y, cells, shifts)
    assert img.shape == lab.shape == (1, 56, 56)
    assert np.array_equal(img[0, :28, :28], x[0])
    assert (lab[0, :28, 28:] == 0).all() and (img[0, :28, 28:] == 0).all()
    fg = x[2] >= data.FOREGROUND
    assert (lab[0, 28:, 28:][fg] == 1 + y[2]).all() and (lab[0, 28:, 28:][~fg] == 0).all()
    seg = data.make_plan("seg", 0, fmnist["train_y"], data.training_pool(fmnist["train_y"], 800),
                         2, 2, 2, 1.0, 4, 1.0)
    assert seg["cells"].shape == (4, 4, 2, 4)
    # Disjoint classes at skew 1: node 1's mosaics hold only classes 5-9.
    items = seg["cells"][:, 2:][seg["cells"][:, 2:] >= 0]
    assert (fmnist["train_y"][items] >= 5).all()


def test_smoke_every_mode_both_tasks(tmp_path, native_parts):
    out = tmp_path / "out"
    cmd = [sys.executable, SCRIPT, "--nodes", "2", "--workers-per-node", "2", "--steps", "3",
           "--seeds", "1", "--test-size", "48", "--evals", "2", "--out", str(out),
           "--modes", ",".join(MODES), "--group-nodes", "1", "--precise-items", "6",
           "--no-progress", "--renorm", "warmup=1,ramp=2", "--lagged", "warmup=1"]
    proc = run_study(cmd, 300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("results.md", "results.json", "runs.csv", "compare.png"):
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "results.json").read_text())
    # The default run crosses a simulated cross-node link.
    assert res["config"]["link_delay_ms"] == cli.LINK_DELAY_MS == 1
    for task in ("cls", "seg"):
        assert sorted(res["summary"][task]) == sorted(MODES)
        for mode, s in res["summary"][task].items():
            assert 0.0 <= s["metric_mean"] <= 1.0 and s["step_ms"] > 0, (task, mode)
            assert 0.0 <= s["metric_sync_stats_mean"] <= 1.0, (task, mode)
            if mode != "reference":
                assert 0.0 <= s["metric_precise_bn_mean"] <= 1.0, (task, mode)
        # global's running statistics are the same on every worker: pooling them is a no-op.
        g = res["summary"][task]["global"]
        assert g["metric_sync_stats_mean"] == g["metric_mean"]
        assert res["summary"][task]["global"]["sync_ms"] > 0
        assert res["summary"][task]["local"]["sync_ms"] == 0
        assert res["summary"][task]["node"]["norm_batch"] == 2 * res["config"]["batch"]
        # shadow: the root's divergence record has every BN layer on both nodes
        rows = res["divergence"][task]
        assert rows and {r["node"] for r in rows} == {0, 1}
        assert all(r["rounds"] == 3 for r in rows)
    assert res["check"]["pass"] and len(res["check"]["rows"]) == 2
    md = (out / "results.md").read_text()
    assert "PASS: global matches reference" in md and "| reference |" in md
    with open(out / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    # every mode of both tasks
    assert len(rows) == 2 * len(MODES)
    assert "sync_running_stats" in md and "precise_bn" in md
    # CPU per step for every distributed mode, none for the one-process reference.
    for task in ("cls", "seg"):
        for mode, s in res["summary"][task].items():
            cpu = s["cpu_ms_per_step"]
            if mode == "reference":
                assert cpu is None
            else:
                # (groups: the group tier's aggregators, which group mode starts)
                assert cpu["workers"] > 0 and set(cpu) - {"groups"} == {
                    "workers", "root", "sidecars", "links"}, (task, mode, cpu)
    assert re.search(r"^Classification: CPU ms per step.* node \d+\.\d \(links \d+\.\d\), ",
                     md, re.M), md
    if "renorm" in MODES:
        # --renorm is recorded with the defaults it did not name; with warm-up 1, the calls
        # after the first used global statistics.
        assert res["config"]["renorm"]["warmup"] == 1 and res["config"]["renorm"]["ramp"] == 2
        assert res["config"]["renorm"]["lag"] >= 1
        for r in res["runs"]:
            if r["mode"] == "renorm":
                # 3 steps x 4 workers x the model's BatchNorm layers
                assert r["renorm"]["calls"] > 0 and r["renorm"]["calls"] % 12 == 0
                assert 0 < r["renorm"]["global_uses"] < r["renorm"]["calls"]
                assert 0.0 <= r["renorm"]["wait_share"] <= 1.0
        assert "of its forward calls had to wait" in md
    if "lagged" in MODES:
        # --lagged likewise; with warm-up 1 (the default is 20) calls 2 and 3 are lagged.
        assert res["config"]["lagged"]["warmup"] == 1
        assert res["config"]["lagged"]["damping"] == 1.0 and res["config"]["lagged"]["ema"] == 0.8
        for r in res["runs"]:
            if r["mode"] == "lagged":
                # 3 steps x 4 workers x the model's layers; the first call of each layer is
                # the warm-up's exact global call, no trip in 3 calls.
                assert r["lagged"]["calls"] > 0 and r["lagged"]["calls"] % 12 == 0
                assert r["lagged"]["exact"] * 3 == r["lagged"]["calls"], r["lagged"]
                assert r["lagged"]["trips"] == 0
        for task in ("cls", "seg"):
            s = res["summary"][task]["lagged"]
            assert abs(s["exact_share"] - 1 / 3) < 1e-12 and s["trips"] == 0
            assert s["norm_batch"] == res["summary"][task]["global"]["norm_batch"]
        assert "of its training calls ran exact global" in md


def test_a_tiny_sweep_pairs_seeds_and_writes_its_report(tmp_path, native_parts):
    out = tmp_path / "sweep"
    cmd = [sys.executable, SCRIPT, "--sweep", "--nodes", "4", "--workers-per-node", "1",
           "--steps", "2", "--test-size", "32", "--sweep-batches", "2,4", "--sweep-skews",
           "0.8", "--sweep-seeds", "1", "--sweep-default-seeds", "2", "--precise-items", "4",
           "--modes", "node,global,reference", "--out", str(out), "--no-progress"]
    proc = run_study(cmd, 900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in ("sweep.md", "sweep.json", "runs.csv", "gap_vs_batch.svg", "acc_vs_sync.svg"):
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "sweep.json").read_text())
    assert res["complete"]
    cells = {(c["batch"], c["skew"]): c for c in res["analysis"]}
    assert sorted(cells) == [(2, 0.8), (4, 0.8)]
    assert cells[(4, 0.8)]["seeds"] == [0, 1] and cells[(2, 0.8)]["seeds"] == [0]
    pair = cells[(4, 0.8)]["pairs"]["global-node"]
    runs = {(r["cfg"]["batch"], r["seed"], r["mode"]): r["metric"] for r in res["runs"]}
    diffs = [runs[(4, s, "global")] - runs[(4, s, "node")] for s in (0, 1)]
    assert pair["n"] == 2 and abs(pair["mean"] - np.mean(diffs)) < 1e-12
    assert pair["lo"] <= pair["mean"] <= pair["hi"]
    assert all(c["check"]["pass"] for c in cells.values())
    with open(out / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    # (1 + 2 seeds) x (node, global, reference)
    assert len(rows) == 3 * 3 and {r["batch"] for r in rows} == {"2", "4"}
    assert "default cell" in (out / "sweep.md").read_text()
    # CPU per step by process kind: the workers' own (never zero: they trained), the
    # aggregators' and the links' from /proc (clock ticks: zero over two steps is possible).
    for r in res["runs"]:
        if r["mode"] == "reference":
            continue
        cpu = r["cpu_ms_per_step"]
        assert set(cpu) == {"workers", "root", "sidecars", "links"}, cpu
        assert cpu["workers"] > 0 and min(cpu.values()) >= 0, cpu
    assert "| mode | workers | sidecars | root | links | total |" in (out / "sweep.md").read_text()


def test_t_interval_of_paired_differences():
    from hsbncmp import sweep
    p = sweep.paired({0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.0, 1: 0.5, 2: 1.0, 3: 9.0})
    d = np.array([1.0, 1.5, 3.0])
    half = 4.303 * d.std(ddof=1) / np.sqrt(3)
    assert p["n"] == 3 and p["seeds"] == [0, 1, 2]
    assert abs(p["mean"] - d.mean()) < 1e-12 and abs(p["hi"] - (d.mean() + half)) < 1e-12


@pytest.mark.parametrize("scope,given,want,bad", [
    ("renorm", "warmup=5, ramp=50,r_max=2.5", dict(warmup=5, ramp=50, r_max=2.5),
     ("warmup", "speed=3", "warmup=1.5", "r_max=0.5", "d_max=x")),
    ("lagged", "warmup=5, damping=1,trip_calls=75", dict(warmup=5, damping=1.0, trip_calls=75),
     ("warmup", "speed=3", "warmup=1.5", "warmup=0", "damping=2", "trip_rel=x"))])
def test_scope_options_from_the_command_line(scope, given, want, bad):
    # --renorm and --lagged: parsed against hsbn.torch's defaults, bad ones refused.
    if not cli._mode_available(scope):
        pytest.skip("this hsbn has no %s scope" % scope)
    import importlib
    defaults = importlib.import_module("hsbn.torch._" + scope).DEFAULTS
    args = cli.parse_args(["--" + scope, given, "--modes", scope])
    assert getattr(args, scope) == dict(defaults, **want)
    assert getattr(cli.parse_args(["--modes", scope]), scope) == defaults
    for b in bad:
        with pytest.raises(SystemExit):
            cli.parse_args(["--" + scope, b])


def test_sweep_analysis_of_renorm_pairs_target_and_paired_sync_ratio():
    """renorm − node, global − renorm, renorm − (node + 0.8 (global − node)) paired by seed;
    the sync ratio renorm/node taken per seed, then averaged with its t-interval."""
    from hsbncmp import sweep
    acc = {"node": [0.60, 0.62, 0.64], "renorm": [0.68, 0.69, 0.70], "global": [0.70, 0.71, 0.72]}
    sync = {"node": [10.0, 20.0, 40.0], "renorm": [11.0, 22.0, 48.0], "global": [30.0] * 3}
    runs = []
    for m in acc:
        for s in range(3):
            r = {"seed": s, "mode": m, "metric": acc[m][s], "metric_sync_stats": acc[m][s],
                 "metric_precise_bn": acc[m][s], "sync_ms": sync[m][s], "step_ms": 50.0}
            if m == "renorm":
                r["renorm"] = {"calls": 100, "global_uses": 80, "waits": 5 * (s + 1),
                               "wait_share": 0.05 * (s + 1), "wait_ms_per_step": 0.1}
            runs.append(r)
    cell = sweep.analyze([{"batch": 4, "skew": 0.8, "seeds": [0, 1, 2], "runs": runs}])[0]
    p = cell["pairs"]
    assert abs(p["renorm-node"]["mean"] - 0.07) < 1e-12
    assert abs(p["global-renorm"]["mean"] - 0.02) < 1e-12
    target = [n + 0.8 * (g - n) for n, g in zip(acc["node"], acc["global"])]
    assert abs(p["renorm-target"]["mean"] - np.mean(np.subtract(acc["renorm"], target))) < 1e-12
    ratio = cell["paired_sync_ratios"]["renorm/node"]
    assert ratio["n"] == 3 and abs(ratio["mean"] - np.mean([1.1, 1.1, 1.2])) < 1e-12
    assert ratio["lo"] < ratio["mean"] < ratio["hi"]
    assert abs(cell["summary"]["renorm"]["wait_share"] - 0.1) < 1e-12
    md = "\n".join(sweep.goals([cell], (4, 0.8)))
    assert "renorm − target" in md and "paired by seed = 1.13" in md


def test_sweep_analysis_of_lagged_pairs_gap_share_and_goal():
    """lagged − node paired by seed, the share of the paired node → global gap it recovers,
    its sync ratio to node per seed, and the goal line (never below node, ≤ 1.2× node)."""
    from hsbncmp import sweep
    acc = {"node": [0.60, 0.62, 0.64], "lagged": [0.66, 0.67, 0.70],
           "global": [0.70, 0.71, 0.72]}
    sync = {"node": [10.0, 20.0, 40.0], "lagged": [10.5, 21.0, 44.0], "global": [30.0] * 3}
    runs = []
    for m in acc:
        for s in range(3):
            r = {"seed": s, "mode": m, "metric": acc[m][s], "metric_sync_stats": acc[m][s],
                 "metric_precise_bn": acc[m][s], "sync_ms": sync[m][s], "step_ms": 50.0}
            if m == "lagged":
                r["lagged"] = {"calls": 100, "exact": 2 + s, "trips": s, "waits": 0,
                               "exact_share": (2 + s) / 100, "wait_ms_per_step": 0.0}
            runs.append(r)
    cell = sweep.analyze([{"batch": 4, "skew": 0.8, "seeds": [0, 1, 2], "runs": runs}])[0]
    p = cell["pairs"]
    gain = np.mean(np.subtract(acc["lagged"], acc["node"]))
    gap = np.mean(np.subtract(acc["global"], acc["node"]))
    assert abs(p["lagged-node"]["mean"] - gain) < 1e-12
    assert abs(p["lagged gap share"]["share"] - gain / gap) < 1e-12
    ratio = cell["paired_sync_ratios"]["lagged/node"]
    assert ratio["n"] == 3 and abs(ratio["mean"] - np.mean([1.05, 1.05, 1.1])) < 1e-12
    assert abs(cell["summary"]["lagged"]["exact_share"] - 0.03) < 1e-12
    assert cell["summary"]["lagged"]["trips"] == 1.0
    md = "\n".join(sweep.goals([cell], (4, 0.8)))
    assert "lagged − node = +5.67" in md and "→ **met**; it recovers 63% of" in md
    assert "paired by seed = 1.07" in md and "3.0% of its" in md
    # A seed below node makes the interval reach below 0: missed.
    runs[3]["metric"] = 0.55
    cell = sweep.analyze([{"batch": 4, "skew": 0.8, "seeds": [0, 1, 2], "runs": runs}])[0]
    assert "points → **missed**" in "\n".join(sweep.goals([cell], (4, 0.8)))


def test_sweep_cpu_per_step_by_kind_and_its_paired_ratio():
    """The CPU table's means by process kind, its total without the simulated links, and the
    paired ratio of those totals; runs without CPU figures (an older hsbn) leave both out."""
    from hsbncmp import sweep
    cpu = {"node": [{"workers": 100.0, "sidecars": 2.0, "root": 1.0, "links": 0.5},
                    {"workers": 120.0, "sidecars": 4.0, "root": 1.0, "links": 0.5}],
           "lagged": [{"workers": 130.0, "sidecars": 12.0, "root": 3.0, "links": 9.0},
                      {"workers": 150.0, "sidecars": 18.0, "root": 5.0, "links": 9.0}]}
    runs = [{"seed": s, "mode": m, "metric": 0.6, "metric_sync_stats": 0.6,
             "metric_precise_bn": 0.6, "sync_ms": 10.0, "step_ms": 50.0,
             "cpu_ms_per_step": cpu[m][s]} for m in cpu for s in range(2)]
    cell = sweep.analyze([{"batch": 4, "skew": 0.8, "seeds": [0, 1], "runs": runs}])[0]
    assert cell["summary"]["lagged"]["cpu_ms_per_step"] == {
        "workers": 140.0, "sidecars": 15.0, "root": 4.0, "links": 9.0}
    ratio = cell["paired_sync_ratios"]["lagged/node cpu"]
    assert ratio["n"] == 2
    assert abs(ratio["mean"] - np.mean([145.0 / 103.0, 173.0 / 125.0])) < 1e-12
    lines = sweep._cpu_table(cell["summary"])
    assert "| node | 110.0 | 3.0 | 1.0 | 0.5 | 114.0 |" in lines
    assert "| lagged | 140.0 | 15.0 | 4.0 | 9.0 | 159.0 |" in lines
    for r in runs:
        del r["cpu_ms_per_step"]
    cell = sweep.analyze([{"batch": 4, "skew": 0.8, "seeds": [0, 1], "runs": runs}])[0]
    assert "lagged/node cpu" not in cell["paired_sync_ratios"]
    assert sweep._cpu_table(cell["summary"]) == []


def test_proc_cpu_sums_by_kind_and_gives_none_for_a_gone_process():
    from hsbncmp import train
    # A process that used 0.1 s of CPU, then waits: its CPU time no longer moves.
    burn = ("import sys, time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.1: pass\nprint('ready', flush=True)\n"
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        pid = child.pid
        got = train._proc_cpu({"node0": pid, "node1": pid, "root": pid, "link0": pid})
    finally:
        child.stdin.close()
        child.wait()
    assert set(got) == {"sidecars", "root", "links"}
    assert got["sidecars"] == 2 * got["root"] and got["links"] == got["root"]
    assert 0.05 <= got["root"] < 10, got
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert train._proc_cpu({"root": gone.pid}) is None
    assert train._proc_cpu({}) is None


def test_check_fails_on_a_real_difference():
    truth = {"stats": {0: (np.zeros(2), np.ones(2))}, "grads": {"w": np.ones(4)},
             "running": {"r": np.ones(2)}}

    def moved(d_mean=0.0, d_grad=0.0):
        return {"stats": {0: (np.zeros(2) + d_mean, np.ones(2))},
                "grads": {"w": np.ones(4) + d_grad}, "running": {"r": np.ones(2)}}

    def run(mode, first):
        return {"task": "cls", "seed": 0, "mode": mode, "state": {"w": np.ones(4)},
                "loss": [1.0, 0.5], "first_step": first, "first_step_f64": truth}
    ref = run("reference", moved(1e-7, 1e-7))
    check = cli.global_reference_check([ref, run("global", moved(3e-7, 2e-7))], ["cls"], [0])
    assert check["pass"]                      # round-off of the reference's size
    for wrong in (moved(d_mean=1e-3), moved(d_grad=1e-3)):
        check = cli.global_reference_check([ref, run("global", wrong)], ["cls"], [0])
        assert not check["pass"]


def test_check_measures_gradients_on_the_runs_branch():
    """A gradient on another branch of a kink (a ReLU flipped by round-off) is measured
    against the float64 gradient on that branch, and passes when the flipped decisions lie
    within round-off of the kink; a flip far from it fails however close the gradient."""
    stats = {0: (np.zeros(2), np.ones(2))}
    truth = {"stats": stats, "grads": {"w": np.ones(4)}, "running": {"r": np.ones(2)},
             "grads_on_branch": {"global": {"w": np.array([1.0, 1.0, 1.0, 1.5])},
                                 "reference": {"w": np.ones(4)}},
             "kink_flips": {"global": {"count": 1, "margin": 2e-7},
                            "reference": {"count": 0, "margin": 0.0}}}

    def run(mode, grad):
        return {"task": "cls", "seed": 0, "mode": mode, "state": {"w": np.ones(4)},
                "loss": [1.0], "first_step": {"stats": stats, "grads": {"w": grad},
                                              "running": {"r": np.ones(2)}},
                "first_step_f64": truth}
    ref = run("reference", np.ones(4) + 1e-7)
    flipped = run("global", np.array([1.0, 1.0, 1.0, 1.5]) + 2e-7)
    check = cli.global_reference_check([ref, flipped], ["cls"], [0])
    row = check["rows"][0]
    assert check["pass"] and row["grads_gap"] < 1e-6 and row["kink_flips"] == 1
    truth["kink_flips"]["global"]["margin"] = 10 * cli.KINK_MARGIN
    check = cli.global_reference_check([ref, flipped], ["cls"], [0])
    assert not check["pass"] and check["rows"][0]["grads_gap"] < 1e-6
    # The branch's own float64 gradient, not float64's: a wrong gradient still fails.
    truth["kink_flips"]["global"]["margin"] = 2e-7
    check = cli.global_reference_check([ref, run("global", np.ones(4))], ["cls"], [0])
    assert not check["pass"]


def test_kinks_record_replay_and_flips():
    """kinks.Kinks records a forward pass's ReLU and max-pool decisions; replaying its own
    record changes nothing; replaying a record with one ReLU decision flipped routes the
    gradient the other way, and kinks.flips finds it with the float64 input's distance from
    0 in units of the channel's RMS."""
    import torch
    import torch.nn as nn
    from hsbncmp import kinks
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(inplace=True),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double()
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)

    def step(replay=None, keep=False):
        net.zero_grad()
        with kinks.Kinks(replay=replay, keep_inputs=keep) as k:
            out = net(x)
        out.square().sum().backward()
        return k, [p.grad.clone() for p in net.parameters()]
    own, g = step(keep=True)
    assert [kind for kind, _ in own.decisions] == ["relu", "maxpool"]
    assert kinks.flips(own.decisions, own) == {"count": 0, "margin": 0.0}
    _, g_again = step(replay=own.decisions)
    assert all(torch.equal(a, b) for a, b in zip(g, g_again))
    flipped = [(kind, d.copy()) for kind, d in own.decisions]
    relu_in, scale = own.inputs[0]
    # A ReLU input that wins its max-pool window (the others get no gradient).
    i = (0, 0) + np.unravel_index(int(own.decisions[1][1][0, 0, 0, 0]), relu_in.shape[2:])
    flipped[0][1][i] = not flipped[0][1][i]
    f = kinks.flips(flipped, own)
    assert f["count"] == 1
    assert abs(f["margin"] - abs(relu_in[i]) / np.broadcast_to(scale, relu_in.shape)[i]) < 1e-12
    _, g_flipped = step(replay=flipped)
    assert not torch.equal(g[0], g_flipped[0])
    # A max-pool window won by another element: flips measures how far below the maximum.
    moved = [(kind, d.copy()) for kind, d in own.decisions]
    moved[1][1][0, 0, 0, 0] += 1 if moved[1][1][0, 0, 0, 0] % 8 == 0 else -1
    assert kinks.flips(moved, own)["count"] == 1 and kinks.flips(moved, own)["margin"] > 0
    assert kinks.concat([own.decisions[:1], own.decisions[:1]])[0][1].shape[0] == 8


def test_a_perturbed_statistic_fails_the_main_jobs_check(tmp_path, native_parts):
    """A wrong merged mean in one layer at global's first step (a hundredth of a standard
    deviation) fails the check end to end: exit status 1, FAIL in results.md."""
    out = tmp_path / "out"
    cmd = [sys.executable, SCRIPT, "--nodes", "2", "--workers-per-node", "1", "--steps", "1",
           "--seeds", "1", "--test-size", "16", "--evals", "1", "--out", str(out), "--task",
           "cls", "--modes", "global,reference", "--precise-items", "2", "--no-progress",
           "--link-delay-ms", "0", "--perturb-mean", "1,0.01"]
    proc = run_study(cmd, 300)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAIL: global does not match reference" in proc.stderr
    res = json.loads((out / "results.json").read_text())
    row = res["check"]["rows"][0]
    assert not row["pass"] and row["stats_gap"] > 1e-3 > row["stats_tolerance"]


def test_sigusr1_prints_the_programs_stacks_and_it_goes_on(tmp_path, native_parts):
    """kill -USR1 (--help's advice for a run that seems stuck): the program writes its Python
    stacks to stderr, every thread's, and finishes its run as if nothing happened."""
    out = tmp_path / "out"
    cmd = [sys.executable, SCRIPT, "--nodes", "2", "--workers-per-node", "1", "--steps", "1",
           "--seeds", "1", "--test-size", "16", "--evals", "1", "--out", str(out), "--task",
           "cls", "--modes", "global", "--precise-items", "2", "--no-progress",
           "--link-delay-ms", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        # Printed (and flushed: the workers' start flushes stdout) before the cluster's run.
        for line in proc.stdout:
            if "distributed runs in a LocalCluster" in line:
                break
        os.kill(proc.pid, signal.SIGUSR1)
        rest, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, rest[-4000:] + err[-4000:]
    assert "Current thread" in err and "hsbn_compare.py" in err, err[-4000:]
    assert (out / "results.json").stat().st_size > 0


def test_a_stalled_worker_stops_the_run_naming_the_stall(tmp_path, native_parts):
    """--stall-minutes: a worker that hangs (--debug-stall-at-step) stops the run with exit
    status 1 and a message naming the stall, after the processes' Python stacks (the stuck
    worker's among them once it got there), and writes no results."""
    cmd = [sys.executable, SCRIPT, "--nodes", "2", "--workers-per-node", "1", "--steps", "3",
           "--seeds", "1", "--test-size", "16", "--evals", "1", "--out", str(tmp_path / "out"),
           "--task", "cls", "--modes", "global", "--no-progress", "--link-delay-ms", "0",
           "--stall-minutes", "0.1", "--debug-stall-at-step", "1"]
    proc = run_study(cmd, 300)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "hsbn_compare: no training step finished in" in proc.stderr, proc.stderr[-4000:]
    assert "--stall-minutes 0.1 allows; the run stopped" in proc.stderr
    assert "Current thread" in proc.stderr  # the stacks (the main process's at least)
    assert not (tmp_path / "out" / "results.json").exists()


def test_stall_minutes_refuses_a_negative_value():
    bad = subprocess.run([sys.executable, SCRIPT, "--stall-minutes", "-1"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "--stall-minutes: -1.0 is not a number of minutes" in bad.stderr


def test_a_torchvision_classifier_by_name(tmp_path, native_parts):
    """--model resnet18: torchvision's ResNet-18 in the comparison (one step, 2 nodes x 1
    worker), checked against the float64 reference like the small CNN."""
    import torchvision   # python3-torchvision (scripts/packages.txt): a failure, not a skip
    out = tmp_path / "out"
    cmd = [sys.executable, SCRIPT, "--model", "resnet18", "--task", "cls", "--nodes", "2",
           "--workers-per-node", "1", "--steps", "1", "--seeds", "1", "--test-size", "8",
           "--evals", "1", "--precise-items", "2", "--link-delay-ms", "0", "--modes",
           "global,reference", "--out", str(out), "--no-progress"]
    proc = run_study(cmd, 600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((out / "results.json").read_text())
    want = sum(p.numel() for p in torchvision.models.resnet18(num_classes=10).parameters())
    assert res["config"]["model"] == "resnet18" and res["config"]["params"]["cls"] == want
    assert res["check"]["pass"]
    assert "torchvision's `resnet18`" in (out / "results.md").read_text()
    bad = subprocess.run([sys.executable, SCRIPT, "--model", "no_such_net", "--task", "cls"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "has no classifier of that name" in bad.stderr


def test_service_against_one_process_pairs_seeds_of_the_chosen_cell(tmp_path):
    """service_vs_oneproc.py: the sweep's rows of the chosen cell only, paired by seed with the
    one-process runs (a mode with options quoted in the CSV), gap share and sync ratio."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "service_vs_oneproc", os.path.join(REPO, "examples", "compare", "service_vs_oneproc.py"))
    svo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(svo)
    svc, one = tmp_path / "svc", tmp_path / "one"
    svc.mkdir()
    one.mkdir()
    acc = {"node": [0.60, 0.62], "lagged": [0.66, 0.69], "global": [0.70, 0.72]}
    sync = {"node": [10.0, 20.0], "lagged": [11.0, 24.0], "global": [40.0, 40.0]}
    with open(svc / "runs.csv", "w") as f:
        f.write("task,seed,mode,batch,skew,metric,sync_ms,step_ms\n")
        for m in acc:
            for s in range(2):
                f.write("cls,%d,%s,4,0.8,%.2f,%.1f,50\n" % (s, m, acc[m][s], sync[m][s]))
                f.write("cls,%d,%s,2,0.8,0.10,1,50\n" % (s, m))   # another cell: ignored
    ref = {"node": [0.61, 0.62], "lagged-damped:0.5,trip_rel=4": [0.65, 0.67],
           "global": [0.70, 0.72]}
    with open(one / "oneproc.csv", "w") as f:
        f.write("seed,mode,steps,metric_rank0,metric_pooled,final_loss,run_s\n")
        for m, v in ref.items():
            for s in range(2):
                f.write('%d,"%s",150,%.4f,%.4f,1.0,1.0\n' % (s, m, v[s], v[s]))
    text = svo.report(str(svc), str(one), {"lagged": "lagged-damped:0.5,trip_rel=4"})
    rows = {line.split()[0]: line for line in text.splitlines()[3:]}
    assert set(rows) == {"node", "lagged", "global"}, text
    # lagged: service 67.50, one-process 66.00, +1.50 paired; gap (6.5 / 10) = 65 %;
    # sync / node per seed 1.1 and 1.2.
    assert "67.50" in rows["lagged"] and "66.00" in rows["lagged"], rows["lagged"]
    assert "+1.50 [" in rows["lagged"] and "65 %" in rows["lagged"], rows["lagged"]
    assert "1.15 [" in rows["lagged"], rows["lagged"]
    assert "-0.50 [" in rows["node"], rows["node"]
