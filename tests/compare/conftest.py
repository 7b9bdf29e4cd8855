"""Set-up of the comparison's tests: the program's modules (examples/compare) and the hsbn
package (client/python, unless installed) on sys.path, and the native parts pinned in the
environment for the worker processes, as tests/python/conftest.py does."""

import os
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
