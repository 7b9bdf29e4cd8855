"""The `hsbn` and `hsbn-aggregator` commands.

  hsbn                      what `python -m hsbn` prints: the native parts in use, torch
  hsbn status [options]     an aggregator's status (jobs, members, rounds, shadow divergence),
                            read with its Status RPC without joining any job
  hsbn env [--markdown]     the environment variables hsbn reads and their values here
  hsbn doctor REPORT.json   render a report hsbn.torch.diagnose saved (text, --json, --plot)
  hsbn run [...] train.py   torchrun, with the job's sidecar (and root) started around it
  hsbn-aggregator ARGS...   the hsbn-aggregator binary this package carries (or HSBN_AGGREGATOR)
  hsbn-linkproxy ARGS...    the hsbn-linkproxy binary (a simulated link; or HSBN_LINKPROXY)
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys

from . import _lib
from .errors import HsbnError, error_for

_STATUS_EPILOG = """\
With job tokens on (--token-file at the aggregator), pass the job's token (--token-file, or
HSBN_TOKEN / HSBN_TOKEN_FILE as workers do): the aggregator then shows that job only.
Exit status: 0 answered, 1 the aggregator refused or did not answer (the message says why),
2 bad arguments."""


def _read_token(args):
    if args.token is not None:
        return args.token
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            raise SystemExit("hsbn status: cannot read the token file %s: %s"
                             % (args.token_file, e.strerror))
    from . import env
    try:
        return env.get("HSBN_TOKEN") or None  # or HSBN_TOKEN_FILE's contents, as workers read it
    except HsbnError as e:
        raise SystemExit("hsbn status: %s" % e)


def query_status(address, job_id=None, token=None, include_upstream=False, timeout_ms=5000,
                 tls_ca=None, tls_cert=None, tls_key=None, tls_name=None):
    """The status of the aggregator at `address` as a dict (protobuf JSON names), read without
    joining a job. Raises hsbn.HsbnError subclasses (UnavailableError when nothing answers)."""
    lib = _lib.lib()
    q = _lib.StatusQuery()
    lib.hsbn_status_query_init(ctypes.byref(q))
    enc = lambda s: None if s is None else s.encode("utf-8")  # noqa: E731
    keep = [enc(address), enc(job_id), enc(token), enc(tls_ca), enc(tls_cert), enc(tls_key),
            enc(tls_name)]
    (q.address, q.job_id, q.token, q.tls_ca_file, q.tls_cert_file, q.tls_key_file,
     q.tls_name) = keep
    q.include_upstream = 1 if include_upstream else 0
    q.timeout_ms = int(timeout_ms)
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        needed = ctypes.c_size_t(0)
        rc = lib.hsbn_query_status_json(ctypes.byref(q), buf, size, ctypes.byref(needed))
        if rc != 0:
            raise error_for(rc, _lib.last_error())
        if needed.value <= size:
            return json.loads(buf.value.decode("utf-8"))
        size = needed.value


def first_node(job):
    """The first node a group aggregator's job covers (proto3 JSON leaves out zeros)."""
    return int(job.get("group", 0)) * int(job.get("groupNodes", 0))


