"""hsbn: hierarchical synchronized BatchNorm as a service — the Python client.

  hsbn.Client            a worker's connection to its node's sidecar aggregator
                         (Client.stats(): rounds and time blocked in them, per scope and phase)
  hsbn.torch             SyncBatchNorm with a scope, convert_sync_batchnorm (needs PyTorch)
  hsbn.cluster           LocalCluster: a root and one sidecar per simulated node on this machine

The package binds libhsbn.so's C ABI with ctypes; see hsbn._lib for how it is found.
"""

import importlib

from .client import (Client, ClientStats, RoundStats, default_client, set_default_client,
                     SCOPES)
from .errors import (HsbnError, ConfigurationError, UnavailableError, DeadlineExceededError,
                     RoundFailedError, InvalidArgumentError, FailedPreconditionError,
                     ResourceExhaustedError)
from ._lib import NativeNotFoundError, library_path, aggregator_path

__version__ = "0.1.0"

__all__ = [
    "Client", "ClientStats", "RoundStats", "default_client", "set_default_client", "SCOPES",
    "HsbnError", "ConfigurationError", "UnavailableError", "DeadlineExceededError", "RoundFailedError",
    "InvalidArgumentError", "FailedPreconditionError", "ResourceExhaustedError", "NativeNotFoundError", "library_path",
    "aggregator_path", "include_dir", "torch", "cluster",
]


def include_dir():
    """The folder to give a C compiler with -I for `#include "hsbn/hsbn.h"` (libhsbn.so's C
    ABI): the wheel's hsbn/include, or client/include in a checkout."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(here, "include"), os.path.join(here, os.pardir, os.pardir, "include")):
        if os.path.isfile(os.path.join(d, "hsbn", "hsbn.h")):
            return os.path.normpath(d)
    raise NativeNotFoundError("hsbn/hsbn.h is neither in %s nor in a checkout's client/include"
                              % os.path.join(here, "include"))


def __getattr__(name):
    # hsbn.torch imports PyTorch; load it (and hsbn.cluster) only when asked for.
    if name in ("torch", "cluster"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError("module 'hsbn' has no attribute %r" % name)
