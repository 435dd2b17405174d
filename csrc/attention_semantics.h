// The semantics of attention, one rule each, for every kernel on both devices: the CPU kernels
// (every ISA variant and stage) and the CUDA kernels (SIMT, tensor-core, split-KV combine), host
// and device. attention_ext/reference.py is the float64 mirror the tests compare against; a new
// score modifier is one function here plus its line there.
//
// The logit pipeline, in this order, in log2 units (so the softmax is exp2 of a difference):
//   s = q·k  ->  s·scale·log2(e)  ->  softcap  ->  ALiBi  ->  additive mask  ->  visibility (bool mask, the causal /
//   sliding-window band of attention_geometry.h).
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

// tanh in float, one formula on the host and the GPU: sign(u)·(1 − e)/(1 + e) with
// e = 2^(−2|u|·log2 e), and below |u| = 0.25, where 1 − e would cancel, the odd Taylor series to u⁹
// (cpu/vector_math.inc's tanh_vec is the same a vector at a time): a few ulps. Not tanhf: nvcc's
// --use_fast_math (which the CUDA build uses for exp2 and the divisions) compiles tanhf to
// tanh.approx.f32, a hardware approximation far coarser than float. NaN stays NaN; ±inf gives ±1.
ATTN_HD inline float tanh_acc(float u) {
  const float a = fabsf(u);
  float t;
  if (a < 0.25f) {
    const float u2 = a * a;
    t = (((((62.0f / 2835.0f) * u2 - 17.0f / 315.0f) * u2 + 2.0f / 15.0f) * u2 - 1.0f / 3.0f) * u2 + 1.0f) * a;
  } else {
    const float e = exp2f(a * -2.8853900817779268f);
    t = (1.0f - e) / (1.0f + e);
  }
  return u != u ? u : copysignf(t, u);
}
ATTN_HD inline double tanh_acc(double x) { return tanh(x); }

// Logit softcapping (softcap·tanh(t / softcap) on the natural-unit logit t) in log2 units: with
// x = t·log2(e) and cap = softcap·log2(e) it is cap·tanh(x / cap). cap == 0: none.
template <typename A>
ATTN_HD inline A softcapped_logit(A x, A cap) {
  return cap * tanh_acc(x / cap);
}
// d(capped)/d(x) = 1 − tanh², from the capped logit itself: the backward multiplies dS by it
// before dQ = dS·K·scale and dK = dSᵀ·Q·scale (a float mask, added after the cap, takes dS as is).
template <typename A>
ATTN_HD inline A softcap_derivative(A capped, A cap) {
  const A t = capped / cap;
  return A(1) - t * t;
}

// ALiBi in log2 units: −slope·log2(e)·|i + m − n − j| (the key aligned with query i is
// i + m − n, as in the window band), slope_log2 = slope·log2(e) of the batch position.
template <typename A>
ATTN_HD inline A alibi_bias(A slope_log2, int64_t i, int64_t j, int64_t diagonal_shift) {
  const int64_t distance = i + diagonal_shift - j;
  return -slope_log2 * static_cast<A>(distance < 0 ? -distance : distance);
}

// An additive-mask entry (as A) applied to a log2-domain logit; lowest = lowest_finite(dtype) as A.
template <typename A>
ATTN_HD inline A with_additive_mask(A logit, A mask_value, A lowest) {
  return mask_value <= lowest ? neg_inf<A>() : logit + mask_value * static_cast<A>(kLog2e);
}

// Visibility by position (causal kinds, sliding windows) is attention_geometry.h's band:
// key_visible for one entry and its range forms (visible_key_begin/end, first_row_seeing,
// rows_seeing_end) for the tile loops.

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
// A row's running max m and sum l (log2 units) with its sink s (log2 units; −inf: none) folded in
// as one more key: M = max(m, s), l' = l·2^(m−M) + 2^(s−M). A NaN row stays NaN; a sink of +inf
// takes the whole row (M = +inf, l' = 1: output 0, lse +inf, the limit of a growing sink).
template <typename A>
struct RowStats {
  A m, l;
};
template <typename A>
ATTN_HD inline RowStats<A> with_sink(A m, A l, A s) {
  if (s == neg_inf<A>() || !(l == l)) return {m, l};
  if (s == -neg_inf<A>()) return {s, A(1)};
  const A top = m > s ? m : s;
  return {top, l * rescale_factor(m, top) + exp2_acc(s - top)};
}
// The ALiBi slope of the batch position idx in log2 units (slope·log2 e), 0 without ALiBi.
template <typename A>
ATTN_HD inline A alibi_slope_log2(const AttentionParams& p, const int64_t* idx) {
  if (p.alibi_slopes.data == nullptr) return A(0);
  const float slope = static_cast<const float*>(p.alibi_slopes.data)[batch_offset(p, p.alibi_slopes, idx)];
  return static_cast<A>(static_cast<double>(slope) * kLog2e);
}
// The sink of the batch position idx in log2 units, −inf without sinks.
template <typename A>
ATTN_HD inline A sink_log2(const AttentionParams& p, const int64_t* idx) {
  if (p.sinks.data == nullptr) return neg_inf<A>();
  return static_cast<const A*>(p.sinks.data)[batch_offset(p, p.sinks, idx)] * static_cast<A>(kLog2e);
}

