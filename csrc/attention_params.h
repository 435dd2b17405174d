// Plain description of one attention call: pointers, sizes and strides.
//
// Shared by the CPU and CUDA kernels, so it includes no torch headers. Every size and stride is
// int64 so index arithmetic never overflows on tensors of more than 2^31 elements.
#pragma once
#include <stdint.h>

namespace attention_ext {

// Leading ("batch") dims of q/k/v/mask broadcast against each other like torch; the kernels see
// the broadcast shape and, per tensor, a stride for every batch dim (0 where it is broadcast).
constexpr int kMaxBatchDims = 8;

enum class ScalarType : int32_t { kFloat64 = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

// kTopLeft: key j visible to query i iff j <= i (torch's is_causal).
// kBottomRight: key j visible iff j <= i + (m - n) (FlashAttention; torch's causal_lower_right).
// Causal is the band's right bound at 0; a sliding window bounds it on both sides
// (attention_geometry.h: the visibility band, one rule for every kernel).
enum class CausalKind : int32_t { kNone = 0, kTopLeft = 1, kBottomRight = 2 };

// kBool: true = the key takes part. kAdditive: added to the scaled scores; -inf, and the lowest
// finite value of the mask's dtype (HF-style "finfo.min" masks), both mean "masked out".
enum class MaskKind : int32_t { kNone = 0, kBool = 1, kAdditive = 2 };

// A view of a (batch..., rows, cols) tensor. Strides are in elements.
struct TensorRef {
  void* data = nullptr;
  int64_t batch_stride[kMaxBatchDims] = {};
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

struct AttentionParams {
  ScalarType dtype = ScalarType::kFloat32;  // of q, k, v, out, grads and an additive mask

  int32_t batch_ndim = 0;
  int64_t batch_size[kMaxBatchDims] = {};
  int64_t batch_numel = 1;

  int64_t n = 0;   // queries
  int64_t m = 0;   // keys / values
  int64_t dk = 0;  // query/key head dim
  int64_t dv = 0;  // value head dim

  TensorRef q, k, v;            // inputs
  TensorRef mask;               // (batch..., n|1, m|1), any strides; see mask_kind
  TensorRef out;                // (batch..., n, dv), written by forward
  TensorRef lse;                // (batch..., n) natural-log logsumexp, float32 (float64 for fp64)
  TensorRef grad_out;           // backward inputs
  TensorRef grad_lse;           // optional gradient flowing into lse (data == nullptr if none)
  TensorRef delta;              // backward scratch: rowsum(dO * O) - dlse, accumulator type
  // Backward / probabilities scratch, accumulator type, (batch..., n) each: P is rebuilt as
  // 2^((s - shift_hi) - shift_lo) with s the log2-domain logit: shift_hi + shift_lo is lse·log2(e)
  // in two words or, for rows where the lse's rounding would show in P, the row max and log2(sum)
  // recomputed from the row (attention_semantics.h, needs_exact_shift).
  TensorRef shift_hi, shift_lo;
  // The lse passed to the backward normalises over more keys than this call sees (a block of an
  // attention merged by lse, as context parallelism runs): P is taken from it as given, never
  // recomputed from this call's own keys (which would renormalise P over them alone).
  bool lse_is_merged = false;
  TensorRef grad_q, grad_k, grad_v;  // allocated with the inputs' own (unbroadcast) shapes
  TensorRef grad_mask;          // allocated with the mask's own shape; data == nullptr if unused
  TensorRef probs;              // attention_probs output (batch..., n, m)

  // Split-key decode (CPU forward for few query rows): the keys are cut into kv_splits ranges of
  // split_keys keys; each (batch index, range) writes its unnormalised output rows to split_out
  // ([batch_numel][kv_splits][n][dv], accumulator type) and (running max in log2 units, sum) to
  // split_stats ([batch_numel][kv_splits][n][2]); a combine step merges them by their lse.
  // Range s covers keys [split_key_begin + s·split_keys, + split_keys): the ranges cover only the
  // keys some row can see (a window's), so no range is idle.
  int64_t kv_splits = 1;
  int64_t split_keys = 0;
  int64_t split_key_begin = 0;
  void* split_out = nullptr;
  void* split_stats = nullptr;

  // Paged keys and values (a KV cache in blocks, as vLLM keeps it; CPU decode forward only): key j
  // of the call is row (key_offset + j) % block_size of block key_blocks[(key_offset + j) /
  // block_size], blocks k_block_stride / v_block_stride elements apart from k.data / v.data (which
  // hold block 0's batch-position offsets as usual). key_blocks == nullptr: rows are j·row_stride.
  const int32_t* key_blocks = nullptr;
  int64_t block_size = 0;
  int64_t key_offset = 0;
  int64_t k_block_stride = 0, v_block_stride = 0;

  MaskKind mask_kind = MaskKind::kNone;
  CausalKind causal = CausalKind::kNone;
  // Sliding window, FlashAttention's (left, right): key j visible to query i iff
  // i + (m − n) − left <= j <= i + (m − n) + right; −1 leaves that side unbounded. Aligned
  // top-left instead (shift 0) under kTopLeft, which the bindings allow only when n == m.
  int64_t window_left = -1;
  int64_t window_right = -1;
  double scale = 1.0;
  // Score modifiers on the scaled score t = scale·q·k, in this order (attention_semantics.h),
  // before the masks. softcap > 0: t = softcap·tanh(t / softcap) (Gemma 2). ALiBi:
  // t −= slope·|i + m − n − j| with the slope of the batch position: alibi_slopes.data is float32,
  // one slope per batch position through batch_stride (nullptr: no ALiBi).
  double softcap = 0.0;
  TensorRef alibi_slopes;
  // Attention sinks: a per-batch-position logit (natural units, accumulator type, through
  // batch_stride; nullptr: none) that joins each row's softmax denominator as one more key, always
  // visible, of value 0 (GPT-OSS). The lse includes it.
  TensorRef sinks;

  // Dropout on the attention weights. A weight is kept iff its Philox draw is >= threshold,
  // where threshold = floor(p * 2^32); kept weights are scaled by 1 / (1 - p).
  double dropout_p = 0.0;
  uint32_t dropout_threshold = 0;
  uint64_t seed = 0;
  uint64_t offset = 0;
  // Added to the query row that keys a draw: a packed (variable-length) batch runs each sequence
  // as a call of its own whose rows start at its first packed row, so sequences never share draws.
  int64_t dropout_row_base = 0;
  // For device kernels: (seed, offset) read from device memory when non-null, so drawing them
  // never synchronises the host with the GPU (and CUDA graphs replay fresh draws).
  const int64_t* rng_state_device = nullptr;
};

}  // namespace attention_ext
