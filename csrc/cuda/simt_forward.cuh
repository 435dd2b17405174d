// SIMT forward: item = (batch index, query tile, d_v chunk); online softmax in log2 units as on
// the CPU; the d_v-chunk-0 CTA writes lse. Tiles and helpers: simt_common.cuh.
#pragma once
#include "simt_common.cuh"

namespace attention_ext {
namespace cuda {
namespace simt {

template <typename A>
constexpr size_t forward_smem() {
  return sizeof(A) * (kBM * kLdC + kBN * kLdC + kBM * kLdS + kBN * kFwdOC);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) forward_kernel(const __grid_constant__ AttentionParams p,
                                                           int64_t total) {
  using A = typename AccOf<T>::type;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Qs = reinterpret_cast<A*>(smem_raw);
  A* Ks = Qs + kBM * kLdC;
  A* Ps = Ks + kBN * kLdC;
  A* Vs = Ps + kBM * kLdS;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const int64_t n_qt = ceil_div(p.n, kBM);
  const int64_t n_oc = imax(1, ceil_div(p.dv, kFwdOC));
  const A ninf = neg_inf<A>();

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t oc = item % n_oc;
    const int64_t qt = (item / n_oc) % n_qt;
    const int64_t b = item / (n_oc * n_qt);
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const int64_t i0 = qt * kBM;
    const int64_t rows = imin(kBM, p.n - i0);
    const int64_t i = i0 + r;  // this thread's query row
    const int64_t c0 = oc * kFwdOC;
    const int64_t ocols = imax(0, imin(kFwdOC, p.dv - c0));
    const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
    const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx);
    const T* v = static_cast<const T*>(p.v.data) + batch_offset(p, p.v, idx) + c0 * p.v.col_stride;
    const auto at = ctx.terms(p, idx);

    A m_run = ninf, l_run = A(0);
    A o[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) o[t] = A(0);

    const int64_t key_end = visible_key_end(p, i0, rows);
    for (int64_t j0 = visible_key_tile_begin(p, i0, kBN); j0 < key_end; j0 += kBN) {
      const int64_t cols = imin(kBN, p.m - j0);
      A s[8];
      tile_logits(s, p, ctx, Qs, Ks, q, i0, rows, k + j0 * p.k.row_stride, j0, cols, at, r, g);
      A tile_max = ninf;
#pragma unroll
      for (int t = 0; t < 8; ++t) tile_max = fmax(tile_max, s[t]);
      tile_max = row_max8(tile_max);
      const A m_new = fmax(m_run, tile_max);
      const A shift = softmax_shift(m_new);
      A psum = A(0);
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        s[t] = exp2_acc(s[t] - shift);
        psum += s[t];
      }
      psum = row_sum8(psum);
      if (m_new != ninf) {
        const A alpha = rescale_factor(m_run, m_new);
        if (m_new != m_run) {
          l_run *= alpha;
#pragma unroll
          for (int t = 0; t < 8; ++t) o[t] *= alpha;
        }
        m_run = m_new;
      }
      l_run += psum;
      if (ctx.dropout) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const PhiloxWords w = ctx.words(b, i, j0 + 32 * h + 4 * g);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[h * 4 + e] = w.w[e] >= p.dropout_threshold ? s[h * 4 + e] * ctx.inv_keep : A(0);
        }
      }
      if (ocols > 0) {
        __syncthreads();  // Ps / Vs free (previous tile's P·V done)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) Ps[r * kLdS + 32 * h + 4 * g + e] = s[h * 4 + e];
        load_tile<kBN, kFwdOC>(Vs, kFwdOC, v + j0 * p.v.row_stride, p.v.row_stride, p.v.col_stride,
                               cols, ocols);
        __syncthreads();
        const A* prow = Ps + r * kLdS;
#pragma unroll 4
        for (int jj = 0; jj < kBN; ++jj) {
          const A pj = prow[jj];
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[h * 4 + e] += pj * Vs[jj * kFwdOC + 32 * h + 4 * g + e];
        }
      }
    }

    if (r < rows) {
      const RowEnd<A> end = row_end(m_run, l_run, sink_log2<A>(p, idx));
      T* out = static_cast<T*>(p.out.data) + batch_offset(p, p.out, idx) + i * p.out.row_stride;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 32 * h + 4 * g + e;
          if (c < ocols) store_acc(static_cast<A>(o[h * 4 + e] * end.out_factor), out + (c0 + c) * p.out.col_stride);
        }
      if (oc == 0 && g == 0) {
        A* lse = static_cast<A*>(p.lse.data) + batch_offset(p, p.lse, idx);
        lse[i * p.lse.row_stride] = end.lse;
      }
    }
  }
}

template <typename T>
cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  const int64_t total = p.batch_numel * ceil_div(p.n, kBM) * imax(1, ceil_div(p.dv, kFwdOC));
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = forward_smem<A>();
  cudaError_t err = prepare_smem(forward_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(forward_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

}  // namespace simt
}  // namespace cuda
}  // namespace attention_ext
