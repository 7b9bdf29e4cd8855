"""deploy/slurm/hsbn-srun.sh, run on this machine with stand-ins for srun, scontrol, the
aggregator and the trainer (no Slurm, no C++ build needed). Each test checks the exact flags
every aggregator got, the exact environment every trainer got, and that the aggregators were
stopped with SIGTERM when the trainers finished."""
import json
import os
import pathlib
import subprocess
import tempfile
import unittest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
LAUNCHER = REPO / "deploy" / "slurm" / "hsbn-srun.sh"
FLAG_CONTRACT = REPO / "deploy" / "aggregator-flags.txt"
# The real binary, when built: set by ctest, else the default build directory.
REAL_AGGREGATOR = os.environ.get("HSBN_TEST_AGGREGATOR", str(REPO / "build" / "server" / "hsbn-aggregator"))

# What torchrun gives a worker, plus hsbn's own variables: the trainer must see exactly these.
TRAINER_KEYS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def contract_flags():
    """{flag: the roles it may be given with}, from deploy/aggregator-flags.txt."""
    flags = {}
    for line in FLAG_CONTRACT.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            flag, _, roles = line.split()
            flags[flag] = set(roles.split(","))
    return flags


class SlurmLauncherTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="hsbn-slurm-")
        self.addCleanup(self.tmp.cleanup)
        root = pathlib.Path(self.tmp.name)
        self.out, self.run_base = root / "out", root / "run"
        self.out.mkdir()
        self.run_base.mkdir()

    def launch(self, nodes, gpus, extra_env=None, timeout=60):
        env = {
            "PATH": f"{HERE / 'fake-bin'}:{os.environ['PATH']}",
            "HOME": self.tmp.name,
            "TMPDIR": str(self.run_base),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": ",".join(nodes),
            "HSBN_AGGREGATOR": str(HERE / "fake-aggregator"),
            "HSBN_GPUS_PER_NODE": str(gpus),
            "HSBN_TEST_OUT": str(self.out),
            "FAKE_SLURM_LOG": str(self.out / "srun.log"),
        }
        env.update(extra_env or {})
        proc = subprocess.run([str(LAUNCHER), "--", str(HERE / "fake-trainer"), "--epochs", "1"],
                              env=env, capture_output=True, text=True, timeout=timeout)
        return proc

    def aggregators(self):
        """{id: {argv, node, sigterm}} as the stand-in aggregators recorded them."""
        out = {}
        for p in self.out.glob("aggregator.*.args"):
            base = str(p)[:-len(".args")]
            out[pathlib.Path(base).name[len("aggregator."):]] = {
                "argv": p.read_text().splitlines(),
                "node": pathlib.Path(base + ".node").read_text().strip(),
                "sigterm": pathlib.Path(base + ".sigterm").exists()}
        return out

    def trainers(self):
        """{rank: {argv, env, sidecar_ready}} as the stand-in trainers recorded them."""
        out = {}
        for p in self.out.glob("trainer.*.args"):
            base = str(p)[:-len(".args")]
            env = dict(kv.split("=", 1) for kv in pathlib.Path(base + ".env").read_text().split("\0") if kv)
            out[int(pathlib.Path(base).name.split(".")[1])] = {
                "argv": p.read_text().splitlines(), "env": env,
                "sidecar_ready": pathlib.Path(base + ".sidecar_ready").exists()}
        return out

    def sruns(self):
        """The srun steps by job name (the aggregator steps start in the background, in any order)."""
        steps = [json.loads(l) for l in (self.out / "srun.log").read_text().splitlines()]
        return {s["options"]["--job-name"]: s["options"] for s in steps}

    def run_dir(self, node):
        return f"{self.run_base}/hsbn-4242-{node}"

    def expected_trainer_env(self, rank, nodes, gpus, **extra):
        node = rank // gpus
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(nodes) * gpus), "LOCAL_RANK": str(rank % gpus),
               "LOCAL_WORLD_SIZE": str(gpus), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(len(nodes)),
               "MASTER_ADDR": nodes[0], "MASTER_PORT": "29500", "HSBN_JOB_ID": "slurm-4242",
               "HSBN_ADDRESS": f"unix:{self.run_dir(node)}/hsbn.sock"}
        env.update(extra)
        return env

    def trainer_view(self, record):
        env = record["env"]
        return {k: v for k, v in env.items()
                if k in TRAINER_KEYS or (k.startswith("HSBN_") and k != "HSBN_TEST_OUT") or k.startswith("_HSBN_")}

    def assert_all_stopped(self):
        for name, agg in self.aggregators().items():
            self.assertTrue(agg["sigterm"], f"aggregator {name} was not stopped with SIGTERM")

    def assert_flags_in_contract(self):
        allowed = contract_flags()
        for name, agg in self.aggregators().items():
            role = next(a.split("=", 1)[1] for a in agg["argv"] if a.startswith("--role="))
            for a in agg["argv"]:
                flag = a.split("=", 1)[0]
                self.assertIn(flag, allowed, f"aggregator {name}: {a}")
                self.assertIn(role, allowed[flag], f"aggregator {name}: {a} is not for --role={role}")

    def test_two_nodes_start_root_on_first_node_one_sidecar_per_node_and_torchrun_env(self):
        nodes, gpus = ["node-a", "node-b"], 2
        proc = self.launch(nodes, gpus)
        self.assertEqual(proc.returncode, 0, proc.stderr)

        aggs = self.aggregators()
        self.assertEqual(sorted(aggs), ["node-0", "node-1", "root"])
        self.assertEqual(aggs["root"]["argv"], ["--role=root", "--listen=0.0.0.0:7070", "--id=root",
                                                f"--ready-file={self.run_dir(0)}/root.ready"])
        self.assertEqual(aggs["root"]["node"], "node-a")
        for i, node in enumerate(nodes):
            self.assertEqual(aggs[f"node-{i}"]["argv"], [
                "--role=node", f"--listen=unix:{self.run_dir(i)}/hsbn.sock", "--upstream=node-a:7070",
                f"--id=node-{i}", f"--ready-file={self.run_dir(i)}/ready"])
            self.assertEqual(aggs[f"node-{i}"]["node"], node)
        self.assert_flags_in_contract()
        self.assert_all_stopped()

        trainers = self.trainers()
        self.assertEqual(sorted(trainers), [0, 1, 2, 3])
        for rank, rec in trainers.items():
            self.assertEqual(self.trainer_view(rec), self.expected_trainer_env(rank, nodes, gpus))
            self.assertEqual(rec["env"]["SLURMD_NODENAME"], nodes[rank // gpus])
            self.assertEqual(rec["argv"], ["--epochs", "1"])
            self.assertTrue(rec["sidecar_ready"], f"rank {rank} started before its sidecar was ready")

        steps = self.sruns()
        self.assertEqual(sorted(steps), ["hsbn-root", "hsbn-sidecar", "hsbn-train"])
        self.assertEqual((steps["hsbn-root"]["--nodelist"], steps["hsbn-root"]["--ntasks"]), ("node-a", "1"))
        self.assertEqual((steps["hsbn-sidecar"]["--nodes"], steps["hsbn-sidecar"]["--ntasks-per-node"]), ("2", "1"))
        self.assertTrue(steps["hsbn-root"]["--overlap"] and steps["hsbn-sidecar"]["--overlap"])
        self.assertEqual((steps["hsbn-train"]["--ntasks"], steps["hsbn-train"]["--ntasks-per-node"]), ("4", "2"))
        self.assertEqual(steps["hsbn-train"]["--kill-on-bad-exit"], "1")
        self.assertNotIn("--overlap", steps["hsbn-train"])

    def test_one_node_has_no_root_and_no_upstream(self):
        nodes, gpus = ["solo"], 3
        proc = self.launch(nodes, gpus)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        aggs = self.aggregators()
        self.assertEqual(sorted(aggs), ["node-0"])
        self.assertEqual(aggs["node-0"]["argv"], ["--role=node", f"--listen=unix:{self.run_dir(0)}/hsbn.sock",
                                                  "--id=node-0", f"--ready-file={self.run_dir(0)}/ready"])
        self.assert_all_stopped()
        trainers = self.trainers()
        self.assertEqual(sorted(trainers), [0, 1, 2])
        for rank, rec in trainers.items():
            self.assertEqual(self.trainer_view(rec), self.expected_trainer_env(rank, nodes, gpus))
        self.assertEqual(sorted(self.sruns()), ["hsbn-sidecar", "hsbn-train"])

    def test_optional_tls_token_and_metrics_settings_become_flags(self):
        nodes, gpus = ["node-a", "node-b"], 1
        proc = self.launch(nodes, gpus, {
            "HSBN_TLS_CERT": "/etc/hsbn/root.crt", "HSBN_TLS_KEY": "/etc/hsbn/root.key",
            "HSBN_TLS_CLIENT_CA": "/etc/hsbn/ca.crt", "HSBN_UPSTREAM_CA": "/etc/hsbn/ca.crt",
            "HSBN_UPSTREAM_CERT": "/etc/hsbn/node.crt", "HSBN_UPSTREAM_KEY": "/etc/hsbn/node.key",
            "HSBN_ROOT_TOKEN_FILE": "/etc/hsbn/all-tokens", "HSBN_NODE_TOKEN_FILE": "/etc/hsbn/job-tokens",
            "HSBN_TOKEN_FILE": "/home/u/.hsbn/token", "HSBN_METRICS_PORT": "9090",
            "HSBN_JOB_ID": "resnet50-a", "HSBN_AGGREGATOR_ARGS": "--round-timeout-ms=60000",
            "HSBN_ROOT_ARGS": "--max-jobs=8"})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        aggs = self.aggregators()
        self.assertEqual(aggs["root"]["argv"], [
            "--role=root", "--listen=0.0.0.0:7070", "--id=root", f"--ready-file={self.run_dir(0)}/root.ready",
            "--tls-cert=/etc/hsbn/root.crt", "--tls-key=/etc/hsbn/root.key", "--tls-client-ca=/etc/hsbn/ca.crt",
            "--token-file=/etc/hsbn/all-tokens", "--metrics-listen=0.0.0.0:9091",
            "--round-timeout-ms=60000", "--max-jobs=8"])
        self.assertEqual(aggs["node-1"]["argv"], [
            "--role=node", f"--listen=unix:{self.run_dir(1)}/hsbn.sock", "--upstream=node-a:7070",
            "--id=node-1", f"--ready-file={self.run_dir(1)}/ready",
            "--upstream-ca=/etc/hsbn/ca.crt", "--upstream-cert=/etc/hsbn/node.crt",
            "--upstream-key=/etc/hsbn/node.key", "--token-file=/etc/hsbn/job-tokens",
            "--metrics-listen=0.0.0.0:9090", "--round-timeout-ms=60000"])
        self.assert_flags_in_contract()
        for rank, rec in self.trainers().items():
            self.assertEqual(self.trainer_view(rec), self.expected_trainer_env(
                rank, nodes, gpus, HSBN_JOB_ID="resnet50-a", HSBN_TOKEN_FILE="/home/u/.hsbn/token"))

    def test_failing_trainer_fails_the_job_and_still_stops_the_aggregators(self):
        proc = self.launch(["node-a", "node-b"], 2, {"FAKE_TRAINER_FAIL_RANK": "1", "FAKE_TRAINER_EXIT": "7"})
        self.assertNotEqual(proc.returncode, 0)
        self.assertEqual(sorted(self.aggregators()), ["node-0", "node-1", "root"])
        self.assert_all_stopped()

    def test_trainers_do_not_start_without_a_ready_sidecar(self):
        proc = self.launch(["node-a"], 2, {"FAKE_AGGREGATOR_READY_DELAY": "never", "HSBN_READY_TIMEOUT": "1"})
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("did not become ready", proc.stderr)
        self.assertEqual(self.trainers(), {})
        self.assert_all_stopped()

    def test_group_tier_starts_a_group_aggregator_on_the_first_node_of_each_group(self):
        nodes, gpus = ["node-a", "node-b", "node-c", "node-d"], 2
        proc = self.launch(nodes, gpus, {"HSBN_GROUP_TIER": "1", "HSBN_GROUP_NODES": "2"})
        self.assertEqual(proc.returncode, 0, proc.stderr)

        aggs = self.aggregators()
        self.assertEqual(sorted(aggs), ["group-0", "group-1", "node-0", "node-1", "node-2", "node-3", "root"])
        self.assertEqual(aggs["root"]["argv"], ["--role=root", "--listen=0.0.0.0:7070", "--id=root",
                                                f"--ready-file={self.run_dir(0)}/root.ready"])
        for g, first in ((0, 0), (1, 2)):
            self.assertEqual(aggs[f"group-{g}"]["argv"], [
                "--role=group", "--listen=0.0.0.0:7071", "--upstream=node-a:7070", f"--id=group-{g}",
                f"--ready-file={self.run_dir(first)}/group.ready"])
            self.assertEqual(aggs[f"group-{g}"]["node"], nodes[first])
        for i, node in enumerate(nodes):
            self.assertEqual(aggs[f"node-{i}"]["argv"], [
                "--role=node", f"--listen=unix:{self.run_dir(i)}/hsbn.sock",
                f"--upstream={nodes[i // 2 * 2]}:7071", f"--id=node-{i}", f"--ready-file={self.run_dir(i)}/ready"])
        self.assert_flags_in_contract()
        self.assert_all_stopped()

        trainers = self.trainers()
        self.assertEqual(sorted(trainers), list(range(8)))
        for rank, rec in trainers.items():
            # HSBN_GROUP_TIER and HSBN_GROUP_PORT are the launcher's; HSBN_GROUP_NODES is the trainers'.
            self.assertEqual(self.trainer_view(rec), self.expected_trainer_env(rank, nodes, gpus, HSBN_GROUP_NODES="2"))
            self.assertTrue(rec["sidecar_ready"])

        steps = self.sruns()
        self.assertEqual(sorted(steps), ["hsbn-group-0", "hsbn-group-1", "hsbn-root", "hsbn-sidecar", "hsbn-train"])
        for g, host in ((0, "node-a"), (1, "node-c")):
            step = steps[f"hsbn-group-{g}"]
            self.assertEqual((step["--nodelist"], step["--ntasks"], step["--nodes"]), (host, "1", "1"))
            self.assertTrue(step["--overlap"])
            self.assertEqual(step["--kill-on-bad-exit"], "0")

    def test_group_tier_optional_settings_become_the_group_aggregators_flags(self):
        nodes, gpus = ["node-a", "node-b"], 1
        proc = self.launch(nodes, gpus, {
            "HSBN_GROUP_TIER": "1", "HSBN_GROUP_NODES": "2", "HSBN_GROUP_PORT": "7171",
            "HSBN_ROOT_PORT": "7170", "HSBN_TLS_CERT": "/etc/hsbn/agg.crt", "HSBN_TLS_KEY": "/etc/hsbn/agg.key",
            "HSBN_TLS_CLIENT_CA": "/etc/hsbn/ca.crt", "HSBN_UPSTREAM_CA": "/etc/hsbn/ca.crt",
            "HSBN_UPSTREAM_CERT": "/etc/hsbn/node.crt", "HSBN_UPSTREAM_KEY": "/etc/hsbn/node.key",
            "HSBN_ROOT_TOKEN_FILE": "/etc/hsbn/all-tokens", "HSBN_METRICS_PORT": "9090",
            "HSBN_AGGREGATOR_ARGS": "--round-timeout-ms=60000", "HSBN_GROUP_ARGS": "--max-jobs=8",
            "HSBN_ROOT_ARGS": "--max-jobs=4"})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        aggs = self.aggregators()
        self.assertEqual(aggs["group-0"]["argv"], [
            "--role=group", "--listen=0.0.0.0:7171", "--upstream=node-a:7170", "--id=group-0",
            f"--ready-file={self.run_dir(0)}/group.ready",
            "--tls-cert=/etc/hsbn/agg.crt", "--tls-key=/etc/hsbn/agg.key", "--tls-client-ca=/etc/hsbn/ca.crt",
            "--upstream-ca=/etc/hsbn/ca.crt", "--upstream-cert=/etc/hsbn/node.crt",
            "--upstream-key=/etc/hsbn/node.key", "--token-file=/etc/hsbn/all-tokens",
            "--metrics-listen=0.0.0.0:9092", "--round-timeout-ms=60000", "--max-jobs=8"])
        self.assertEqual(aggs["root"]["argv"][-2:], ["--round-timeout-ms=60000", "--max-jobs=4"])
        self.assertIn("--upstream=node-a:7171", aggs["node-1"]["argv"])
        self.assert_flags_in_contract()
        for rank, rec in self.trainers().items():
            self.assertEqual(self.trainer_view(rec), self.expected_trainer_env(rank, nodes, gpus, HSBN_GROUP_NODES="2"))

    def test_without_the_tier_group_nodes_reach_the_trainers_and_sidecars_use_the_root(self):
        # Group scope without the tier: the root serves the groups, the launcher starts nothing more.
        nodes, gpus = ["node-a", "node-b"], 1
        proc = self.launch(nodes, gpus, {"HSBN_GROUP_NODES": "1"})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        aggs = self.aggregators()
        self.assertEqual(sorted(aggs), ["node-0", "node-1", "root"])
        self.assertIn("--upstream=node-a:7070", aggs["node-1"]["argv"])
        for rank, rec in self.trainers().items():
            self.assertEqual(self.trainer_view(rec), self.expected_trainer_env(rank, nodes, gpus, HSBN_GROUP_NODES="1"))

    def test_group_tier_on_one_node_starts_no_tier(self):
        proc = self.launch(["solo"], 1, {"HSBN_GROUP_TIER": "1", "HSBN_GROUP_NODES": "1"})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(sorted(self.aggregators()), ["node-0"])
        self.assertEqual(sorted(self.sruns()), ["hsbn-sidecar", "hsbn-train"])

    def test_group_tier_settings_that_do_not_fit_are_refused_before_anything_starts(self):
        nodes = ["node-a", "node-b", "node-c", "node-d"]
        for env, expect in [
            ({"HSBN_GROUP_TIER": "1"}, "HSBN_GROUP_TIER=1 needs HSBN_GROUP_NODES"),
            ({"HSBN_GROUP_TIER": "1", "HSBN_GROUP_NODES": "0"}, "HSBN_GROUP_TIER=1 needs HSBN_GROUP_NODES"),
            ({"HSBN_GROUP_TIER": "1", "HSBN_GROUP_NODES": "3"}, "HSBN_GROUP_NODES=3 does not divide the allocation's 4 nodes"),
            ({"HSBN_GROUP_TIER": "yes", "HSBN_GROUP_NODES": "2"}, "HSBN_GROUP_TIER must be 0 or 1"),
        ]:
            with self.subTest(env=env):
                proc = self.launch(nodes, 1, env)
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertIn(expect, proc.stderr)
                self.assertEqual(self.aggregators(), {})
                self.assertFalse((self.out / "srun.log").exists())

    def test_trainers_on_a_group_aggregators_node_wait_for_it(self):
        proc = self.launch(["node-a", "node-b", "node-c", "node-d"], 1,
                           {"HSBN_GROUP_TIER": "1", "HSBN_GROUP_NODES": "2", "FAKE_AGGREGATOR_NEVER_READY": "group-1",
                            "HSBN_READY_TIMEOUT": "1"})
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("rank 2: the group aggregator on", proc.stderr)
        self.assertNotIn(2, self.trainers())
        self.assert_all_stopped()

    @unittest.skipUnless(os.access(REAL_AGGREGATOR, os.X_OK), f"{REAL_AGGREGATOR} is not built")
    def test_real_aggregator_serves_each_nodes_socket_and_stops_on_sigterm(self):
        port = str(20000 + os.getpid() % 20000)
        check = ('test -S "${HSBN_ADDRESS#unix:}" && '
                 'grep -qx "$HSBN_ADDRESS" "$(dirname "${HSBN_ADDRESS#unix:}")/ready" && '
                 'touch "$HSBN_TEST_OUT/served.$RANK"')
        env = {"PATH": f"{HERE / 'fake-bin'}:{os.environ['PATH']}", "HOME": self.tmp.name,
               "TMPDIR": str(self.run_base), "SLURM_JOB_ID": "4243", "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
               "HSBN_AGGREGATOR": REAL_AGGREGATOR, "HSBN_GPUS_PER_NODE": "2", "HSBN_ROOT_PORT": port,
               "HSBN_TEST_OUT": str(self.out)}
        proc = subprocess.run([str(LAUNCHER), "--", "bash", "-c", check], env=env,
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(sorted(p.name for p in self.out.glob("served.*")), [f"served.{r}" for r in range(4)])
        for who in ("root", "node-0", "node-1"):
            self.assertIn(f"[{who}] stopped", proc.stderr)

    @unittest.skipUnless(os.access(REAL_AGGREGATOR, os.X_OK), f"{REAL_AGGREGATOR} is not built")
    def test_real_aggregator_group_tier_starts_serves_and_stops_on_sigterm(self):
        # Two nodes in one group: the root, the group aggregator below it and two sidecars below
        # that, all real processes on this machine (the group's first node is "localhost").
        port = 20000 + os.getpid() % 20000
        check = ('test -S "${HSBN_ADDRESS#unix:}" && test "$HSBN_GROUP_NODES" = 2 && '
                 'touch "$HSBN_TEST_OUT/served.$RANK"')
        env = {"PATH": f"{HERE / 'fake-bin'}:{os.environ['PATH']}", "HOME": self.tmp.name,
               "TMPDIR": str(self.run_base), "SLURM_JOB_ID": "4244", "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
               "HSBN_AGGREGATOR": REAL_AGGREGATOR, "HSBN_GPUS_PER_NODE": "1", "HSBN_ROOT_PORT": str(port),
               "HSBN_GROUP_PORT": str(port + 1), "HSBN_GROUP_TIER": "1", "HSBN_GROUP_NODES": "2",
               "HSBN_TEST_OUT": str(self.out)}
        proc = subprocess.run([str(LAUNCHER), "--", "bash", "-c", check], env=env,
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(sorted(p.name for p in self.out.glob("served.*")), ["served.0", "served.1"])
        ready = pathlib.Path(f"{self.run_base}/hsbn-4244-0/group.ready").read_text()
        self.assertIn(f":{port + 1}", ready)
        for who in ("root", "group-0", "node-0", "node-1"):
            self.assertIn(f"[{who}] stopped", proc.stderr)

    def test_outside_an_allocation_it_refuses_to_start(self):
        proc = subprocess.run([str(LAUNCHER), "--", "true"], env={"PATH": os.environ["PATH"]},
                              capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("not inside a Slurm allocation", proc.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
