// Torch-free entry points of the CUDA attention kernels. Each takes the plain AttentionParams the
// bindings build (csrc/op_arguments.h) and a stream, launches asynchronously and returns the
// launch status (cudaGetLastError after the launches; no synchronisation, no host reads of device
// memory: dropout reads (seed, offset) from p.rng_state_device inside the kernels).
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "../attention_params.h"

namespace attention_ext {
namespace cuda {

// Which backward passes to run (delta always runs first).
struct BackwardPlan {
  bool kv = true;     // grad_k and grad_v
  bool q = true;      // grad_q
  bool mask = false;  // grad_mask (a floating mask that needs a gradient; zero-filled by caller)
};

// Split-KV plan of a forward call: sets p.kv_splits / p.split_keys (1 / 0 when the call is not
// split). When kv_splits > 1 the caller provides p.split_out (batch_numel·kv_splits·n·dv floats)
// and p.split_stats (batch_numel·kv_splits·n·2 floats) before attention_fwd_cuda.
void plan_forward_cuda(AttentionParams& p);
// Forward: writes p.out and p.lse.
cudaError_t attention_fwd_cuda(const AttentionParams& p, cudaStream_t stream);
// Attention probabilities from a saved p.lse: writes p.shift_hi / p.shift_lo (scratch), then p.probs.
cudaError_t attention_probs_cuda(const AttentionParams& p, cudaStream_t stream);
// Backward: writes p.shift_hi / p.shift_lo and p.delta (scratch), then the gradients the plan asks for.
cudaError_t attention_bwd_cuda(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream);
// Dropout keep mask (batch, n, m) contiguous bool, with (seed, offset) read from device memory.
cudaError_t dropout_keep_mask_cuda(const int64_t* rng_state_device, uint32_t threshold, int64_t batch,
                                   int64_t n, int64_t m, bool* keep, cudaStream_t stream);

// Per-dtype instantiations (one translation unit each, so builds parallelise).
cudaError_t forward_fp64(const AttentionParams& p, cudaStream_t stream);
cudaError_t forward_fp32(const AttentionParams& p, cudaStream_t stream);
cudaError_t forward_fp16(const AttentionParams& p, cudaStream_t stream);
cudaError_t forward_bf16(const AttentionParams& p, cudaStream_t stream);
cudaError_t probs_fp64(const AttentionParams& p, cudaStream_t stream);
cudaError_t probs_fp32(const AttentionParams& p, cudaStream_t stream);
cudaError_t probs_fp16(const AttentionParams& p, cudaStream_t stream);
cudaError_t probs_bf16(const AttentionParams& p, cudaStream_t stream);
cudaError_t backward_fp64(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream);
cudaError_t backward_fp32(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream);
cudaError_t backward_fp16(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream);
cudaError_t backward_bf16(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream);

}  // namespace cuda
}  // namespace attention_ext
