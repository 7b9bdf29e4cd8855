#!/usr/bin/env python3
"""hsbn's CUDA BN kernels (through their C ABI, ctypes) against PyTorch's
torch.batch_norm_stats / batch_norm_elemt / batch_norm_backward_reduce / batch_norm_backward_elemt,
on the same tensors and stream: results compared (all four kernels), times compared (CUDA
events), and both against the measured device-to-device copy bandwidth.

Shapes are the ones users run (issue 14): (32,64,112,112), (32,2048,7,7), (2,256,256,256),
BatchNorm1d (4096,1024), C = 70000 with spatial size 3, each in fp32 / fp16 / bf16, NCHW and (4-d
shapes) channels-last; plus one fp16 case of more than 2^32 elements (--no-huge leaves it out).

Bytes are counted as in docs/results/PERFORMANCE.md: each tensor read or written once (moments: x;
normalize: x, y; backward reduce: x, dy; backward elementwise: x, dy, dx).

Exit status 1 when a result differs beyond the tolerances below (docs/KERNELS.md): mean, invstd,
y and dx from PyTorch's, the backward sums (sum_dy, sum_dy_xmu, grad_weight, grad_bias) from their
exact value computed in float64 (torch's distance from it is reported too); 2 when there is no
CUDA device. Speed goals are reported, not enforced.

  torch_compare.py --lib BUILD/bench/kernels/libhsbn_bn_bench.so [--json F] [--iters N]
"""
import argparse
import ctypes
import json
import sys

import torch

F16, BF16, F32, F64 = 0, 1, 2, 3
NCHW, CL = 0, 1
M2 = 2
DTYPES = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
SHAPES = [(32, 64, 112, 112), (32, 2048, 7, 7), (2, 256, 256, 256), (4096, 1024),
          (64, 70000, 3)]
HUGE = (65, 256, 512, 512)  # 4.36e9 > 2^32 elements, fp16 only
# max |hsbn - torch| / max |torch| per result: statistics (fp64 vs torch's fp32), and outputs
# in the input's dtype (a few units of its rounding).
STAT_TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}
OUT_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def load(path):
    lib = ctypes.CDLL(path)
    i64, vp, dbl, sz = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_size_t
    c_int = ctypes.c_int
    lib.hsbn_bn_last_error.restype = ctypes.c_char_p
    lib.hsbn_bn_cuda_available.restype = c_int
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


