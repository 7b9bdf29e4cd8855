"""Builds hsbn's wheel from the CMake build: the Python package, libhsbn.so and its C header
(hsbn/include/hsbn/hsbn.h), hsbn-aggregator and hsbn-linkproxy (LocalCluster's simulated link, when built), and the shared libraries they need that a plain Linux system does not have (gRPC, protobuf,
Abseil, OpenSSL, ...), as auditwheel does: each bundled library is renamed with a hash of its
contents (so it never clashes with another copy in the process), every reference to it is
patched, and every native file finds its neighbours through RPATH $ORIGIN. Only glibc and the
GCC runtime (libstdc++, libgcc_s) come from the system; METADATA states the versions needed.

The package uses ctypes, not the Python C API, so the wheel is `py3-none-linux_<machine>`.
Nothing is written into the source tree: the staging area is a temporary folder.

  python3 hsbn_wheel.py --lib build/client/libhsbn.so --aggregator build/server/hsbn-aggregator \\
      --linkproxy build/tools/linkproxy/hsbn-linkproxy --out build/dist
                                (what the CMake target hsbn_wheel runs)

It is also the package's PEP 517 build backend, so `pip install client/python` builds the same
wheel from the CMake build folder ($HSBN_BUILD_DIR, default build/ at the repository root, or
$HSBN_LIBRARY / $HSBN_AGGREGATOR). Needs Python 3.11+ (tomllib), patchelf, strip, ldd, objdump.
"""

import argparse
import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))

# As pip's build backend this module is imported from the source folder, and Python has just
# cached its bytecode there: remove it, so that building never leaves a file in the tree.
if __name__ != "__main__" and globals().get("__cached__"):
    try:
        os.remove(__cached__)
        os.rmdir(os.path.dirname(__cached__))
    except OSError:
        pass
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
RUNTIME_DEPS = os.path.join(REPO, "docker", "runtime-deps.sh")
HEADER = os.path.join(REPO, "client", "include", "hsbn", "hsbn.h")
# 1980-01-01, the earliest time a zip can hold: the same inputs give the same wheel.
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
ENTRY_POINTS = {"hsbn": "hsbn.cli:main", "hsbn-aggregator": "hsbn.cli:aggregator_main",
                "hsbn-linkproxy": "hsbn.cli:linkproxy_main"}


class BuildError(RuntimeError):
    pass


def _run(*cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr.strip()))
    return p.stdout


def _project():
    import tomllib  # Python 3.11+
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    with open(os.path.join(HERE, "hsbn", "__init__.py"), encoding="utf-8") as f:
        m = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if not m or m.group(1) != project["version"]:
        raise BuildError("hsbn/__init__.py's __version__ (%s) differs from pyproject.toml's "
                         "version (%s); make them equal" % (m and m.group(1), project["version"]))
    scripts = project.get("scripts", {})
    if scripts != ENTRY_POINTS:
        raise BuildError("pyproject.toml [project.scripts] is %r; this builder installs %r"
                         % (scripts, ENTRY_POINTS))
    return project


def _max_version(files, prefix):
    """Highest symbol version named prefix_X.Y[.Z] that the files need (objdump -T)."""
    best = None
    for f in files:
        for m in re.finditer(r"\(?%s_([0-9.]+)\)?\s" % prefix, _run("objdump", "-T", f)):
            v = tuple(int(x) for x in m.group(1).split("."))
            best = v if best is None or v > best else best
    return ".".join(map(str, best)) if best else None


def _bundle(native, elves):
    """Copies the non-system libraries the ELF files need into `native`, renames them
    auditwheel-style and points every file's RPATH at $ORIGIN. Returns the bundled names."""
    before = set(os.listdir(native))
    _run("bash", RUNTIME_DEPS, "bundle", native, *elves)
    bundled = sorted(set(os.listdir(native)) - before)
    renames = {}
    for name in bundled:
        path = os.path.join(native, name)
        os.chmod(path, 0o755)
        soname = _run("patchelf", "--print-soname", path).strip() or name
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:8]
        stem, dot, rest = soname.partition(".so")
        new = "%s-%s%s%s" % (stem, digest, dot, rest)
        renames[soname] = new
        _run("patchelf", "--set-soname", new, path)
        os.rename(path, os.path.join(native, new))
    for name in sorted(os.listdir(native)):
        path = os.path.join(native, name)
        for needed in _run("patchelf", "--print-needed", path).split():
            if needed in renames:
                _run("patchelf", "--replace-needed", needed, renames[needed], path)
        _run("patchelf", "--set-rpath", "$ORIGIN", path)
    return sorted(renames.values())


