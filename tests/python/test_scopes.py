"""The scopes Python knows are the library's table (hsbn.h, hsbn_scope_*; proto/wire.h kScopes),
read, not restated."""

import hsbn
import hsbn.torch
from hsbn import _lib
from hsbn import client as _client


def test_python_scopes_are_the_library_table():
    handle = _lib.lib()
    n = handle.hsbn_scope_count()
    from_library = {handle.hsbn_scope_name(v).decode(): v for v in range(1, n + 1)}
    assert dict(hsbn.SCOPES) == from_library
    assert list(hsbn.SCOPES) == ["node", "global", "shadow", "group", "auto", "renorm", "lagged"]
    assert tuple(hsbn.torch.SCOPES) == ("local",) + tuple(from_library)
    # The properties the Python side branches on come from the flags.
    assert tuple(_client.STAT_SCOPES) == ("node", "global", "shadow", "group", "renorm",
                                          "lagged")
    assert tuple(_client.LATE_SCOPES) == ("renorm", "lagged")
    assert "node" not in _client.CROSS_NODE_SCOPES and "auto" in _client.CROSS_NODE_SCOPES
    for row in _lib.scope_table():
        flags = handle.hsbn_scope_flags(row.value)
        assert row.late == bool(flags & 8) and row.on_wire == bool(flags & 4)
    assert handle.hsbn_scope_name(0) is None and handle.hsbn_scope_flags(n + 1) == -1

