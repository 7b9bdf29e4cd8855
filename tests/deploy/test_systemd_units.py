"""deploy/systemd: every unit, and every unit with each of its drop-in examples applied, passes
`systemd-analyze verify` without a single warning, scores an exposure of at most 2.0 in
`systemd-analyze security --offline`, and has the structure hsbn relies on (runtime directory
that holds the socket, restart policy, hardening, flags from deploy/aggregator-flags.txt).
Its SystemCallFilter= must allow every system call the aggregator makes, the shared-memory node
path's included. Deliberately broken copies must fail the same checks."""
import pathlib
import re
import shutil
import subprocess
import tempfile
import unittest

REPO = pathlib.Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"
FLAG_CONTRACT = REPO / "deploy" / "aggregator-flags.txt"
BINARY = "/usr/local/bin/hsbn-aggregator"
ANALYZE = shutil.which("systemd-analyze")
MAX_EXPOSURE = 20  # systemd-analyze's --threshold: exposure 2.0 of 10

REQUIRED = {
    "Restart": "on-failure", "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
    "PrivateTmp": "yes", "PrivateDevices": "yes", "CapabilityBoundingSet": "", "RestrictNamespaces": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "MemoryDenyWriteExecute": "yes",
    "SystemCallArchitectures": "native", "UMask": "0007", "KillSignal": "SIGTERM",
}


# Every system call an hsbn-aggregator made while serving jobs over the gRPC stream and shared
# memory (node, global and shadow rounds, the fallback): `strace -f` of the sidecars and the
# root, started through HSBN_AGGREGATOR=<a wrapper that runs strace>, during
# integration_test --gtest_filter='SharedMemory.NodeGlobalAndShadow*:SharedMemory.OneRank*'.
AGGREGATOR_SYSCALLS = set("""
accept4 access arch_prctl bind brk clone3 close connect epoll_create1 epoll_ctl epoll_wait
eventfd2 execve fcntl ftruncate futex getpeername getpid getrandom getsockname getsockopt listen
lseek memfd_create mmap mprotect munmap newfstatat openat prctl pread64 prlimit64 read recvfrom
recvmsg rename rseq rt_sigaction rt_sigprocmask rt_sigtimedwait sendmsg set_robust_list
set_tid_address setsockopt shutdown socket umask uname unlink write
""".split())


def syscall_set(entry, cache={}):
    """A system call, or a @group expanded through `systemd-analyze syscall-filter`."""
    if not entry.startswith("@"):
        return {entry}
    if entry not in cache:
        out = subprocess.run([ANALYZE, "syscall-filter", entry], capture_output=True, text=True,
                             check=True).stdout
        names = set()
        for line in out.splitlines()[1:]:
            line = line.strip()
            if line and not line.startswith("#"):
                names |= syscall_set(line)
        cache[entry] = names
    return cache[entry]


def filter_allows(text):
    """The system calls a unit's SystemCallFilter= lines allow, as systemd reads them: the first
    line decides allow-list or deny-list; later lines add (or, with ~, remove)."""
    allowed, mode = None, None
    for value in parse(text).get("SystemCallFilter", []):
        deny = value.startswith("~")
        names = set()
        for entry in value.lstrip("~").split():
            names |= syscall_set(entry)
        if mode is None:
            mode = "deny" if deny else "allow"
            allowed = set(syscall_set("@known")) - names if deny else names
        else:
            allowed = allowed - names if deny else allowed | names
    return syscall_set("@known") if allowed is None else allowed


def contract_flags():
    """{flag: the roles it may be given with}, from deploy/aggregator-flags.txt."""
    fields = [l.split("#", 1)[0].split() for l in FLAG_CONTRACT.read_text().splitlines()]
    return {f[0]: set(f[2].split(",")) for f in fields if f}


def parse(text):
    """Unit file -> {key: [values]} for [Service], continuation lines joined, resets honoured."""
    text = re.sub(r"\\\n\s*", " ", text)
    keys, section = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        k, _, v = line.partition("=")
        if section == "[Service]":
            keys.setdefault(k, [])
            if v == "" and k in ("ExecStart",):
                keys[k] = []
            else:
                keys[k].append(v)
    return keys


