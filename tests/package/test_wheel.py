"""The wheel as a user gets it: tagged for the platform, self-contained, installable into a fresh
venv with the system's gRPC, protobuf and Abseil invisible to it, with working console scripts
(an aggregator and a round run from the venv alone), and built without touching the source tree.
"""

import json
import os
import re
import subprocess
import textwrap
import zipfile

import pytest

import wheelenv as W


@pytest.fixture(scope="module")
def wheel():
    return W.wheel_path()


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel):
    """A fresh venv of Debian's Python (no system site-packages; Debian's numpy alone visible)
    with the wheel installed the way it is installed where pip has no index."""
    root = tmp_path_factory.mktemp("venv")
    path = str(root / "venv")
    site = W.make_venv(path)
    W.pip_install_wheel(path, wheel)
    return {"path": path, "site": site, "native": os.path.join(site, "hsbn", "_native"),
            "bin": os.path.join(path, "bin")}


def test_the_wheel_is_python3_generic_and_tagged_for_linux_x86_64(wheel):
    assert os.path.basename(wheel) == "hsbn-0.1.0-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read("hsbn-0.1.0.dist-info/WHEEL").decode()
        metadata = z.read("hsbn-0.1.0.dist-info/METADATA").decode()
        entry = z.read("hsbn-0.1.0.dist-info/entry_points.txt").decode()
        agg = z.getinfo("hsbn/_native/hsbn-aggregator")
        proxy = z.getinfo("hsbn/_native/hsbn-linkproxy")  # LocalCluster(link_delay_ms=...)
    assert "Tag: py3-none-linux_x86_64\n" in meta and "Root-Is-Purelib: false\n" in meta
    # Nothing tied to one Python version: no extension modules, no bytecode.
    assert not [n for n in names if re.search(r"\.(pyc|pyd)$|cpython-|abi3", n)]
    natives = [n for n in names if n.startswith("hsbn/_native/")]
    assert "hsbn/_native/libhsbn.so" in natives
    with zipfile.ZipFile(wheel) as z, open(os.path.join(W.REPO, "client", "include", "hsbn",
                                                        "hsbn.h"), "rb") as h:
        assert z.read("hsbn/include/hsbn/hsbn.h") == h.read()  # hsbn.include_dir()
    assert [n for n in names if ".so" in n and not n.startswith("hsbn/_native/")] == []
    assert any(re.match(r"hsbn/_native/libgrpc-[0-9a-f]{8}\.so\.\d+$", n) for n in natives)
    assert any(re.match(r"hsbn/_native/libprotobuf-[0-9a-f]{8}\.so\.\d+$", n) for n in natives)
    assert (agg.external_attr >> 16) & 0o111 == 0o111
    assert (proxy.external_attr >> 16) & 0o111 == 0o111
    assert re.search(r"^Requires-External: glibc \(>=2\.\d+\)$", metadata, re.M)
    assert re.search(r"^Requires-Dist: numpy$", metadata, re.M)
    assert "hsbn = hsbn.cli:main\n" in entry
    assert "hsbn-aggregator = hsbn.cli:aggregator_main\n" in entry
    assert "hsbn-linkproxy = hsbn.cli:linkproxy_main\n" in entry


def test_the_installed_native_files_load_only_the_wheel_and_the_base_system(venv):
    names = sorted(os.listdir(venv["native"]))
    assert "libhsbn.so" in names and "hsbn-aggregator" in names and len(names) > 20
    for name in names:
        path = os.path.join(venv["native"], name)
        rpath = W.run(["patchelf", "--print-rpath", path], W.clean_env(), "/").stdout.strip()
        assert rpath == "$ORIGIN", (name, rpath)
        out = W.run(["ldd", path], W.clean_env(), "/").stdout
        for line in out.splitlines():
            m = re.match(r"\s*(\S+) => (\S+)", line)
            if not m:
                continue
            lib, where = m.groups()
            assert where != "not", "%s: %s not found" % (name, lib)
            if os.path.dirname(where) == venv["native"]:
                continue
            assert re.match(W.SYSTEM_LIBS, lib), "%s loads %s from %s" % (name, lib, where)


