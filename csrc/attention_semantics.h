// The semantics of attention, one rule each, for every kernel on both devices: the CPU kernels
// (every ISA variant and stage) and the CUDA kernels (SIMT, tensor-core, split-KV combine), host
// and device. attention_ext/reference.py is the float64 mirror the tests compare against; a new
// score modifier is one function here plus its line there.
//
// The logit pipeline, in this order, in log2 units (so the softmax is exp2 of a difference):
//   s = q·k  ->  s·scale·log2(e)  ->  additive mask  ->  visibility (bool mask, causal kinds).
// The online softmax keeps per row a running max m (log2 units) and a running sum l of
// 2^(logit − m); the row end turns (m, l) into the output factor and the natural-log lse; partial
// results over key ranges (split-KV) merge by their maxima.
#pragma once
#include <math.h>

#include "attention_geometry.h"
#include "attention_params.h"

namespace attention_ext {

// Accumulation type of a storage type: float for fp32/fp16/bf16, double for fp64 (the lse, the
// row statistics and every tile product are held in it).
template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

template <typename A>
ATTN_HD inline A neg_inf() {
  return -static_cast<A>(INFINITY);
}

ATTN_HD inline float exp2_acc(float x) { return exp2f(x); }
ATTN_HD inline double exp2_acc(double x) { return exp2(x); }
ATTN_HD inline float log2_acc(float x) { return log2f(x); }
ATTN_HD inline double log2_acc(double x) { return log2(x); }

// --- The logit pipeline -----------------------------------------------------------------------

// Lowest finite value of a storage dtype. An additive-mask entry at or below it is "masked out",
// exactly like −inf: torch.finfo(dtype).min masks, as Hugging Face models build them, must not
// leave a fully masked row with a softmax over huge negative logits.
ATTN_HD inline double lowest_finite(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::kFloat64:
      return -1.7976931348623157e308;
    case ScalarType::kFloat32:
      return -3.4028234663852886e38;
    case ScalarType::kFloat16:
      return -65504.0;
    case ScalarType::kBFloat16:
      return -3.3895313892515355e38;
  }
  return -INFINITY;
}

// Scaled score in log2 units: s·(scale·log2 e), with scale_log2 = scale·log2(e) precomputed in A.
template <typename A>
ATTN_HD inline A scaled_logit(A score, A scale_log2) {
  return score * scale_log2;
}

// An additive-mask entry (as A) applied to a log2-domain logit; lowest = lowest_finite(dtype) as A.
template <typename A>
ATTN_HD inline A with_additive_mask(A logit, A mask_value, A lowest) {
  return mask_value <= lowest ? neg_inf<A>() : logit + mask_value * static_cast<A>(kLog2e);
}

// Causal visibility (attention_geometry.h's causal_shift: 0 top-left, m − n bottom-right): key j
// is visible to query i iff j <= i + shift. The tile loops use its range forms in
// attention_geometry.h: visible_key_end (keys a row can see) and first_row_seeing.
ATTN_HD inline bool causally_visible(int64_t i, int64_t j, int64_t shift) { return j <= i + shift; }

// --- The online softmax and the row end -------------------------------------------------------

// The shift subtracted before exp2 in a row whose running max is m. While the row has seen no
// visible key (m = −inf) it is 0, so masked logits give P = 0 while NaN logits (which the max
// skips) still give NaN and reach the output, as in the reference.
template <typename A>
ATTN_HD inline A softmax_shift(A m) {
  return m == neg_inf<A>() ? A(0) : m;
}

// Factor that rescales a row's sum and output accumulator when its max moves from m_old to m_new:
// 1 while nothing is visible yet (m_new = −inf: nothing changes), 0 when the first visible key
// arrives (the accumulators hold zeros, or NaN from NaN scores, which 0·NaN keeps).
template <typename A>
ATTN_HD inline A rescale_factor(A m_old, A m_new) {
  return m_new == neg_inf<A>() ? A(1) : (m_old == neg_inf<A>() ? A(0) : exp2_acc(m_old - m_new));
}

// The end of a row from its running max m (log2 units) and sum l: the factor that normalises O,
// and the natural-log lse. l > 0: a row with visible keys; l == 0: fully masked (output 0,
// lse −inf); l NaN: NaN scores (output and lse NaN).
template <typename A>
ATTN_HD inline A inverse_row_sum(A l) {
  return l > A(0) ? A(1) / l : (l == A(0) ? A(0) : static_cast<A>(NAN));
}
template <typename A>
ATTN_HD inline A row_lse(A m, A l) {
  return l > A(0) ? static_cast<A>((m + log2_acc(l)) * static_cast<A>(kLn2))
                  : (l == A(0) ? neg_inf<A>() : static_cast<A>(NAN));
}

// --- The lse merge ------------------------------------------------------------------------------

// Weight of one partial result (max m_part over its key range) in a row whose overall max over
// all ranges is m_all: its sum and output are multiplied by it and added. A range that saw no
// visible key (max −inf) holds zeros, or NaN from NaN scores, which must reach the row: it enters
// with weight 0, or 1 when no range saw a visible key.
template <typename A>
ATTN_HD inline A merge_weight(A m_part, A m_all) {
  return m_part == neg_inf<A>() ? (m_all == neg_inf<A>() ? A(1) : A(0)) : exp2_acc(m_part - m_all);
}

}  // namespace attention_ext
