"""`hsbn run`: torchrun, with the hsbn aggregators the job needs started around it.

    hsbn run [hsbn run options] [torchrun options] train.py [script arguments]

The whole contract is in HELP below (`hsbn run --help` prints it)."""

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from . import _lib
from . import env as _env
from ._procs import ClusterError, ManagedProcess, free_port, popen_isolated

PROG = "hsbn run"

HELP = """\
usage: hsbn run [hsbn run options] [torchrun options] SCRIPT [script arguments]

Runs SCRIPT under torchrun (`python -m torch.distributed.run` of this Python) with what hsbn
needs around it: it starts this node's sidecar aggregator on a private Unix socket (and, for
a job of several nodes, the root on node 0), waits until they listen, sets HSBN_ADDRESS and
HSBN_JOB_ID for the workers, forwards SIGINT, SIGTERM and SIGHUP to torchrun, stops (SIGTERM)
and waits for everything it started when torchrun exits, whatever happened, and exits with
torchrun's status. It says what it started on stderr, one line each.

  one node:            hsbn run --nproc_per_node 2 train.py
  two nodes:           hsbn run --root HOST0:7070 --nnodes 2 --node_rank K \\
                           --master_addr HOST0 --master_port 29500 --job-id JOB \\
                           --nproc_per_node 2 train.py             (on node K = 0 and 1)
                   or  hsbn run --root HOST0:7070 --nnodes 2 --rdzv_backend c10d \\
                           --rdzv_endpoint HOST0:29400 --rdzv_id JOB \\
                           --nproc_per_node 2 train.py             (on every node)
  simulated nodes:     hsbn run --simulate-nodes 2 --nproc_per_node 2 train.py

hsbn run options (before SCRIPT; every other option before SCRIPT goes to torchrun):
  --simulate-nodes N    Run N simulated nodes on this machine: a root, and per node a sidecar
                        that reaches the root through a link proxy (hsbn-linkproxy) holding
                        every chunk --link-delay-ms in each direction, and a torchrun agent
                        (--nnodes N --node_rank K, a static rendezvous on 127.0.0.1). Their
                        output lines start with [nodeK]. hsbn run sets the torchrun options
                        of nodes and rendezvous itself: do not pass them.
  --link-delay-ms MS    The simulated link's delay, each way (default 1; --simulate-nodes).
  --root HOST:PORT      The root aggregator of a job of several nodes (--nnodes N > 1): every
                        sidecar forwards its global rounds there. Give the same on every node.
  --start-root auto|yes|no
                        Whether this node starts the root (listening on --root-listen).
                        auto (default): yes on node 0 (--node_rank 0, torchrun's default);
                        with a dynamic rendezvous (--rdzv_backend other than static), where
                        node ranks are assigned later, yes when --root's HOST is this machine.
                        no: the root runs already (a shared root, docs/DEPLOY.md).
  --root-listen ADDR    Where a root started here listens (default 0.0.0.0:PORT of --root).
  --job-id ID           The job id (HSBN_JOB_ID) the workers use. Default: $HSBN_JOB_ID if
                        set; else on one node a fresh id per launch; for several nodes
                        torchrun's --rdzv_id (the same on every node), and without one this
                        option is required (the same value on every node).
  --aggregator-arg FLAG A flag for every aggregator started here, as `hsbn-aggregator --help`
                        lists them (repeat it: --aggregator-arg=--round-timeout-ms=60000).
  -h, --help            Show this text.

torchrun options hsbn run reads (all others pass through unchanged; see
`python -m torch.distributed.run --help`): --nnodes (a fixed number: N or N:N), --node_rank,
--rdzv_backend, --rdzv_id, --redirects and --tee. On PyTorch < 2 with Python >= 3.11, where
torchrun fails at start with "AttributeError: 'NoneType' object has no attribute 'get'",
hsbn run adds --redirects 1 --tee 1 unless you give --redirects or --tee yourself
(docs/PYTORCH.md).

Existing set-ups: when HSBN_ADDRESS is set (a sidecar run as a service or in the pod), hsbn
run starts no aggregator and the workers use that sidecar; only the job id and the signal
handling are added.

The aggregators' logs go to a temporary folder, removed when the job succeeds and kept (the
path is printed) when it fails. hsbn-aggregator and hsbn-linkproxy are found as
hsbn.aggregator_path() finds them ($HSBN_AGGREGATOR, the wheel's, PATH, a checkout's build).

Exit status: torchrun's (128+N when it died of signal N); 2 for bad arguments; 1 when an
aggregator could not be started.
"""

