// SIMT row shift: item = (batch index, query tile): the softmax shift P is rebuilt with (as the
// CPU's row_shift); run before the backward passes and the probabilities. Tiles and helpers: simt_common.cuh.
#pragma once
#include "simt_common.cuh"

namespace attention_ext {
namespace cuda {
namespace simt {

// Softmax shift of each row (AttentionParams::shift_hi / shift_lo) by the rules of
// attention_semantics.h, as the CPU's row_shift: lse·log2(e) in two words, except for rows that
// needs_exact_shift, where the row max and log2(sum) are recomputed from S in two passes over the
// visible keys. forward_scores_differ = false: for fp32/fp64 the forward's scores came from the
// same tile_logits, so only the lse's own rounding is at stake; fp16/bf16 forwards may have run on
// the tensor cores (mma summation order), but for 16-bit storage the flag changes nothing (the
// output's own rounding dwarfs the difference). item = (batch index, query tile); the
// recomputation runs only for tiles with such a row (a CTA-uniform decision, since tile_dot
// synchronises the CTA).
template <typename A>
constexpr size_t row_shift_smem() {
  return sizeof(A) * (kBM * kLdC + kBN * kLdC) + 16;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) row_shift_kernel(const __grid_constant__ AttentionParams p,
                                                             int64_t total) {
  using A = typename AccOf<T>::type;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Qs = reinterpret_cast<A*>(smem_raw);
  A* Ks = Qs + kBM * kLdC;
  int* any_large = reinterpret_cast<int*>(Ks + kBN * kLdC);
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const int64_t n_qt = ceil_div(p.n, kBM);
  const A ninf = neg_inf<A>();
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t qt = item % n_qt;
    const int64_t b = item / n_qt;
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const int64_t i0 = qt * kBM;
    const int64_t rows = imin(kBM, p.n - i0);
    const int64_t i = i0 + r;
    A* hi = static_cast<A*>(p.shift_hi.data) + batch_offset(p, p.shift_hi, idx);
    A* lo = static_cast<A*>(p.shift_lo.data) + batch_offset(p, p.shift_lo, idx);
    RowShift<A> from_lse = {ninf, A(0)};
    if (r < rows)
      from_lse = shift_from_lse(static_cast<const A*>(p.lse.data)[batch_offset(p, p.lse, idx) + i * p.lse.row_stride]);
    const bool large = !p.lse_is_merged && r < rows && needs_exact_shift(from_lse.hi, sizeof(T) < sizeof(float), false);
    if (r < rows && g == 0) {
      hi[i * p.shift_hi.row_stride] = from_lse.hi;
      lo[i * p.shift_lo.row_stride] = from_lse.lo;
    }
    __syncthreads();  // the previous item is done with any_large
    if (tid == 0) *any_large = 0;
    __syncthreads();
    if (large) *any_large = 1;
    __syncthreads();
    if (*any_large == 0) continue;

    const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
    const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx);
    const auto at = ctx.terms(p, idx);
    const int64_t key_end = visible_key_end(p, i0, rows);
    A row_max = ninf, row_sum = A(0);
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t j0 = visible_key_tile_begin(p, i0, kBN); j0 < key_end; j0 += kBN) {
        const int64_t cols = imin(kBN, p.m - j0);
        A s[8];
        tile_logits(s, p, ctx, Qs, Ks, q, i0, rows, k + j0 * p.k.row_stride, j0, cols, at, r, g);
        A part = pass == 0 ? ninf : A(0);
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          if (pass == 0) part = fmax(part, s[t]);
          else if (row_max != ninf) part += exp2_acc(s[t] - row_max);
        }
        if (pass == 0) row_max = fmax(row_max, row_max8(part));
        else row_sum += row_sum8(part);
      }
    }
    const RowStats<A> row = with_sink(row_max, row_sum, sink_log2<A>(p, idx));
    if (large && g == 0 && is_usable_row(row.m, row.l)) {
      const RowShift<A> exact = shift_from_row(row.m, row.l);
      hi[i * p.shift_hi.row_stride] = exact.hi;
      lo[i * p.shift_lo.row_stride] = exact.lo;
    }
  }
}

template <typename T>
cudaError_t launch_row_shift(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  const int64_t total = p.batch_numel * ceil_div(p.n, kBM);
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = row_shift_smem<A>();
  cudaError_t err = prepare_smem(row_shift_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(row_shift_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

}  // namespace simt
}  // namespace cuda
}  // namespace attention_ext
