"""scripts/main.sh --help answers at once: it prints the comparison's flags and runs nothing else
(no package install, no CMake). Every tool setup.sh would call is replaced by a stub on PATH
that records the call."""
import os
import pathlib
import subprocess
import tempfile
import unittest

REPO = pathlib.Path(__file__).resolve().parents[2]


class MainHelpTest(unittest.TestCase):
    def test_help_installs_and_builds_nothing(self):
        with tempfile.TemporaryDirectory() as d:
            calls = pathlib.Path(d, "calls")
            for tool in ("apt-get", "dpkg-query", "cmake", "sudo", "nproc"):
                stub = pathlib.Path(d, tool)
                stub.write_text("#!/bin/sh\necho %s \"$@\" >> %s\nexit 1\n" % (tool, calls))
                stub.chmod(0o755)
            env = dict(os.environ, PATH=d + ":/usr/bin:/bin", HSBN_BUILD_DIR=str(pathlib.Path(d, "b")))
            for flag in ("--help", "-h"):
                p = subprocess.run([str(REPO / "scripts" / "main.sh"), "--nodes", "3", flag],
                                   env=env, capture_output=True, text=True, timeout=60)
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertIn("installs what is missing (scripts/setup.sh)", p.stdout)
                self.assertIn("usage: hsbn_compare.py", p.stdout)
                self.assertIn("--workers-per-node", p.stdout)
            self.assertFalse(calls.exists(), calls.read_text() if calls.exists() else "")
            self.assertFalse(pathlib.Path(d, "b").exists())


if __name__ == "__main__":
    unittest.main(verbosity=2)
