"""ctypes binding of the hsbn C ABI (client/include/hsbn/hsbn.h) and location of the native parts.

Only the C ABI is bound, never C++ symbols, so the package works with any PyTorch build.
The native parts are looked up, in order:
  1. the environment: HSBN_LIBRARY (path to libhsbn.so), HSBN_AGGREGATOR (path to hsbn-aggregator);
  2. a copy inside the installed package: hsbn/_native/;
  3. the repository's CMake build folders (build*/client/libhsbn.so, build*/server/hsbn-aggregator)
     relative to this source file, for a checkout used through PYTHONPATH=client/python.
"""

import ctypes
import glob
import os
import threading

ABI_VERSION = 1

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_NATIVE_DIR = os.path.join(_PACKAGE_DIR, "_native")
# client/python/hsbn -> repository root
_REPO_ROOT = os.path.normpath(os.path.join(_PACKAGE_DIR, "..", "..", ".."))

_HOW_TO_BUILD = (
    "Build it with `cmake -S . -B build && cmake --build build --target hsbn_c hsbn-aggregator` "
    "in the hsbn repository, then either set HSBN_LIBRARY / HSBN_AGGREGATOR to the outputs or "
    "copy them into client/python/hsbn/_native/ and `pip install client/python`.")


class NativeNotFoundError(RuntimeError):
    """A native part of hsbn (libhsbn.so or hsbn-aggregator) could not be found."""


def _repo_build_candidates(relative):
    # Newest first, so a fresh build wins over a stale one.
    found = glob.glob(os.path.join(_REPO_ROOT, "build*", relative))
    found = [p for p in found if os.path.isfile(p)]
    found.sort(key=os.path.getmtime, reverse=True)
    return found


def _locate(env_var, native_name, build_relative, what):
    tried = []
    path = os.environ.get(env_var)
    if path:
        if os.path.isfile(path):
            return os.path.abspath(path)
        raise NativeNotFoundError(
            "%s=%s does not name a file. Point it at the %s, or unset it to use the copy in the "
            "package or the repository's build folder." % (env_var, path, what))
    tried.append("$%s (unset)" % env_var)
    packaged = os.path.join(_NATIVE_DIR, native_name)
    if os.path.isfile(packaged):
        return packaged
    tried.append(packaged)
    built = _repo_build_candidates(build_relative)
    if built:
        return built[0]
    tried.append(os.path.join(_REPO_ROOT, "build*", build_relative))
    raise NativeNotFoundError("cannot find the %s; looked at: %s. %s"
                              % (what, ", ".join(tried), _HOW_TO_BUILD))


def library_path():
    """Path of libhsbn.so, found as described in the module docstring."""
    return _locate("HSBN_LIBRARY", "libhsbn.so", os.path.join("client", "libhsbn.so"),
                   "hsbn C library (libhsbn.so)")


def aggregator_path():
    """Path of the hsbn-aggregator binary, found as described in the module docstring."""
    path = _locate("HSBN_AGGREGATOR", "hsbn-aggregator",
                   os.path.join("server", "hsbn-aggregator"),
                   "aggregator binary (hsbn-aggregator)")
    if not os.access(path, os.X_OK):
        raise NativeNotFoundError("%s is not executable; `chmod +x` it." % path)
    return path


# --- C types -------------------------------------------------------------------------------------

class Options(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("address", ctypes.c_char_p),
        ("job_id", ctypes.c_char_p),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("local_rank", ctypes.c_int32),
        ("local_world_size", ctypes.c_int32),
        ("node_rank", ctypes.c_int32),
        ("round_timeout_ms", ctypes.c_int64),
        ("connect_timeout_ms", ctypes.c_int64),
        ("token", ctypes.c_char_p),
    ]


class ClientInfo(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("local_rank", ctypes.c_int32),
        ("local_world_size", ctypes.c_int32),
        ("node_rank", ctypes.c_int32),
        ("num_nodes", ctypes.c_int32),
        ("max_channels", ctypes.c_int32),
        ("round_timeout_ms", ctypes.c_int64),
    ]


class CRoundStats(ctypes.Structure):
    _fields_ = [
        ("completed", ctypes.c_int64),
        ("failed", ctypes.c_int64),
        ("blocked_seconds", ctypes.c_double),
        ("max_blocked_seconds", ctypes.c_double),
    ]


