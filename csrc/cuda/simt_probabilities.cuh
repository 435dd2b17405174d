// SIMT attention probabilities from a saved lse: item = (batch index, query tile, key tile),
// P = 2^((s − shift_hi) − shift_lo) after the row shift. Tiles and helpers: simt_common.cuh.
#pragma once
#include "simt_row_shift.cuh"

namespace attention_ext {
namespace cuda {
namespace simt {

template <typename A>
constexpr size_t probs_smem() {
  return sizeof(A) * (kBM * kLdC + kBN * kLdC);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) probs_kernel(const __grid_constant__ AttentionParams p,
                                                         int64_t total) {
  using A = typename AccOf<T>::type;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Qs = reinterpret_cast<A*>(smem_raw);
  A* Ks = Qs + kBM * kLdC;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const int64_t n_qt = ceil_div(p.n, kBM), n_kt = ceil_div(p.m, kBN);
  const A ninf = neg_inf<A>();
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t kt = item % n_kt;
    const int64_t qt = (item / n_kt) % n_qt;
    const int64_t b = item / (n_kt * n_qt);
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const int64_t i0 = qt * kBM, j0 = kt * kBN;
    const int64_t rows = imin(kBM, p.n - i0), cols = imin(kBN, p.m - j0);
    const int64_t i = i0 + r;
    A s[8];
    if (j0 >= visible_key_tile_begin(p, i0, kBN) && j0 < visible_key_end(p, i0, rows)) {  // uniform over the CTA
      const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
      const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx) + j0 * p.k.row_stride;
      const auto at = ctx.terms(p, idx);
      tile_logits(s, p, ctx, Qs, Ks, q, i0, rows, k, j0, cols, at, r, g);
      const A* shift_hi = static_cast<const A*>(p.shift_hi.data) + batch_offset(p, p.shift_hi, idx);
      const A* shift_lo = static_cast<const A*>(p.shift_lo.data) + batch_offset(p, p.shift_lo, idx);
      const A hi = r < rows ? shift_hi[i * p.shift_hi.row_stride] : ninf;
      const A lo = r < rows ? shift_lo[i * p.shift_lo.row_stride] : A(0);
#pragma unroll
      for (int t = 0; t < 8; ++t) s[t] = hi == ninf ? A(0) : exp2_acc((s[t] - hi) - lo);
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t) s[t] = A(0);
    }
    if (r < rows) {
      T* out = static_cast<T*>(p.probs.data) + batch_offset(p, p.probs, idx) + i * p.probs.row_stride;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 32 * h + 4 * g + e;
          if (c < cols) store_acc(s[h * 4 + e], out + (j0 + c) * p.probs.col_stride);
        }
    }
  }
}

template <typename T>
cudaError_t launch_probs(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  const int64_t total = p.batch_numel * ceil_div(p.n, kBM) * ceil_div(p.m, kBN);
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = probs_smem<A>();
  cudaError_t err = launch_row_shift<T>(p, stream);
  if (err != cudaSuccess) return err;
  if ((err = prepare_smem(probs_kernel<T>, smem)) != cudaSuccess) return err;
  ATTN_LAUNCH(probs_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

}  // namespace simt
}  // namespace cuda
}  // namespace attention_ext
