"""docs/PYTORCH.md's example program runs as written."""

import os
import re
import subprocess
import sys


DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "PYTORCH.md")


def example_program():
    with open(DOC) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    programs = [b for b in blocks if b.startswith("# hsbn_local_example.py")]
    assert len(programs) == 1, "docs/PYTORCH.md should hold one hsbn_local_example.py"
    return programs[0]


def test_the_local_example_in_the_docs_runs_as_written(tmp_path):
    script = tmp_path / "hsbn_local_example.py"
    script.write_text(example_program())
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=os.environ,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    out = proc.stdout.decode("utf-8", "replace")
    assert proc.returncode == 0, out
    assert out.rstrip().endswith("ok"), out
    assert len(re.findall(r"^rank \d  loss", out, re.M)) == 4, out


README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_the_readmes_c_worker_compiles_runs_and_reports_failures(tmp_path):
    """The README's C program, built with its compile line's flags against this build's
    libhsbn.so and hsbn.include_dir(), makes its round on a real sidecar, and says why and
    exits 1 when there is no sidecar."""
    import hsbn
    import hsbn.cluster
    with open(README) as f:
        text = f.read()
    blocks = [b for b in re.findall(r"```c\n(.*?)```", text, re.S)
              if b.startswith("/* worker.c:")]
    assert len(blocks) == 1, "README.md should hold one worker.c"
    assert "cc worker.c -Iclient/include -Lbuild/client -lhsbn" in text
    (tmp_path / "worker.c").write_text(blocks[0])
    libdir = os.path.dirname(hsbn.library_path())
    subprocess.run(["cc", "worker.c", "-I" + hsbn.include_dir(), "-L" + libdir, "-lhsbn",
                    "-Wl,-rpath," + libdir, "-o", "worker"], cwd=str(tmp_path), check=True)
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1) as cluster:
        env = cluster.worker_env(0, dict(os.environ))
        ok = subprocess.run(["./worker"], cwd=str(tmp_path), env=env, timeout=120,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "job: count 16, mean 0.5 1, var 0.1875 0.25\n"
    env["HSBN_ADDRESS"] = "unix:" + str(tmp_path / "no-sidecar.sock")
    env["HSBN_CONNECT_TIMEOUT_MS"] = "200"
    bad = subprocess.run(["./worker"], cwd=str(tmp_path), env=env, timeout=120,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("hsbn_client_create_from_env: UNAVAILABLE: "), bad.stderr
