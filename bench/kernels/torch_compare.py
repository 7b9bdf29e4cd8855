#!/usr/bin/env python3
"""Side-by-side: hsbn's CUDA BN kernels (through the C ABI, ctypes) and PyTorch's
torch.batch_norm_stats / batch_norm_elemt / batch_norm_backward_reduce /
batch_norm_backward_elemt, on the same tensors and stream, timed with CUDA events.

Prints GB/s for both, the fraction of peak (--peak-gbs, from bn_kernels_bench), and the speed
ratio hsbn/torch (> 1: hsbn faster). Also checks that both compute the same statistics.

  torch_compare.py --lib build/bench/kernels/libhsbn_bn_bench.so [--peak-gbs 4800] [--json F]
"""
import argparse
import ctypes
import json
import sys

import torch

F16, BF16, F32, F64 = 0, 1, 2, 3
NCHW, CL = 0, 1
M2 = 2
DTYPES = {torch.float16: F16, torch.bfloat16: BF16, torch.float32: F32}
SHAPES = [(8, 256, 128, 128), (2, 64, 512, 512), (32, 2048, 7, 7)]


def load(path):
    lib = ctypes.CDLL(path)
    i64, vp, dbl, sz = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_size_t
    c_int = ctypes.c_int
    lib.hsbn_bn_last_error.restype = ctypes.c_char_p
    lib.hsbn_bn_workspace_size.argtypes = [c_int, c_int, c_int, i64, i64, i64, ctypes.POINTER(sz)]
    lib.hsbn_bn_moments.argtypes = [c_int, c_int, c_int, i64, i64, i64, vp,
                                    ctypes.POINTER(i64), vp, vp, vp, sz, vp]
    lib.hsbn_bn_normalize.argtypes = [c_int, c_int, c_int, i64, i64, i64, vp, vp, vp, vp, c_int,
                                      c_int, dbl, i64, vp, vp, c_int, c_int, vp]
    lib.hsbn_bn_backward_reduce.argtypes = [c_int, c_int, c_int, i64, i64, i64, vp, vp, vp, vp,
                                            c_int, c_int, dbl, i64, vp, vp, vp, vp, c_int, vp, sz,
                                            vp]
    lib.hsbn_bn_backward_elemt.argtypes = [c_int, c_int, c_int, i64, i64, i64, vp, vp, vp, vp,
                                           c_int, c_int, dbl, i64, vp, c_int, vp, vp, i64, vp, vp]
    return lib