def _fmt_status(st, indent=""):
    lines = ["%saggregator %s  role %s  up %.0f s  jobs %d"
             % (indent, st.get("aggregatorId", "?"), st.get("role", "?"),
                float(st.get("uptimeS", 0)), len(st.get("jobs", [])))]
    for job in st.get("jobs", []):
        members = job.get("members", [])
        connected = sum(1 for m in members if m.get("connected"))
        lines.append("%s  job %s  world %s  nodes %s  members %d/%s  open rounds %s  "
                     "completed %s  failed %s"
                     % (indent, job.get("jobId"), job.get("worldSize"), job.get("numNodes"),
                        connected, job.get("groupSize"), job.get("openRounds"),
                        job.get("roundsCompleted"), job.get("roundsFailed")))
        late = [(k, int(job.get(key, 0))) for k, key in
                (("late results due", "lateDue"), ("lagged forward records", "laggedForwards"),
                 ("parent results dropped", "lateDropped"))]
        if any(n for _, n in late):
            lines.append("%s    %s" % (indent, "  ".join("%s %d" % (k, n) for k, n in late)))
        for t in job.get("laggedTrips", []):
            lines.append("%s    lagged trip guard %s: trips %s  last at seq %s (drift %.4g), "
                         "exact global for %s calls"
                         % (indent, t.get("layer") or "op %s" % t.get("op", 0),
                            t.get("trips", 0), t.get("lastSeq", 0),
                            float(t.get("lastDrift", 0)), t.get("exactCalls", 0)))
        if st.get("role") == "group":
            lines.append("%s    serves group %s (nodes %d-%d)"
                         % (indent, job.get("group", 0), first_node(job),
                            first_node(job) + int(job.get("groupNodes", 1)) - 1))
        for m in members:
            index = int(m.get("index", 0))
            if int(m.get("rank", -1)) >= 0:
                what = "rank %s" % m.get("rank")
            elif int(job.get("memberNodes", 1)) > 1:  # a root above group aggregators
                what = "group %d" % index
            else:
                what = "node %d" % (first_node(job) + index if st.get("role") == "group"
                                    else index)
            state = "connected" if m.get("connected") else "gone"
            down = ("  down: %s" % m["down"]) if m.get("down") else ""
            lines.append("%s    %-8s %-9s contributions %s%s"
                         % (indent, what, state, m.get("contributions"), down))
        for key, unit in (("divergence", "node"), ("groupDivergence", "group")):
            for d in job.get(key, []):
                layer = d.get("layer") or "op %s" % d.get("op")
                lines.append("%s    shadow %s %s %s: rounds %s  mean shift avg %.4g max %.4g  "
                             "var ratio avg %.4g"
                             % (indent, layer, unit, d.get("node", 0), d.get("rounds"),
                                float(d.get("meanShiftAvg", 0)),
                                float(d.get("meanShiftMax", 0)),
                                float(d.get("varRatioAvg", 0))))
    if st.get("upstreamError"):
        lines.append("%s  upstream: %s" % (indent, st["upstreamError"]))
    if st.get("upstream"):
        lines.append("%s  upstream:" % indent)
        lines.extend(_fmt_status(st["upstream"], indent + "    "))
    return lines


def address_error(address, name="--address"):
    """Why `address` is not an aggregator address (`name` is where it came from), or None: the
    library's one address check (the aggregator's flags and the workers use it too), which
    answers a path without unix: with the spelling that works."""
    lib = _lib.lib()
    if lib.hsbn_check_address(address.encode("utf-8", "surrogateescape"),
                              name.encode("utf-8")) == 0:
        return None
    return _lib.last_error()