STARTUP_TIMEOUT_S = 60.0
GRACE_AFTER_FAILURE_S = 60.0  # --simulate-nodes: the others' time to fail on their own

# hsbn run's options: name -> takes a value.
_OPTIONS = {"--simulate-nodes": True, "--link-delay-ms": True, "--root": True,
            "--start-root": True, "--root-listen": True, "--job-id": True,
            "--aggregator-arg": True, "-h": False, "--help": False}

# torchrun options that --simulate-nodes sets itself (argparse dests).
_SIMULATION_SETS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                    "master_addr", "master_port", "standalone")


class UsageError(Exception):
    """Bad arguments: the message says what to pass instead."""


class _Stopped(Exception):
    """A signal came before torchrun was started."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def say(message):
    print("%s: %s" % (PROG, message), file=sys.stderr, flush=True)


def _our_parser():
    p = argparse.ArgumentParser(prog=PROG, add_help=False)
    p.add_argument("--simulate-nodes", type=int)
    p.add_argument("--link-delay-ms", type=int)
    p.add_argument("--root")
    p.add_argument("--start-root", choices=("auto", "yes", "no"), default="auto")
    p.add_argument("--root-listen")
    p.add_argument("--job-id")
    p.add_argument("--aggregator-arg", action="append", default=[])
    p.add_argument("-h", "--help", action="store_true")
    return p


def _torchrun_action(parser, name):
    """torchrun's argparse action for option `name` (exact, or an unambiguous prefix of a long
    option, as argparse accepts), or None."""
    actions = parser._option_string_actions  # argparse's own table of option strings
    if name in actions:
        return actions[name]
    if name.startswith("--"):
        found = {id(a): a for s, a in actions.items() if s.startswith(name)}
        if len(found) == 1:
            return next(iter(found.values()))
    return None


def split_args(argv, torchrun_parser):
    """Splits `hsbn run`'s arguments into (ours, torchrun's, SCRIPT and its arguments, the
    argparse dests of the torchrun options given). hsbn run's options and torchrun's may mix
    before SCRIPT, the first argument that is not an option or an option's value."""
    ours, theirs, given = [], [], set()
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("-") or tok == "-":
            break
        name = tok.split("=", 1)[0]
        if name in _OPTIONS:
            takes = _OPTIONS[name] and "=" not in tok
            if takes and i + 1 >= len(argv):
                raise UsageError("%s needs a value" % name)
            # NAME=VALUE, so that argparse takes a value that starts with "-" as a value.
            ours.append(tok + "=" + argv[i + 1] if takes else tok)
            i += 1 + takes
            continue
        short_value = not tok.startswith("--") and len(tok) > 2  # -r1
        action = _torchrun_action(torchrun_parser, tok[:2] if short_value else name)
        if action is None:
            raise UsageError("unknown option %s: it is neither hsbn run's (hsbn run --help) nor "
                             "torchrun's (python -m torch.distributed.run --help)" % name)
        takes = action.nargs != 0 and "=" not in tok and not short_value
        if takes and i + 1 >= len(argv):
            raise UsageError("torchrun's %s needs a value" % name)
        theirs += argv[i:i + 1 + takes]
        given.add(action.dest)
        i += 1 + takes
    return ours, theirs, argv[i:], given


def _node_count(nnodes):
    lo, _, hi = str(nnodes).partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError("--nnodes %s is not a number of nodes" % nnodes)
    if lo != hi or lo < 1:
        raise UsageError("--nnodes %s: hsbn needs a fixed number of nodes (N, or N:N), since "
                         "a job's layout is fixed for each run" % nnodes)
    return lo


def _split_host_port(address, what):
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError("%s %s is not HOST:PORT (e.g. %s node0.example.com:7070)"
                         % (what, address, what))
    return host.strip("[]"), int(port)


def _is_this_machine(host):
    """True when `host` resolves to an address this machine can bind."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0) + tuple(sockaddr[2:]))
                return True
        except OSError:
            continue
    return False


def _needs_torchrun_workaround(torch_version, given):
    """torch 1.13's torchrun on Python >= 3.11 fails in Std.from_str("0") unless --redirects
    and --tee are given; only then, and only when the user gave neither."""
    try:
        major = int(torch_version.split(".")[0])
    except ValueError:
        return False
    return major < 2 and sys.version_info >= (3, 11) and not ({"redirects", "tee"} & given)


def _given(environ, name):
    """Variable `name` as hsbn reads it (checked, canonical) when `environ` sets it, else None:
    hsbn run acts on what the user set, not on the table's defaults or fallbacks."""
    if not _env.is_set(name, environ):
        return None
    return _env.get(name, {name: environ[name]}) or None


