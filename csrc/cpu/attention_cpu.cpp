// CPU implementations of the attention ops: validation -> AttentionParams -> the passes of the
// active kernel variant (kernel_passes.h). The packed ops run one dense call per sequence.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "../op_arguments.h"
#include "../attention_geometry.h"
#include "../philox.h"
#include "../kv_cache.h"
#include "../packed_sequences.h"
#include "kernel_table.h"
#include "kernel_passes.h"

namespace attention_ext {
namespace cpu {
namespace {

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
  auto [out, lse] = allocate_forward_outputs(shape, q);
  if (lse.numel() == 0) return {out, lse};
  AttentionParams p = make_params(shape, q, k, v, attn_mask, scale, logit, dropout_p, rng_state);
  p.out = make_ref(out, shape.batch);
  p.lse = make_row_ref(lse, shape.batch);
  std::vector<AttentionParams> calls{p};
  run_forward(calls, q);
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
  BackwardCall call = prepare_backward(grad_out, grad_lse, q, k, v, attn_mask, out, lse, scale,
                                       logit, dropout_p, rng_state, mask_requires_grad);
  at::Tensor &gq = call.grad_q, &gk = call.grad_k, &gv = call.grad_v, &gmask = call.grad_mask;
  if (call.no_rows) return {gq, gk, gv, gmask};
  call.params.lse_is_merged = merged_lse;
  const AttentionParams& p = call.params;

  run_backward({p}, {gk.numel() > 0 || gv.numel() > 0, gq.numel() > 0, mask_requires_grad && gmask.numel() > 0});
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
  const auto lse_pair = attention_fwd(q, k, v, attn_mask, scale, causal, window_left, window_right, softcap,
                                      alibi_slopes, sinks, 0.0, {});
  at::Tensor probs = at::empty(with_tail(shape.batch, {shape.n, shape.m}), q.options());
  if (probs.numel() == 0) return probs;
  AttentionParams p = make_params(shape, q, k, v, attn_mask, scale, logit, 0.0, {});
  const at::Tensor& lse = std::get<1>(lse_pair);
  p.lse = make_row_ref(lse, shape.batch);
  const auto row_shift = attach_row_shift(p, lse, shape);
  p.probs = make_ref(probs, shape.batch);
  run_probabilities({p});
  return probs;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, int64_t causal,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  PackedForward forward = prepare_packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                                 {causal, window_left, window_right, softcap, alibi_slopes, sinks},
                                                 dropout_p, rng_state);
  run_forward(forward.sequences, q);
  return {forward.out, forward.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, const at::Tensor& out, const at::Tensor& lse, double scale,
    int64_t causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  const PackedBackward packed = prepare_packed_backward(
      grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, scale,
      {causal, window_left, window_right, softcap, alibi_slopes, sinks}, dropout_p, rng_state);
  const BackwardCall& b = packed.backward;
  run_backward(packed.sequences, {b.grad_k.numel() > 0 || b.grad_v.numel() > 0, b.grad_q.numel() > 0, false});
  return {b.grad_q, b.grad_k, b.grad_v};
}

// Inference against a KV cache (kv_cache.h): calls of few query rows read a paged cache through
// its block table in the decode kernel; longer ones get their blocks copied first.
std::tuple<at::Tensor, at::Tensor> attention_kvcache_fwd(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& cache_leftpad,
    const std::optional<at::Tensor>& block_table, double scale, int64_t causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  KVCacheForward forward = prepare_kv_cache_forward(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                                                    block_table, scale,
                                                    {causal, window_left, window_right, softcap, alibi_slopes, {}},
                                                    kDecodeRows);
  run_forward(forward.entries, q);
  return {forward.out, forward.lse};
}

at::Tensor dropout_keep_mask(const at::Tensor& rng_state, at::IntArrayRef batch_shape, int64_t n,
                             int64_t m, double dropout_p) {
  int64_t batch = 1;
  at::Tensor keep = allocate_keep_mask(rng_state, batch_shape, n, m, dropout_p, &batch);
  const at::Tensor state = rng_state.contiguous();
  const uint64_t seed = static_cast<uint64_t>(state.data_ptr<int64_t>()[0]);
  const uint64_t offset = static_cast<uint64_t>(state.data_ptr<int64_t>()[1]);
  const uint32_t threshold = dropout_threshold(dropout_p);
  bool* data = keep.data_ptr<bool>();
  at::parallel_for(0, batch * n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / n, i = row % n;
      for (int64_t j = 0; j < m; j += 4) {
        const PhiloxWords w = dropout_words(seed, offset, static_cast<uint64_t>(b),
                                            static_cast<uint64_t>(i), static_cast<uint64_t>(j));
        for (int t = 0; t < 4 && j + t < m; ++t) data[row * m + j + t] = w.w[t] >= threshold;
      }
    }
  });
  return keep;
}

}  // namespace

#ifndef ATTN_CUDA_EMULATION  // there the CUDA binding takes CPU tensors (cuda_emulation/emulation.h)
TORCH_LIBRARY_IMPL(attention_ext, CPU, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
  m.impl("attention_probs", &attention_probs);
  m.impl("dropout_keep_mask", &dropout_keep_mask);
  m.impl("attention_varlen_fwd", &attention_varlen_fwd);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd);
  m.impl("attention_kvcache_fwd", &attention_kvcache_fwd);
}
#endif

}  // namespace cpu
}  // namespace attention_ext
