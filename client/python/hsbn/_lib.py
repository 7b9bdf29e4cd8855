"""ctypes binding of the hsbn C ABI (client/include/hsbn/hsbn.h) and location of the native parts.

Only the C ABI is bound, never C++ symbols, so the package works with any PyTorch build.
The native parts are looked up, in order:
  1. the environment: HSBN_LIBRARY (path to libhsbn.so), HSBN_AGGREGATOR (path to hsbn-aggregator),
     HSBN_LINKPROXY (path to hsbn-linkproxy, which LocalCluster's simulated link runs);
  2. the copy inside the installed package, hsbn/_native/ (the wheel puts them there, with the
     libraries they need);
  3. the system's loader paths: libhsbn.so in a folder of LD_LIBRARY_PATH or in the ld.so cache
     (ldconfig), as dlopen("libhsbn.so") finds it; hsbn-aggregator and hsbn-linkproxy on PATH;
  4. the repository's CMake build folders (build*/client/libhsbn.so, build*/server/hsbn-aggregator,
     build*/tools/linkproxy/hsbn-linkproxy) relative to this source file, for a checkout used
     through PYTHONPATH=client/python.
"""

import collections
import ctypes
import ctypes.util
import glob
import os
import threading

ABI_VERSION = 6

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_NATIVE_DIR = os.path.join(_PACKAGE_DIR, "_native")
# client/python/hsbn -> repository root
_REPO_ROOT = os.path.normpath(os.path.join(_PACKAGE_DIR, "..", "..", ".."))

_HOW_TO_BUILD = (
    "Install the hsbn wheel (`cmake --build build --target hsbn_wheel` in the hsbn repository, "
    "then `pip install build/dist/hsbn-*.whl`), or set HSBN_LIBRARY / HSBN_AGGREGATOR to the "
    "files of a CMake build, or put libhsbn.so's folder on LD_LIBRARY_PATH.")


class NativeNotFoundError(RuntimeError):
    """A native part of hsbn (libhsbn.so or hsbn-aggregator) could not be found."""


def _repo_build_candidates(relative):
    # Newest first, so a fresh build wins over a stale one.
    found = glob.glob(os.path.join(_REPO_ROOT, "build*", relative))
    found = [p for p in found if os.path.isfile(p)]
    found.sort(key=os.path.getmtime, reverse=True)
    return found


def _on_loader_path(name):
    """Where dlopen(name) would find a library: LD_LIBRARY_PATH's folders, then the ld.so cache.
    Returns a path, or the bare name when only the loader knows where it is, or None."""
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if d and os.path.isfile(os.path.join(d, name)):
            return os.path.abspath(os.path.join(d, name))
    stem = name[3:].split(".so")[0] if name.startswith("lib") else name
    if ctypes.util.find_library(stem):
        return name
    return None


def _locate(env_var, native_name, build_relative, what, system):
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
    found, where = system()
    if found:
        return found
    tried.append(where)
    built = _repo_build_candidates(build_relative)
    if built:
        return built[0]
    tried.append(os.path.join(_REPO_ROOT, "build*", build_relative))
    raise NativeNotFoundError("cannot find the %s; looked at: %s. %s"
                              % (what, ", ".join(tried), _HOW_TO_BUILD))


def library_path():
    """Path of libhsbn.so, found as described in the module docstring. When only the system's
    loader knows the folder (the ld.so cache), this is the bare name "libhsbn.so"."""
    return _locate("HSBN_LIBRARY", "libhsbn.so", os.path.join("client", "libhsbn.so"),
                   "hsbn C library (libhsbn.so)",
                   lambda: (_on_loader_path("libhsbn.so"),
                            "the loader's paths (LD_LIBRARY_PATH, ldconfig)"))


def aggregator_path():
    """Path of the hsbn-aggregator binary, found as described in the module docstring."""
    path = _locate("HSBN_AGGREGATOR", "hsbn-aggregator",
                   os.path.join("server", "hsbn-aggregator"),
                   "aggregator binary (hsbn-aggregator)",
                   lambda: (_binary_on_path("hsbn-aggregator"), "$PATH"))
    if not os.access(path, os.X_OK):
        raise NativeNotFoundError("%s is not executable; `chmod +x` it." % path)
    return path


def linkproxy_path():
    """Path of the hsbn-linkproxy binary (LocalCluster's link_delay_ms and link_proxy), found
    as described in the module docstring."""
    path = _locate("HSBN_LINKPROXY", "hsbn-linkproxy",
                   os.path.join("tools", "linkproxy", "hsbn-linkproxy"),
                   "link proxy binary (hsbn-linkproxy)",
                   lambda: (_binary_on_path("hsbn-linkproxy"), "$PATH"))
    if not os.access(path, os.X_OK):
        raise NativeNotFoundError("%s is not executable; `chmod +x` it." % path)
    return path


