// CUDA implementations of the attention ops: the same validation, output allocation and order of
// passes as the CPU binding (cpu/attention_cpu.cpp), then the torch-free launchers of kernels.h
// on the current stream. Nothing here synchronises with the device: dropout's (seed, offset) stay
// in device memory (p.rng_state_device) and are read by the kernels. The stream comes from
// c10/cuda/CUDAStream.h (what at::cuda::getCurrentCUDAStream forwards to), which keeps this file
// free of the cuBLAS/cuSPARSE headers ATen/cuda/CUDAContext.h pulls in.
//
// In an ATTN_CUDA_EMULATION build (setup.py, ATTENTION_EXT_CUDA_EMULATION=1) the same binding is
// registered for CPU tensors and the kernels run on host threads (../cuda_emulation/emulation.h): no device, guard
// or stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#ifndef ATTN_CUDA_EMULATION
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "../op_arguments.h"
#include "../kv_cache.h"
#include "../packed_sequences.h"
#include "../philox.h"
#include "kernels.h"

namespace attention_ext {
namespace cuda {
namespace {

#ifndef ATTN_CUDA_EMULATION
using DeviceGuard = c10::cuda::CUDAGuard;
cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cuda() && t.device() == like.device(), "attention_ext: ", name,
              " must be a CUDA tensor on ", like.device(), " here, got ", t.device());
}

void check_launch(cudaError_t err) {
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#else
struct DeviceGuard {
  explicit DeviceGuard(const c10::Device&) {}
};
cudaStream_t current_stream() { return nullptr; }

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "attention_ext (CUDA emulation build): ", name,
              " must be a CPU tensor, got ", t.device());
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "attention_ext: emulated CUDA launch failed (", static_cast<int>(err), ")");
}
#endif

// The tensor-core backward (fp16/bf16) copies dO rows in 16-byte chunks: a gradient without unit
// column stride (out.sum().backward() hands in an expanded scalar) is made dense first, an
// O(n·d_v) copy, instead of sending the call to the SIMT kernels.
at::Tensor dense_grad_out(const at::Tensor& grad_out, const at::Tensor& q) {
  const bool low_precision = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
  return low_precision && grad_out.dim() > 0 && grad_out.numel() > 0 && grad_out.stride(-1) != 1
             ? grad_out.contiguous()
             : grad_out;
}

// Plans the split-KV forward of one call and launches it, with its scratch (released after the
// launch, stream-ordered).
void launch_forward(AttentionParams& p, const at::Tensor& q) {
  plan_forward_cuda(p);
  at::Tensor split_out, split_stats;
  if (p.kv_splits > 1) {
    split_out = at::empty({p.batch_numel * p.kv_splits * p.n * p.dv}, q.options().dtype(at::kFloat));
    split_stats = at::empty({p.batch_numel * p.kv_splits * p.n * 2}, q.options().dtype(at::kFloat));
    p.split_out = split_out.data_ptr();
    p.split_stats = split_stats.data_ptr();
  }
  check_launch(attention_fwd_cuda(p, current_stream()));
}

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 double scale, int64_t causal, int64_t window_left,
                                                 int64_t window_right, double softcap,
                                                 const std::optional<at::Tensor>& alibi_slopes,
                                                 const std::optional<at::Tensor>& sinks, double dropout_p,
                                                 const std::optional<at::Tensor>& rng_state) {
  const LogitOptions logit{causal, window_left, window_right, softcap, alibi_slopes, sinks};
  const AttentionShape shape =
      check_attention_inputs(q, k, v, attn_mask, scale, logit, dropout_p, rng_state);
  check_cuda(q, q, "query");
  const DeviceGuard guard(q.device());
  auto [out, lse] = allocate_forward_outputs(shape, q);
  if (lse.numel() == 0) return {out, lse};
  AttentionParams p = make_params(shape, q, k, v, attn_mask, scale, logit, dropout_p, rng_state);
  p.out = make_ref(out, shape.batch);
  p.lse = make_row_ref(lse, shape.batch);
  launch_forward(p, q);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
    const at::Tensor& out, const at::Tensor& lse, double scale, int64_t causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& rng_state, bool mask_requires_grad, bool merged_lse) {
  const LogitOptions logit{causal, window_left, window_right, softcap, alibi_slopes, sinks};
  check_cuda(q, q, "query");
  const DeviceGuard guard(q.device());
  const at::Tensor dout = dense_grad_out(grad_out, q);  // alive while the kernels read it
  BackwardCall call = prepare_backward(dout, grad_lse, q, k, v, attn_mask, out, lse, scale,
                                       logit, dropout_p, rng_state, mask_requires_grad);
  const at::Tensor &gq = call.grad_q, &gk = call.grad_k, &gv = call.grad_v, &gmask = call.grad_mask;
  if (call.no_rows) return {gq, gk, gv, gmask};
  call.params.lse_is_merged = merged_lse;
  const AttentionParams& p = call.params;

  BackwardPlan plan;
  plan.kv = gk.numel() > 0 || gv.numel() > 0;
  plan.q = gq.numel() > 0;
  plan.mask = mask_requires_grad && gmask.numel() > 0;
  check_launch(attention_bwd_cuda(p, plan, current_stream()));
  return {gq, gk, gv, gmask};
}

