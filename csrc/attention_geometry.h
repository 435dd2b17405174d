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

// Key j is visible to query i iff j <= i + causal_shift (when causal).
ATTN_HD inline int64_t causal_shift(const AttentionParams& p) {
  return p.causal == CausalKind::kBottomRight ? p.m - p.n : 0;
}
// Keys [0, end) can be visible to some row of the query rows [i0, i0 + rows).
ATTN_HD inline int64_t visible_key_end(const AttentionParams& p, int64_t i0, int64_t rows) {
  if (p.causal == CausalKind::kNone) return p.m;
  return imax(0, imin(p.m, i0 + rows + causal_shift(p)));
}
// First query row that can see key j0 (rows before it see none of keys >= j0).
ATTN_HD inline int64_t first_row_seeing(const AttentionParams& p, int64_t j0) {
  if (p.causal == CausalKind::kNone) return 0;
  return imax(0, j0 - causal_shift(p));
}

}  // namespace attention_ext