class Plan:
    """What one `hsbn run` does, from its arguments and environment; no process started."""

    def __init__(self, argv, environ, torchrun_parser, torch_version):
        ours, theirs, script, given = split_args(argv, torchrun_parser)
        try:
            args, rest = _our_parser().parse_known_args(ours)
        except SystemExit:
            raise UsageError("bad hsbn run option (hsbn run --help)")
        if rest:
            raise UsageError("unexpected %s" % " ".join(rest))
        self.help = args.help
        if self.help:
            return
        if not script:
            raise UsageError("no training script: hsbn run [options] SCRIPT [arguments] "
                             "(hsbn run --help)")
        try:
            ns = torchrun_parser.parse_args(theirs + script)
        except SystemExit:  # argparse said why on stderr
            raise UsageError("torchrun refuses its options above (python -m "
                             "torch.distributed.run --help)")
        self.script = script
        self.environ = environ
        self.extra = []
        if _needs_torchrun_workaround(torch_version, given):
            self.extra = ["--redirects", "1", "--tee", "1"]
        self.torchrun_args = theirs
        self.aggregator_args = args.aggregator_arg
        self.simulate = args.simulate_nodes
        if args.link_delay_ms is not None and self.simulate is None:
            raise UsageError("--link-delay-ms is the delay of --simulate-nodes' links: add "
                             "--simulate-nodes N, or drop it")
        self.link_delay_ms = 1 if args.link_delay_ms is None else args.link_delay_ms
        self.external_address = _given(environ, "HSBN_ADDRESS")
        self.nproc = str(ns.nproc_per_node)
        self.root = args.root
        self.root_listen = args.root_listen
        self.start_root = False
        if self.simulate is not None:
            if self.simulate < 1:
                raise UsageError("--simulate-nodes %d: give at least 1 node" % self.simulate)
            if not 0 <= self.link_delay_ms <= 600000:
                raise UsageError("--link-delay-ms %d: give 0 to 600000" % self.link_delay_ms)
            clash = sorted(given & set(_SIMULATION_SETS))
            if clash:
                raise UsageError("--simulate-nodes sets torchrun's nodes and rendezvous itself: "
                                 "drop --%s" % " and --".join(clash))
            if self.root or self.root_listen or args.start_root != "auto":
                raise UsageError("--simulate-nodes starts its own root: drop --root, "
                                 "--root-listen and --start-root")
            if self.external_address:
                raise UsageError("--simulate-nodes starts its own sidecars, but HSBN_ADDRESS=%s "
                                 "is set: unset it" % self.external_address)
            self.nodes = self.simulate
        else:
            self.nodes = _node_count(ns.nnodes)
        if self.external_address and (self.root or self.root_listen
                                      or args.start_root == "yes"):
            raise UsageError("HSBN_ADDRESS=%s is set, so hsbn run starts no aggregator; that "
                             "sidecar has its own --upstream. Drop --root, or unset "
                             "HSBN_ADDRESS to have hsbn run start the sidecar and root"
                             % self.external_address)
        if self.simulate is None and not self.external_address:
            if self.nodes > 1:
                if not self.root:
                    raise UsageError(
                        "a job of %d nodes needs the root's address: pass --root HOST:PORT, the "
                        "same on every node (node 0 starts the root there; docs/PYTORCH.md, "
                        "\"Launching with hsbn run\")" % self.nodes)
                host, port = _split_host_port(self.root, "--root")
                if args.start_root == "yes":
                    self.start_root = True
                elif args.start_root == "auto":
                    if ns.rdzv_backend == "static":
                        self.start_root = int(ns.node_rank) == 0
                    else:
                        self.start_root = _is_this_machine(host)
                if self.start_root and not self.root_listen:
                    self.root_listen = "0.0.0.0:%d" % port
            elif self.root or self.root_listen or args.start_root == "yes":
                raise UsageError("--root, --root-listen and --start-root are for jobs of "
                                 "several nodes (--nnodes N with N > 1)")
        # The job id: the same on every node of the job, unique among the sidecar's jobs.
        self.job_id = args.job_id or _given(environ, "HSBN_JOB_ID")
        self.job_id_from = ("--job-id" if args.job_id else "HSBN_JOB_ID" if self.job_id
                            else None)
        rdzv_id = ns.rdzv_id if ns.rdzv_id not in (None, "", "none") else None
        if not self.job_id:
            if self.simulate is not None or self.nodes == 1:
                self.job_id = "run-%s" % uuid.uuid4().hex[:12]
                self.job_id_from = "fresh for this launch"
            elif rdzv_id and ns.rdzv_backend != "static":
                self.job_id, self.job_id_from = rdzv_id, "torchrun's --rdzv_id"
            else:
                raise UsageError(
                    "a job of %d nodes needs one job id, the same on every node: pass "
                    "--job-id ID to hsbn run (or use torchrun's --rdzv_backend c10d with "
                    "--rdzv_id ID)" % self.nodes)

    def torchrun_command(self, node=None, master_port=None):
        """The torchrun command line; for simulated node `node`, with its node options."""
        cmd = [sys.executable, "-m", "torch.distributed.run"] + self.extra
        if node is not None:
            cmd += ["--nnodes=%d" % self.nodes, "--node_rank=%d" % node,
                    "--master_addr=127.0.0.1", "--master_port=%d" % master_port]
        return cmd + self.torchrun_args + self.script


