#!/usr/bin/env python3
"""The folders' layers, checked: no #include runs back up between folders.

  kernels/   the math (hsbn/moments.h, the kernels)        may include: kernels
  proto/     the wire schema and its conversion           may include: proto
  round/     the round core, the shared-memory segment    may include: round, proto, kernels
  server/    the aggregator                               may include: server, round, proto, kernels
  client/    the worker's library                         may include: client, round, proto, kernels

server/ and client/ never include each other. A quoted include is resolved by where a file of
that name (or relative path) lives in the tree; generated headers (hsbn/v1/*.pb.h) are proto's,
version.h is server's. Prints every include that breaks the rule and exits 1 if one does.

  python3 tests/lint/layers.py [REPO_ROOT]
"""
import os
import re
import sys

ALLOWED = {
    "kernels": {"kernels"},
    "proto": {"proto"},
    "round": {"round", "proto", "kernels"},
    "server": {"server", "round", "proto", "kernels"},
    "client": {"client", "round", "proto", "kernels"},
}
GENERATED = {"version.h": "server"}
SOURCES = (".h", ".cc", ".cu", ".cuh", ".hpp", ".cpp")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def sources(root, folder):
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
        # Python packages and build outputs hold no C++ of the layer; kernels/compat holds
        # stand-ins for Abseil headers (for machines without it), which are Abseil's spellings.
        dirnames[:] = [d for d in dirnames
                       if d not in ("python", "build", "__pycache__", "compat")]
        for name in filenames:
            if name.endswith(SOURCES):
                yield os.path.join(dirpath, name)


def owners(root):
    """Maps an include spelling (a base name, or a path below an include folder) to folders."""
    found = {}
    for folder in ALLOWED:
        for path in sources(root, folder):
            rel = os.path.relpath(path, os.path.join(root, folder)).split(os.sep)
            # Every suffix of the path is a spelling an include may use ("moments.h",
            # "hsbn/moments.h", "include/hsbn/moments.h").
            for i in range(len(rel)):
                found.setdefault("/".join(rel[i:]), set()).add(folder)
    return found


def owner_of(spelling, includer_dir, root, found):
    if spelling.startswith("hsbn/v1/"):
        return {"proto"}
    if spelling in GENERATED:
        return {GENERATED[spelling]}
    local = os.path.normpath(os.path.join(includer_dir, spelling))
    if os.path.exists(local):
        return {os.path.relpath(local, root).split(os.sep)[0]}
    return found.get(spelling, set())


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), "..", ".."))
    found = owners(root)
    broken, checked = [], 0
    for folder, allowed in ALLOWED.items():
        for path in sources(root, folder):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            for spelling in INCLUDE.findall(text):
                checked += 1
                where = owner_of(spelling, os.path.dirname(path), root, found)
                if not where:
                    continue  # a system or third-party header spelled with quotes
                if not where & allowed:
                    broken.append("%s includes \"%s\" (%s): %s/ may include only %s" % (
                        os.path.relpath(path, root), spelling, ", ".join(sorted(where)), folder,
                        ", ".join(sorted(allowed))))
    for line in broken:
        print(line)
    print("layers: %d quoted includes in %s checked, %d run back up" % (
        checked, ", ".join(ALLOWED), len(broken)))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
