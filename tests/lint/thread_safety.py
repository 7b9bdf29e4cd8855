#!/usr/bin/env python3
"""Checks the server's and the client's lock rules with Clang's -Wthread-safety.

Their locking is written as ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED annotations; GCC
ignores them, Clang checks them. This compiles every server/*.cc and client/*.cc with clang++ in
-fsyntax-only mode (no objects, a few seconds a file), with the include paths and defines that
CMake recorded in compile_commands.json, and fails on any thread-safety warning.

Usage: thread_safety.py BUILD_DIR [CLANGXX]
"""
import json
import os
import shlex
import subprocess
import sys


def main():
    build = sys.argv[1]
    clang = sys.argv[2] if len(sys.argv) > 2 else "clang++"
    with open(os.path.join(build, "compile_commands.json")) as f:
        commands = json.load(f)
    wanted = [c for c in commands
              if any(os.sep + d + os.sep in c["file"] for d in ("server", "client"))
              and os.sep + "tests" + os.sep not in c["file"] and c["file"].endswith(".cc")]
    for d in ("server", "client"):
        if not any(os.sep + d + os.sep in c["file"] for c in wanted):
            print("thread_safety: no %s sources in compile_commands.json" % d)
            return 1
    failed = 0
    for c in sorted(wanted, key=lambda c: c["file"]):
        args = shlex.split(c["command"])
        flags = [a for a in args[1:] if a.startswith(("-I", "-D", "-std=", "-isystem"))]
        # -isystem takes its path as the next argument.
        out = []
        skip = False
        for i, a in enumerate(args[1:]):
            if skip:
                out.append(a)
                skip = False
                continue
            if a == "-isystem":
                out.append(a)
                skip = True
            elif a in flags:
                out.append(a)
        cmd = [clang, "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
               "-Wno-unknown-warning-option"] + out + [c["file"]]
        r = subprocess.run(cmd, cwd=c["directory"], capture_output=True, text=True)
        name = os.path.relpath(c["file"], os.path.dirname(os.path.abspath(build)))
        if r.returncode != 0:
            failed += 1
            print("thread_safety: FAIL %s\n%s" % (name, r.stderr))
        else:
            print("thread_safety: ok   %s" % name)
    print("thread_safety: %d of %d files clean" % (len(wanted) - failed, len(wanted)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
