"""The GPU device check's verdict (bench/kernels/run_gpu_checks.sh), without a GPU.

The check records each step's verdict in steps.tsv and leaves one output per step; its summary
(`run_gpu_checks.sh --summarize DIR`) is computed from those files alone. These tests build
result folders by hand, break one step at a time, and check that the summary never says PASS
for a run in which a step did not run, failed, or left no output."""

import os
import re
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "kernels", "run_gpu_checks.sh")


def declared_steps():
    """[(name, output)] from the script's STEPS array, in order."""
    text = open(SCRIPT).read()
    block = re.search(r"^STEPS=\(\n(.*?)^\)", text, re.S | re.M).group(1)
    return [tuple(line.strip().strip('"').split(" ", 1)) for line in block.splitlines()
            if line.strip()]


STEPS = declared_steps()


def summarize(out):
    p = subprocess.run(["bash", SCRIPT, "--summarize", str(out)], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def step_line(text, name):
    """The summary's line of step `name`, its spaces collapsed."""
    lines = [re.sub(r"\s+", " ", line.strip()) for line in text.splitlines()
             if line.strip().startswith(name + " ")]
    assert len(lines) == 1, text
    return lines[0]


def passing_run(out):
    """A result folder in which every step passed and left its output."""
    records, sections = [], []
    for name, output in STEPS:
        records.append("%s\tpassed\t" % name)
        if output == "-":
            continue
        path, _, marker = output.partition("#")
        if marker:
            sections.append((path, "=== %s\nsome output\n" % marker))
        else:
            (out / path).write_text("{\"some\": \"output\"}\n")
    for path, text in sections:
        with open(out / path, "a") as f:
            f.write(text)
    (out / "steps.tsv").write_text("\n".join(records) + "\n")
    return out


def test_the_script_declares_the_steps_it_records():
    text = open(SCRIPT).read()
    recorded = set(re.findall(r"\brecord ([a-z0-9_]+) (?:passed|failed|not-run)", text))
    assert recorded == {name for name, _ in STEPS}
    assert [name for name, _ in STEPS][:3] == ["prereqs", "build", "gpu"]


def test_every_step_passed_with_its_output_is_pass(tmp_path):
    rc, text = summarize(passing_run(tmp_path))
    assert rc == 0, text
    assert text.rstrip().endswith("PASS: every step ran and passed")
    assert all(step_line(text, name).split()[1] == "passed" for name, _ in STEPS)


@pytest.mark.parametrize("name,output", [s for s in STEPS if s[1] != "-"])
def test_a_passed_step_without_its_output_fails(tmp_path, name, output):
    out = passing_run(tmp_path)
    path, _, marker = output.partition("#")
    if marker:
        text = (out / path).read_text().replace("=== %s\n" % marker, "")
        (out / path).write_text(text)
    else:
        (out / path).unlink()
    rc, text = summarize(out)
    assert rc == 1
    assert "PASS" not in text.replace("not every step ran and passed", "")
    line = step_line(text, name)
    assert line.startswith("%s FAILED: recorded as passed, but its output" % name) or \
        line.startswith("%s FAILED: recorded as passed, but %s has no '=== %s'"
                        % (name, path, marker)), line


@pytest.mark.parametrize("name", [s[0] for s in STEPS])
def test_a_step_without_a_verdict_is_not_run(tmp_path, name):
    out = passing_run(tmp_path)
    lines = (out / "steps.tsv").read_text().splitlines()
    (out / "steps.tsv").write_text("\n".join(l for l in lines if not l.startswith(name + "\t"))
                                   + "\n")
    rc, text = summarize(out)
    assert rc == 1
    assert text.rstrip().endswith("FAIL: not every step ran and passed (see above)")
    assert step_line(text, name) == (
        "%s NOT RUN: no verdict recorded (the check stopped before it)" % name)


@pytest.mark.parametrize("verdict,shown", [("not-run", "NOT RUN"), ("failed", "FAILED")])
def test_a_step_not_run_or_failed_shows_its_reason_and_fails(tmp_path, verdict, shown):
    out = passing_run(tmp_path)
    with open(out / "steps.tsv", "a") as f:  # the last record of a step wins
        f.write("sanitizer\t%s\tcompute-sanitizer could not attach here\n" % verdict)
    rc, text = summarize(out)
    assert rc == 1
    assert step_line(text, "sanitizer") == (
        "sanitizer %s: compute-sanitizer could not attach here" % shown)


def test_no_records_at_all_is_not_pass(tmp_path):
    rc, text = summarize(tmp_path)
    assert rc == 1
    assert sum("NOT RUN: no verdict recorded" in line for line in text.splitlines()) == len(STEPS)


def test_an_unknown_verdict_or_step_fails(tmp_path):
    out = passing_run(tmp_path)
    with open(out / "steps.tsv", "a") as f:
        f.write("bench\tmaybe\t\nwarmup\tpassed\t\n")
    rc, text = summarize(out)
    assert rc == 1
    assert step_line(text, "bench") == "bench FAILED: unknown verdict maybe"
    assert "unknown step 'warmup' in steps.tsv" in text


def test_a_whole_run_with_unusable_binaries_is_not_pass(tmp_path):
    """The real script end to end, with a prebuilt folder of binaries that only fail: every step
    gets a verdict, and none of them makes it PASS (without a GPU it stops at the gpu step)."""
    pre = tmp_path / "pre"
    pre.mkdir()
    for f in ("bn_kernels_cpu_test", "bn_kernels_cuda_test", "bn_kernels_bench",
              "libhsbn_bn_bench.so"):
        (pre / f).write_text("#!/bin/sh\nexit 1\n")
        (pre / f).chmod(stat.S_IRWXU)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("HSBN_WHEEL", None)
    p = subprocess.run(["bash", SCRIPT, "--prebuilt", str(pre), "--out", str(out), "--build",
                        str(tmp_path / "build")], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path))
    assert p.returncode == 1, p.stdout + p.stderr
    records = [l.split("\t") for l in (out / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in records] == [name for name, _ in STEPS]
    assert dict((r[0], r[1]) for r in records)["build"] == "passed"
    assert any(r[1] != "passed" for r in records)
    summary = (out / "summary.txt").read_text()
    assert "FAIL: not every step ran and passed (see above)" in summary
    assert "PASS: every step" not in summary
    rc, text = summarize(out)
    assert rc == 1 and text in summary
