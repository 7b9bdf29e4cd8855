"""Reconciles deploy/aggregator-flags.txt with the built hsbn-aggregator: every `contract` flag
must be in `hsbn-aggregator --help`; `planned` flags are reported as present or not yet there,
and a planned flag that the binary has is reported so it can be promoted. The roles column
(node, group, root) must agree with the binary: every role named is a --role value in --help,
and for each contract flag and role the binary accepts the flag with that role exactly when the
column names it (it refuses a flag of another role at start, before it listens: each check is
one short run with an unusable --listen, which fails after the role checks). Exits 77
(skipped) when the binary has not been built."""
import os
import pathlib
import re
import subprocess
import sys

ROLES = ("node", "group", "root")
# What each role needs besides --role to get past the role checks (a group needs its root).
BASE = {"node": [], "group": ["--upstream=127.0.0.1:1"], "root": []}
# A value of the right type for each metavariable --help shows (checked before the roles).
SAMPLE = {"N": "1", "OCTAL": "0660", "LEVEL": "info", "FILE": "/nonexistent/hsbn-file",
          "PATH": "/nonexistent/hsbn-path", "DIR": "/nonexistent/hsbn-dir", "NAME": "hsbn-name",
          "HOST:PORT": "127.0.0.1:0", "ADDR": "127.0.0.1:1"}
BAD_LISTEN = "--listen=no-port-here"

repo = pathlib.Path(__file__).resolve().parents[2]
binary = pathlib.Path(sys.argv[1])
if not binary.is_file() or not os.access(binary, os.X_OK):
    print(f"skipped: {binary} is not built")
    sys.exit(77)
p = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
text = p.stdout + p.stderr
have = set(re.findall(r"--[a-z][a-z0-9_-]*", text))
metavar = dict(re.findall(r"^\s+(--[a-z][a-z0-9-]*)=(\S+)", text, re.M))
help_roles = set(metavar.get("--role", "").split("|"))

missing, planned_missing, wrong_roles = [], [], []
entries = []
for line in (repo / "deploy" / "aggregator-flags.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    fields = line.split()
    if len(fields) != 3:
        print(f"FAIL: deploy/aggregator-flags.txt: {line!r}: want three columns: flag, status, roles")
        sys.exit(1)
    flag, status, roles = fields
    roles = roles.split(",")
    unknown = [r for r in roles if r not in ROLES or r not in help_roles]
    if unknown:
        wrong_roles.append(f"{flag}: role(s) {','.join(unknown)} not among --role={'|'.join(sorted(help_roles))}")
    present = flag in have or flag.replace("-", "_") in have
    print(f"{'ok' if present else 'MISSING'}: {flag} ({status}; {','.join(roles)})")
    if not present:
        (missing if status == "contract" else planned_missing).append(flag)
    elif status == "contract":
        entries.append((flag, set(roles)))


def run(role, extra):
    argv = [str(binary), f"--role={role}", *BASE[role], *extra, BAD_LISTEN]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(argv[1:])} did not stop (it should refuse {BAD_LISTEN})"
    return r.returncode, r.stderr.strip()


for role in ROLES:
    rc, err = run(role, [])
    if rc != 2 or BAD_LISTEN not in err:
        wrong_roles.append(f"--role={role} {' '.join(BASE[role])}: expected the refusal of {BAD_LISTEN}, got rc={rc}: {err}")
for flag, allowed in entries:
    # --role and --listen are on every command line; BASE gives the group its --upstream.
    skip = set(ROLES) if flag in ("--role", "--listen") else {r for r in ROLES if any(
        a.startswith(f"{flag}=") for a in BASE[r])}
    if skip == set(ROLES):
        continue
    if flag in metavar:
        value = SAMPLE.get(metavar[flag])
        if value is None:
            wrong_roles.append(f"{flag}: no sample value for {flag}={metavar[flag]}; add one to SAMPLE")
            continue
        arg = f"{flag}={value}"
    else:
        arg = flag
    seen = []
    for role in ROLES:
        if role in skip:
            continue
        rc, err = run(role, [arg])
        refused = f"{flag} is for --role=" in err
        accepted = rc == 2 and BAD_LISTEN in err
        if role in allowed and not accepted:
            wrong_roles.append(f"{flag}: deploy/aggregator-flags.txt allows --role={role}, the binary says: {err}")
        elif role not in allowed and not refused:
            wrong_roles.append(f"{flag}: deploy/aggregator-flags.txt refuses --role={role}, the binary accepts it ({err})")
        else:
            seen.append(f"{role} {'accepts' if accepted else 'refuses'}")
    print(f"ok: {arg}: {', '.join(seen)}")

if planned_missing:
    print(f"planned, not yet in the binary: {' '.join(planned_missing)} (docs/DEPLOY.md marks them)")
failed = False
if missing:
    print(f"FAIL: contract flags missing from --help: {' '.join(missing)}")
    failed = True
for w in wrong_roles:
    print(f"FAIL: roles: {w}")
    failed = True
if failed:
    sys.exit(1)
print("ok: every contract flag is in --help, and its roles are the binary's")
