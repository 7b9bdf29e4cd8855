"""Shared set-up of the hsbn Python tests.

The tests run real aggregator processes and real worker processes, so they need the native parts:
libhsbn.so and hsbn-aggregator, found as the package finds them (HSBN_LIBRARY / HSBN_AGGREGATOR,
then hsbn/_native/, then the repository's build*/ folders). If they are missing every test fails
with a message that says how to build them; nothing is skipped.
"""

import os
import sys

import pytest

import transports

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(_REPO, "client", "python")
try:
    import hsbn  # noqa: F401  (installed, or PYTHONPATH=client/python)
except ImportError:
    sys.path.insert(0, _PKG)
    import hsbn  # noqa: F401

from hsbn import _lib  # noqa: E402

# Subprocesses (workers, the docs example) run elsewhere: give them this hsbn by absolute path.
_HSBN_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(hsbn.__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_HSBN_PARENT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

_NATIVE_ERROR = None
try:
    # Pin what was found, so worker processes and aggregators use the same build.
    os.environ["HSBN_LIBRARY"] = _lib.library_path()
    os.environ["HSBN_AGGREGATOR"] = _lib.aggregator_path()
    _lib.lib()
except _lib.NativeNotFoundError as e:
    _NATIVE_ERROR = str(e)


@pytest.fixture(scope="session", autouse=True)
def native_parts():
    """Fails (never skips) every test when libhsbn.so or hsbn-aggregator is missing."""
    if _NATIVE_ERROR:
        pytest.fail("hsbn's native parts are missing: " + _NATIVE_ERROR, pytrace=False)
    return os.environ["HSBN_LIBRARY"], os.environ["HSBN_AGGREGATOR"]


# The node path's integration and failure tests take `transport` (through their worker pool's
# fixture, or transport_env for clients made in the test process) and run once over each of
# transports.NAMES: their ids end in [shm] or [grpc].
@pytest.fixture(scope="module", params=transports.NAMES)
def transport(request):
    return request.param


@pytest.fixture
def transport_env(transport, monkeypatch):
    """Clients made by the test process during this test use `transport`; returns what their
    Client.stats().transport must say."""
    monkeypatch.setenv("HSBN_TRANSPORT", transports.ENV[transport])
    return transports.EXPECTED[transport]
