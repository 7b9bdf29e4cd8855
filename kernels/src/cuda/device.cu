// Device discovery and the per-channel running-statistics update.
#include "common.cuh"
#include "cuda_kernels.h"
#include "hsbn/moments.h"

namespace hsbn::kernels::cuda {

bool DeviceAvailable() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error for later calls
    return false;
  }
  return n > 0;
}

DeviceScope::DeviceScope(const void* ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    error_ = cudaGetErrorString(cudaGetLastError());
    return;
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) return;
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    error_ = cudaGetErrorString(cudaGetLastError());
    return;
  }
  if (current == attr.device) return;
  if (cudaSetDevice(attr.device) != cudaSuccess) {
    error_ = cudaGetErrorString(cudaGetLastError());
    return;
  }
  previous_ = current;
}

DeviceScope::~DeviceScope() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

int MaxResidentBlocks() {
  // Cached per device: cudaDeviceGetAttribute is cheap, but this sits on the hot path.
  static thread_local int cached_device = -1;
  static thread_local int cached_blocks = 0;
  int device = 0;
  cudaGetDevice(&device);
  if (device != cached_device) {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cached_device = device;
    cached_blocks = (sms > 0 ? sms : 80) * (2048 / kThreads);
  }
  return cached_blocks;
}

namespace {

__global__ void UpdateRunningStatsKernel(int64_t channels, int64_t count, const double* mean,
                                         const double* m2, void* running_mean,
                                         void* running_var, DType dtype, double factor) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= channels) return;
  const double unbiased = UnbiasedVariance(Moments<double>{count, mean[c], m2[c]});
  const double rm = LoadAsDouble(running_mean, dtype, c);
  const double rv = LoadAsDouble(running_var, dtype, c);
  StoreFromDouble(running_mean, dtype, c, (1.0 - factor) * rm + factor * mean[c]);
  StoreFromDouble(running_var, dtype, c, (1.0 - factor) * rv + factor * unbiased);
}

}  // namespace

const char* UpdateRunningStats(int64_t channels, int64_t count, const double* mean,
                               const double* m2, void* running_mean, void* running_var,
                               DType running_dtype, double factor, void* stream) {
  const unsigned blocks = static_cast<unsigned>((channels + kThreads - 1) / kThreads);
  UpdateRunningStatsKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      channels, count, mean, m2, running_mean, running_var, running_dtype, factor);
  return LastLaunchError();
}

}  // namespace hsbn::kernels::cuda
