"""The two ways a node's rounds travel, which the node-path tests run over one after the other.

"shm": the node's shared-memory segment, where every local rank can map it (HSBN_TRANSPORT=auto,
the default). "grpc": the worker's gRPC stream to its sidecar (HSBN_TRANSPORT=grpc). The library
reads HSBN_TRANSPORT from the worker process's environment when it joins. A test that asks for a
transport also checks, from Client.stats(), that its rounds took it: a silent fallback to the
stream must not pass as shared memory.
"""

NAMES = ("shm", "grpc")

# HSBN_TRANSPORT for each: "auto" is written out, so that an HSBN_TRANSPORT=grpc left in the
# caller's environment cannot turn a shared-memory run into a stream run.
ENV = {"shm": "auto", "grpc": "grpc"}

# What Client.stats().transport says once the node's transport is decided.
EXPECTED = {"shm": "shm", "grpc": "grpc: HSBN_TRANSPORT=grpc"}

# A node round that decides a job's transport before any test's round: the last op of the
# range that directly constructed layers count through from 0 (hsbn.torch numbers them), which
# no test's layers reach.
PROBE_OP = (1 << 30) - 1
