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
    flags = set()
    for line in FLAG_CONTRACT.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            flags.add(line.split()[0])
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
            for a in agg["argv"]:
                self.assertIn(a.split("=", 1)[0], allowed, f"aggregator {name}: {a}")

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

    def test_outside_an_allocation_it_refuses_to_start(self):
        proc = subprocess.run([str(LAUNCHER), "--", "true"], env={"PATH": os.environ["PATH"]},
                              capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("not inside a Slurm allocation", proc.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