def _binary_on_path(name):
    """The executable `name` in a folder of PATH that is not a script: the package's console
    scripts of the same name (hsbn-aggregator, hsbn-linkproxy) only run the binary."""
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK) and not _is_script(p):
            return os.path.abspath(p)
    return None


def _is_script(path):
    with open(path, "rb") as f:
        return f.read(2) == b"#!"


def _loaded_path(handle, name):
    """The file the loader opened for `handle` (dlinfo RTLD_DI_LINKMAP), else `name`."""
    try:
        class LinkMap(ctypes.Structure):
            _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]
        libc = ctypes.CDLL(None)
        lm = ctypes.POINTER(LinkMap)()
        if libc.dlinfo(ctypes.c_void_p(handle._handle), 2, ctypes.byref(lm)) == 0 and lm:
            return lm.contents.l_name.decode() or name
    except (AttributeError, OSError):
        pass
    return name


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
        ("strict_finite", ctypes.c_int32),
        ("group_nodes", ctypes.c_int32),
        ("env", ctypes.POINTER(ctypes.c_char_p)),
        ("transport", ctypes.c_char_p),
        ("incarnation", ctypes.c_int64),
        ("auto_warmup", ctypes.c_int64),
        ("auto_max_mean_shift", ctypes.c_double),
        ("auto_max_log_var_ratio", ctypes.c_double),
        ("auto_recheck_every", ctypes.c_int64),
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


class StatusQuery(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("address", ctypes.c_char_p),
        ("job_id", ctypes.c_char_p),
        ("token", ctypes.c_char_p),
        ("include_upstream", ctypes.c_int),
        ("timeout_ms", ctypes.c_int64),
        ("tls_ca_file", ctypes.c_char_p),
        ("tls_cert_file", ctypes.c_char_p),
        ("tls_key_file", ctypes.c_char_p),
        ("tls_name", ctypes.c_char_p),
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
        ("group_rounds", CRoundStats * 2),
        ("transport", ctypes.c_char * 256),
        ("renorm_rounds", CRoundStats * 2),
        ("global_stats", CRoundStats),
        ("global_stats_waited", ctypes.c_int64),
        ("lagged_rounds", CRoundStats * 2),
        ("late_dropped", ctypes.c_int64),
    ]


class AutoPolicy(ctypes.Structure):
    _fields_ = [
        ("warmup_rounds", ctypes.c_int64),
        ("max_mean_shift", ctypes.c_double),
        ("max_log_var_ratio", ctypes.c_double),
        ("recheck_every", ctypes.c_int64),
    ]


class AutoDecision(ctypes.Structure):
    _fields_ = [
        ("decided", ctypes.c_int32),
        ("scope", ctypes.c_int32),
        ("mean_shift", ctypes.c_double),
        ("log_var_ratio", ctypes.c_double),
        ("rounds", ctypes.c_int64),
        ("decided_at", ctypes.c_int64),
    ]


# The scopes are not restated here: scope_table() reads the library's table (hsbn_scope_*).
PHASE_FORWARD = 1
PHASE_BACKWARD = 2

_c_int = ctypes.c_int
_c_i32 = ctypes.c_int32
_c_u32 = ctypes.c_uint32
_c_i64 = ctypes.c_int64
_c_u64 = ctypes.c_uint64
# double*, declared void*: a numpy array's address (array.ctypes.data, an int) then passes as
# it is, without a ctypes cast per pointer (about 1.7 us each, four per round); a ctypes pointer
# passes too.
_p_dbl = ctypes.c_void_p
_p_i64 = ctypes.POINTER(ctypes.c_int64)
_p_void = ctypes.c_void_p