def check(lib, rc):
    if rc != 0:
        raise RuntimeError(lib.hsbn_bn_last_error().decode())


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e-3 / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--peak-gbs", type=float, default=0.0)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch has no CUDA device; nothing to compare")
        return 0
    lib = load(args.lib)
    dev = torch.device("cuda")
    rows, worst = [], 0.0
    print(f"{'shape':18} {'dtype':9} {'layout':6} {'kernel':16} {'hsbn GB/s':>10} {'%peak':>6} "
          f"{'torch GB/s':>10} {'hsbn/torch':>10}")
    for shape in SHAPES:
        n, c, h, w = shape
        for tdtype, code in DTYPES.items():
            for layout in (NCHW, CL):
                fmt = torch.channels_last if layout == CL else torch.contiguous_format
                x = torch.randn(shape, device=dev).to(tdtype).contiguous(memory_format=fmt)
                dy = torch.randn(shape, device=dev).to(tdtype).contiguous(memory_format=fmt)
                y = torch.empty_like(x)
                weight = torch.ones(c, device=dev)
                bias = torch.zeros(c, device=dev)
                mean = torch.empty(c, device=dev, dtype=torch.float64)
                m2 = torch.empty_like(mean)
                sdy, sdx = torch.empty_like(mean), torch.empty_like(mean)
                gw, gb = torch.empty(c, device=dev), torch.empty(c, device=dev)
                ws_bytes = ctypes.c_size_t()
                check(lib, lib.hsbn_bn_workspace_size(1, code, layout, n, c, h * w,
                                                      ctypes.byref(ws_bytes)))
                ws = torch.empty(max(1, ws_bytes.value), device=dev, dtype=torch.uint8)
                stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
                count = ctypes.c_int64()
                shp = (1, code, layout, n, c, h * w)

                def moments():
                    check(lib, lib.hsbn_bn_moments(*shp, x.data_ptr(), ctypes.byref(count),
                                                   mean.data_ptr(), m2.data_ptr(), ws.data_ptr(),
                                                   ws_bytes.value, stream))
                moments()
                tmean, tinvstd = torch.batch_norm_stats(x, 1e-5)
                torch.cuda.synchronize()
                var = (m2 / count.value)
                ok_mean = torch.allclose(mean.float(), tmean, rtol=1e-3, atol=1e-3)
                ok_var = torch.allclose((1 / torch.sqrt(var + 1e-5)).float(), tinvstd,
                                        rtol=1e-3, atol=1e-3)
                if not (ok_mean and ok_var):
                    print(f"MISMATCH with torch.batch_norm_stats at {shape} {tdtype} {layout}")
                    worst = float("inf")
                stats = (mean.data_ptr(), m2.data_ptr(), F64, M2, 1e-5, count.value)
                count_t = torch.full((1,), count.value, device=dev, dtype=torch.int32)
                sdy_f, sdx_f = torch.zeros(c, device=dev), torch.zeros(c, device=dev)
                ops = [
                    ("moments", 1, moments, lambda: torch.batch_norm_stats(x, 1e-5)),
                    ("normalize", 2,
                     lambda: check(lib, lib.hsbn_bn_normalize(*shp, x.data_ptr(), y.data_ptr(),
                                                              *stats, weight.data_ptr(),
                                                              bias.data_ptr(), F32, 0, stream)),
                     lambda: torch.batch_norm_elemt(x, weight, bias, tmean, tinvstd, 1e-5)),
                    ("backward_reduce", 2,
                     lambda: check(lib, lib.hsbn_bn_backward_reduce(
                         *shp, dy.data_ptr(), x.data_ptr(), *stats, sdy.data_ptr(),
                         sdx.data_ptr(), gw.data_ptr(), gb.data_ptr(), F32, ws.data_ptr(),
                         ws_bytes.value, stream)),
                     lambda: torch.batch_norm_backward_reduce(dy, x, tmean, tinvstd, weight,
                                                              True, True, True)),
                    ("backward_elemt", 3,
                     lambda: check(lib, lib.hsbn_bn_backward_elemt(
                         *shp, dy.data_ptr(), x.data_ptr(), *stats, weight.data_ptr(), F32,
                         sdy.data_ptr(), sdx.data_ptr(), count.value, y.data_ptr(), stream)),
                     lambda: torch.batch_norm_backward_elemt(dy, x, tmean, tinvstd, weight,
                                                             sdy_f, sdx_f, count_t)),
                ]
                nbytes = x.numel() * x.element_size()
                for name, traffic, ours, theirs in ops:
                    t_ours = timed(ours, args.iters)
                    t_torch = timed(theirs, args.iters)
                    g_ours = traffic * nbytes / t_ours / 1e9
                    g_torch = traffic * nbytes / t_torch / 1e9
                    ratio = t_torch / t_ours
                    pct = f"{100 * g_ours / args.peak_gbs:5.0f}%" if args.peak_gbs else "    -"
                    print(f"{str(shape):18} {str(tdtype)[6:]:9} {'cl' if layout else 'nchw':6} "
                          f"{name:16} {g_ours:10.1f} {pct:>6} {g_torch:10.1f} {ratio:10.2f}")
                    sys.stdout.flush()
                    rows.append(dict(shape=shape, dtype=str(tdtype)[6:],
                                     layout="cl" if layout else "nchw", kernel=name,
                                     hsbn_gbs=g_ours, torch_gbs=g_torch, speedup=ratio,
                                     peak_gbs=args.peak_gbs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    slower = [r for r in rows if r["speedup"] < 1.0]
    print(f"{len(rows)} measurements; hsbn slower than torch in {len(slower)}")
    return 1 if worst == float("inf") else 0


if __name__ == "__main__":
    sys.exit(main())
