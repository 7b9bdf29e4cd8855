"""The environment table: one parser of every variable, for the C++ client, the C ABI and
Python alike (client/env.cc), and docs/ENVIRONMENT.md generated from it."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import hsbn
import hsbn.cluster
import hsbn.env
from hsbn import errors

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUT = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
          "GROUP_RANK": "0", "HSBN_JOB_ID": "env-job"}


def test_docs_environment_md_is_the_table():
    with open(os.path.join(_REPO, "docs", "ENVIRONMENT.md"), encoding="utf-8") as f:
        docs = f.read()
    assert docs == hsbn.env.markdown(), \
        "docs/ENVIRONMENT.md differs from the table: regenerate it with `hsbn env --markdown`"
    listed = re.findall(r"^\| `([A-Z_]+)` \|", docs, flags=re.M)
    assert listed == hsbn.env.names()


def _reads_in(paths, pattern):
    found = set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            found.update(re.findall(pattern, f.read()))
    return found


def test_every_variable_the_client_reads_is_in_the_table_and_read_through_it():
    names = set(hsbn.env.names())
    client = os.path.join(_REPO, "client")
    cc = [os.path.join(client, f) for f in os.listdir(client) if f.endswith(".cc")]
    # C++: only env.cc calls getenv.
    for path in cc:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if os.path.basename(path) != "env.cc":
            assert "getenv" not in text, "%s reads the environment outside the table" % path
    # Python: os.environ / getenv reads of HSBN_* name only the table's Python-only variables;
    # every other one goes through hsbn.env.get.
    py = []
    for root, _, files in os.walk(os.path.join(client, "python", "hsbn")):
        py += [os.path.join(root, f) for f in files if f.endswith(".py")]
    direct = _reads_in(py, r"""environ(?:\.get)?\(?\[?["'](HSBN_[A-Z_]+)""")
    direct |= _reads_in(py, r"""getenv\(["'](HSBN_[A-Z_]+)""")
    python_only = {"HSBN_LIBRARY", "HSBN_AGGREGATOR"}
    assert direct <= python_only, direct - python_only
    through = _reads_in(py, r"""(?:_env|env)\.get\(["'](HSBN_[A-Z_]+)""")
    assert through <= names, through - names
    assert python_only <= names


@pytest.mark.parametrize("var,value,complaint", [
    ("HSBN_STRICT_FINITE", "2", "HSBN_STRICT_FINITE='2' is not 0 or 1"),
    ("HSBN_GROUP_NODES", "two", "HSBN_GROUP_NODES='two' is not an integer"),
    ("HSBN_AUTO_WARMUP", "0", r"HSBN_AUTO_WARMUP=0 is out of range \[1, "),
    ("HSBN_AUTO_MAX_MEAN_SHIFT", "-0.5", "HSBN_AUTO_MAX_MEAN_SHIFT='-0.5' must be a finite"),
    ("HSBN_TRANSPORT", "shm", "HSBN_TRANSPORT='shm' is not one of auto, grpc"),
    ("HSBN_INCARNATION", "-1", "HSBN_INCARNATION=-1 is out of range"),
    ("HSBN_ADDRESS", "/tmp/hsbn.sock", "a Unix socket is written HSBN_ADDRESS=unix:/tmp/hsbn.sock"),
    ("HSBN_ADDRESS", "127.0.0.1:99999", "the port must be a number from 1 to 65535"),
    ("HSBN_CONNECT_TIMEOUT_MS", "-5", "HSBN_CONNECT_TIMEOUT_MS=-5 is out of range"),
])
def test_a_bad_value_is_refused_naming_the_variable_before_any_wait(var, value, complaint):
    with pytest.raises(hsbn.ConfigurationError, match=complaint):
        hsbn.Client.from_env(dict(LAYOUT, **{var: value}))
    with pytest.raises(hsbn.ConfigurationError, match=complaint):
        hsbn.env.get(var, {var: value})


def test_the_process_environment_is_read_the_same_way(monkeypatch):
    monkeypatch.setenv("HSBN_STRICT_FINITE", "2")
    with pytest.raises(hsbn.ConfigurationError, match="HSBN_STRICT_FINITE='2'"):
        hsbn.env.get("HSBN_STRICT_FINITE")
    # hsbn.Client(...) with the variable unset as an argument reads the process's: refused too.
    with pytest.raises(hsbn.ConfigurationError, match="HSBN_STRICT_FINITE"):
        hsbn.Client("unix:/nonexistent/hsbn.sock", "j", 0, 1, 0, 1, 0)
    monkeypatch.setenv("HSBN_STRICT_FINITE", "1")
    assert hsbn.env.get("HSBN_STRICT_FINITE") == "1"
    assert hsbn.env.get("HSBN_STRICT_FINITE", {}) == "0"  # a given mapping replaces os.environ


def test_fallbacks_and_defaults(tmp_path):
    assert hsbn.env.get("HSBN_ADDRESS", {}) == "unix:/tmp/hsbn.sock"
    assert hsbn.env.get("HSBN_JOB_ID", {"TORCHELASTIC_RUN_ID": "r1"}) == "r1"
    with pytest.raises(hsbn.ConfigurationError, match="HSBN_JOB_ID is not set"):
        hsbn.env.get("HSBN_JOB_ID", {"TORCHELASTIC_RUN_ID": "none"})
    # plain torchrun (no --rdzv_id): the rendezvous store's address, shared by the job's ranks
    plain = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "node7", "MASTER_PORT": "29500"}
    assert hsbn.env.get("HSBN_JOB_ID", plain) == "torchrun-node7-29500"
    assert hsbn.env.get("HSBN_JOB_ID", dict(plain, TORCHELASTIC_RUN_ID="r2")) == "r2"
    with pytest.raises(hsbn.ConfigurationError, match="HSBN_JOB_ID is not set"):
        hsbn.env.get("HSBN_JOB_ID", {"MASTER_ADDR": "node7"})
    token = tmp_path / "token"
    token.write_text(" abc \n")
    assert hsbn.env.get("HSBN_TOKEN", {"HSBN_TOKEN_FILE": str(token)}) == "abc"
    assert hsbn.env.get("HSBN_INCARNATION", {"TORCHELASTIC_RESTART_COUNT": "4"}) == "4"
    with pytest.raises(KeyError):
        hsbn.env.get("HSBN_NOT_A_VARIABLE")


def test_keyword_arguments_are_checked_like_the_variables():
    for kw, complaint in (({"incarnation": -1}, "incarnation must be an int >= 0"),
                          ({"auto_warmup": 0}, "auto_warmup must be an int >= 1"),
                          ({"transport": "shm"}, "transport must be 'auto' or 'grpc'"),
                          ({"auto_max_mean_shift": float("nan")}, "finite number")):
        with pytest.raises(hsbn.ConfigurationError, match=complaint):
            hsbn.Client("unix:/nonexistent/hsbn.sock", "j", 0, 1, 0, 1, 0, **kw)


def test_a_given_environment_sets_strict_mode_and_transport_where_the_process_says_otherwise(
        monkeypatch):
    # The process's environment says "not strict, shared memory"; the mapping given to
    # from_env says "strict, the gRPC stream", and wins for everything, the C library's part
    # included (it once read strict mode and transport from the process only).
    monkeypatch.setenv("HSBN_TRANSPORT", "auto")
    monkeypatch.delenv("HSBN_STRICT_FINITE", raising=False)
    with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1, root=False) as c:
        env = dict(c.worker_env(0), HSBN_STRICT_FINITE="1", HSBN_TRANSPORT="grpc")
        with hsbn.Client.from_env(env) as client:
            mean, m2 = np.array([np.nan, 1.0]), np.array([1.0, 2.0])
            with pytest.raises(hsbn.HsbnError, match="HSBN_STRICT_FINITE") as info:
                client.forward(11, 0, "node", 4, mean, m2)
            assert info.value.code == errors.INVALID_ARGUMENT
            count, _, _ = client.forward(11, 1, "node", 4, np.array([0.5, 1.0]), m2)
            assert count == 4
            assert client.stats().transport == "grpc: HSBN_TRANSPORT=grpc"


def test_hsbn_env_command_shows_values_and_refusals():
    env = dict(os.environ, HSBN_GROUP_NODES="3", HSBN_TRANSPORT="bogus")
    out = subprocess.run([sys.executable, "-m", "hsbn.cli", "env"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    text = out.stdout.decode()
    assert out.returncode == 1, text  # one variable is refused
    assert re.search(r"^HSBN_GROUP_NODES +3$", text, flags=re.M), text
    assert re.search(r"^HSBN_TRANSPORT +refused: .*'bogus' is not one of auto, grpc", text,
                     flags=re.M), text
    assert re.search(r"^HSBN_AUTO_WARMUP +\(unset: 50\)$", text, flags=re.M), text