def variants():
    """(name, text) for each unit alone and each unit with each of its drop-in examples."""
    for unit in sorted(UNITS.glob("*.service")):
        base = unit.read_text()
        yield unit.name, base
        for drop in sorted((UNITS / f"{unit.name}.d").glob("*.conf.example")):
            yield f"{unit.name}+{drop.name}", base + "\n" + drop.read_text()


def structure_errors(name, text):
    errors = []
    keys = parse(text)
    for k, v in REQUIRED.items():
        if keys.get(k, [None])[-1] != v:
            errors.append(f"{name}: {k}= must be {v!r}, is {keys.get(k)}")
    if keys.get("User", ["root"])[-1] in ("root", "0"):
        errors.append(f"{name}: must run as a non-root User=")
    runtime = keys.get("RuntimeDirectory", [None])[-1]
    if not runtime:
        errors.append(f"{name}: RuntimeDirectory= is missing")
    if len(keys.get("ExecStart", [])) != 1:
        errors.append(f"{name}: needs exactly one ExecStart, has {keys.get('ExecStart')}")
        return errors
    argv = keys["ExecStart"][0].split()
    if argv[0] != BINARY:
        errors.append(f"{name}: ExecStart runs {argv[0]}, not {BINARY}")
    allowed = contract_flags()
    flags = {}
    for a in argv[1:]:
        if a.startswith("--"):
            f, _, v = a.partition("=")
            flags[f] = v
    role = flags.get("--role")
    if role not in ("node", "group", "root"):
        errors.append(f"{name}: --role must be node, group or root")
    for f in flags:
        if f not in allowed:
            errors.append(f"{name}: {f} is not in the aggregator's flag contract")
        elif role and role not in allowed[f]:
            errors.append(f"{name}: {f} is not for --role={role} (deploy/aggregator-flags.txt: "
                          f"{','.join(sorted(allowed[f]))})")
    # A group aggregator forwards to the root: its unit must name one (an empty one is refused).
    if role == "group" and not flags.get("--upstream"):
        errors.append(f"{name}: a group aggregator needs --upstream (its root)")
    for f in ("--listen", "--ready-file"):
        v = flags.get(f, "")
        if f == "--listen" and not v.startswith("unix:"):
            continue
        if runtime and not v.removeprefix("unix:").startswith(f"/run/{runtime}/"):
            errors.append(f"{name}: {f}={v} is not in the runtime directory /run/{runtime}/")
    return errors


def analyze_errors(name, text):
    """systemd-analyze verify and security on a copy whose ExecStart binary exists."""
    errors = []
    with tempfile.TemporaryDirectory(prefix="hsbn-units-") as tmp:
        stand_in = pathlib.Path(tmp, "hsbn-aggregator")
        stand_in.write_text("#!/bin/sh\n")
        stand_in.chmod(0o755)
        unit_name = name.split("+")[0]
        path = pathlib.Path(tmp, unit_name)
        path.write_text(text.replace(BINARY, str(stand_in)))
        v = subprocess.run([ANALYZE, "verify", "--man=no", str(path)], capture_output=True, text=True)
        out = (v.stdout + v.stderr).strip()
        if v.returncode or out:
            errors.append(f"{name}: systemd-analyze verify: rc={v.returncode} {out}")
        s = subprocess.run([ANALYZE, "security", "--offline=yes", f"--threshold={MAX_EXPOSURE}", str(path)],
                           capture_output=True, text=True)
        if s.returncode:
            level = [l for l in s.stdout.splitlines() if "Overall exposure" in l]
            errors.append(f"{name}: exposure above {MAX_EXPOSURE / 10}: {level or s.stderr.strip()}")
    return errors


