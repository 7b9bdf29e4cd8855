#!/usr/bin/env python3
"""hsbn.torch.SyncBatchNorm on a GPU, with both CUDA op sets, against torch.nn.BatchNorm2d.

For each op set ("torch": PyTorch's SyncBatchNorm kernels; "kernels": hsbn's CUDA kernels),
input dtype (float32; float16 and bfloat16 under torch.autocast) and layout (NCHW,
channels-last), a Conv2d -> BatchNorm pair runs three training steps twice, once with
torch.nn.BatchNorm2d and once with hsbn.torch.SyncBatchNorm (in-process loopback rounds: one
worker, so the scope's batch is the worker's batch), and compares the output, input gradient,
weight and bias gradients and running statistics. hsbn's steps run under
torch.cuda.set_sync_debug_mode("error"): any synchronizing torch call in the layer raises. The
layer's own host waits are counted by hsbn.torch.sync_stats(): exactly one per round.

Then a few GradScaler steps from an initial scale that overflows fp16: the scaler must skip
them (scale shrinks, weights unchanged) without anything raising.

Needs hsbn's Python package on PYTHONPATH (client/python) and, for the "kernels" op set, the
kernels' C ABI: libhsbn.so (HSBN_LIBRARY) or the kernels-only build's libhsbn_bn_bench.so
(--kernels-lib). Exit status 1 when anything differs or raises, 2 when there is no GPU.

  gpu_module_check.py [--kernels-lib BUILD/bench/kernels/libhsbn_bn_bench.so] [--json F]
"""
import argparse
import contextlib
import copy
import ctypes
import json
import sys
import traceback

import torch

import hsbn._lib as _lib
import hsbn.torch
from hsbn.torch import _ops

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class LoopbackClient:
    """One worker's rounds: the scope's statistics are its own."""

    def forward(self, op, seq, scope, count, a, b):
        return count, a.copy(), b.copy()

    backward = forward


def bind_kernels(path):
    """Makes hsbn.torch use the C ABI in `path` as it would use libhsbn.so's."""
    handle = ctypes.CDLL(path)
    for name, (restype, argtypes) in _lib._BN_SIGNATURES.items():
        fn = getattr(handle, name)
        fn.restype = restype
        fn.argtypes = argtypes
    if handle.hsbn_bn_abi_version() != _lib.BN_ABI_VERSION:
        raise RuntimeError("%s has kernel ABI %d, not %d" % (path, handle.hsbn_bn_abi_version(),
                                                              _lib.BN_ABI_VERSION))
    _lib._bn, _lib._bn_checked = handle, True


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    d = (a - b).abs().max().item()
    return d / scale if scale > 0 else d


def run_case(ops, dtype, channels_last, steps=3, C=64, device="cuda"):
    torch.manual_seed(0)
    dev = torch.device(device)
    if device == "cpu":
        _ops.set_cpu_ops(ops)
    conv = torch.nn.Conv2d(8, C, 3, padding=1).to(dev)
    ref_bn = torch.nn.BatchNorm2d(C).to(dev)
    with torch.no_grad():
        ref_bn.weight.uniform_(0.5, 2.0)
        ref_bn.bias.uniform_(-1, 1)
    ref = torch.nn.Sequential(conv, ref_bn)
    ours = copy.deepcopy(ref)
    ours = hsbn.torch.convert_sync_batchnorm(ours, scope="global", client=LoopbackClient())
    hsbn.torch.set_cuda_ops(ops, module=ours)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ref, ours = ref.to(memory_format=fmt), ours.to(memory_format=fmt)
    autocast = dtype != torch.float32
    worst = {}
    hsbn.torch.reset_sync_stats()
    for step in range(steps):
        x = torch.randn(16, 8, 14, 14, device=dev).contiguous(memory_format=fmt) * 3 + 1
        g = torch.randn(16, C, 14, 14, device=dev).contiguous(memory_format=fmt)
        outs = []
        for model, checked in ((ref, False), (ours, True)):
            xi = x.clone().requires_grad_()
            model.zero_grad()
            if checked and device == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                with (torch.autocast(device, dtype=dtype) if autocast
                      else contextlib.nullcontext()):
                    y = model(xi)
                (y.float() * g).sum().backward()
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            bn = model[1]
            outs.append(dict(y=y, dx=xi.grad, dw=bn.weight.grad, db=bn.bias.grad,
                             y_dtype=str(y.dtype), layout_kept=y.is_contiguous(memory_format=fmt)))
        for k in ("y", "dx", "dw", "db"):
            worst[k] = max(worst.get(k, 0.0), rel(outs[1][k], outs[0][k]))
        if outs[1]["y_dtype"] != outs[0]["y_dtype"]:
            raise AssertionError("output dtype %s, BatchNorm2d's %s" % (outs[1]["y_dtype"],
                                                                       outs[0]["y_dtype"]))
        if not outs[1]["layout_kept"]:
            raise AssertionError("the output lost the input's memory format")
    worst["running_mean"] = rel(ours[1].running_mean, ref[1].running_mean)
    worst["running_var"] = rel(ours[1].running_var, ref[1].running_var)
    s = hsbn.torch.sync_stats()
    syncs = dict(rounds=s.rounds, downloads=s.downloads, uploads=s.uploads,
                 device_waits=s.device_waits, per_layer_step=s.device_waits / steps)
    waits = 2 * steps if device == "cuda" else 0
    if (s.rounds, s.downloads, s.uploads, s.device_waits) != (2 * steps,) * 3 + (waits,):
        raise AssertionError("expected %d rounds, downloads and uploads and %d device waits, "
                             "got %s" % (2 * steps, waits, syncs))
    bad = {k: v for k, v in worst.items() if not v <= TOL[dtype]}
    if bad:
        raise AssertionError("differs from BatchNorm2d beyond %g: %s" % (TOL[dtype], bad))
    return dict(errors=worst, syncs=syncs, tolerance=TOL[dtype])


