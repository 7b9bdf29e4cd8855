"""Set-up of the comparison's tests: the program's modules (examples/compare) and the hsbn
package (client/python, unless installed) on sys.path, and the native parts pinned in the
environment for the worker processes, as tests/python/conftest.py does."""

import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARE = os.path.join(REPO, "examples", "compare")
PKG = os.path.join(REPO, "client", "python")

sys.path.insert(0, COMPARE)
try:
    import hsbn  # noqa: F401
except ImportError:
    sys.path.insert(0, PKG)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (PKG, os.environ.get("PYTHONPATH")) if p)
    import hsbn  # noqa: F401

from hsbn import _lib  # noqa: E402

NATIVE_ERROR = None
try:
    os.environ["HSBN_LIBRARY"] = _lib.library_path()
    os.environ["HSBN_AGGREGATOR"] = _lib.aggregator_path()
except _lib.NativeNotFoundError as e:
    NATIVE_ERROR = str(e)


@pytest.fixture
def native_parts():
    """Fails (never skips) a test that needs libhsbn.so and hsbn-aggregator when they are
    missing."""
    if NATIVE_ERROR:
        pytest.fail("hsbn's native parts are missing: " + NATIVE_ERROR, pytrace=False)


def run_study(cmd, timeout):
    """subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout), except
    that a study still running at the timeout first prints every one of its Python processes'
    stacks (SIGUSR1: hsbn_compare's hook) and the test fails showing them, with the output so
    far; then the study's whole process group is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        from hsbncmp import cli
        cli.dump_stacks([proc.pid] + cli.python_descendants(proc.pid))
        try:  # the dumps are written at once; the study itself does not end
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail("%s did not finish in %d s; its stacks (SIGUSR1) and output:\n"
                    "--- stdout ---\n%s\n--- stderr ---\n%s"
                    % (" ".join(cmd[:2]), timeout, out[-4000:], err[-20000:]), pytrace=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
