"""Whether torchrun can start a job with this torch at all, for the tests that run it.

torch 2.4+ makes torchrun's rendezvous stores (TCPStore, static and c10d rendezvous alike) with
libuv unless told otherwise, and torchrun itself never tells them otherwise: USE_LIBUV=0 reaches
init_process_group's stores only. A torch built without libuv (Debian 13's python3-torch 2.6)
then fails every torchrun at its first rendezvous, "use_libuv was requested but PyTorch was
build without libuv support", whatever the script: those tests are skipped there, with that
reason (docs/PYTORCH.md, "PyTorch 2.x from Debian")."""

import functools

import pytest


@functools.lru_cache(maxsize=None)
def why_not():
    """None when a TCPStore with torch's defaults (what torchrun makes) can be made here; else
    why torchrun cannot start on this torch."""
    import torch
    import torch.distributed as dist
    try:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    except RuntimeError as e:
        if "libuv" not in str(e):
            raise
        return ("torchrun cannot start any job on torch %s: it was built without libuv and "
                "torchrun's rendezvous asks for libuv stores (%s)" % (torch.__version__, e))
    del store
    return None


needs_torchrun = pytest.mark.skipif(why_not() is not None, reason=why_not() or "")
