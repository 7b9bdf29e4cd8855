// bn_kernels_bench — achieved memory bandwidth of each BN kernel over shapes from real models.
//
// For every (shape, dtype, layout) it times local moments, normalize, backward reduce and
// backward elementwise and prints GB/s (bytes the kernel must move / time) and, on a GPU, the
// fraction of the device's peak memory bandwidth (from its memory clock and bus width). On the
// CPU it reports the CPU path's GB/s. --json FILE writes one JSON object per measurement.
// --cpu-time (CPU device) times with this thread's CPU time instead of wall time, so that other
// processes on a shared, loaded machine slow the numbers down less (the kernels are
// single-threaded).
//
//   bn_kernels_bench [--device cpu|cuda] [--iters N] [--json FILE] [--quick] [--cpu-time]
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "hsbn/bn_kernels.h"
#if HSBN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using hsbn::kernels::BnAffine;
using hsbn::kernels::BnInput;
using hsbn::kernels::BnStats;
using hsbn::kernels::Device;
using hsbn::kernels::DType;
using hsbn::kernels::Layout;
using hsbn::kernels::StatsKind;

struct Shape {
  int64_t n, c, h, w;
};

void* Alloc(Device d, size_t bytes) {
#if HSBN_HAVE_CUDA
  if (d == Device::kCuda) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    cudaMemset(p, 0, bytes);
    return p;
  }
#endif
  void* p = ::operator new(bytes);
  std::memset(p, 0, bytes);
  return p;
}

void Free(Device d, void* p) {
#if HSBN_HAVE_CUDA
  if (d == Device::kCuda) {
    cudaFree(p);
    return;
  }
#endif
  ::operator delete(p);
}

// Fills x with a pattern so the kernels see ordinary numbers (host-side, then copied).
void Fill(Device d, void* p, DType dtype, int64_t numel) {
  std::vector<unsigned char> host(numel * hsbn::kernels::DTypeSize(dtype));
  for (int64_t i = 0; i < numel; ++i) {
    const float v = 0.25f * static_cast<float>(i % 17) - 1.0f;
    if (dtype == DType::kF32) {
      std::memcpy(host.data() + i * 4, &v, 4);
    } else if (dtype == DType::kF64) {
      const double dv = v;
      std::memcpy(host.data() + i * 8, &dv, 8);
    } else {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      // Both encodings of these small dyadic values are exact: bf16 is the top half; fp16 is
      // built from the float fields.
      uint16_t h = static_cast<uint16_t>(bits >> 16);
      if (dtype == DType::kF16) {
        const uint32_t sign = (bits >> 16) & 0x8000u, exp = (bits >> 23) & 0xffu;
        h = v == 0.0f ? 0 : static_cast<uint16_t>(sign | ((exp - 112u) << 10) | ((bits >> 13) & 0x3ffu));
      }
      std::memcpy(host.data() + i * 2, &h, 2);
    }
  }
#if HSBN_HAVE_CUDA
  if (d == Device::kCuda) {
    cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice);
    return;
  }
#endif
  std::memcpy(p, host.data(), host.size());
}

bool g_cpu_time = false;

double ThreadCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Seconds per call of fn, averaged over iters calls after a warm-up.
double Time(Device d, int iters, const std::function<void()>& fn) {
  fn();
#if HSBN_HAVE_CUDA
  if (d == Device::kCuda) {
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    cudaDeviceSynchronize();
    cudaEventRecord(start);
    for (int i = 0; i < iters; ++i) fn();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms * 1e-3 / iters;
  }
#endif
  if (g_cpu_time) {
    const double t0 = ThreadCpuSeconds();
    for (int i = 0; i < iters; ++i) fn();
    return (ThreadCpuSeconds() - t0) / iters;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

double PeakGBs(Device d) {
#if HSBN_HAVE_CUDA
  if (d == Device::kCuda) {
    int dev = 0, clock_khz = 0, bus_bits = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev);
    cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev);
    return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;  // double data rate
  }
#endif
  return 0;
}

