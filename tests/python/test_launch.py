"""`hsbn run` (hsbn/launch.py) as a user runs it: examples/quickstart/train.py, a plain DDP
script with hsbn's three lines, under `hsbn run --nproc_per_node 2` on one node and under
`--simulate-nodes 2` on two simulated nodes; every rank's BatchNorm statistics are checked
against BatchNorm over the scope's batch computed here. Around it: the aggregators hsbn run
started are gone when it ends (success, a failing script, SIGTERM), a failing script's status
comes back, an existing sidecar (HSBN_ADDRESS) is used as it is, and bad arguments are refused
before anything starts, naming the fix."""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch.distributed.run import get_args_parser

import hsbn.cluster
from hsbn import launch
from hsbn._procs import free_port
from torchrun_support import needs_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "quickstart",
                     "train.py")
LINE = re.compile(r"rank (\d+)/(\d+) node (\d+): bn1 running mean after step 1: \[([^\]]*)\]")


def quickstart():
    spec = importlib.util.spec_from_file_location("quickstart_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_mean(ranks):
    """The first BatchNorm layer's running mean after step 1 when it normalizes with `ranks`'
    batches together: 0.1 x the mean of its input (the first convolution's output)."""
    q = quickstart()
    model = q.make_model()
    x = torch.cat([q.batch(r, 0)[0] for r in ranks])
    with torch.no_grad():
        return (0.1 * model[0](x).mean(dim=(0, 2, 3))).tolist()


def clean_env(**extra):
    """The environment of a user's shell: no launcher variables; the CPU (on GPUs, convolutions
    may use TF32 and miss the reference by more than the tolerance)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HSBN_ADDRESS", "HSBN_JOB_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def hsbn_run(args, cwd, env=None, timeout=300):
    p = subprocess.run([sys.executable, "-m", "hsbn", "run"] + list(args), cwd=str(cwd),
                       env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=timeout)
    return p


def workdir_of(stderr):
    """The private folder of the aggregators hsbn run started (their sockets are in it)."""
    m = re.search(r"unix:(/\S+)/(?:sidecar|node0)\.sock", stderr)
    assert m, stderr
    return m.group(1)


def processes_mentioning(text):
    """(pid, command line) of every process whose command line contains `text`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmd:
            found.append((int(pid), cmd))
    return found


def started_pids(stderr):
    return [int(p) for p in re.findall(r"^hsbn run: .*?pid (\d+)", stderr, re.M)]


def assert_all_gone(stderr):
    """Nothing hsbn run started is left: no process names its folder, none of the pids it
    reported is alive (they were its children, so it has reaped them)."""
    workdir = workdir_of(stderr)
    assert processes_mentioning(workdir) == []
    for pid in started_pids(stderr):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return workdir


def ranks_means(stdout):
    found = {}
    for m in LINE.finditer(stdout):
        found[int(m.group(1))] = (int(m.group(2)), int(m.group(3)),
                                  [float(v) for v in m.group(4).split(",")])
    return found


@needs_torchrun
def test_one_node_runs_the_converted_script_with_one_command(tmp_path):
    p = hsbn_run(["--nproc_per_node", "2", TRAIN, "--steps", "3"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    got = ranks_means(p.stdout)
    assert sorted(got) == [0, 1], p.stdout
    want = expected_mean([0, 1])
    for rank, (world, node, mean) in got.items():
        assert (world, node) == (2, 0)
        assert mean == pytest.approx(want, abs=2e-6), (rank, mean, want)
    # The ranks' own statistics differ from the node's (the rank shifts the images).
    assert expected_mean([0]) != pytest.approx(want, abs=1e-3)
    assert re.search(r"^hsbn run: job id run-[0-9a-f]{12} \(fresh for this launch\)$",
                     p.stderr, re.M), p.stderr
    assert re.search(r"^hsbn run: sidecar  pid \d+  unix:/\S+/sidecar\.sock$", p.stderr, re.M)
    assert re.search(r"^hsbn run: stopped sidecar \(pid \d+, status 0\)$", p.stderr, re.M)
    workdir = assert_all_gone(p.stderr)
    assert not os.path.exists(workdir)  # removed after a job that succeeded
    if torch.__version__.split(".")[0] == "1" and sys.version_info >= (3, 11):
        assert "--redirects 1 --tee 1" in p.stderr


@needs_torchrun
def test_two_simulated_nodes_sync_globally_across_them(tmp_path):
    p = hsbn_run(["--simulate-nodes", "2", "--nproc_per_node", "2", TRAIN, "--steps", "3"],
                 tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    got = ranks_means(p.stdout)
    assert sorted(got) == [0, 1, 2, 3], p.stdout
    want = expected_mean([0, 1, 2, 3])
    node_only = expected_mean([0, 1])
    assert node_only != pytest.approx(want, abs=1e-3)  # node scope would be caught
    for rank, (world, node, mean) in got.items():
        assert (world, node) == (4, rank // 2)
        assert mean == pytest.approx(want, abs=2e-6), (rank, mean, want)
    # Each line comes from its node's torchrun agent.
    for rank in range(4):
        assert re.search(r"^\[node%d\] .*rank %d/4 node %d:" % (rank // 2, rank, rank // 2),
                         p.stdout, re.M), p.stdout
    for what in ("root        pid", "node 0 link pid", "node 1 link pid", "node 0 sidecar pid",
                 "node 1 sidecar pid", "node 0 torchrun pid", "node 1 torchrun pid"):
        assert "hsbn run: " + what in p.stderr, p.stderr
    assert "1 ms each way (hsbn-linkproxy)" in p.stderr
    workdir = assert_all_gone(p.stderr)
    assert not os.path.exists(workdir)


@needs_torchrun
def test_a_failing_script_fails_hsbn_run_with_torchruns_status(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('about to fail', flush=True)\nsys.exit(3)\n")
    p = hsbn_run(["--nproc_per_node", "1", str(script)], tmp_path)
    # torchrun ends with 1 when a worker fails, and names the worker's own status.
    assert p.returncode == 1, p.stdout + p.stderr
    assert re.search(r"exitcode\s*: 3 ", p.stderr), p.stderr
    workdir = assert_all_gone(p.stderr)
    assert "hsbn run: the aggregators' logs are kept in %s" % workdir in p.stderr
    assert os.path.isfile(os.path.join(workdir, "sidecar.log"))
    shutil.rmtree(workdir)


@needs_torchrun
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_to_hsbn_run_reaches_torchrun_and_everything_is_torn_down(tmp_path, sig):
    script = tmp_path / "waits.py"
    script.write_text("import os, signal\nprint('waiting pid %d' % os.getpid(), flush=True)\n"
                      "signal.pause()\n")
    proc = subprocess.Popen([sys.executable, "-m", "hsbn", "run", "--nproc_per_node", "2",
                             str(script)], cwd=str(tmp_path), env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = []
        for line in proc.stdout:  # until both workers run
            m = re.search(r"waiting pid (\d+)", line)
            if m:
                workers.append(int(m.group(1)))
            if len(workers) == 2:
                break
        assert len(workers) == 2, proc.communicate(timeout=60)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # torch 1.13's torchrun ends with 1 after it stopped its workers on a signal.
    assert proc.returncode not in (0, None), err
    assert "hsbn run: passed %s on to torchrun" % sig in err, err
    workdir = assert_all_gone(err)
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    shutil.rmtree(workdir)


@needs_torchrun
def test_a_sidecar_already_running_is_used_and_none_started(tmp_path):
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=2, root=False) as cluster:
        env = clean_env(HSBN_ADDRESS=cluster.node_addresses[0], HSBN_JOB_ID="mine-42")
        p = hsbn_run(["--nproc_per_node", "2", TRAIN, "--steps", "2"], tmp_path, env=env)
        log = cluster.logs()["node0"]
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("hsbn run: HSBN_ADDRESS=%s is set: the workers use that sidecar; starting no "
            "aggregator" % cluster.node_addresses[0]) in p.stderr
    assert "hsbn run: job id mine-42 (HSBN_JOB_ID)" in p.stderr
    assert "sidecar  pid" not in p.stderr and "stopped" not in p.stderr
    got = ranks_means(p.stdout)
    assert sorted(got) == [0, 1]
    for _, _, mean in got.values():
        assert mean == pytest.approx(expected_mean([0, 1]), abs=2e-6)
    assert len(re.findall(r"job 'mine-42': rank \d \([^)]*\) left;", log)) == 2, log


# --- arguments, without starting anything ---------------------------------------------------------

def plan(args, env=None, torch_version="1.13.0"):
    return launch.Plan(args, env or {}, get_args_parser(), torch_version)


def test_options_split_between_hsbn_run_torchrun_and_the_script():
    p = plan(["--job-id", "j1", "--nproc_per_node", "2", "-r1", "--max_restarts=1",
              "train.py", "--steps", "3", "--job-id", "x"])
    assert p.job_id == "j1" and p.job_id_from == "--job-id"
    assert p.torchrun_args == ["--nproc_per_node", "2", "-r1", "--max_restarts=1"]
    assert p.script == ["train.py", "--steps", "3", "--job-id", "x"]
    assert p.extra == []  # the user chose --redirects
    assert p.torchrun_command()[-9:] == ["--nproc_per_node", "2", "-r1", "--max_restarts=1",
                                         "train.py", "--steps", "3", "--job-id", "x"]


def test_the_torchrun_workaround_is_added_only_on_torch_1_and_when_not_chosen():
    workaround = ["--redirects", "1", "--tee", "1"]
    want = workaround if sys.version_info >= (3, 11) else []
    assert plan(["train.py"], torch_version="1.13.0a0").extra == want
    assert plan(["train.py"], torch_version="2.3.1").extra == []
    assert plan(["--tee", "3", "train.py"], torch_version="1.13.0").extra == []


def test_one_node_gets_a_fresh_job_id_per_launch_and_an_explicit_one_wins():
    a, b = plan(["train.py"]), plan(["train.py"])
    assert a.job_id != b.job_id and a.job_id.startswith("run-")
    assert plan(["train.py"], {"HSBN_JOB_ID": "from-env"}).job_id == "from-env"
    assert plan(["--job-id", "opt", "train.py"], {"HSBN_JOB_ID": "env"}).job_id == "opt"


def test_several_nodes_need_the_roots_address_and_one_job_id():
    with pytest.raises(launch.UsageError, match=r"pass --root HOST:PORT, the same on every"):
        plan(["--nnodes", "2", "--node_rank", "1", "--job-id", "j", "train.py"])
    with pytest.raises(launch.UsageError, match=r"same on every node: pass --job-id ID"):
        plan(["--root", "h0:7070", "--nnodes", "2", "--node_rank", "1", "train.py"])
    with pytest.raises(launch.UsageError, match=r"--root h0 is not HOST:PORT"):
        plan(["--root", "h0", "--nnodes", "2", "--job-id", "j", "train.py"])
    with pytest.raises(launch.UsageError, match=r"fixed number of nodes"):
        plan(["--root", "h0:7070", "--nnodes", "1:4", "--job-id", "j", "train.py"])
    # Static rendezvous: node 0 starts the root, on every interface at --root's port.
    p0 = plan(["--root", "h0:7070", "--nnodes", "2", "--job-id", "j", "train.py"])
    assert (p0.nodes, p0.start_root, p0.root_listen, p0.job_id) == (2, True, "0.0.0.0:7070", "j")
    p1 = plan(["--root", "h0:7070", "--nnodes", "2", "--node_rank", "1", "--job-id", "j",
               "train.py"])
    assert not p1.start_root
    # Dynamic rendezvous: the job id is torchrun's --rdzv_id; the root starts where it lives.
    c10d = ["--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h0:29400",
            "--rdzv_id", "job42", "train.py"]
    here = plan(["--root", "127.0.0.1:7070"] + c10d)
    assert (here.job_id, here.job_id_from, here.start_root) == (
        "job42", "torchrun's --rdzv_id", True)
    assert not plan(["--root", "192.0.2.1:7070"] + c10d).start_root  # TEST-NET: not here
    assert not plan(["--root", "127.0.0.1:7070", "--start-root", "no"] + c10d).start_root


def test_simulation_and_an_existing_sidecar_refuse_what_they_would_ignore():
    with pytest.raises(launch.UsageError, match=r"sets torchrun's nodes and rendezvous itself: "
                                                r"drop --nnodes"):
        plan(["--simulate-nodes", "2", "--nnodes", "2", "train.py"])
    with pytest.raises(launch.UsageError, match=r"HSBN_ADDRESS=unix:/s is set: unset it"):
        plan(["--simulate-nodes", "2", "train.py"], {"HSBN_ADDRESS": "unix:/s"})
    with pytest.raises(launch.UsageError, match=r"starts no aggregator; that sidecar has its own "
                                                r"--upstream. Drop --root"):
        plan(["--root", "h:1", "--nnodes", "2", "train.py"], {"HSBN_ADDRESS": "unix:/s"})
    with pytest.raises(launch.UsageError, match=r"unknown option --bogus: it is neither"):
        plan(["--bogus", "train.py"])
    with pytest.raises(launch.UsageError, match=r"no training script"):
        plan(["--nproc_per_node", "2"])
    with pytest.raises(launch.UsageError, match=r"--link-delay-ms is the delay of "
                                                r"--simulate-nodes' links"):
        plan(["--link-delay-ms", "5", "train.py"])
    p = plan(["--simulate-nodes", "3", "--nproc_per_node", "2", "--aggregator-arg",
              "--round-timeout-ms=60000", "--link-delay-ms", "0", "train.py"])
    assert p.aggregator_args == ["--round-timeout-ms=60000"] and p.link_delay_ms == 0
    assert p.nodes == 3 and p.job_id.startswith("run-")
    assert p.torchrun_command(2, 1234)[-7:] == [
        "--nnodes=3", "--node_rank=2", "--master_addr=127.0.0.1", "--master_port=1234",
        "--nproc_per_node", "2", "train.py"]


def test_bad_arguments_exit_2_and_help_documents_the_options(tmp_path):
    p = hsbn_run(["--nnodes", "2", "train.py"], tmp_path, timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("hsbn run: a job of 2 nodes needs the root's address"), p.stderr
    h = hsbn_run(["--help"], tmp_path, timeout=120)
    assert h.returncode == 0 and h.stderr == ""
    for option in ("--simulate-nodes N", "--link-delay-ms MS", "--root HOST:PORT",
                   "--start-root auto|yes|no", "--root-listen ADDR", "--job-id ID",
                   "--aggregator-arg FLAG", "--redirects 1 --tee 1", "HSBN_ADDRESS"):
        assert option in h.stdout, option


@needs_torchrun
def test_two_nodes_one_command_each_node_0_starts_the_root(tmp_path):
    """The multi-node path itself, both nodes on this machine: each node's `hsbn run` starts
    its sidecar with the root as upstream, node 0's also the root."""
    root_port, master_port = free_port(), free_port()
    common = ["--root", "127.0.0.1:%d" % root_port, "--root-listen", "127.0.0.1:%d" % root_port,
              "--job-id", "two-nodes-%d" % root_port, "--nnodes", "2",
              "--master_addr", "127.0.0.1", "--master_port", str(master_port),
              "--nproc_per_node", "2"]
    procs = []
    for node in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hsbn", "run"] + common + ["--node_rank", str(node), TRAIN,
                                                                "--steps", "2"],
            cwd=str(tmp_path), env=clean_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    (out0, err0), (out1, err1) = outs
    assert re.search(r"^hsbn run: root     pid \d+  listening on 127\.0\.0\.1:%d " % root_port,
                     err0, re.M), err0
    assert "root     pid" not in err1
    assert "root at 127.0.0.1:%d" % root_port in err1
    got = ranks_means(out0 + out1)
    assert sorted(got) == [0, 1, 2, 3], out0 + out1
    want = expected_mean([0, 1, 2, 3])
    for rank, (world, node, mean) in got.items():
        assert (world, node) == (4, rank // 2)
        assert mean == pytest.approx(want, abs=2e-6), (rank, mean, want)
    for err in (err0, err1):
        assert "hsbn run: job id two-nodes-%d (--job-id)" % root_port in err
        assert_all_gone(err)


def test_an_aggregator_that_cannot_start_fails_hsbn_run_before_torchrun(tmp_path):
    p = hsbn_run(["--aggregator-arg=--bogus", "--nproc_per_node", "1", TRAIN], tmp_path,
                 timeout=120)
    assert p.returncode == 1, p.stderr
    assert "hsbn run: cannot start the aggregators: aggregator sidecar exited with status 2 " \
        "before it was ready" in p.stderr, p.stderr
    assert "--bogus" in p.stderr and "torchrun pid" not in p.stderr
    workdir = assert_all_gone(p.stderr)
    shutil.rmtree(workdir)