// The natural-log lse of a row, rounded once: the sum m + log2(l) is formed in double even for a
// float row (in float it would round twice, and |m| of a few hundred puts 1e-5 into the lse).
ATTN_HD inline float row_lse(float m, float l) {
  if (!(l > 0.0f)) return l == 0.0f ? neg_inf<float>() : static_cast<float>(NAN);
  return static_cast<float>((static_cast<double>(m) + log2(static_cast<double>(l))) * kLn2);
}
ATTN_HD inline double row_lse(double m, double l) {
  if (!(l > 0.0)) return l == 0.0 ? neg_inf<double>() : static_cast<double>(NAN);
  return (m + log2(l)) * kLn2;
}

// The end of a row, every forward's: from its running max m and sum l and its sink s (log2
// units, −inf: none), the factor that turns the output accumulator into the output and the lse.
// The sink's key has value 0: it adds to the denominator only.
template <typename A>
struct RowEnd {
  A out_factor, lse;
};
template <typename A>
ATTN_HD inline RowEnd<A> row_end(A m, A l, A s) {
  const RowStats<A> r = with_sink(m, l, s);
  return {rescale_factor(m, r.m) * inverse_row_sum(r.l), row_lse(r.m, r.l)};
}

// --- The softmax shift of the backward and the probabilities ------------------------------------
//
// The backward and the probabilities rebuild P = 2^((s − hi) − lo) with s the log2-domain logit
// and hi + lo = L = m + log2(l), the row's normaliser, carried in two accumulator-type words
// (AttentionParams::shift_hi / shift_lo):
//  * from the saved lse (shift_from_lse): hi + lo = lse·log2(e) with no rounding on top of the
//    lse's own. That rounding, up to |lse|·2^-25 in float, lands in the exponent of every P of
//    the row alike; so does whatever separates the forward's scores from the backward's;
//  * recomputed from the row (shift_from_row) where that shows (needs_exact_shift): an online
//    softmax over the visible keys with the backward's own logits gives m and l. P then sums to
//    1 to rounding and the largest P of a row led by a few large logits is exact to an ulp or
//    two, as in a softmax computed from the row itself. Through the lse, rows with |lse| of a few
//    hundred (torch's OpInfo samples: values up to ±9) had dV 30 times and dQ/dK a few times
//    less accurate than torch's.

template <typename A>
struct RowShift {
  A hi, lo;
};

// log2(e) − kLog2e: the part of log2(e) beyond the double nearest to it.
constexpr double kLog2eTail = 2.0355273740931033e-17;

// hi + lo = lse·log2(e). A non-finite lse (fully masked rows: −inf; NaN rows) gives (lse·log2(e), 0).
ATTN_HD inline RowShift<float> shift_from_lse(float lse) {
  const double x = static_cast<double>(lse) * kLog2e;  // exact to 2^-53: far below float's ulp
  const float hi = static_cast<float>(x);
  if (!isfinite(x)) return {hi, 0.0f};
  return {hi, static_cast<float>(x - static_cast<double>(hi))};
}
ATTN_HD inline RowShift<double> shift_from_lse(double lse) {
  const double hi = lse * kLog2e;
  if (!isfinite(hi)) return {hi, 0.0};
  // The product's rounding error, exactly (fma), and the part of log2(e) that kLog2e misses.
  return {hi, fma(lse, kLog2e, -hi) + lse * kLog2eTail};
}

// hi + lo = m + log2(l) for a row's max m (log2 units) and sum l, both finite and l > 0: kept
// apart, not summed (m may be ~1e30 beside a log2(l) of a few units), so that s − m is exact for
// the keys near the max and lo ~ 0 on a row led by one key.
ATTN_HD inline RowShift<float> shift_from_row(float m, float l) {
  return {m, static_cast<float>(log2(static_cast<double>(l)))};
}
ATTN_HD inline RowShift<double> shift_from_row(double m, double l) { return {m, log2(l)}; }

// Whether a row max and sum can give shift_from_row: a finite max and a positive finite sum
// (not so for fully masked rows, NaN or infinite scores: their shift from the lse stays).
template <typename A>
ATTN_HD inline bool is_usable_row(A m, A l) {
  return m > neg_inf<A>() && m < -neg_inf<A>() && l > A(0) && l < -neg_inf<A>();
}

// Whether a row's shift must be recomputed from the row, given hi = shift_from_lse(lse).hi.
// Fully masked (−inf) and NaN rows never are.
//  * float / double storage: from |hi| = 16 on, and always when forward_scores_differ (the
//    forward summed q·k in another order than the backward, as the CPU decode forward does:
//    its lse is then off by the scores' own rounding, about eps·Σ|q_c·k_c|·scale). Below 16 the
//    lse's rounding puts at most 8·2^-24 (float) into the exponent of P, a few ulps; above it
//    the error grows with |lse| and dominates dV, dK and dQ on rows led by a few large logits.
//    16 keeps ordinary rows out of the pass: |hi| ~ log2(keys) + 0.7 for unit-variance logits,
//    past 16 only beyond ~40k keys. The pass costs one score GEMM per tile pair.
//  * 16-bit storage (fp16 / bf16; float accumulation): from |hi| = 256 on, where the lse has lost
//    log2(l) to within 3e-5 (e.g. −1e9 biases); below it the stored output's own rounding (2^-11
//    or 2^-8) dwarfs the lse's, and the pass would cost a score GEMM for nothing.
ATTN_HD inline bool needs_exact_shift(double hi, bool narrow_storage, bool forward_scores_differ) {
  if (!(hi == hi) || hi == neg_inf<double>()) return false;
  const double threshold = narrow_storage ? 256.0 : 16.0;
  return (!narrow_storage && forward_scores_differ) || hi > threshold || hi < -threshold;
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
