"""Reconciles deploy/aggregator-flags.txt with `hsbn-aggregator --help`: every `contract` flag
must be in the help text; `planned` flags are reported as present or not yet there, and a
planned flag that the binary has is reported so it can be promoted. Exits 77 (skipped) when
the binary has not been built."""
import os
import pathlib
import re
import subprocess
import sys

repo = pathlib.Path(__file__).resolve().parents[2]
binary = pathlib.Path(sys.argv[1])
if not binary.is_file() or not os.access(binary, os.X_OK):
    print(f"skipped: {binary} is not built")
    sys.exit(77)
p = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
text = p.stdout + p.stderr
have = set(re.findall(r"--[a-z][a-z0-9_-]*", text))
missing, planned_missing = [], []
for line in (repo / "deploy" / "aggregator-flags.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    flag, status = line.split()
    present = flag in have or flag.replace("-", "_") in have
    print(f"{'ok' if present else 'MISSING'}: {flag} ({status})")
    if not present:
        (missing if status == "contract" else planned_missing).append(flag)
if planned_missing:
    print(f"planned, not yet in the binary: {' '.join(planned_missing)} (docs/DEPLOY.md marks them)")
if missing:
    print(f"FAIL: contract flags missing from --help: {' '.join(missing)}")
    sys.exit(1)
print("ok: every contract flag is in --help")