def _check_closed(native, system_re):
    """Every library a native file loads is in `native` or is a system library."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    for name in sorted(os.listdir(native)):
        path = os.path.join(native, name)
        out = subprocess.run(["ldd", path], capture_output=True, text=True, env=env).stdout
        for line in out.splitlines():
            m = re.match(r"\s*(\S+) => (\S+)", line)
            if not m:
                continue
            lib, where = m.groups()
            if where == "not":
                raise BuildError("%s: %s not found after bundling" % (name, lib))
            if os.path.dirname(where) != native and not re.match(system_re, lib):
                raise BuildError("%s loads %s from %s, outside the wheel" % (name, lib, where))


def _system_libs_re():
    with open(RUNTIME_DEPS, encoding="utf-8") as f:
        m = re.search(r"^SYSTEM_LIBS='([^']+)'", f.read(), re.M)
    if not m:
        raise BuildError("%s has no SYSTEM_LIBS line" % RUNTIME_DEPS)
    return m.group(1)


def _metadata(project, glibc, glibcxx):
    lines = ["Metadata-Version: 2.1", "Name: %s" % project["name"],
             "Version: %s" % project["version"], "Summary: %s" % project["description"],
             "Requires-Python: %s" % project["requires-python"]]
    lines += ["Requires-Dist: %s" % d for d in project.get("dependencies", [])]
    lines.append("Requires-External: glibc (>=%s)" % glibc)
    if glibcxx:
        lines.append("Requires-External: libstdc++ (GLIBCXX >=%s)" % glibcxx)
    readme = project.get("readme")
    text = ""
    if readme:
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(HERE, readme), encoding="utf-8") as f:
            text = f.read()
    return "\n".join(lines) + "\n\n" + text


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build(lib, aggregator, out_dir, work_dir=None, plat=None, linkproxy=None):
    """Builds the wheel into out_dir and returns its path. `linkproxy` (optional) is the
    hsbn-linkproxy binary that LocalCluster's link_delay_ms / link_proxy use."""
    project = _project()
    plat = plat or "linux_" + platform.machine()
    natives_in = [(lib, "libhsbn.so"), (aggregator, "hsbn-aggregator")]
    if linkproxy:
        natives_in.append((linkproxy, "hsbn-linkproxy"))
    for f, what in natives_in:
        if not os.path.isfile(f):
            raise BuildError("%s (%s) does not exist; build it first: cmake --build build "
                             "--target hsbn_c hsbn-aggregator" % (f, what))
    if shutil.which("patchelf") is None:
        raise BuildError("patchelf is not installed (Debian: apt-get install patchelf)")
    if work_dir:
        os.makedirs(work_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="hsbn-wheel-", dir=work_dir)
    try:
        stage = os.path.join(tmp, "stage")
        shutil.copytree(os.path.join(HERE, "hsbn"), os.path.join(stage, "hsbn"),
                        ignore=shutil.ignore_patterns("_native", "__pycache__", "*.pyc"))
        # The C ABI's header, for C and C++ workers that link the wheel's libhsbn.so
        # (hsbn.include_dir() returns the folder).
        include = os.path.join(stage, "hsbn", "include", "hsbn")
        os.makedirs(include)
        shutil.copyfile(HEADER, os.path.join(include, "hsbn.h"))
        native = os.path.join(stage, "hsbn", "_native")
        os.makedirs(native)
        elves = []
        for src, name in natives_in:
            dst = os.path.join(native, name)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o755)
            _run("strip", "--strip-debug", dst)
            elves.append(dst)
        bundled = _bundle(native, elves)
        _check_closed(native, _system_libs_re())
        natives = [os.path.join(native, n) for n in os.listdir(native)]
        glibc = _max_version(natives, "GLIBC")
        glibcxx = _max_version(natives, "GLIBCXX")

        name, version = project["name"], project["version"]
        tag = "py3-none-%s" % plat
        dist_info = "%s-%s.dist-info" % (name, version)
        files = {}
        for root, dirs, names in os.walk(stage):
            dirs.sort()
            for n in sorted(names):
                path = os.path.join(root, n)
                with open(path, "rb") as f:
                    files[os.path.relpath(path, stage)] = (f.read(), os.stat(path).st_mode)
        meta = {
            "METADATA": _metadata(project, glibc, glibcxx),
            "WHEEL": "Wheel-Version: 1.0\nGenerator: hsbn_wheel.py\nRoot-Is-Purelib: false\n"
                     "Tag: %s\n" % tag,
            "entry_points.txt": "[console_scripts]\n" + "".join(
                "%s = %s\n" % kv for kv in sorted(ENTRY_POINTS.items())),
        }
        for n, text in meta.items():
            files["%s/%s" % (dist_info, n)] = (text.encode("utf-8"), 0o644)
        record = "".join("%s,%s,%d\n" % (p, _record_hash(d), len(d))
                         for p, (d, _) in sorted(files.items()))
        record += "%s/RECORD,,\n" % dist_info
        files["%s/RECORD" % dist_info] = (record.encode("utf-8"), 0o644)

        os.makedirs(out_dir, exist_ok=True)
        wheel = os.path.join(out_dir, "%s-%s-%s.whl" % (name, version, tag))
        partial = wheel + ".part"
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as z:
            # RECORD last, as the wheel spec recommends.
            for p in sorted(files, key=lambda p: (p.endswith("/RECORD"), p)):
                data, mode = files[p]
                info = zipfile.ZipInfo(p, ZIP_TIME)
                info.external_attr = ((0o755 if mode & 0o111 else 0o644) | 0o100000) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, data)
        os.replace(partial, wheel)
        print("hsbn_wheel: %s (%.1f MiB; bundled %d libraries; needs glibc >= %s%s)"
              % (wheel, os.path.getsize(wheel) / 2**20, len(bundled), glibc,
                 ", GLIBCXX >= %s" % glibcxx if glibcxx else ""))
        return wheel
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- PEP 517 --------------------------------------------------------------------------------

