"""The trainer image's file layout finds libhsbn.so. There is no Docker engine here, so the test
reads docker/trainer.Dockerfile's final stage, lays out the files it installs under a temporary
root (the wheel copied from the build stage, the venv at /opt/venv with the wheel installed by
its own pip line, its ENV), and runs a synchronized BatchNorm round there, against an
aggregator started by the image's hsbn-aggregator command. Debian's PyTorch stands in for the
one the image installs from PyTorch's index (--system-site-packages).

A second test covers a library installed outside any package: hsbn's Python files alone, and
libhsbn.so found through the system loader's LD_LIBRARY_PATH."""

import glob
import json
import os
import re
import shlex
import shutil
import textwrap

import pytest

import wheelenv as W

DOCKERFILE = os.path.join(W.REPO, "docker", "trainer.Dockerfile")


def final_stage():
    """(instruction, arguments) of the Dockerfile's last stage, continuation lines joined."""
    with open(DOCKERFILE, encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    stages, current = [], None
    for line in lines:
        kw, _, args = line.partition(" ")
        if kw.upper() == "FROM":
            current = []
            stages.append(current)
        elif current is not None:
            current.append((kw.upper(), re.sub(r"\s+", " ", args.strip())))
    return stages[-1]


def env_of(stage):
    env = {}
    for kw, args in stage:
        if kw == "ENV":
            for item in shlex.split(args):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def test_the_trainer_image_layout_finds_its_library_and_syncs_a_batchnorm(tmp_path):
    stage = final_stage()
    root = str(tmp_path / "image")
    build = os.environ.get("HSBN_BUILD_DIR", os.path.join(W.REPO, "build"))
    in_image = lambda p: os.path.join(root, p.lstrip("/"))  # noqa: E731

    copies = [args.split()[1:] for kw, args in stage
              if kw == "COPY" and args.startswith("--from=build ")]
    assert copies == [["/src/build/dist/", "/opt/hsbn/dist/"]], copies
    # The build stage's WORKDIR is /src and scripts/setup.sh builds into build/.
    src, dst = copies[0]
    shutil.copytree(os.path.join(build, "dist"), in_image(dst))
    assert glob.glob(in_image(dst) + "hsbn-*-py3-none-linux_x86_64.whl"), os.listdir(in_image(dst))

    runs = [args for kw, args in stage if kw == "RUN"]
    venv_run = [r for r in runs if "-m venv /opt/venv" in r]
    assert venv_run, runs
    W.make_venv(in_image("/opt/venv"), system_site_packages=True)
    pip_runs = [r for r in runs if "/opt/venv/bin/pip install" in r and "/opt/hsbn/dist/" in r]
    assert pip_runs == ["/opt/venv/bin/pip install --no-cache-dir --no-deps "
                        "/opt/hsbn/dist/hsbn-*.whl"], pip_runs
    argv = [in_image(a) if a.startswith("/opt/") else a for a in shlex.split(pip_runs[0])]
    argv = [m for a in argv for m in (sorted(glob.glob(a)) if "*" in a else [a])]
    W.run(argv + ["--no-index", "--disable-pip-version-check", "-q"],
          W.clean_env(in_image("/opt/venv")), "/")

    image_env = env_of(stage)
    assert "LD_LIBRARY_PATH" not in image_env  # the wheel carries its libraries
    env = W.clean_env()
    for k, v in image_env.items():
        v = v.replace("${PATH}", env["PATH"]).replace("unix:/run/", "unix:" + in_image("/run/"))
        env[k] = re.sub(r"(^|:)/opt/", lambda m: m.group(1) + in_image("/opt/"), v)
    sock = env["HSBN_ADDRESS"][len("unix:"):]
    assert sock == in_image("/run/hsbn/hsbn.sock")
    os.makedirs(os.path.dirname(sock))
    work = in_image("/workspace")
    os.makedirs(work)

    agg = W.start_aggregator(["hsbn-aggregator", "--role=node", "--listen=" + env["HSBN_ADDRESS"]],
                             work, "sidecar", env)
    try:
        trainer = textwrap.dedent("""
            import json, torch, hsbn, hsbn.torch
            torch.manual_seed(0)
            x = torch.randn(6, 3)
            bn = hsbn.torch.convert_sync_batchnorm(torch.nn.BatchNorm1d(3), scope="node")
            y = bn(x)
            ref = torch.nn.functional.batch_norm(x, None, None, training=True)
            print(json.dumps({"lib": hsbn.library_path(), "err": (y - ref).abs().max().item(),
                              "mean": bn.running_mean.tolist(),
                              "want": (0.1 * x.mean(0)).tolist()}))
        """)
        run_env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       GROUP_RANK="0", HSBN_JOB_ID="image-layout")
        r = json.loads(W.run(["python", "-c", trainer], run_env, work, timeout=300).stdout)
        site = glob.glob(in_image("/opt/venv/lib/python3*/site-packages"))[0]
        assert r["lib"] == os.path.join(site, "hsbn", "_native", "libhsbn.so")
        assert r["err"] < 1e-6
        assert r["mean"] == pytest.approx(r["want"], abs=1e-6)
    finally:
        W.stop(agg)


def test_a_library_on_the_system_loader_path_is_found_without_a_package_copy(tmp_path):
    """hsbn's Python files without _native/, libhsbn.so (with its libraries) in a folder named
    by LD_LIBRARY_PATH, as an image that installs the library separately would have it."""
    import zipfile
    pkg, lib = tmp_path / "site", tmp_path / "lib"
    lib.mkdir()
    with zipfile.ZipFile(W.wheel_path()) as z:
        for n in z.namelist():
            if n.startswith("hsbn/") and "/_native/" not in n:
                z.extract(n, str(pkg))
            elif n.startswith("hsbn/_native/lib"):
                (lib / os.path.basename(n)).write_bytes(z.read(n))
    assert not (pkg / "hsbn" / "_native").exists()
    probe = ("import hsbn, hsbn._lib as L; L.lib(); print(hsbn.library_path()); "
             "print(L.lib().hsbn_path)")
    env = W.clean_env(PYTHONPATH=str(pkg), LD_LIBRARY_PATH=str(lib))
    out = W.run([W.DEBIAN_PYTHON, "-c", probe], env, str(tmp_path)).stdout.split()
    assert out == [str(lib / "libhsbn.so")] * 2
    # Without the folder on the loader's path the error names every place it looked.
    p = W.run([W.DEBIAN_PYTHON, "-c", probe], W.clean_env(PYTHONPATH=str(pkg)), str(tmp_path),
              check=False)
    assert p.returncode != 0
    assert "the loader's paths (LD_LIBRARY_PATH, ldconfig)" in p.stderr
