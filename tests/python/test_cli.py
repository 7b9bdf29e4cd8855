"""The `hsbn` command as a user meets it in a shell: a mistyped command is named, and a reader
that goes away (`hsbn | head -1`) ends it quietly (issue 26)."""

import os
import subprocess
import sys


def hsbn(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "hsbn"] + list(args), text=True, timeout=120,
                          **kwargs)


def test_an_unknown_command_is_named_and_fails_with_the_usage():
    p = hsbn("bogus", capture_output=True)
    assert p.returncode == 2
    assert p.stderr.startswith("hsbn: unknown command 'bogus'\nusage: hsbn [info]"), p.stderr
    assert p.stdout == ""
    p = hsbn("--bogus", capture_output=True)
    assert p.returncode == 2
    assert p.stderr.startswith("hsbn: unknown option '--bogus'\n"), p.stderr
    p = hsbn("info", "extra", capture_output=True)
    assert p.returncode == 2
    assert p.stderr.startswith("hsbn: hsbn info takes no arguments, not 'extra'\n"), p.stderr


def test_help_goes_to_stdout_and_succeeds():
    p = hsbn("--help", capture_output=True)
    assert p.returncode == 0
    assert p.stdout.startswith("usage: hsbn [info]"), p.stdout
    assert p.stderr == ""


def test_a_reader_that_went_away_ends_hsbn_without_a_traceback():
    # A pipe whose reader is gone, as `hsbn | head -1` once head has exited: every write fails
    # with EPIPE (Python ignores SIGPIPE), which used to end in a BrokenPipeError traceback.
    for args in (["--version"], ["status", "--help"], []):
        r, w = os.pipe()
        os.close(r)
        try:
            p = hsbn(*args, stdout=w, stderr=subprocess.PIPE)
        finally:
            os.close(w)
        assert p.returncode == 141, (args, p.stderr)
        assert p.stderr == "", (args, p.stderr)


def test_version_names_the_commit_of_the_binaries():
    p = hsbn("--version", capture_output=True)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("hsbn "), p.stdout
    assert lines[1].startswith("hsbn-aggregator ") and "(commit " in lines[1], p.stdout