def test_console_scripts_run_an_aggregator_a_round_and_status_from_the_venv_alone(venv, tmp_path):
    env = W.clean_env(venv["path"])
    work = str(tmp_path)
    # hsbn-aggregator is the console script: it execs the binary inside the package.
    agg = W.start_aggregator([os.path.join(venv["bin"], "hsbn-aggregator"), "--role=node",
                              "--listen=unix:" + os.path.join(work, "n.sock")], work, "n0", env)
    try:
        agg_maps = W.mapped_libraries(agg.pid)
        address = agg.hsbn_addresses[0]
        # The worker stays a member (its job lives while it is connected) until told to go.
        worker = textwrap.dedent("""
            import json, os, sys, numpy as np, hsbn
            c = hsbn.Client(%r, "venv-job", 0, 1, 0, 1, 0)
            n, mean, m2 = c.forward(0, 0, "node", 4, np.array([1.0, 2.0]), np.array([3.0, 4.0]))
            with open("/proc/self/maps") as f:
                maps = sorted({l.split()[-1] for l in f if ".so" in l.split()[-1]})
            print(json.dumps({"lib": hsbn.library_path(), "agg": hsbn.aggregator_path(),
                              "n": n, "mean": mean.tolist(), "m2": m2.tolist(), "maps": maps,
                              "hsbn": hsbn.__file__}), flush=True)
            sys.stdin.readline()
            c.close()
        """ % address)
        proc = subprocess.Popen([os.path.join(venv["bin"], "python"), "-c", worker], env=env,
                                cwd=work, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=30)
            r = json.loads(line)
            assert r["hsbn"].startswith(venv["site"] + os.sep)
            assert r["lib"] == os.path.join(venv["native"], "libhsbn.so")
            assert r["agg"] == os.path.join(venv["native"], "hsbn-aggregator")
            assert (r["n"], r["mean"], r["m2"]) == (4, [1.0, 2.0], [3.0, 4.0])
            assert os.path.join(venv["native"], "libhsbn.so") in r["maps"]
            assert W.foreign_libraries(r["maps"], venv["native"], W.GRPC_FAMILIES) == []
            assert [m for m in r["maps"] if re.search(r"/libgrpc-[0-9a-f]{8}\.so", m)], r["maps"]
            assert W.foreign_libraries(agg_maps, venv["native"]) == []
            assert os.path.realpath("/proc/%d/exe" % agg.pid) == os.path.join(
                venv["native"], "hsbn-aggregator")

            st = W.run([os.path.join(venv["bin"], "hsbn"), "status", "--address", address,
                        "--json"], env, work)
            status = json.loads(st.stdout)
            assert status["role"] == "node" and status["aggregatorId"] == "n0"
            assert [(j["jobId"], int(j["roundsCompleted"]), len(j["members"]))
                    for j in status["jobs"]] == [("venv-job", 1, 1)]
        finally:
            proc.communicate("go\n", timeout=30)
        assert proc.returncode == 0

        info = W.run([os.path.join(venv["bin"], "hsbn")], env, work).stdout
        assert "libhsbn.so       %s" % os.path.join(venv["native"], "libhsbn.so") in info
        assert "hsbn-aggregator  %s" % os.path.join(venv["native"], "hsbn-aggregator") in info
        version = W.run([os.path.join(venv["bin"], "hsbn"), "--version"], env, work).stdout
        # The package's version, and the commit of the aggregator the wheel ships.
        assert re.fullmatch(r"hsbn 0\.1\.0\nhsbn-aggregator 0\.1\.0 \(commit \S+\)\n",
                            version), version
        # The link simulator's console script runs the wheel's binary; `hsbn run --help`
        # needs no PyTorch.
        proxy = W.run([os.path.join(venv["bin"], "hsbn-linkproxy"), "--help"], env, work)
        assert proxy.stdout.startswith("usage: hsbn-linkproxy --target=HOST:PORT"), proxy.stdout
        found = W.run([os.path.join(venv["bin"], "python"), "-c",
                       "import hsbn._lib as l; print(l.linkproxy_path())"], env, work).stdout
        assert found == os.path.join(venv["native"], "hsbn-linkproxy") + "\n"
        run_help = W.run([os.path.join(venv["bin"], "hsbn"), "run", "--help"], env, work).stdout
        assert run_help.startswith("usage: hsbn run [hsbn run options] [torchrun options]")
    finally:
        W.stop(agg)
    assert agg.returncode == 0


def test_pip_install_from_the_source_folder_builds_the_same_wheel_and_writes_nothing_there(
        venv, tmp_path):
    pkg = os.path.join(W.REPO, "client", "python")

    def tree():  # every file and folder under client/python, with its modification time
        return sorted((os.path.relpath(os.path.join(d, n), pkg),
                       os.stat(os.path.join(d, n)).st_mtime_ns)
                      for d, dirs, names in os.walk(pkg) for n in names + dirs)
    before = tree()
    build = os.environ.get("HSBN_BUILD_DIR", os.path.join(W.REPO, "build"))
    # clean_env drops PYTHONDONTWRITEBYTECODE: Python caches bytecode as it does for users.
    env = W.clean_env(venv["path"], HSBN_LIBRARY=os.path.join(build, "client", "libhsbn.so"),
                      HSBN_AGGREGATOR=os.path.join(build, "server", "hsbn-aggregator"))
    W.run([os.path.join(venv["bin"], "pip"), "wheel", "--no-build-isolation", "--no-deps",
           "--no-index", "--disable-pip-version-check", "-q", "-w", str(tmp_path), pkg],
          env, str(tmp_path), timeout=300)
    assert tree() == before  # no file or folder added, none modified
    assert os.listdir(str(tmp_path)) == ["hsbn-0.1.0-py3-none-linux_x86_64.whl"]
    with zipfile.ZipFile(str(tmp_path / "hsbn-0.1.0-py3-none-linux_x86_64.whl")) as a, \
            zipfile.ZipFile(W.wheel_path()) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())


def test_the_aggregator_command_says_what_is_missing_when_the_binary_is_gone(venv, tmp_path):
    env = W.clean_env(venv["path"], HSBN_AGGREGATOR=str(tmp_path / "nope"))
    p = subprocess.run([os.path.join(venv["bin"], "hsbn-aggregator"), "--help"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 127
    assert "HSBN_AGGREGATOR=%s does not name a file" % (tmp_path / "nope") in p.stderr