# name: (restype, argtypes). hsbn_result is a C enum: int.
_SIGNATURES = {
    "hsbn_result_string": (ctypes.c_char_p, [_c_int]),
    "hsbn_last_error": (ctypes.c_char_p, []),
    "hsbn_last_error_reason": (_c_int, []),
    "hsbn_reason_string": (ctypes.c_char_p, [_c_int]),
    "hsbn_abi_version": (_c_int, []),
    "hsbn_scope_count": (_c_int, []),
    "hsbn_scope_name": (ctypes.c_char_p, [_c_int]),
    "hsbn_scope_flags": (_c_int, [_c_int]),
    "hsbn_check_layout": (_c_int, [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int64]),
    "hsbn_check_layout_groups": (_c_int, [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
    "hsbn_set_auto_policy": (_c_int, [_p_void, _c_u32, ctypes.POINTER(AutoPolicy)]),
    "hsbn_get_auto_decision": (_c_int, [_p_void, _c_u32, ctypes.POINTER(AutoDecision)]),
    "hsbn_set_auto_decision": (_c_int, [_p_void, _c_u32, _c_int]),
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
    "hsbn_round_wait_for": (_c_int, [_p_void, _c_i64, ctypes.POINTER(_c_int), _p_i64, _p_dbl,
                                     _p_dbl]),
    "hsbn_client_abort": (_c_int, [_p_void, ctypes.c_char_p]),
    "hsbn_client_stats": (_c_int, [_p_void, ctypes.POINTER(CStats)]),
    "hsbn_client_global_stats": (_c_int, [_p_void, _c_u32, _c_u64, _c_i64, _p_i64, _p_dbl,
                                          _p_dbl]),
    "hsbn_client_global_stats_ready": (_c_int, [_p_void, _c_u32, _c_u64]),
    "hsbn_client_global_sums_ready": (_c_int, [_p_void, _c_u32, _c_u64]),
    "hsbn_client_global_sums_for": (_c_int, [_p_void, _c_u32, _c_u64, _c_i64, _c_i64,
                                             ctypes.POINTER(_c_int), _p_i64, _p_dbl, _p_dbl]),
    "hsbn_client_global_stats_for": (_c_int, [_p_void, _c_u32, _c_u64, _c_i64, _c_i64,
                                              ctypes.POINTER(_c_int), _p_i64, _p_dbl, _p_dbl]),
    "hsbn_client_name_layers": (_c_int, [_p_void, ctypes.POINTER(_c_u32),
                                         ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t]),
    "hsbn_client_report_lagged_trip": (_c_int, [_p_void, _c_u32, _c_u64, ctypes.c_double,
                                                _c_i64]),
    "hsbn_client_reset_stats": (_c_int, [_p_void]),
    "hsbn_status_json": (_c_int, [_p_void, _c_int, ctypes.c_char_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_size_t)]),
    "hsbn_status_query_init": (None, [ctypes.POINTER(StatusQuery)]),
    "hsbn_env_get": (_c_int, [ctypes.POINTER(ctypes.c_char_p), ctypes.c_char_p, ctypes.c_char_p,
                              ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "hsbn_env_name": (ctypes.c_char_p, [_c_int]),
    "hsbn_check_address": (_c_int, [ctypes.c_char_p, ctypes.c_char_p]),
    "hsbn_env_markdown": (_c_int, [ctypes.c_char_p, ctypes.c_size_t,
                                   ctypes.POINTER(ctypes.c_size_t)]),
    "hsbn_query_status_json": (_c_int, [ctypes.POINTER(StatusQuery), ctypes.c_char_p,
                                        ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
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
            handle.hsbn_path = _loaded_path(handle, path) if os.sep not in path else path
            _lib = handle
    return _lib


class ScopeInfo(collections.namedtuple(
        "ScopeInfo", "value name cross_node round_stats on_wire late late_backward")):
    """One row of the library's scope table (hsbn.h, hsbn_scope_flags): its hsbn_scope value,
    its name, and whether some round of it waits on other nodes, whether its rounds are counted
    under its own name, whether they carry it on the wire (auto's do not), whether its forward
    is answered with the node's statistics and the job's follow, and its backward too."""


_scopes = None


def scope_table():
    """The library's scopes, in value order (1, 2, ...): ScopeInfo rows, read once."""
    global _scopes
    if _scopes is None:
        handle = lib()
        rows = []
        for v in range(1, handle.hsbn_scope_count() + 1):
            f = handle.hsbn_scope_flags(v)
            rows.append(ScopeInfo(v, handle.hsbn_scope_name(v).decode("ascii"), bool(f & 1),
                                  bool(f & 2), bool(f & 4), bool(f & 8), bool(f & 16)))
        _scopes = tuple(rows)
    return _scopes


def result_name(code):
    return lib().hsbn_result_string(code).decode("utf-8", "replace")


def last_error():
    return lib().hsbn_last_error().decode("utf-8", "replace")


def last_error_reason():
    """The reason of the last failed call on this thread, by name ("MEMBER_ABORTED"), or
    "UNSPECIFIED"."""
    handle = lib()
    return handle.hsbn_reason_string(handle.hsbn_last_error_reason()).decode("ascii", "replace")


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
