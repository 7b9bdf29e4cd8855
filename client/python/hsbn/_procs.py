"""Child processes that announce readiness through a ready file: aggregators and link proxies,
as hsbn.cluster.LocalCluster and `hsbn run` (hsbn/launch.py) start them."""

import ctypes
import os
import signal
import socket
import subprocess
import time


class ClusterError(RuntimeError):
    """An aggregator of the LocalCluster failed to start, or a worker of run() failed."""

    __module__ = "hsbn.cluster"  # its public name (tracebacks, pickling): hsbn.cluster.ClusterError


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolate():
    """Runs in the child before exec: its own session (a terminal's Ctrl-C reaches only the
    parent, which stops it) and SIGTERM when the parent's starting thread dies (no orphan when
    the parent is killed)."""
    os.setsid()
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a parent may block signals around Popen
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def popen_isolated(args, **kwargs):
    """subprocess.Popen(args, **kwargs) with the child isolated as _isolate says."""
    return subprocess.Popen(args, preexec_fn=_isolate, **kwargs)


class ManagedProcess:
    """A child process (an aggregator or a link proxy) that writes its bound addresses into a
    ready file once listening. Its output goes to NAME.log in `workdir`. With isolate=True it runs
    in its own session and gets SIGTERM if the thread that started it dies."""

    def __init__(self, name, args, workdir, id_flag=True, isolate=False):
        self.name = name
        self.ready_file = os.path.join(workdir, name + ".ready")
        self.log_path = os.path.join(workdir, name + ".log")
        self.args = args + (["--id=" + name] if id_flag else []) + [
            "--ready-file=" + self.ready_file]
        self.isolate = isolate
        self.proc = None
        self.addresses = []

    def start(self):
        try:
            os.remove(self.ready_file)
        except FileNotFoundError:
            pass
        self._log = open(self.log_path, "ab")
        start = popen_isolated if self.isolate else subprocess.Popen
        self.proc = start(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL)

    def wait_ready(self, deadline):
        """Waits until the ready file is complete (self.addresses then holds its lines); raises
        ClusterError with the log's tail when the process exits first or `deadline`
        (time.monotonic()) passes."""
        while True:
            if os.path.exists(self.ready_file):
                with open(self.ready_file) as f:
                    text = f.read()
                lines = [line.strip() for line in text.splitlines() if line.strip()]
                if lines and text.endswith("\n"):
                    self.addresses = lines
                    return
            if self.proc.poll() is not None:
                raise ClusterError("aggregator %s exited with status %s before it was ready "
                                   "(%s):\n%s" % (self.name, self.proc.returncode,
                                                  " ".join(self.args), self.log_tail()))
            if time.monotonic() > deadline:
                raise ClusterError("aggregator %s was not ready in time (%s):\n%s"
                                   % (self.name, " ".join(self.args), self.log_tail()))
            time.sleep(0.01)

    def log_tail(self, chars=4000):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-chars:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop(self):
        """SIGTERM, then SIGKILL after 5 s; waits for the exit. Returns the exit status (None if
        it never started)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()
            return self.proc.returncode
        return None