def grad_scaler_skips_overflowing_steps(ops):
    """fp16 autocast, initial scale 2^40: the first steps overflow; every one must be skipped
    (weights unchanged, scale reduced), nothing raises."""
    torch.manual_seed(1)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(10))
    model.to(dev)(torch.randn(2, 3, 8, 8, device=dev))  # materialize the lazy layer
    model = hsbn.torch.convert_sync_batchnorm(model, scope="global", client=LoopbackClient())
    hsbn.torch.set_cuda_ops(ops, module=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if hasattr(torch.amp, "GradScaler"):  # 2.3+; torch.cuda.amp.GradScaler is deprecated
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 40)
    else:
        scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 40)
    scales, skipped = [], []
    for _ in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(
                model(torch.randn(8, 3, 8, 8, device=dev) * 100),
                torch.randint(0, 10, (8,), device=dev))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    if not skipped[0] or not scales[0] < 2.0 ** 40:
        raise AssertionError("the overflowing first step was not skipped: scales %s, "
                             "skipped %s" % (scales, skipped))
    return dict(scales=scales, skipped=skipped)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels-lib", help="the kernels' C ABI when libhsbn.so is not there")
    ap.add_argument("--json")
    ap.add_argument("--cpu-plumbing", action="store_true",
                    help="CPU tensors (float32, bfloat16 autocast), no GradScaler: proves the "
                         "script, not the GPU")
    args = ap.parse_args()
    device = "cpu" if args.cpu_plumbing else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("FAIL: torch sees no CUDA device")
        return 2
    if args.kernels_lib:
        bind_kernels(args.kernels_lib)
    # Both models share the convolution; TF32 would let two runs of it differ by ~1e-3.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (plumbing only)"
    print("device: %s, torch %s" % (device_name, torch.__version__))
    dtypes = ((torch.float32, torch.float16, torch.bfloat16) if device == "cuda"
              else (torch.float32, torch.bfloat16))
    results, failed = [], 0
    for ops in ("torch", "kernels"):
        for dtype in dtypes:
            for cl in (False, True):
                name = "%s %s%s %s" % (ops, "autocast " if dtype != torch.float32 else "",
                                       str(dtype)[6:], "channels_last" if cl else "nchw")
                try:
                    r = dict(case=name, ok=True, **run_case(ops, dtype, cl, device=device))
                    print("ok   %-40s worst %s; host waits per layer and step %.0f" % (
                        name, ", ".join("%s %.2g" % kv for kv in r["errors"].items()),
                        r["syncs"]["per_layer_step"]))
                except Exception:
                    failed += 1
                    r = dict(case=name, ok=False, error=traceback.format_exc())
                    print("FAIL %s\n%s" % (name, r["error"]))
                results.append(r)
        name = "%s GradScaler overflow" % ops
        if device == "cpu":
            continue
        try:
            r = dict(case=name, ok=True, **grad_scaler_skips_overflowing_steps(ops))
            print("ok   %-40s scales %s skipped %s" % (name, r["scales"], r["skipped"]))
        except Exception:
            failed += 1
            r = dict(case=name, ok=False, error=traceback.format_exc())
            print("FAIL %s\n%s" % (name, r["error"]))
        results.append(r)
    print("module check: %s" % ("all %d cases passed" % len(results) if not failed
                                else "FAIL: %d of %d cases" % (failed, len(results))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__,
                       "cases": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