class Launcher:
    """Runs a Plan: the aggregators, the torchrun agent(s), signals, teardown."""

    def __init__(self, plan):
        self.plan = plan
        self.workdir = None
        self.aggregators = []   # ManagedProcess, stopped in reverse order of start
        self.cluster = None     # --simulate-nodes: the LocalCluster
        self.agents = []        # torchrun processes
        self.readers = []

    # --- signals ------------------------------------------------------------------------------

    def _on_signal(self, signum, frame):
        agents = list(self.agents)
        if not agents:
            raise _Stopped(signum)
        for p in agents:
            if p.poll() is not None:
                continue
            try:
                if signum == signal.SIGINT:
                    os.killpg(p.pid, signum)  # as a terminal's Ctrl-C: agent and workers
                else:
                    p.send_signal(signum)
            except ProcessLookupError:
                pass
        say("passed %s on to torchrun" % signal.Signals(signum).name)

    # --- the run ------------------------------------------------------------------------------

    def run(self):
        old = {s: signal.signal(s, self._on_signal)
               for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        code = None
        try:
            try:
                self._start_aggregators()
                code = self._run_agents()
            except _Stopped as e:
                say("stopped by %s before the job started" % signal.Signals(e.signum).name)
                code = 128 + e.signum
            except (ClusterError, _lib.NativeNotFoundError) as e:
                say("cannot start the aggregators: %s" % e)
                code = 1
        finally:
            # Teardown runs whatever happened; a signal now only repeats what it does.
            for s in old:
                signal.signal(s, signal.SIG_IGN)
            self._teardown(code)
            for s, h in old.items():
                signal.signal(s, h)
        return code

    def _start_aggregators(self):
        plan = self.plan
        say("job id %s (%s)" % (plan.job_id, plan.job_id_from))
        if plan.external_address:
            say("HSBN_ADDRESS=%s is set: the workers use that sidecar; starting no aggregator"
                % plan.external_address)
            return
        self.workdir = tempfile.mkdtemp(prefix="hsbn-run-")
        binary = _lib.aggregator_path()
        if plan.simulate is not None:
            from .cluster import LocalCluster
            nproc = int(plan.nproc) if plan.nproc.isdigit() else 1
            self.cluster = LocalCluster(
                nodes=plan.nodes, workers_per_node=nproc, aggregator=binary,
                workdir=self.workdir, startup_timeout=STARTUP_TIMEOUT_S,
                link_delay_ms=plan.link_delay_ms, aggregator_args=plan.aggregator_args,
                isolate_signals=True)
            self.cluster.start()
            c = self.cluster
            say("root        pid %d  listening on %s" % (c.root.proc.pid, c.root_address))
            for n in range(plan.nodes):
                say("node %d link pid %d  %s -> root, %d ms each way (hsbn-linkproxy)"
                    % (n, c.proxies[n].proc.pid, c.proxies[n].addresses[0], plan.link_delay_ms))
                say("node %d sidecar pid %d  %s" % (n, c.sidecars[n].proc.pid,
                                                    c.node_addresses[n]))
            return
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        if plan.start_root:
            root = ManagedProcess("root", [binary, "--role=root", "--listen=" + plan.root_listen]
                                  + plan.aggregator_args, self.workdir, id_flag=False,
                                  isolate=True)
            self.aggregators.append(root)
            root.start()
            root.wait_ready(deadline)
            say("root     pid %d  listening on %s (the sidecars reach it at %s)"
                % (root.proc.pid, ", ".join(root.addresses), plan.root))
        args = [binary, "--role=node",
                "--listen=unix:" + os.path.join(self.workdir, "sidecar.sock")]
        if plan.nodes > 1:
            args.append("--upstream=" + plan.root)
        sidecar = ManagedProcess("sidecar", args + plan.aggregator_args, self.workdir,
                                 id_flag=False, isolate=True)
        self.aggregators.append(sidecar)
        sidecar.start()
        sidecar.wait_ready(deadline)
        self.address = sidecar.addresses[0]
        say("sidecar  pid %d  %s%s" % (sidecar.proc.pid, self.address,
                                      ", root at " + plan.root if plan.nodes > 1 else ""))

    def _agent_env(self, node):
        env = dict(os.environ)
        env["HSBN_JOB_ID"] = self.plan.job_id
        if self.cluster is not None:
            env["HSBN_ADDRESS"] = self.cluster.node_addresses[node]
        elif not self.plan.external_address:
            env["HSBN_ADDRESS"] = self.address
        return env

    def _spawn(self, cmd, env, **kwargs):
        """Starts a torchrun agent in its own session. Signals wait until it is in
        self.agents, so the handler forwards them or teardown stops it, never neither."""
        caught = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, caught)
        try:
            p = popen_isolated(cmd, env=env, **kwargs)
            self.agents.append(p)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, caught)
        return p

    def _run_agents(self):
        plan = self.plan
        if plan.extra:
            say("adding torchrun --redirects 1 --tee 1 (torch < 2 on Python >= 3.11: its "
                "torchrun fails without them; docs/PYTORCH.md)")
        if self.cluster is None:
            cmd = plan.torchrun_command()
            agent = self._spawn(cmd, self._agent_env(None))
            say("torchrun pid %d  %s" % (agent.pid, shlex.join(cmd)))
            return _exit_code(agent.wait())
        port = free_port()
        for n in range(plan.nodes):
            cmd = plan.torchrun_command(n, port)
            self._spawn(cmd, self._agent_env(n), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT)
            reader = threading.Thread(target=_prefix_lines,
                                      args=(self.agents[-1].stdout, "[node%d] " % n),
                                      daemon=True)
            reader.start()
            self.readers.append(reader)
            say("node %d torchrun pid %d  %s" % (n, self.agents[-1].pid, shlex.join(cmd)))
        # Every agent's status; after the first failure the others get a grace period to end
        # on their own (their workers see the failed node's errors), then SIGTERM.
        failed_at, code = None, 0
        while True:
            running = [p for p in self.agents if p.poll() is None]
            for p in self.agents:
                if p.returncode not in (None, 0) and code == 0:
                    code = _exit_code(p.returncode)
                    failed_at = time.monotonic()
            if not running:
                break
            if failed_at is not None and time.monotonic() - failed_at > GRACE_AFTER_FAILURE_S:
                for p in running:
                    p.send_signal(signal.SIGTERM)
                failed_at = float("inf")
            try:
                running[0].wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        for r in self.readers:
            r.join()
        return code

    def _teardown(self, code):
        for p in self.agents:  # only when hsbn run itself fails or is stopped early
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        stopped = []
        procs = list(reversed(self.aggregators))
        if self.cluster is not None:
            c = self.cluster
            procs = c.sidecars + c.proxies + ([c.root] if c.root else [])
        for agg in procs:
            if agg.proc is None:
                continue
            early = agg.proc.poll()
            status = agg.stop()
            if early is not None and self.agents:
                say("%s (pid %d) had exited by itself, status %s; its log:\n%s"
                    % (agg.name, agg.proc.pid, early, agg.log_tail(2000)))
            stopped.append("%s (pid %d, status %s)" % (agg.name, agg.proc.pid, status))
        if stopped:
            say("stopped " + ", ".join(stopped))
        if self.workdir:
            if code == 0:
                import shutil
                shutil.rmtree(self.workdir, ignore_errors=True)
            else:
                say("the aggregators' logs are kept in %s" % self.workdir)


def _exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


def _prefix_lines(stream, prefix):
    out = sys.stdout.buffer
    for line in iter(stream.readline, b""):
        out.write(prefix.encode() + line)
        out.flush()
    stream.close()


def main(argv):
    """`hsbn run ...`: returns the exit status."""
    if not argv:
        sys.stderr.write(HELP)
        return 2
    if argv[0] in ("-h", "--help"):
        sys.stdout.write(HELP)
        return 0
    try:
        import torch
        from torch.distributed.run import get_args_parser
    except ImportError as e:
        say("needs PyTorch in this Python (%s): %s. Install hsbn into a venv that sees torch "
            "(Debian: /usr/bin/python3 -m venv --system-site-packages .venv)"
            % (sys.executable, e))
        return 2
    try:
        plan = Plan(argv, os.environ, get_args_parser(), torch.__version__)
    except UsageError as e:
        say("%s" % e)
        return 2
    if plan.help:
        sys.stdout.write(HELP)
        return 0
    return Launcher(plan).run()