class CStats(ctypes.Structure):
    """hsbn_stats: rounds[scope - 1][phase - 1]; struct_size versions it."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("rounds", (CRoundStats * 2) * 3),
        ("bytes_sent", ctypes.c_int64),
        ("bytes_received", ctypes.c_int64),
        ("elapsed_seconds", ctypes.c_double),
    ]


SCOPE_NODE = 1
SCOPE_GLOBAL = 2
SCOPE_SHADOW = 3
PHASE_FORWARD = 1
PHASE_BACKWARD = 2

_c_int = ctypes.c_int
_c_i32 = ctypes.c_int32
_c_u32 = ctypes.c_uint32
_c_i64 = ctypes.c_int64
_c_u64 = ctypes.c_uint64
_p_dbl = ctypes.POINTER(ctypes.c_double)
_p_i64 = ctypes.POINTER(ctypes.c_int64)
_p_void = ctypes.c_void_p

# name: (restype, argtypes). hsbn_result is a C enum: int.
_SIGNATURES = {
    "hsbn_result_string": (ctypes.c_char_p, [_c_int]),
    "hsbn_last_error": (ctypes.c_char_p, []),
    "hsbn_abi_version": (_c_int, []),
    "hsbn_options_init": (None, [ctypes.POINTER(Options)]),
    "hsbn_client_create": (_c_int, [ctypes.POINTER(Options), ctypes.POINTER(_p_void)]),
    "hsbn_client_create_from_env": (_c_int, [ctypes.POINTER(_p_void)]),
    "hsbn_client_destroy": (None, [_p_void]),
    "hsbn_client_get_info": (_c_int, [_p_void, ctypes.POINTER(ClientInfo)]),
    "hsbn_forward": (_c_int, [_p_void, _c_u32, _c_u64, _c_int, _c_i64, _c_i64, _p_dbl, _p_dbl,
                              _p_i64, _p_dbl, _p_dbl]),
    "hsbn_backward": (_c_int, [_p_void, _c_u32, _c_u64, _c_int, _c_i64, _c_i64, _p_dbl, _p_dbl,
                               _p_i64, _p_dbl, _p_dbl]),
    "hsbn_round_start": (_c_int, [_p_void, _c_int, _c_u32, _c_u64, _c_int, _c_i64, _c_i64, _p_dbl,
                                  _p_dbl, ctypes.POINTER(_p_void)]),
    "hsbn_round_wait": (_c_int, [_p_void, _p_i64, _p_dbl, _p_dbl]),
    "hsbn_client_stats": (_c_int, [_p_void, ctypes.POINTER(CStats)]),
    "hsbn_client_reset_stats": (_c_int, [_p_void]),
    "hsbn_status_json": (_c_int, [_p_void, _c_int, ctypes.c_char_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_size_t)]),
}

_lock = threading.Lock()
_lib = None


def lib():
    """The loaded libhsbn.so with its C ABI declared. Loaded once per process."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                handle = ctypes.CDLL(path)  # CDLL releases the GIL during every call
            except OSError as e:
                raise NativeNotFoundError("cannot load %s: %s. %s" % (path, e, _HOW_TO_BUILD))
            for name, (restype, argtypes) in _SIGNATURES.items():
                if not hasattr(handle, name):
                    raise NativeNotFoundError(
                        "%s lacks the C ABI function %s; it is not a matching hsbn build. %s"
                        % (path, name, _HOW_TO_BUILD))
                fn = getattr(handle, name)
                fn.restype = restype
                fn.argtypes = argtypes
            version = handle.hsbn_abi_version()
            if version != ABI_VERSION:
                raise NativeNotFoundError(
                    "%s speaks C ABI version %d, this Python package needs %d; rebuild or "
                    "reinstall so that both come from the same hsbn version."
                    % (path, version, ABI_VERSION))
            handle.hsbn_path = path
            _lib = handle
    return _lib


def result_name(code):
    return lib().hsbn_result_string(code).decode("utf-8", "replace")


def last_error():
    return lib().hsbn_last_error().decode("utf-8", "replace")


# --- the BatchNorm kernels' C ABI (kernels/include/hsbn/bn_kernels_c.h) ------------------------
# Exported by libhsbn.so when the kernels are built into it; optional: hsbn.torch falls back to
# torch's own ops when they are absent.

BN_ABI_VERSION = 1
BN_CPU, BN_CUDA = 0, 1
BN_F16, BN_BF16, BN_F32, BN_F64 = 0, 1, 2, 3
BN_NCHW, BN_CHANNELS_LAST = 0, 1
BN_INVSTD, BN_VAR, BN_M2 = 0, 1, 2

_c_dbl = ctypes.c_double
_c_size = ctypes.c_size_t
_BN_SIGNATURES = {
    "hsbn_bn_last_error": (ctypes.c_char_p, []),
    "hsbn_bn_abi_version": (_c_int, []),
    "hsbn_bn_cuda_available": (_c_int, []),
    "hsbn_bn_workspace_size": (_c_int, [_c_int, _c_int, _c_int, _c_i64, _c_i64, _c_i64,
                                        ctypes.POINTER(_c_size)]),
    "hsbn_bn_moments": (_c_int, [_c_int, _c_int, _c_int, _c_i64, _c_i64, _c_i64, _p_void,
                                 _p_i64, _p_void, _p_void, _p_void, _c_size, _p_void]),
    "hsbn_bn_normalize": (_c_int, [_c_int, _c_int, _c_int, _c_i64, _c_i64, _c_i64, _p_void,
                                   _p_void, _p_void, _p_void, _c_int, _c_int, _c_dbl, _c_i64,
                                   _p_void, _p_void, _c_int, _c_int, _p_void]),
    "hsbn_bn_backward_reduce": (_c_int, [_c_int, _c_int, _c_int, _c_i64, _c_i64, _c_i64,
                                         _p_void, _p_void, _p_void, _p_void, _c_int, _c_int,
                                         _c_dbl, _c_i64, _p_void, _p_void, _p_void, _p_void,
                                         _c_int, _p_void, _c_size, _p_void]),
    "hsbn_bn_backward_elemt": (_c_int, [_c_int, _c_int, _c_int, _c_i64, _c_i64, _c_i64,
                                        _p_void, _p_void, _p_void, _p_void, _c_int, _c_int,
                                        _c_dbl, _c_i64, _p_void, _c_int, _p_void, _p_void,
                                        _c_i64, _p_void, _p_void]),
}

_bn_checked = False
_bn = None


def bn_kernels():
    """libhsbn.so's handle if it exports the BatchNorm kernels' C ABI (version 1), else None."""
    global _bn_checked, _bn
    if _bn_checked:
        return _bn
    handle = lib()
    with _lock:
        if not _bn_checked:
            if all(hasattr(handle, name) for name in _BN_SIGNATURES):
                for name, (restype, argtypes) in _BN_SIGNATURES.items():
                    fn = getattr(handle, name)
                    fn.restype = restype
                    fn.argtypes = argtypes
                if handle.hsbn_bn_abi_version() == BN_ABI_VERSION:
                    _bn = handle
            _bn_checked = True
    return _bn