class SystemdUnitsTest(unittest.TestCase):
    def test_units_and_drop_ins_have_the_structure_hsbn_needs(self):
        names = []
        for name, text in variants():
            names.append(name)
            self.assertEqual(structure_errors(name, text), [])
        self.assertIn("hsbn-sidecar.service", names)
        self.assertIn("hsbn-root.service", names)
        self.assertIn("hsbn-group.service", names)
        for unit in ("hsbn-root", "hsbn-sidecar", "hsbn-group"):
            self.assertTrue(any(n.startswith(f"{unit}.service+tls") for n in names), names)
        self.assertTrue(any(n.startswith("hsbn-group.service+token") for n in names), names)
        self.assertTrue(any("+tls" in n for n in names), names)

    @unittest.skipUnless(ANALYZE, "systemd-analyze is not installed (Debian package systemd)")
    def test_units_and_drop_ins_pass_systemd_analyze_verify_and_security(self):
        for name, text in variants():
            with self.subTest(unit=name):
                self.assertEqual(analyze_errors(name, text), [])

    @unittest.skipUnless(ANALYZE, "systemd-analyze is not installed (Debian package systemd)")
    def test_system_call_filters_allow_every_call_the_aggregator_makes(self):
        for name, text in variants():
            with self.subTest(unit=name):
                self.assertEqual(sorted(AGGREGATOR_SYSCALLS - filter_allows(text)), [])
        # The check can fail: a filter without @ipc loses memfd_create, the shared-memory
        # segment's system call.
        sidecar = (UNITS / "hsbn-sidecar.service").read_text()
        broken = sidecar.replace("SystemCallFilter=~@privileged @resources",
                                 "SystemCallFilter=~@privileged @resources @ipc")
        self.assertNotEqual(broken, sidecar)
        self.assertIn("memfd_create", AGGREGATOR_SYSCALLS - filter_allows(broken))

    def test_broken_copies_fail_the_structure_check(self):
        sidecar = (UNITS / "hsbn-sidecar.service").read_text()
        for old, new, expect in [
            ("NoNewPrivileges=yes\n", "", "NoNewPrivileges"),
            ("Restart=on-failure", "Restart=always", "Restart"),
            ("--ready-file=/run/hsbn/ready", "--ready-file=/tmp/ready", "not in the runtime directory"),
            ("--id=${HSBN_NODE_ID}", "--node-id=${HSBN_NODE_ID}", "flag contract"),
            ("User=hsbn", "User=root", "non-root"),
        ]:
            with self.subTest(mutation=new or old):
                self.assertIn(old, sidecar)
                errors = structure_errors("broken", sidecar.replace(old, new))
                self.assertTrue(any(expect in e for e in errors), errors)
        group = (UNITS / "hsbn-group.service").read_text()
        root = (UNITS / "hsbn-root.service").read_text()
        for text, old, new, expect in [
            (group, "--upstream=${HSBN_UPSTREAM} ", "", "needs --upstream"),
            (group, "--role=group", "--role=rack", "--role must be node, group or root"),
            (group, "$HSBN_ARGS", "--shm=off $HSBN_ARGS", "not in the aggregator's flag contract"),
            (root, "--id=root", "--id=root --upstream-ca=/etc/hsbn/ca.crt", "--upstream-ca is not for --role=root"),
            (group, "--ready-file=/run/hsbn-group/ready", "--ready-file=/run/hsbn-root/ready", "not in the runtime directory"),
        ]:
            with self.subTest(mutation=new or old):
                self.assertIn(old, text)
                errors = structure_errors("broken", text.replace(old, new))
                self.assertTrue(any(expect in e for e in errors), errors)

    @unittest.skipUnless(ANALYZE, "systemd-analyze is not installed (Debian package systemd)")
    def test_broken_copies_fail_systemd_analyze(self):
        root = (UNITS / "hsbn-root.service").read_text()
        for old, new, expect in [
            ("ProtectSystem=strict", "ProtectSytem=strict", "Unknown key"),
            ("Restart=on-failure", "Restart=sometimes", "restart specifier"),
            ("RestrictNamespaces=yes", "RestrictNamespaces=no", "exposure"),
        ]:
            with self.subTest(mutation=new):
                self.assertIn(old, root)
                errors = analyze_errors("hsbn-root.service", root.replace(old, new))
                self.assertTrue(any(expect in e for e in errors), errors)


if __name__ == "__main__":
    unittest.main(verbosity=2)
