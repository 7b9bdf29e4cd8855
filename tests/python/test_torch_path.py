"""The host side of hsbn.torch's step: each round crosses the host once each way (one packed
payload down, the result up), running statistics stay on the tensor's device, nothing reads a
tensor's value on the host, and the CUDA arithmetic defaults to PyTorch's own kernels.

These run on CPU tensors with in-process rounds (test_autograd_math's stand-in aggregator); the
same code path serves CUDA tensors, where bench/kernels/run_gpu_checks.sh also runs it under
torch.cuda.set_sync_debug_mode("error")."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import hsbn
import hsbn.torch
from hsbn.torch import _ops
from bnref import assert_group_matches, make_spec, reference
from test_autograd_math import InProcessRounds, ThreadClient, run_threads


def test_each_round_is_one_download_and_one_upload_and_cpu_tensors_wait_on_nothing():
    spec, data = make_spec("global", "float32", steps=3, seed=31)
    hsbn.torch.reset_sync_stats()
    run_threads(spec, data)
    s = hsbn.torch.sync_stats()
    # 4 workers x 3 steps x (forward + backward): the empty worker takes part too.
    assert (s.rounds, s.downloads, s.uploads, s.device_waits) == (24, 24, 24, 0)


class _HostReadError(AssertionError):
    pass


@pytest.fixture
def no_host_reads(monkeypatch):
    """Makes every Python-level read of a tensor's value on the host raise (what would be a
    device sync for a CUDA tensor): .item(), float(), int(), bool(), .tolist()."""
    def refuse(name):
        def f(self, *a, **k):
            raise _HostReadError("Tensor.%s called on the hot path" % name)
        return f
    for name in ("item", "__float__", "__int__", "__bool__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("cpu_ops", ["torch", "kernels"])
def test_a_step_reads_no_tensor_value_on_the_host(no_host_reads, momentum, cpu_ops):
    if cpu_ops == "kernels" and hsbn._lib.bn_kernels() is None:
        pytest.fail("%s does not export the hsbn_bn_ kernels" % hsbn.library_path())
    _ops.set_cpu_ops(cpu_ops)
    try:
        bn = hsbn.torch.SyncBatchNorm(4, momentum=momentum, scope="global",
                                      client=ThreadClient(InProcessRounds(1), 0),
                                      op=hsbn.torch.next_op())
        for _ in range(2):
            x = torch.randn(3, 4, 5, requires_grad=True)
            (bn(x) * torch.randn(3, 4, 5)).sum().backward()
    finally:
        _ops.set_cpu_ops(None)


@pytest.mark.parametrize("channels_last", [False, True])
def test_momentum_none_running_statistics_match_batchnorm(channels_last):
    spec, data = make_spec("global", "float64", steps=3, seed=32, momentum=None,
                           channels_last=channels_last)
    results = run_threads(spec, data)
    assert_group_matches(results, spec, data, [[0, 1, 2, 3]], 1e-12)
    ref = reference(spec, data, [0, 1, 2, 3])
    assert np.allclose(results[0]["running_var"], ref["running_var"], rtol=1e-12, atol=0)


def test_cuda_ops_default_to_torch_without_a_gpu_and_can_be_chosen(monkeypatch):
    monkeypatch.delenv("HSBN_TORCH_CUDA_OPS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    which, why = hsbn.torch.cuda_ops()
    assert which == "torch" and "no CUDA device visible" in why and "9.0" in why
    monkeypatch.setenv("HSBN_TORCH_CUDA_OPS", "kernels")
    assert hsbn.torch.cuda_ops() == ("kernels", "HSBN_TORCH_CUDA_OPS")
    monkeypatch.setenv("HSBN_TORCH_CUDA_OPS", "auto")
    with pytest.raises(ValueError, match="HSBN_TORCH_CUDA_OPS takes 'torch' or 'kernels'"):
        hsbn.torch.cuda_ops()


class _FakeKernels:
    def __init__(self, usable):
        self.usable = usable

    def hsbn_bn_cuda_available(self):
        return int(self.usable)


@pytest.mark.parametrize("capability,usable,expected", [
    ((9, 0), True, "kernels"),   # where the GPU device check passed
    ((8, 0), True, "torch"),     # compiled for, never run: not the default
    ((9, 0), False, "torch"),    # a library without CUDA kernels
])
def test_cuda_default_is_hsbn_kernels_only_where_the_device_check_passed(
        monkeypatch, capability, usable, expected):
    # The decision alone, with the GPU faked (this machine has none): the kernels themselves
    # are checked on a GPU by bench/kernels/run_gpu_checks.sh.
    monkeypatch.delenv("HSBN_TORCH_CUDA_OPS", raising=False)
    monkeypatch.setattr(_ops, "_cuda_defaults", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda i: asked.append(i) or capability)
    monkeypatch.setattr(_ops._lib, "bn_kernels", lambda: _FakeKernels(usable))
    which, why = hsbn.torch.cuda_ops()
    assert which == expected, why
    assert why.startswith("default: ")
    if expected == "kernels":
        assert "passed the GPU device check on compute capability 9.0" in why
    elif usable:
        assert "not on this GPU's 8.0" in why and "HSBN_TORCH_CUDA_OPS=kernels" in why
    else:
        assert "no usable CUDA kernels" in why
    assert _ops.cuda_ops_choice(torch.device("cuda", 0)) == (which, why)
    assert asked == [0]  # decided once per device
    monkeypatch.setenv("HSBN_TORCH_CUDA_OPS", "torch")
    assert hsbn.torch.cuda_ops() == ("torch", "HSBN_TORCH_CUDA_OPS")


def test_a_module_can_choose_its_cuda_ops():
    model = torch.nn.Sequential(hsbn.torch.SyncBatchNorm(2), hsbn.torch.SyncBatchNorm(2))
    hsbn.torch.set_cuda_ops("kernels", module=model[1])
    assert [getattr(m, "cuda_ops", None) for m in model] == [None, "kernels"]
    with pytest.raises(ValueError):
        hsbn.torch.set_cuda_ops("fast", module=model)


def test_python_m_hsbn_says_which_cuda_ops_are_used_and_why():
    out = subprocess.run([sys.executable, "-m", "hsbn"], capture_output=True, text=True,
                         env=dict(__import__("os").environ, HSBN_TORCH_CUDA_OPS=""))
    # No GPU here: torch's ops, and the reason names where hsbn's kernels are the default.
    assert "CUDA BN ops      torch" in out.stdout, out.stdout + out.stderr
    assert "device check" in out.stdout and "compute capability 9.0" in out.stdout


def test_hsbn_torch_custom_ops_env_chooses_the_path_or_is_refused_by_name():
    # In a fresh process: the variable is read when the first layer is made.
    code = ("import hsbn.torch, torch\n"
            "try:\n"
            "    hsbn.torch.SyncBatchNorm(4)\n"
            "except hsbn.ConfigurationError as e:\n"
            "    print('refused:', e)\n"
            "else:\n"
            "    print('in use:', hsbn.torch.custom_ops_in_use())\n")
    import os
    from hsbn.torch import _custom_op
    # Unset: the ops where traced (torch >= 2.4: "compiled"), the function on older torch.
    env = {k: v for k, v in os.environ.items() if k != "HSBN_TORCH_CUSTOM_OPS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "in use: %s" % ("compiled" if _custom_op.ENABLED else False), \
        out.stdout + out.stderr
    env["HSBN_TORCH_CUSTOM_OPS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    if _custom_op.ENABLED:  # torch >= 2.4
        assert out.stdout.strip() == "in use: True", out.stdout
    else:
        assert out.stdout.startswith("refused: HSBN_TORCH_CUSTOM_OPS=1: torch "), out.stdout
    env["HSBN_TORCH_CUSTOM_OPS"] = "0"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "in use: False", out.stdout + out.stderr
    env["HSBN_TORCH_CUSTOM_OPS"] = "yes"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "HSBN_TORCH_CUSTOM_OPS" in out.stdout, out.stdout + out.stderr


def test_cuda_inputs_keep_the_function_unless_asked_and_a_bad_cuda_choice_is_refused():
    # The ops path has not run on a GPU (issue #35): CUDA inputs take it only when asked, by
    # use_custom_ops(True or "compiled", cuda=True) (test_compile.py checks the routing). A
    # refused call changes nothing.
    before = hsbn.torch.custom_ops_in_use()
    assert hsbn.torch.custom_ops_on_cuda() is False
    with pytest.raises(hsbn.ConfigurationError, match=r"use_custom_ops\(False, cuda=True\)"):
        hsbn.torch.use_custom_ops(False, cuda=True)
    with pytest.raises(hsbn.ConfigurationError, match="cuda is True, False or None"):
        hsbn.torch.use_custom_ops(False, cuda="yes")
    assert hsbn.torch.custom_ops_in_use() == before
    assert hsbn.torch.custom_ops_on_cuda() is False
