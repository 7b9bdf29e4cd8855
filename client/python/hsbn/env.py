"""hsbn.env: the environment variables hsbn reads, through libhsbn's one table.

Every variable (docs/ENVIRONMENT.md) is parsed by the library's table (client/env.cc), so a
value means the same here as in the C++ client and the C ABI, and a bad one is refused naming
the variable:

    hsbn.env.get("HSBN_GROUP_NODES")                 # "0" when unset
    hsbn.env.get("HSBN_TOKEN", env={"HSBN_TOKEN_FILE": "/run/token"})
    hsbn.env.names()                                 # every variable in the table
    hsbn.env.markdown()                              # docs/ENVIRONMENT.md

Only HSBN_LIBRARY (which names the library itself) and HSBN_AGGREGATOR (a binary to locate) are
read by Python alone (hsbn._lib), as the table says.
"""

import ctypes

from . import _lib
from .errors import ConfigurationError, error_for, INVALID_ARGUMENT


class Entries:
    """An environment as the C ABI takes it ("NAME=VALUE" entries, NULL-terminated), kept alive
    as long as this object. `env` is a mapping; None means the process's environment."""

    def __init__(self, env):
        self.env = env
        if env is None:
            self.pointer = None
            return
        self._encoded = []
        for k, v in env.items():
            k, v = str(k), str(v)
            if not k or "=" in k or "\0" in k or "\0" in v:
                continue  # not something an environment can hold
            self._encoded.append(("%s=%s" % (k, v)).encode("utf-8", "surrogateescape"))
        arr = (ctypes.c_char_p * (len(self._encoded) + 1))(*self._encoded, None)
        self._array = arr
        self.pointer = ctypes.cast(arr, ctypes.POINTER(ctypes.c_char_p))


def get(name, env=None):
    """The value of variable `name` as hsbn reads it: checked against its type and range,
    written canonically (integers in decimal, flags "0"/"1"), with its fallback or default when
    unset ("" when it has none). `env`: a mapping to read instead of os.environ, or an Entries.
    ConfigurationError naming the variable for a bad value (or an unset required one);
    KeyError for a name that is not in the table."""
    entries = env if isinstance(env, Entries) else Entries(env)
    lib = _lib.lib()
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        needed = ctypes.c_size_t(0)
        rc = lib.hsbn_env_get(entries.pointer, str(name).encode("utf-8"), buf, size,
                              ctypes.byref(needed))
        if rc == 5:  # NOT_FOUND
            raise KeyError(_lib.last_error())
        if rc == INVALID_ARGUMENT:
            raise ConfigurationError(_lib.last_error())
        if rc != 0:
            raise error_for(rc, _lib.last_error())
        if needed.value <= size:
            return buf.value.decode("utf-8", "surrogateescape")
        size = needed.value


def is_set(name, env=None):
    """Whether variable `name` is set (and not empty) in `env` (None: os.environ): where a value
    came from, for messages; its value is get()'s."""
    import os
    return bool((os.environ if env is None else env).get(name))


def names():
    """Every variable in the table, in documentation order."""
    lib = _lib.lib()
    out, i = [], 0
    while True:
        name = lib.hsbn_env_name(i)
        if name is None:
            return out
        out.append(name.decode("utf-8"))
        i += 1


def markdown():
    """docs/ENVIRONMENT.md: the table as Markdown."""
    lib = _lib.lib()
    needed = ctypes.c_size_t(0)
    lib.hsbn_env_markdown(None, 0, ctypes.byref(needed))
    buf = ctypes.create_string_buffer(needed.value)
    lib.hsbn_env_markdown(buf, needed.value, ctypes.byref(needed))
    return buf.value.decode("utf-8")
