"""README.md's "Use it in your script", as written: its install lines (after scripts/setup.sh,
which the build has done) make a venv of Debian's /usr/bin/python3 that sees python3-torch and
install the wheel; then its launch lines run examples/quickstart/train.py (a plain DDP script
with hsbn's three lines) on one node and on two simulated nodes, each with one command, and every
rank reports the first BatchNorm layer's statistics over the whole job's batch."""

import json
import os
import re
import shutil

import pytest

import wheelenv as W

README = os.path.join(W.REPO, "README.md")
TRAIN = os.path.join(W.REPO, "examples", "quickstart", "train.py")
LINE = re.compile(r"rank (\d+)/(\d+) node (\d+): bn1 running mean after step 1: \[([^\]]*)\]")


def readme_blocks():
    """The shell blocks of README.md's "Use it in your script" section: (install, launch)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Use it in your script\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 2, blocks
    return blocks


def commands(block):
    """A block's commands, comments dropped and continuation lines joined."""
    text = re.sub(r"\\\n\s*", "", block)
    return [line.split("#", 1)[0].strip() for line in text.splitlines()
            if line.split("#", 1)[0].strip()]


def expected_mean(root, env, ranks):
    """0.1 x the mean of the first BatchNorm layer's input over `ranks`' step-1 batches,
    computed by the venv's Python with train.py's own model and data."""
    code = ("import json, torch, train\n"
            "x = torch.cat([train.batch(r, 0)[0] for r in %r])\n"
            "with torch.no_grad():\n"
            "    print(json.dumps((0.1 * train.make_model()[0](x).mean(dim=(0, 2, 3))).tolist()))\n"
            % (list(ranks),))
    out = W.run([str(root / ".venv" / "bin" / "python"), "-c", code], env, str(root)).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A folder laid out as a checkout after scripts/setup.sh, as far as the README's lines
    need: build/dist/ with the wheel, and the user's train.py; the README's install lines run
    there (pip without an index: Debian's numpy satisfies the wheel's one dependency)."""
    root = tmp_path_factory.mktemp("checkout")
    os.makedirs(str(root / "build" / "dist"))
    wheel = W.wheel_path()
    shutil.copy(wheel, str(root / "build" / "dist" / os.path.basename(wheel)))
    shutil.copy(TRAIN, str(root / "train.py"))
    install, _ = readme_blocks()
    lines = commands(install)
    assert lines[0] == "scripts/setup.sh", lines
    assert lines[1] == "/usr/bin/python3 -m venv --system-site-packages .venv", lines
    # The CPU: on GPUs convolutions may use TF32 and miss the reference by more than 2e-6.
    env = W.clean_env(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
                      CUDA_VISIBLE_DEVICES="")
    script = "set -e\n" + "\n".join(lines[1:]) + "\n"
    W.run(["bash", "-c", script], env, str(root), timeout=300)
    return root, env


@pytest.mark.parametrize("which", ["one node", "two simulated nodes"])
def test_the_readmes_launch_lines_run_the_quickstart_script(checkout, which):
    root, env = checkout
    _, launch = readme_blocks()
    lines = commands(launch)
    line = lines[0] if which == "one node" else lines[1]
    assert line == {"one node": "hsbn run --nproc_per_node 2 train.py",
                    "two simulated nodes": "hsbn run --simulate-nodes 2 --nproc_per_node 2 "
                                           "train.py"}[which]
    p = W.run(["bash", "-c", "set -e\n. .venv/bin/activate\n" + line], env, str(root),
              timeout=600, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^hsbn run: (node 0 )?sidecar\s+pid \d+", p.stderr, re.M), p.stderr
    world = 2 if which == "one node" else 4
    got = {int(m.group(1)): (int(m.group(2)), int(m.group(3)),
                             [float(v) for v in m.group(4).split(",")])
           for m in LINE.finditer(p.stdout)}
    assert sorted(got) == list(range(world)), p.stdout
    want = expected_mean(root, env, range(world))
    for rank, (w, node, mean) in got.items():
        assert (w, node) == (world, rank // 2)
        assert mean == pytest.approx(want, abs=2e-6), (rank, mean, want)