def rel(a, b, rows=1 << 26):
    """max |a - b| / max |b| (absolute when b is all zeros), in float64, over slices of the first
    dimension holding about `rows` values each (the > 2^32 case must not be copied whole)."""
    step = max(1, rows // max(1, b[0].numel())) if b.dim() > 1 else b.shape[0]
    scale = d = 0.0
    for i in range(0, b.shape[0], step):
        ai, bi = a[i:i + step].double(), b[i:i + step].double()
        scale = max(scale, bi.abs().max().item())
        d = max(d, (ai - bi).abs().max().item())
    return d / scale if scale > 0 else d


def backward_sums_fp64(dy, x, mean, rows=1 << 26):
    """The exact backward sums per channel, sum(dy) and sum(dy * (x - mean)), in float64, over
    slices of the first dimension (as rel)."""
    c = x.shape[1]
    step = max(1, rows // max(1, x[0].numel()))
    dims = [0] + list(range(2, x.dim()))
    centre = mean.double().view(1, c, *([1] * (x.dim() - 2)))
    sdy = torch.zeros(c, device=x.device, dtype=torch.float64)
    sdx = torch.zeros_like(sdy)
    for i in range(0, x.shape[0], step):
        d = dy[i:i + step].double()
        sdy += d.sum(dims)
        sdx += (d * (x[i:i + step].double() - centre)).sum(dims)
    return sdy, sdx


def copy_gbs(iters):
    """Device-to-device copy bandwidth (read + write counted), 1 GiB each way."""
    src = torch.empty(1 << 28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), iters)
    return 2 * (1 << 30) / t / 1e9


def cases(huge):
    for shape in SHAPES:
        for dt in DTYPES:
            yield shape, dt, NCHW
            if len(shape) == 4:
                yield shape, dt, CL
    if huge:
        yield HUGE, torch.float16, NCHW


def run_case(lib, shape, dt, layout, iters, copy_bw):
    dev = torch.device("cuda")
    n, c = shape[0], shape[1]
    s = 1
    for d in shape[2:]:
        s *= d
    fmt = torch.channels_last if layout == CL else torch.contiguous_format
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(shape, device=dev, dtype=dt, generator=gen) * 2 + 3).contiguous(
        memory_format=fmt)
    dy = torch.randn(shape, device=dev, dtype=dt, generator=gen).contiguous(memory_format=fmt)
    y = torch.empty_like(x)
    dx = torch.empty_like(x)
    weight = torch.rand(c, device=dev, generator=gen) + 0.5
    bias = torch.randn(c, device=dev, generator=gen)
    mean = torch.empty(c, device=dev, dtype=torch.float64)
    m2 = torch.empty_like(mean)
    sdy, sdx = torch.empty_like(mean), torch.empty_like(mean)
    gw, gb = torch.empty(c, device=dev), torch.empty(c, device=dev)
    ws_bytes = ctypes.c_size_t()
    code = DTYPES[dt]
    check(lib, lib.hsbn_bn_workspace_size(1, code, layout, n, c, s, ctypes.byref(ws_bytes)))
    ws = torch.empty(max(1, ws_bytes.value), device=dev, dtype=torch.uint8)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    count = ctypes.c_int64()
    shp = (1, code, layout, n, c, s)
    eps = 1e-5

    def moments():
        check(lib, lib.hsbn_bn_moments(*shp, x.data_ptr(), ctypes.byref(count), mean.data_ptr(),
                                       m2.data_ptr(), ws.data_ptr(), ws_bytes.value, stream))
    moments()
    stats = (mean.data_ptr(), m2.data_ptr(), F64, M2, eps, count.value)

    def normalize():
        check(lib, lib.hsbn_bn_normalize(*shp, x.data_ptr(), y.data_ptr(), *stats,
                                         weight.data_ptr(), bias.data_ptr(), F32, 0, stream))

    def backward_reduce():
        check(lib, lib.hsbn_bn_backward_reduce(*shp, dy.data_ptr(), x.data_ptr(), *stats,
                                               sdy.data_ptr(), sdx.data_ptr(), gw.data_ptr(),
                                               gb.data_ptr(), F32, ws.data_ptr(),
                                               ws_bytes.value, stream))

    def backward_elemt():
        check(lib, lib.hsbn_bn_backward_elemt(*shp, dy.data_ptr(), x.data_ptr(), *stats,
                                              weight.data_ptr(), F32, sdy.data_ptr(),
                                              sdx.data_ptr(), count.value, dx.data_ptr(), stream))

    normalize()
    backward_reduce()
    backward_elemt()
    # torch's side, fed hsbn's statistics (rounded to fp32) so each comparison isolates one
    # kernel. Where torch itself cannot run the case, hsbn is timed alone and that is reported.
    try:
        tmean, tinvstd = torch.batch_norm_stats(x, eps)
        torch.cuda.synchronize()
    except RuntimeError as e:
        nbytes = x.numel() * x.element_size()
        rows = [dict(shape=list(shape), dtype=str(dt)[6:], layout="cl" if layout == CL else "nchw",
                     kernel=name, hsbn_gbs=traffic * nbytes / timed(fn, iters) / 1e9,
                     torch_gbs=None, speedup=None, copy_gbs=copy_bw, torch_error=str(e))
                for name, traffic, fn in (("moments", 1, moments), ("normalize", 2, normalize),
                                          ("backward_reduce", 2, backward_reduce),
                                          ("backward_elemt", 3, backward_elemt))]
        return rows, None
    invstd32 = (m2 / count.value + eps).rsqrt().float()
    mean32 = mean.float()
    ty = torch.batch_norm_elemt(x, weight, bias, mean32, invstd32, eps)
    tsdy, tsdx, tgw, tgb = torch.batch_norm_backward_reduce(dy, x, mean32, invstd32, weight,
                                                            True, True, True)
    count_t = torch.full((1,), count.value, device=dev, dtype=torch.int32)
    tdx = torch.batch_norm_backward_elemt(dy, x, mean32, invstd32, weight, sdy.float(),
                                          sdx.float(), count_t)
    # The backward sums are judged against their exact value (fp64, from the same tensors):
    # torch's own can be the less accurate side (on the H200, torch 2.11's bf16 NCHW sums
    # differed from hsbn's by 3e-3 of their largest value). torch's distance to the exact sums
    # (for its fp32 mean) is reported beside them.
    invstd64 = (m2 / count.value + eps).rsqrt()
    ref_sdy, ref_sdx = backward_sums_fp64(dy, x, mean)
    ref_sdx32 = ref_sdx + (mean - mean32.double()) * ref_sdy
    errors = {
        "mean": (rel(mean, tmean), STAT_TOL[dt]),
        "invstd": (rel(invstd64, tinvstd), STAT_TOL[dt]),
        "y": (rel(y, ty), OUT_TOL[dt]),
        "sum_dy": (rel(sdy, ref_sdy), STAT_TOL[dt]),
        "sum_dy_xmu": (rel(sdx, ref_sdx), STAT_TOL[dt]),
        "grad_weight": (rel(gw, ref_sdx * invstd64), STAT_TOL[dt]),
        "grad_bias": (rel(gb, ref_sdy), STAT_TOL[dt]),
        "dx": (rel(dx, tdx), OUT_TOL[dt]),
    }
    torch_errors = {
        "sum_dy": rel(tsdy, ref_sdy),
        "sum_dy_xmu": rel(tsdx, ref_sdx32),
        "grad_weight": rel(tgw, ref_sdx32 * invstd32.double()),
        "grad_bias": rel(tgb, ref_sdy),
    }
    del ref_sdy, ref_sdx, ref_sdx32
    del ty, tdx
    sdy_f, sdx_f = sdy.float(), sdx.float()
    ops = [
        ("moments", 1, moments, lambda: torch.batch_norm_stats(x, eps)),
        ("normalize", 2, normalize,
         lambda: torch.batch_norm_elemt(x, weight, bias, tmean, tinvstd, eps)),
        ("backward_reduce", 2, backward_reduce,
         lambda: torch.batch_norm_backward_reduce(dy, x, tmean, tinvstd, weight, True, True,
                                                  True)),
        ("backward_elemt", 3, backward_elemt,
         lambda: torch.batch_norm_backward_elemt(dy, x, tmean, tinvstd, weight, sdy_f, sdx_f,
                                                 count_t)),
    ]
    nbytes = x.numel() * x.element_size()
    rows = []
    for name, traffic, ours, theirs in ops:
        t_ours = timed(ours, iters)
        t_torch = timed(theirs, iters)
        rows.append(dict(shape=list(shape), dtype=str(dt)[6:],
                         layout="cl" if layout == CL else "nchw", kernel=name,
                         hsbn_gbs=traffic * nbytes / t_ours / 1e9,
                         torch_gbs=traffic * nbytes / t_torch / 1e9,
                         speedup=t_torch / t_ours, copy_gbs=copy_bw))
    return rows, (errors, torch_errors)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, help="libhsbn_bn_bench.so (or libhsbn.so)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-huge", action="store_true", help="leave out the > 2^32 fp16 case")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: torch sees no CUDA device")
        return 2
    lib = load(args.lib)
    if not lib.hsbn_bn_cuda_available():
        print("FAIL: %s has no CUDA kernels or sees no GPU" % args.lib)
        return 2
    print("device: %s, torch %s" % (torch.cuda.get_device_name(), torch.__version__))
    copy_bw = copy_gbs(args.iters)
    print("device-to-device copy: %.0f GB/s (read + write)" % copy_bw)
    print(f"{'shape':22} {'dtype':8} {'layout':6} {'kernel':16} {'hsbn GB/s':>10} {'%copy':>6} "
          f"{'torch GB/s':>10} {'hsbn/torch':>10}")
    all_rows, mismatches = [], []
    for shape, dt, layout in cases(not args.no_huge):
        tag = "%s %s %s" % (shape, str(dt)[6:], "cl" if layout == CL else "nchw")
        try:
            rows, errors = run_case(lib, shape, dt, layout, args.iters, copy_bw)
        except RuntimeError as e:  # a kernel error, or out of memory (a RuntimeError too)
            print("FAIL %s: %s" % (tag, e))
            mismatches.append({"case": tag, "error": str(e)})
            torch.cuda.empty_cache()
            continue
        if errors is None:
            print("NOTE %s: torch cannot run this case (%s); hsbn timed alone, results not "
                  "compared" % (tag, rows[0]["torch_error"].splitlines()[0]))
            for r in rows:
                print(f"{str(tuple(r['shape'])):22} {r['dtype']:8} {r['layout']:6} "
                      f"{r['kernel']:16} {r['hsbn_gbs']:10.1f} "
                      f"{100 * r['hsbn_gbs'] / copy_bw:5.0f}% {'-':>10} {'-':>10}")
            all_rows += rows
            torch.cuda.empty_cache()
            continue
        errors, torch_errors = errors
        for r in rows:
            print(f"{str(tuple(r['shape'])):22} {r['dtype']:8} {r['layout']:6} {r['kernel']:16} "
                  f"{r['hsbn_gbs']:10.1f} {100 * r['hsbn_gbs'] / copy_bw:5.0f}% "
                  f"{r['torch_gbs']:10.1f} {r['speedup']:10.2f}")
            r["errors"] = {k: v[0] for k, v in errors.items()}
            r["torch_errors_vs_fp64"] = torch_errors
        torch_off = {k: e for k, e in torch_errors.items() if not e <= STAT_TOL[dt]}
        if torch_off:
            print("NOTE %s: torch's own backward sums are off the exact ones: %s (hsbn's: %s)"
                  % (tag, ", ".join("%s %.3g" % kv for kv in torch_off.items()),
                     ", ".join("%s %.3g" % (k, errors[k][0]) for k in torch_off)))
        bad = {k: v for k, v in errors.items() if not v[0] <= v[1]}
        if bad:
            print("MISMATCH %s: %s" % (tag, ", ".join("%s %.3g > %g" % (k, e, t)
                                                       for k, (e, t) in bad.items())))
            mismatches.append({"case": tag, "errors": {k: v[0] for k, v in bad.items()}})
        all_rows += rows
        sys.stdout.flush()
        torch.cuda.empty_cache()
    slower = [r for r in all_rows if r["speedup"] is not None and r["speedup"] < 1.0]
    below = [r for r in all_rows if r["hsbn_gbs"] < 0.8 * copy_bw]
    print("%d measurements; hsbn slower than torch in %d; below 80%% of copy bandwidth in %d "
          "(large shapes are the goal's)" % (len(all_rows), len(slower), len(below)))
    print("results: %s" % ("all within tolerance" if not mismatches else
                           "FAIL: %d cases differ from torch" % len(mismatches)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_bw, "rows": all_rows, "mismatches": mismatches,
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__},
                      f, indent=1)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
