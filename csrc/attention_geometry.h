// Batch and causal geometry of an attention call, shared by the CPU kernels, the bindings and
// the CUDA kernels (host and device), so every implementation partitions work and masks keys by
// the very same rules.
#pragma once
#include <math.h>
#include <stdint.h>

#include "attention_params.h"

#if defined(__CUDACC__)
#define ATTN_HD __host__ __device__
#else
#define ATTN_HD
#endif

namespace attention_ext {

constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

ATTN_HD inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
ATTN_HD inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
ATTN_HD inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// A tensor "owns" a batch dim when its gradient is laid out along it (stride != 0) or the dim
// has size 1; it is broadcast along the others. Work items enumerate a tensor's owned positions
// and loop over the broadcast positions inside, in a fixed order: that is how gradients of
// broadcast inputs (GQA's K/V, a shared mask) are summed without atomics.
struct BatchSplit {
  int num_owned_dims = 0, num_bcast_dims = 0;
  int owned_dim[kMaxBatchDims] = {}, bcast_dim[kMaxBatchDims] = {};
  int64_t num_owned = 1, num_bcast = 1;

  ATTN_HD BatchSplit(const AttentionParams& p, const TensorRef& grad) {
    for (int d = 0; d < p.batch_ndim; ++d) {
      if (p.batch_size[d] > 1 && grad.batch_stride[d] == 0) {
        bcast_dim[num_bcast_dims++] = d;
        num_bcast *= p.batch_size[d];
      } else {
        owned_dim[num_owned_dims++] = d;
        num_owned *= p.batch_size[d];
      }
    }
  }
  // Full batch multi-index of (owned position, broadcast position), both row-major.
  ATTN_HD void index(const AttentionParams& p, int64_t owned, int64_t bcast, int64_t* idx) const {
    for (int i = num_owned_dims - 1; i >= 0; --i) {
      const int d = owned_dim[i];
      idx[d] = owned % p.batch_size[d];
      owned /= p.batch_size[d];
    }
    for (int i = num_bcast_dims - 1; i >= 0; --i) {
      const int d = bcast_dim[i];
      idx[d] = bcast % p.batch_size[d];
      bcast /= p.batch_size[d];
    }
  }
};

// Number of work-item owners of a gradient tensor (positions of the batch dims it owns).
ATTN_HD inline int64_t owners_of(const AttentionParams& p, const TensorRef& grad) {
  return BatchSplit(p, grad).num_owned;
}

ATTN_HD inline void unravel_batch(const AttentionParams& p, int64_t linear, int64_t* idx) {
  for (int d = p.batch_ndim - 1; d >= 0; --d) {
    idx[d] = linear % p.batch_size[d];
    linear /= p.batch_size[d];
  }
}
// Row-major linear index over the broadcast batch dims (what keys the dropout stream).
ATTN_HD inline int64_t ravel_batch(const AttentionParams& p, const int64_t* idx) {
  int64_t linear = 0;
  for (int d = 0; d < p.batch_ndim; ++d) linear = linear * p.batch_size[d] + idx[d];
  return linear;
}
ATTN_HD inline int64_t batch_offset(const AttentionParams& p, const TensorRef& t, const int64_t* idx) {
  int64_t off = 0;
  for (int d = 0; d < p.batch_ndim; ++d) off += idx[d] * t.batch_stride[d];
  return off;
}

// The visibility band: key j is visible to query i iff lo(i) <= j <= hi(i) with
//   lo(i) = i + shift − window_left   (no bound when window_left < 0),
//   hi(i) = i + shift + right          (right = 0 when causal, window_right otherwise; −1: none),
// shift = 0 for top-left causal and m − n otherwise (bottom-right, FlashAttention's alignment).
// Both bounds grow with i, so a tile of rows [i0, i0 + rows) sees keys [lo(i0), hi(i0 + rows − 1)]
// at most and every loop below skips the tiles outside the band: cost follows the visible work.
ATTN_HD inline int64_t band_shift(const AttentionParams& p) {
  return p.causal == CausalKind::kTopLeft ? 0 : p.m - p.n;
}
ATTN_HD inline int64_t band_right(const AttentionParams& p) {
  return p.causal != CausalKind::kNone ? 0 : p.window_right;
}
ATTN_HD inline bool has_band(const AttentionParams& p) {
  return p.window_left >= 0 || band_right(p) >= 0;
}
ATTN_HD inline bool key_visible(const AttentionParams& p, int64_t i, int64_t j) {
  const int64_t right = band_right(p), diag = i + band_shift(p);
  return (right < 0 || j <= diag + right) && (p.window_left < 0 || j >= diag - p.window_left);
}
// Keys [visible_key_begin(i0), visible_key_end(i0, rows)) hold every key some row of the query
// rows [i0, i0 + rows) can see (empty when begin >= end).
ATTN_HD inline int64_t visible_key_begin(const AttentionParams& p, int64_t i0) {
  if (p.window_left < 0) return 0;
  return imax(0, imin(p.m, i0 + band_shift(p) - p.window_left));
}
ATTN_HD inline int64_t visible_key_end(const AttentionParams& p, int64_t i0, int64_t rows) {
  const int64_t right = band_right(p);
  if (right < 0) return p.m;
  return imax(0, imin(p.m, i0 + rows + band_shift(p) + right));
}
// The first key tile (of `tile` keys, tiles at multiples of it) rows from i0 on can see: tile
// loops start there, so every kernel visits the same tiles as without a window.
ATTN_HD inline int64_t visible_key_tile_begin(const AttentionParams& p, int64_t i0, int64_t tile) {
  return visible_key_begin(p, i0) / tile * tile;
}
// Query rows [first_row_seeing(j0), rows_seeing_end(j_end)) hold every row that can see some key
// of [j0, j_end).
ATTN_HD inline int64_t first_row_seeing(const AttentionParams& p, int64_t j0) {
  const int64_t right = band_right(p);
  if (right < 0) return 0;
  return imax(0, imin(p.n, j0 - band_shift(p) - right));
}
ATTN_HD inline int64_t rows_seeing_end(const AttentionParams& p, int64_t j_end) {
  if (p.window_left < 0) return p.n;
  return imax(0, imin(p.n, j_end - band_shift(p) + p.window_left));
}
// Whether every (row, key) pair of rows [i0, i0 + rows) x keys [j0, j0 + cols) is in the band.
ATTN_HD inline bool tile_inside_band(const AttentionParams& p, int64_t i0, int64_t rows, int64_t j0,
                                     int64_t cols) {
  return key_visible(p, i0, j0 + cols - 1) && key_visible(p, i0 + rows - 1, j0);
}

}  // namespace attention_ext