at::Tensor attention_probs(const at::Tensor& q, const at::Tensor& k,
                           const std::optional<at::Tensor>& attn_mask, double scale, int64_t causal,
                           int64_t window_left, int64_t window_right, double softcap,
                           const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
  const LogitOptions logit{causal, window_left, window_right, softcap, alibi_slopes, sinks};
  // A value tensor with no columns: the forward kernel then computes only the lse.
  const at::Tensor v = empty_value_for(k);
  const AttentionShape shape = check_attention_inputs(q, k, v, attn_mask, scale, logit, 0.0, {});
  check_cuda(q, q, "query");
  const DeviceGuard guard(q.device());
  const auto lse_pair = attention_fwd(q, k, v, attn_mask, scale, causal, window_left, window_right, softcap,
                                      alibi_slopes, sinks, 0.0, {});
  at::Tensor probs = at::empty(with_tail(shape.batch, {shape.n, shape.m}), q.options());
  if (probs.numel() == 0) return probs;
  AttentionParams p = make_params(shape, q, k, v, attn_mask, scale, logit, 0.0, {});
  const at::Tensor& lse = std::get<1>(lse_pair);
  p.lse = make_row_ref(lse, shape.batch);
  const auto row_shift = attach_row_shift(p, lse, shape);
  p.probs = make_ref(probs, shape.batch);
  check_launch(attention_probs_cuda(p, current_stream()));
  return probs;
}

// Packed (variable-length) batches and KV caches: the dense launchers once per sequence / batch
// entry (packed_sequences.h, kv_cache.h), in order on the current stream. Cost follows the work
// (Σ n_s·m_s), plus one launch (or split-KV pair) each: a batch of many short sequences pays the
// launch overhead of each. A paged cache has each entry's blocks copied into one contiguous tensor
// first (these kernels do not read through a block table).
std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, int64_t causal,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  check_cuda(q, q, "query");
  const DeviceGuard guard(q.device());
  PackedForward forward = prepare_packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                                 {causal, window_left, window_right, softcap, alibi_slopes, sinks},
                                                 dropout_p, rng_state);
  for (AttentionParams& p : forward.sequences) launch_forward(p, q);
  return {forward.out, forward.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, const at::Tensor& out, const at::Tensor& lse, double scale,
    int64_t causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  check_cuda(q, q, "query");
  const DeviceGuard guard(q.device());
  const at::Tensor dout = dense_grad_out(grad_out, q);  // alive while the kernels read it
  const PackedBackward packed = prepare_packed_backward(
      dout, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
      lse, scale, {causal, window_left, window_right, softcap, alibi_slopes, sinks}, dropout_p, rng_state);
  const BackwardCall& b = packed.backward;
  BackwardPlan plan;
  plan.kv = b.grad_k.numel() > 0 || b.grad_v.numel() > 0;
  plan.q = b.grad_q.numel() > 0;
  for (const AttentionParams& p : packed.sequences) check_launch(attention_bwd_cuda(p, plan, current_stream()));
  return {b.grad_q, b.grad_k, b.grad_v};
}

std::tuple<at::Tensor, at::Tensor> attention_kvcache_fwd(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& cache_leftpad,
    const std::optional<at::Tensor>& block_table, double scale, int64_t causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  check_cuda(q, q, "query");
  const DeviceGuard guard(q.device());
  KVCacheForward forward = prepare_kv_cache_forward(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                                                    block_table, scale,
                                                    {causal, window_left, window_right, softcap, alibi_slopes, {}}, 0);
  for (AttentionParams& p : forward.entries) launch_forward(p, q);
  return {forward.out, forward.lse};
}

at::Tensor dropout_keep_mask(const at::Tensor& rng_state, at::IntArrayRef batch_shape, int64_t n,
                             int64_t m, double dropout_p) {
  const DeviceGuard guard(rng_state.device());
  int64_t batch = 1;
  at::Tensor keep = allocate_keep_mask(rng_state, batch_shape, n, m, dropout_p, &batch);
  const at::Tensor state = rng_state.contiguous();
  if (keep.numel() == 0) return keep;
  check_launch(dropout_keep_mask_cuda(state.data_ptr<int64_t>(), dropout_threshold(dropout_p), batch, n, m,
                                      keep.data_ptr<bool>(), current_stream()));
  return keep;
}

}  // namespace

#ifndef ATTN_CUDA_EMULATION
TORCH_LIBRARY_IMPL(attention_ext, CUDA, m) {
#else
TORCH_LIBRARY_IMPL(attention_ext, CPU, m) {
#endif
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
  m.impl("attention_probs", &attention_probs);
  m.impl("dropout_keep_mask", &dropout_keep_mask);
  m.impl("attention_varlen_fwd", &attention_varlen_fwd);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd);
  m.impl("attention_kvcache_fwd", &attention_kvcache_fwd);
}

}  // namespace cuda
}  // namespace attention_ext
