"""Shared set-up of the package tests: the wheel the build made, fresh venvs made with Debian's
/usr/bin/python3, clean environments (no PYTHONPATH, HSBN_*, LD_LIBRARY_PATH), and aggregators
started from an installed wheel."""

import glob
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBIAN_PYTHON = "/usr/bin/python3"
# What a plain glibc system provides (docker/runtime-deps.sh's SYSTEM_LIBS): the only libraries
# an installed wheel may load from outside itself.
with open(os.path.join(REPO, "docker", "runtime-deps.sh"), encoding="utf-8") as _f:
    SYSTEM_LIBS = re.search(r"^SYSTEM_LIBS='([^']+)'", _f.read(), re.M).group(1)
# Libraries the wheel bundles: none may be loaded from the system. The aggregator loads no
# other libraries at all; Python itself may load the system's libz, libssl and libcrypto for its
# own modules (the wheel's copies carry other names, so they never stand in for each other).
BUNDLED_FAMILIES = re.compile(r"^lib(grpc|gpr|upb|address_sorting|protobuf|absl_|cares|re2|ssl|"
                              r"crypto|z)[-._]")
GRPC_FAMILIES = re.compile(r"^lib(grpc|gpr|upb|address_sorting|protobuf|absl_|cares|re2)[-._]")


def wheel_path():
    w = os.environ.get("HSBN_WHEEL")
    if not w:
        build = os.environ.get("HSBN_BUILD_DIR", os.path.join(REPO, "build"))
        found = sorted(glob.glob(os.path.join(build, "dist", "hsbn-*.whl")))
        w = found[-1] if found else os.path.join(build, "dist", "hsbn-*.whl")
    if not os.path.isfile(w):
        raise AssertionError("the wheel %s is not built: cmake --build build --target hsbn_wheel "
                             "(needs patchelf: apt-get install patchelf)" % w)
    return w


def clean_env(venv=None, **extra):
    """An environment that sees nothing of the checkout or the build: no PYTHONPATH, no HSBN_*,
    no LD_LIBRARY_PATH; PATH starts with the venv's bin."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HSBN_", "PYTHON", "LD_")) and k not in ("VIRTUAL_ENV",)}
    env["PATH"] = ((os.path.join(venv, "bin") + os.pathsep) if venv else "") + "/usr/bin:/bin"
    env.update(extra)
    return env


def run(cmd, env, cwd, timeout=120, check=True):
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError("%s exited %d\nstdout:\n%s\nstderr:\n%s"
                             % (" ".join(cmd), p.returncode, p.stdout, p.stderr))
    return p


def make_venv(path, system_site_packages=False, see_numpy=True):
    """A fresh venv of Debian's Python. Without system site-packages it still sees Debian's numpy
    (hsbn's one dependency; pip cannot download it here) through a .pth file naming a folder
    that holds numpy alone, so nothing else of the system's Python is visible."""
    cmd = [DEBIAN_PYTHON, "-m", "venv"]
    if system_site_packages:
        cmd.append("--system-site-packages")
    run(cmd + [path], clean_env(), cwd="/")
    site = run([os.path.join(path, "bin", "python"), "-c",
                "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
               clean_env(), cwd="/").stdout.strip()
    if see_numpy and not system_site_packages:
        import numpy  # Debian's, in the interpreter running the tests
        only = os.path.join(path, "numpy-only")
        os.makedirs(only)
        os.symlink(os.path.dirname(numpy.__file__), os.path.join(only, "numpy"))
        with open(os.path.join(site, "debian-numpy.pth"), "w") as f:
            f.write(only + "\n")
    return site


def pip_install_wheel(venv, wheel):
    run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--no-index", "--no-deps",
         "--disable-pip-version-check", "-q", wheel], clean_env(venv), cwd="/")


def start_aggregator(argv, workdir, name, env):
    """Starts an aggregator (argv without --ready-file/--id) and waits for its ready file."""
    ready = os.path.join(workdir, name + ".ready")
    log = open(os.path.join(workdir, name + ".log"), "w")
    proc = subprocess.Popen(argv + ["--id=" + name, "--ready-file=" + ready], env=env,
                            cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(log.name) as f:
                raise AssertionError("aggregator %s did not get ready (status %s):\n%s"
                                     % (name, proc.poll(), f.read()))
        time.sleep(0.02)
    with open(ready) as f:
        addresses = [line.strip() for line in f if line.strip()]
    proc.hsbn_addresses = addresses
    proc.hsbn_log = log
    return proc


def stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.hsbn_log.close()


def mapped_libraries(pid):
    """The shared objects mapped into process `pid`: {path}."""
    with open("/proc/%d/maps" % pid) as f:
        return {line.split()[-1] for line in f if ".so" in line.split()[-1]}


def foreign_libraries(paths, inside, families=BUNDLED_FAMILIES):
    """Mapped libraries of the bundled families that come from outside `inside`."""
    return sorted(p for p in paths
                  if families.match(os.path.basename(p))
                  and not os.path.realpath(p).startswith(os.path.realpath(inside) + os.sep))


if __name__ == "__main__":
    sys.exit("a helper module for tests/package")
