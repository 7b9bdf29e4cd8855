"""The aggregator raises its open-file soft limit to the hard one: every member stream holds a
connection (one fd), and a root of 1024 nodes must not stop accepting at a soft limit of 1024."""

import os
import resource
import subprocess
import time

from hsbn import _lib


def _limits(pid):
    with open("/proc/%d/limits" % pid) as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    hard = min(hard, 1 << 20)
    soft = min(256, hard // 2)  # below the hard limit, so the raise is seen

    def lower():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    ready = str(tmp_path / "root.ready")
    log = open(tmp_path / "root.log", "w+")
    proc = subprocess.Popen([_lib.aggregator_path(), "--role=root", "--listen=127.0.0.1:0",
                             "--ready-file=" + ready], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lower)
    try:
        while not os.path.exists(ready):  # the event: the ready file, written once listening
            assert proc.poll() is None, open(tmp_path / "root.log").read()
            time.sleep(0.01)
        assert _limits(proc.pid) == (hard, hard)
        log.seek(0)
        assert "open files: at most %d" % hard in log.read()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
