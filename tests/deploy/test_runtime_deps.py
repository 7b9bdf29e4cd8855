"""docker/runtime-deps.sh reads a binary's run-time needs off the binary: the Debian packages
that own its shared libraries, or a bundle of those libraries without the C/C++ runtime. Tried
on protoc, which links libprotoc and libprotobuf like the aggregator does."""
import pathlib
import shutil
import subprocess
import tempfile
import unittest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "docker" / "runtime-deps.sh"
PROTOC = shutil.which("protoc")


@unittest.skipUnless(PROTOC, "protoc is not installed (Debian package protobuf-compiler)")
class RuntimeDepsTest(unittest.TestCase):
    def run_script(self, *args):
        return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True)

    def test_packages_are_the_owners_of_the_linked_libraries(self):
        p = self.run_script("packages", PROTOC)
        self.assertEqual(p.returncode, 0, p.stderr)
        pkgs = p.stdout.split()
        self.assertEqual(pkgs, sorted(set(pkgs)))
        for expected in ("libc6", "libprotobuf32", "libprotoc32", "libstdc++6"):
            self.assertIn(expected, pkgs)

    def test_bundle_copies_libraries_but_not_the_c_runtime(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.run_script("bundle", d, PROTOC)
            self.assertEqual(p.returncode, 0, p.stderr)
            names = sorted(x.name for x in pathlib.Path(d).iterdir())
            self.assertIn("libprotobuf.so.32", names)
            self.assertIn("libprotoc.so.32", names)
            for n in names:
                self.assertFalse(n.startswith(("libc.so", "libstdc++", "libm.so", "ld-linux", "libgcc_s")), n)

    def test_a_missing_binary_fails(self):
        p = self.run_script("packages", "/nonexistent/hsbn-aggregator")
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("no such file", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