std::string DeviceName(Device d) {
#if HSBN_HAVE_CUDA
  if (d == Device::kCuda) {
    cudaDeviceProp prop;
    int dev = 0;
    cudaGetDevice(&dev);
    cudaGetDeviceProperties(&prop, dev);
    return prop.name;
  }
#endif
  return "cpu";
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "kernel failed: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Device device = hsbn::kernels::CudaAvailable() ? Device::kCuda : Device::kCpu;
  bool device_given = false;
  int iters = 0;
  bool quick = false;
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--device") && i + 1 < argc) {
      device_given = true;
      device = std::strcmp(argv[++i], "cuda") == 0 ? Device::kCuda : Device::kCpu;
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--cpu-time")) {
      g_cpu_time = true;
    } else {
      std::fprintf(stderr, "usage: %s [--device cpu|cuda] [--iters N] [--json FILE] [--quick] [--cpu-time]\n", argv[0]);
      return 2;
    }
  }
  if (!device_given && device == Device::kCpu) {
    std::fprintf(stderr, "note: no --device given and no usable GPU: timing the CPU kernels "
                         "(--device cuda requires a GPU)\n");
  }
  if (device == Device::kCuda && !hsbn::kernels::CudaAvailable()) {
    std::fprintf(stderr, "no CUDA device (or built without CUDA); use --device cpu\n");
    return 1;
  }
  if (iters <= 0) iters = device == Device::kCuda ? 50 : (quick ? 1 : 3);
  std::vector<Shape> shapes = {{8, 256, 128, 128}, {2, 64, 512, 512}, {32, 2048, 7, 7}};
  std::vector<DType> dtypes = {DType::kF16, DType::kBF16, DType::kF32};
  if (quick) dtypes = {DType::kF16, DType::kF32};
  FILE* json = json_path ? std::fopen(json_path, "w") : nullptr;
  const double peak = PeakGBs(device);
  std::printf("device: %s, peak memory bandwidth: %s\n", DeviceName(device).c_str(),
              peak > 0 ? (std::to_string(static_cast<int>(peak)) + " GB/s").c_str() : "n/a");
  std::printf("%-22s %-5s %-6s %-16s %10s %9s %7s\n", "shape (N,C,H,W)", "dtype", "layout",
              "kernel", "time(us)", "GB/s", "%peak");
  static const char* names[] = {"f16", "bf16", "f32", "f64"};
  for (const Shape& sh : shapes) {
    for (DType dtype : dtypes) {
      for (Layout layout : {Layout::kNchw, Layout::kChannelsLast}) {
        BnInput in;
        in.device = device;
        in.dtype = dtype;
        in.layout = layout;
        in.n = sh.n;
        in.c = sh.c;
        in.s = sh.h * sh.w;
        const size_t bytes = in.numel() * hsbn::kernels::DTypeSize(dtype);
        void* x = Alloc(device, bytes);
        void* dy = Alloc(device, bytes);
        void* y = Alloc(device, bytes);
        Fill(device, x, dtype, in.numel());
        Fill(device, dy, dtype, in.numel());
        const size_t ws_bytes = hsbn::kernels::WorkspaceBytes(in);
        void* ws = ws_bytes ? Alloc(device, ws_bytes) : nullptr;
        double* mean = static_cast<double*>(Alloc(device, in.c * 8));
        double* m2 = static_cast<double*>(Alloc(device, in.c * 8));
        double* sum_dy = static_cast<double*>(Alloc(device, in.c * 8));
        double* sum_dy_xmu = static_cast<double*>(Alloc(device, in.c * 8));
        float* weight = static_cast<float*>(Alloc(device, in.c * 4));
        float* gw = static_cast<float*>(Alloc(device, in.c * 4));
        float* gb = static_cast<float*>(Alloc(device, in.c * 4));
        int64_t count = 0;
        Check(hsbn::kernels::LocalMoments(in, x, &count, mean, m2, ws, ws_bytes, nullptr));
        const BnStats stats{mean, m2, DType::kF64, StatsKind::kM2, 1e-5, count};
        const BnAffine affine{weight, weight, DType::kF32};
        struct Op {
          const char* name;
          double traffic;  // tensor-sized reads + writes
          std::function<void()> fn;
        };
        const std::vector<Op> ops = {
            {"moments", 1,
             [&] { Check(hsbn::kernels::LocalMoments(in, x, &count, mean, m2, ws, ws_bytes, nullptr)); }},
            {"normalize", 2,
             [&] { Check(hsbn::kernels::Normalize(in, x, y, stats, affine, false, nullptr)); }},
            {"backward_reduce", 2,
             [&] {
               Check(hsbn::kernels::BackwardReduce(in, dy, x, stats, sum_dy, sum_dy_xmu, gw, gb,
                                                   DType::kF32, ws, ws_bytes, nullptr));
             }},
            {"backward_elemt", 3,
             [&] {
               Check(hsbn::kernels::BackwardElementwise(in, dy, x, stats, affine, sum_dy,
                                                        sum_dy_xmu, count, y, nullptr));
             }},
        };
        for (const Op& op : ops) {
          const double t = Time(device, iters, op.fn);
          const double gbs = op.traffic * bytes / t / 1e9;
          char shape_str[64];
          std::snprintf(shape_str, sizeof shape_str, "%lld,%lld,%lld,%lld", (long long)sh.n,
                        (long long)sh.c, (long long)sh.h, (long long)sh.w);
          const char* lay = layout == Layout::kNchw ? "nchw" : "cl";
          std::printf("%-22s %-5s %-6s %-16s %10.1f %9.1f %7s\n", shape_str,
                      names[static_cast<int>(dtype)], lay, op.name, t * 1e6, gbs,
                      peak > 0 ? (std::to_string(static_cast<int>(100 * gbs / peak)) + "%").c_str() : "-");
          std::fflush(stdout);
          if (json)
            std::fprintf(json,
                         "{\"device\":\"%s\",\"shape\":[%s],\"dtype\":\"%s\",\"layout\":\"%s\","
                         "\"kernel\":\"%s\",\"seconds\":%.9g,\"gbs\":%.6g,\"peak_gbs\":%.6g}\n",
                         device == Device::kCuda ? "cuda" : "cpu", shape_str,
                         names[static_cast<int>(dtype)], lay, op.name, t, gbs, peak);
        }
        for (void* p : {x, dy, y, ws, static_cast<void*>(mean), static_cast<void*>(m2),
                        static_cast<void*>(sum_dy), static_cast<void*>(sum_dy_xmu),
                        static_cast<void*>(weight), static_cast<void*>(gw), static_cast<void*>(gb)})
          if (p) Free(device, p);
      }
    }
  }
  if (json) std::fclose(json);
  return 0;
}
