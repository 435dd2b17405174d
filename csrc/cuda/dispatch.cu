// Dtype dispatch of the CUDA kernels, the split-KV plan, the dropout keep-mask kernel, and whether
// a device runs the build's tensor-core code.
#include <atomic>

#include "common.cuh"
#include "kernels.h"
#include "tc_forward.cuh"

namespace attention_ext {
namespace cuda {

namespace tc {

// An empty kernel compiled with the build's flags: its attributes on a device say which PTX
// architecture the device code comes from there (the same for every .cu of the build).
__global__ void arch_probe_kernel() {}

bool device_runs_sm80_code(int device) {
  // The answer is fixed for a process and device: asked once (devices beyond the table, every time).
  constexpr int kCachedDevices = 64;
  static std::atomic<int> answers[kCachedDevices];  // 0: not asked yet, 1: yes, 2: no
  std::atomic<int>* answer = device >= 0 && device < kCachedDevices ? &answers[device] : nullptr;
  const int known = answer != nullptr ? answer->load(std::memory_order_relaxed) : 0;
  if (known != 0) return known == 1;
  cudaFuncAttributes attributes;
  bool yes = false;
  if (cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&arch_probe_kernel)) == cudaSuccess)
    yes = attributes.ptxVersion >= 80;
  else
    cudaGetLastError();  // (not left for the next launch's check to find)
  if (answer != nullptr) answer->store(yes ? 1 : 2, std::memory_order_relaxed);
  return yes;
}

}  // namespace tc

void plan_forward_cuda(AttentionParams& p) { tc::plan_kv_splits(p); }  // only the tensor-core forward splits

cudaError_t attention_fwd_cuda(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarType::kFloat64: return forward_fp64(p, stream);
    case ScalarType::kFloat32: return forward_fp32(p, stream);
    case ScalarType::kFloat16: return forward_fp16(p, stream);
    case ScalarType::kBFloat16: return forward_bf16(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t attention_probs_cuda(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarType::kFloat64: return probs_fp64(p, stream);
    case ScalarType::kFloat32: return probs_fp32(p, stream);
    case ScalarType::kFloat16: return probs_fp16(p, stream);
    case ScalarType::kBFloat16: return probs_bf16(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t attention_bwd_cuda(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream) {
  switch (p.dtype) {
    case ScalarType::kFloat64: return backward_fp64(p, plan, stream);
    case ScalarType::kFloat32: return backward_fp32(p, plan, stream);
    case ScalarType::kFloat16: return backward_fp16(p, plan, stream);
    case ScalarType::kBFloat16: return backward_bf16(p, plan, stream);
  }
  return cudaErrorInvalidValue;
}

namespace {

// One thread per (row, group of 4 keys): one Philox draw gives the 4 keep flags.
__global__ void dropout_keep_mask_kernel(const int64_t* rng_state, uint32_t threshold, int64_t batch,
                                         int64_t n, int64_t m, bool* keep) {
  const int64_t groups = (m + 3) / 4;
  const int64_t total = batch * n * groups;
  const uint64_t seed = static_cast<uint64_t>(rng_state[0]);
  const uint64_t offset = static_cast<uint64_t>(rng_state[1]);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = t / groups;
    const int64_t j = (t % groups) * 4;
    const int64_t b = row / n, i = row % n;
    const PhiloxWords w = dropout_words(seed, offset, static_cast<uint64_t>(b), static_cast<uint64_t>(i),
                                        static_cast<uint64_t>(j));
    bool* dst = keep + row * m + j;
    for (int e = 0; e < 4 && j + e < m; ++e) dst[e] = w.w[e] >= threshold;
  }
}

}  // namespace

cudaError_t dropout_keep_mask_cuda(const int64_t* rng_state_device, uint32_t threshold, int64_t batch,
                                   int64_t n, int64_t m, bool* keep, cudaStream_t stream) {
  const int64_t total = batch * n * ((m + 3) / 4);
  if (total <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const unsigned grid = static_cast<unsigned>(imin(ceil_div(total, kThreads), 65536 * 8));
  ATTN_LAUNCH(dropout_keep_mask_kernel, grid, kThreads, 0, stream)(rng_state_device, threshold, batch, n, m, keep);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attention_ext