def _native_from_build():
    build_dir = os.environ.get("HSBN_BUILD_DIR", "build")
    build_dir = build_dir if os.path.isabs(build_dir) else os.path.join(REPO, build_dir)
    lib = os.environ.get("HSBN_LIBRARY") or os.path.join(build_dir, "client", "libhsbn.so")
    agg = os.environ.get("HSBN_AGGREGATOR") or os.path.join(build_dir, "server",
                                                            "hsbn-aggregator")
    proxy = os.environ.get("HSBN_LINKPROXY") or os.path.join(build_dir, "tools", "linkproxy",
                                                             "hsbn-linkproxy")
    return lib, agg, (proxy if os.path.isfile(proxy) else None)


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    lib, agg, proxy = _native_from_build()
    return os.path.basename(build(lib, agg, wheel_directory, linkproxy=proxy))


def build_sdist(sdist_directory, config_settings=None):
    raise BuildError("hsbn has no source distribution: the wheel is built from the CMake "
                     "build (cmake --build build --target hsbn_wheel)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", required=True, help="libhsbn.so from the CMake build")
    p.add_argument("--aggregator", required=True, help="hsbn-aggregator from the CMake build")
    p.add_argument("--linkproxy", help="hsbn-linkproxy from the CMake build (optional)")
    p.add_argument("--out", required=True, help="folder for the .whl")
    p.add_argument("--work", help="folder for the temporary staging area (default: $TMPDIR)")
    p.add_argument("--plat", help="platform tag (default: linux_<machine>)")
    a = p.parse_args(argv)
    try:
        build(a.lib, a.aggregator, a.out, a.work, a.plat, linkproxy=a.linkproxy)
    except BuildError as e:
        print("hsbn_wheel: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