def status_main(argv):
    p = argparse.ArgumentParser(
        prog="hsbn status", epilog=_STATUS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Show an hsbn aggregator's jobs, members, rounds and shadow divergence, "
                    "without joining a job.")
    p.add_argument("--address",
                   help="sidecar, group aggregator or root: unix:/path.sock or host:port (default: $HSBN_ADDRESS "
                        "or unix:/tmp/hsbn.sock)")
    p.add_argument("--job", help="one job's status (default: every job it shows you)")
    p.add_argument("--json", action="store_true", help="print the Status RPC's answer as JSON")
    p.add_argument("--upstream", action="store_true",
                   help="a sidecar also asks its parent, and a group aggregator its root: "
                        "the tree, each parent under 'upstream'")
    p.add_argument("--token", help="the job's token (prefer --token-file: a command line is "
                                   "visible to other users)")
    p.add_argument("--token-file", help="file holding the job's token")
    p.add_argument("--timeout-ms", type=int, default=5000,
                   help="how long to wait for the aggregator's answer, in ms (default 5000)")
    p.add_argument("--tls-ca", help="PEM CA of a root with --tls-cert (TCP addresses)")
    p.add_argument("--tls-cert", help="PEM client certificate for a root with --tls-client-ca")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")
    p.add_argument("--tls-name", help="the name in the root's certificate, if not the host")
    args = p.parse_args(argv)
    from . import env
    if args.address is not None:
        bad = address_error(args.address)
    else:
        # The workers' default, read as they read it (the library's environment table).
        try:
            args.address, bad = env.get("HSBN_ADDRESS"), None
        except HsbnError as e:
            args.address, bad = None, str(e)
    if bad:
        print("hsbn status: %s" % bad, file=sys.stderr)
        return 2
    try:
        st = query_status(args.address, job_id=args.job, token=_read_token(args),
                          include_upstream=args.upstream, timeout_ms=args.timeout_ms,
                          tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          tls_name=args.tls_name)
    except HsbnError as e:
        print("hsbn status: %s" % e, file=sys.stderr)
        return 1
    except _lib.NativeNotFoundError as e:
        print("hsbn status: %s" % e, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print("\n".join(_fmt_status(st)))
    return 0


def env_main(argv):
    p = argparse.ArgumentParser(
        prog="hsbn env",
        description="The environment variables hsbn reads (docs/ENVIRONMENT.md), each with its "
                    "value in this environment as hsbn parses it, or why it is refused.")
    p.add_argument("--markdown", action="store_true",
                   help="print the table as docs/ENVIRONMENT.md has it")
    args = p.parse_args(argv)
    from . import env
    if args.markdown:
        sys.stdout.write(env.markdown())
        return 0
    status = 0
    for name in env.names():
        try:
            value = env.get(name)
            shown = value
            if not os.environ.get(name):
                shown = "(unset: %s)" % value if value else "(unset)"
            if name == "HSBN_TOKEN" and value:
                shown = "(set, %d bytes)" % len(value)
            print("%-28s %s" % (name, shown))
        except HsbnError as e:
            print("%-28s refused: %s" % (name, e))
            status = 1
    return status


_USAGE = ("usage: hsbn [info]               the native parts in use (as python -m hsbn)\n"
          "       hsbn status [--help] ...  an aggregator's status, without joining a job\n"
          "       hsbn env [--markdown]     the environment variables hsbn reads\n"
          "       hsbn doctor REPORT.json   render a saved hsbn.torch.diagnose report\n"
          "       hsbn run [--help] ...     torchrun, with the job's sidecar and root around it\n"
          "       hsbn --version")


def _version():
    """The package's version, and the commit its aggregator binary was built from (the wheel
    ships the aggregator and the library from one build)."""
    from . import __version__, _lib
    print("hsbn %s" % __version__)
    try:
        out = subprocess.run([_lib.aggregator_path(), "--version"], capture_output=True,
                             text=True, timeout=30, check=False).stdout.strip()
    except (_lib.NativeNotFoundError, OSError, subprocess.TimeoutExpired) as e:
        out = "hsbn-aggregator: not found (%s)" % e
    print(out or "hsbn-aggregator: --version printed nothing")
    return 0


def main(argv=None):
    """`hsbn [info | status ... | env ...]`. A reader that goes away (`hsbn | head -1`) ends it
    quietly, with status 141 as a process that SIGPIPE ended, not with a BrokenPipeError
    traceback.

    stdout is flushed however _main ends, SystemExit included: argparse's --help and usage errors
    end in SystemExit, and since Python 3.13 argparse also swallows the write's own error there,
    so the broken pipe shows only when the interpreter flushes at exit ("Exception ignored on
    flushing sys.stdout", status 120) unless it is flushed here, where it can be caught."""
    try:
        try:
            return _main(sys.argv[1:] if argv is None else list(argv))
        finally:
            sys.stdout.flush()   # raises BrokenPipeError in place of a SystemExit too
    except BrokenPipeError:
        # Python flushes stdout again at exit, which would raise again: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


def _main(argv):
    if argv and argv[0] == "status":
        return status_main(argv[1:])
    if argv and argv[0] == "env":
        return env_main(argv[1:])
    if argv and argv[0] == "run":
        from .launch import main as run_main   # torchrun with the aggregators it needs
        return run_main(argv[1:])
    if argv and argv[0] == "doctor":
        from .doctor import main as doctor_main   # renders hsbn.torch.diagnose's saved report
        return doctor_main(argv[1:])
    if not argv or argv == ["info"]:
        from . import __main__ as info
        return info.main()
    if argv == ["--version"]:
        return _version()
    if argv in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    if argv[0] == "info":
        what = "hsbn info takes no arguments, not %r" % " ".join(argv[1:])
    elif argv[0].startswith("-"):
        what = "unknown option %r" % argv[0]
    else:
        what = "unknown command %r" % argv[0]
    print("hsbn: %s\n%s" % (what, _USAGE), file=sys.stderr)
    return 2


def _exec_native(name, locate):
    """Runs the native binary `locate()` finds in this process's place (exit 127 when none)."""
    try:
        path = locate()
    except _lib.NativeNotFoundError as e:
        print("%s: %s" % (name, e), file=sys.stderr)
        return 127
    os.execv(path, [path] + sys.argv[1:])


def aggregator_main():
    """`hsbn-aggregator ARGS...`: runs the aggregator binary in this process's place."""
    return _exec_native("hsbn-aggregator", _lib.aggregator_path)


def linkproxy_main():
    """`hsbn-linkproxy ARGS...`: runs the link proxy binary (tools/linkproxy) in this process's
    place."""
    return _exec_native("hsbn-linkproxy", _lib.linkproxy_path)


if __name__ == "__main__":
    sys.exit(main())
