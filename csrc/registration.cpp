// The one place every op of the library is declared. Implementations register per device
// (cpu/attention_cpu.cpp, cuda/attention_cuda.cpp; the KV-cache append, CPU only, below);
// autograd and fake (meta) kernels are registered from Python (attention_ext/_ops.py,
// function.py, varlen.py, kv_cache.py).
//
// causal: 0 = none, 1 = top-left (torch's is_causal), 2 = bottom-right (FlashAttention).
// window_left / window_right: FlashAttention's sliding window, key j visible to query i iff
// i + m − n − window_left <= j <= i + m − n + window_right; −1 = unbounded on that side.
// softcap (0: none) and alibi_slopes (float32, broadcasting to the batch dims; no gradient): the
// score modifiers, softcap·tanh(t / softcap) then −slope·|i + m − n − j| on the scaled score t.
// sinks (the lse's dtype, broadcasting to the batch dims): one more always-visible key per row,
// of that logit and value 0 (in the lse; its gradient is −Σ_rows exp(sink − lse)·delta, composed
// in Python from the op's outputs).
// rng_state: int64 (seed, offset) on the inputs' device, required when dropout_p > 0.
#include <torch/library.h>

#include "build_info.h"
#include "cpu/cpu_dispatch.h"
#include "kv_cache.h"
#include "rotary.h"

TORCH_LIBRARY(attention_ext, m) {
  m.def(
      "attention_fwd(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float scale, "
      "int causal, int window_left, int window_right, float softcap, Tensor? alibi_slopes, Tensor? sinks, "
      "float dropout_p, Tensor? rng_state) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "attention_bwd(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, "
      "Tensor? attn_mask, Tensor out, Tensor lse, float scale, int causal, int window_left, "
      "int window_right, float softcap, Tensor? alibi_slopes, Tensor? sinks, float dropout_p, "
      "Tensor? rng_state, bool mask_requires_grad, bool merged_lse=False) -> (Tensor grad_query, "
      "Tensor grad_key, Tensor grad_value, Tensor grad_mask)");
  m.def(
      "attention_probs(Tensor query, Tensor key, Tensor? attn_mask, float scale, int causal, "
      "int window_left, int window_right, float softcap, Tensor? alibi_slopes, Tensor? sinks) -> Tensor");
  m.def(
      "dropout_keep_mask(Tensor rng_state, int[] batch_shape, int n, int m, float dropout_p) -> "
      "Tensor");
  // Packed (variable-length) batches, FlashAttention's varlen layout with the row dim second to last:
  // query (batch..., total_q, d), key/value (batch..., total_k, d); sequence s holds the rows
  // cu_seqlens_q[s]:cu_seqlens_q[s+1] and cu_seqlens_k[s]:cu_seqlens_k[s+1] (int32) and sees only
  // itself (csrc/packed_sequences.h). causal 0 or 2; alibi_slopes may have one row per sequence.
  // max_seqlen_q/k are SymInt, as in torch's own varlen ops, so that under torch.compile a new longest
  // sequence is no new graph (the kernels read them as int64_t).
  m.def(
      "attention_varlen_fwd(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float scale, int causal, int window_left, int window_right, "
      "float softcap, Tensor? alibi_slopes, Tensor? sinks, float dropout_p, Tensor? rng_state) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "attention_varlen_bwd(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor out, Tensor lse, "
      "float scale, int causal, int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
      "Tensor? sinks, float dropout_p, Tensor? rng_state) -> (Tensor grad_query, Tensor grad_key, "
      "Tensor grad_value)");
  // Inference against a key/value cache (csrc/kv_cache.h): query (batch, heads..., n, d), caches
  // (rows | blocks, heads..., length | block_size, d); batch entry b attends to keys
  // [cache_leftpad[b], cache_seqlens[b]) of cache row cache_batch_idx[b] (or b), or of the blocks
  // block_table[b] lists. causal 0 or 2; alibi_slopes may have one row per batch entry. No autograd.
  m.def(
      "attention_kvcache_fwd(Tensor query, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
      "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, float scale, int causal, "
      "int window_left, int window_right, float softcap, Tensor? alibi_slopes) -> (Tensor out, Tensor lse)");
  // The append before it (kv_cache.h): k / v (batch, new, kv_heads, d) written in place at
  // positions cache_seqlens[b] + t of (rows | blocks, length | block_size, kv_heads, d) caches.
  m.def(
      "attention_kvcache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor cache_seqlens, "
      "Tensor? cache_batch_idx, Tensor? block_table) -> ()");
  // Rotary embeddings of the new keys and the queries before the append (rotary.h): x (batch, rows,
  // heads, d) rotated at positions start[b] + t (per_row) or start[b], into a new tensor.
  m.def(
      "attention_rotary(Tensor x, Tensor cos, Tensor sin, Tensor start, bool per_row, bool interleaved) -> Tensor");
  // Introspection and CPU kernel-variant control; no tensors, so one implementation for all.
  m.def("build_info() -> str", &attention_ext::build_info);
  m.def("cpu_variant() -> str", &attention_ext::cpu_variant);
  m.def("set_cpu_variant(str name) -> str", &attention_ext::set_cpu_variant);
  // The machine's float32 FMA peak (GFLOP/s, all torch threads), measured by the CPU kernels' code.
  m.def("cpu_fma_peak_gflops(int iterations) -> float", &attention_ext::cpu::fma_peak_gflops);
  m.def("cpu_tile_gemm_gflops(int iterations) -> float", &attention_ext::cpu::tile_gemm_gflops);
  m.def("cpu_tile_forward_gflops(int iterations) -> float", &attention_ext::cpu::tile_forward_gflops);
  m.def("cpu_tile_backward_gflops(int iterations) -> float", &attention_ext::cpu::tile_backward_gflops);
  // The streaming read bandwidth (GB/s, all torch threads) over a float32 buffer the caller sizes.
  m.def("cpu_stream_read_gbps(Tensor buffer) -> float", &attention_ext::cpu::stream_read_gbps);
}

// The append and the rotary before it, for CPU caches, in every build (the append follows torch's
// rules for in-place ops itself: it bumps the caches' version counters and refuses inference
// tensors outside inference mode; on other devices flash_attn_with_kvcache appends with index_put_
// and rotates with torch ops).
TORCH_LIBRARY_IMPL(attention_ext, CPU, m) {
  m.impl("attention_kvcache_append", &attention_ext::kv_cache_append);
  m.impl("attention_rotary", &attention_ext::rotary_embedding);
}

