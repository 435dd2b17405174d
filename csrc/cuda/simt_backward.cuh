// SIMT backward (deterministic, no atomics, same ownership as the CPU), after the row shift:
//   delta:  one thread per query row: rowsum(dO ∘ O) − dlse, in the column order of dP.
//   kv:     item = (K owner, key tile, column chunk); loops over the broadcast batch positions of
//           K/V and the query tiles; dV += (P∘Z)ᵀ dO, dK += dSᵀ Q (· scale at the end).
//   q:      item = (Q owner, query tile, column chunk); loops over broadcast positions and key
//           tiles; dQ += dS K (· scale).
//   mask:   item = (mask owner, mask row tile, mask key tile (or all when the mask broadcasts over
//           keys)); sums dS over broadcast positions, then over broadcast rows/cols in a fixed
//           order through shared memory.
// Tiles and helpers: simt_common.cuh.
#pragma once
#include "simt_row_shift.cuh"

namespace attention_ext {
namespace cuda {
namespace simt {

// ---------------------------------------------------------------------------------------------
// Backward: delta = rowsum(dO ∘ O) − dlse, one thread per query row, summed in column order:
// the order in which tile_dot sums dP = dO Vᵀ, so that where P is one-hot (huge scores) the
// output row is that V row and dP − delta is exactly 0, as it is on the CPU, instead of a rounding
// difference that a huge scale turns into an overflowing dQ.

template <typename T>
__global__ void __launch_bounds__(kThreads) delta_kernel(const __grid_constant__ AttentionParams p,
                                                         int64_t total_rows) {
  using A = typename AccOf<T>::type;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; row < total_rows;
       row += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t b = row / p.n, i = row % p.n;
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const T* out = static_cast<const T*>(p.out.data) + batch_offset(p, p.out, idx) + i * p.out.row_stride;
    const T* dout = static_cast<const T*>(p.grad_out.data) + batch_offset(p, p.grad_out, idx) +
                    i * p.grad_out.row_stride;
    A sum = A(0);
    for (int64_t c = 0; c < p.dv; ++c)
      sum += to_acc(dout[c * p.grad_out.col_stride]) * to_acc(out[c * p.out.col_stride]);
    if (p.grad_lse.data != nullptr)
      sum -= static_cast<const A*>(p.grad_lse.data)[batch_offset(p, p.grad_lse, idx) + i * p.grad_lse.row_stride];
    static_cast<A*>(p.delta.data)[batch_offset(p, p.delta, idx) + i * p.delta.row_stride] = sum;
  }
}

// For the query tile at i0 (rows valid) and key tile at j0 (cols valid) of batch position idx
// (linear b): P∘Z and dS = P ∘ (dP∘Z − delta) in the score layout, the gradient of the logits
// (what a float mask gets); with `of_scores` and a softcap, times the softcap's derivative: the
// gradient of the raw scores, for dQ and dK. Rows/keys outside the tile give 0. Xs/Ys: the two
// staging tiles of tile_dot.
template <typename T>
__device__ __forceinline__ void score_gradient(const AttentionParams& p, const DevCtx<T>& ctx,
                                               const int64_t* idx, int64_t b, int64_t i0, int64_t rows,
                                               int64_t j0, int64_t cols,
                                               typename AccOf<T>::type* Xs, typename AccOf<T>::type* Ys,
                                               int r, int g, typename AccOf<T>::type (&pz)[8],
                                               typename AccOf<T>::type (&ds)[8], bool of_scores = true) {
  using A = typename AccOf<T>::type;
  const A ninf = neg_inf<A>();
  const int64_t i = i0 + r;
  const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
  const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx) + j0 * p.k.row_stride;
  const T* v = static_cast<const T*>(p.v.data) + batch_offset(p, p.v, idx) + j0 * p.v.row_stride;
  const T* dout = static_cast<const T*>(p.grad_out.data) + batch_offset(p, p.grad_out, idx) +
                  i0 * p.grad_out.row_stride;
  const auto at = ctx.terms(p, idx);
  A hi = ninf, lo = A(0), delta = A(0);
  if (r < rows) {
    hi = static_cast<const A*>(p.shift_hi.data)[batch_offset(p, p.shift_hi, idx) + i * p.shift_hi.row_stride];
    lo = static_cast<const A*>(p.shift_lo.data)[batch_offset(p, p.shift_lo, idx) + i * p.shift_lo.row_stride];
    delta = static_cast<const A*>(p.delta.data)[batch_offset(p, p.delta, idx) + i * p.delta.row_stride];
  }
  const bool chain_softcap = of_scores && ctx.softcap_log2 != A(0);  // uniform over the CTA
  A dcap[8];
  tile_logits(pz, p, ctx, Xs, Ys, q, i0, rows, k, j0, cols, at, r, g, chain_softcap ? &dcap : nullptr);
  tile_dot(ds, Xs, Ys, dout, p.grad_out.row_stride, p.grad_out.col_stride, rows, v, p.v.row_stride,
           p.v.col_stride, cols, p.dv, r, g);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    PhiloxWords w{{0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}};
    if (ctx.dropout) w = ctx.words(b, i, j0 + 32 * h + 4 * g);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 32 * h + 4 * g + e;
      const bool valid = r < rows && c < cols;
      const A pw = (hi == ninf || !valid) ? A(0) : exp2_acc((pz[h * 4 + e] - hi) - lo);
      const bool keep = !ctx.dropout || w.w[e] >= p.dropout_threshold;
      const A dp = keep ? (ctx.dropout ? ds[h * 4 + e] * ctx.inv_keep : ds[h * 4 + e]) : A(0);
      ds[h * 4 + e] = valid ? pw * (dp - delta) * (chain_softcap ? dcap[h * 4 + e] : A(1)) : A(0);
      pz[h * 4 + e] = keep ? (ctx.dropout ? pw * ctx.inv_keep : pw) : A(0);
    }
  }
}

template <typename A>
constexpr size_t bwd_kv_smem() {
  constexpr int OC = BwdCfg<A>::kOC;
  return sizeof(A) * (kBM * kLdC + kBN * kLdC + 2 * kBM * kLdS + 2 * kBM * OC);
}

// dK, dV for (K owner, key tile, column chunk); columns [c0, c0 + OC) of both dK and dV.
// Accumulator layout: key row kr = t / 4, columns (t % 4) + 4·jj.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_kv_kernel(const __grid_constant__ AttentionParams p,
                                                          int64_t total) {
  using A = typename AccOf<T>::type;
  constexpr int OC = BwdCfg<A>::kOC;
  constexpr int NACC = OC / 4;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Xs = reinterpret_cast<A*>(smem_raw);
  A* Ys = Xs + kBM * kLdC;
  A* Ps = Ys + kBN * kLdC;
  A* dSs = Ps + kBM * kLdS;
  A* dOo = dSs + kBM * kLdS;
  A* Qo = dOo + kBM * OC;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const int kr = tid >> 2, kc = tid & 3;
  const DevCtx<T> ctx(p);
  const BatchSplit split(p, p.grad_k);
  const int64_t n_kt = ceil_div(p.m, kBN);
  const int64_t n_oc = imax(1, ceil_div(imax(p.dk, p.dv), OC));

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t oc = item % n_oc;
    const int64_t kt = (item / n_oc) % n_kt;
    const int64_t owner = item / (n_oc * n_kt);
    const int64_t j0 = kt * kBN, cols = imin(kBN, p.m - j0);
    const int64_t c0 = oc * OC;
    const int64_t dk_cols = imax(0, imin(OC, p.dk - c0)), dv_cols = imax(0, imin(OC, p.dv - c0));
    A acc_k[NACC], acc_v[NACC];
#pragma unroll
    for (int t = 0; t < NACC; ++t) acc_k[t] = acc_v[t] = A(0);
    int64_t idx[kMaxBatchDims];
    const int64_t row_begin = first_row_seeing(p, j0) / kBM * kBM, row_end = rows_seeing_end(p, j0 + cols);
    for (int64_t bc = 0; bc < split.num_bcast; ++bc) {
      split.index(p, owner, bc, idx);
      const int64_t b = ravel_batch(p, idx);
      const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + c0 * p.q.col_stride;
      const T* dout = static_cast<const T*>(p.grad_out.data) + batch_offset(p, p.grad_out, idx) +
                      c0 * p.grad_out.col_stride;
      for (int64_t i0 = row_begin; i0 < row_end; i0 += kBM) {
        const int64_t rows = imin(kBM, p.n - i0);
        A pz[8], ds[8];
        score_gradient<T>(p, ctx, idx, b, i0, rows, j0, cols, Xs, Ys, r, g, pz, ds);
        // (score_gradient ends with a tile_dot whose last barrier precedes its compute; the
        // barrier below orders that compute before Ps / dSs / dOo / Qo are overwritten.)
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            Ps[r * kLdS + 32 * h + 4 * g + e] = pz[h * 4 + e];
            dSs[r * kLdS + 32 * h + 4 * g + e] = ds[h * 4 + e];
          }
        load_tile<kBM, OC>(dOo, OC, dout + i0 * p.grad_out.row_stride, p.grad_out.row_stride,
                           p.grad_out.col_stride, rows, dv_cols);
        load_tile<kBM, OC>(Qo, OC, q + i0 * p.q.row_stride, p.q.row_stride, p.q.col_stride, rows, dk_cols);
        __syncthreads();
#pragma unroll 2
        for (int ii = 0; ii < kBM; ++ii) {
          const A pv = Ps[ii * kLdS + kr];
          const A dsv = dSs[ii * kLdS + kr];
#pragma unroll
          for (int t = 0; t < NACC; ++t) {
            acc_v[t] += pv * dOo[ii * OC + kc + 4 * t];
            acc_k[t] += dsv * Qo[ii * OC + kc + 4 * t];
          }
        }
      }
    }
    if (kr < cols) {
      split.index(p, owner, 0, idx);
      T* gk = static_cast<T*>(p.grad_k.data) + batch_offset(p, p.grad_k, idx) + (j0 + kr) * p.grad_k.row_stride;
      T* gv = static_cast<T*>(p.grad_v.data) + batch_offset(p, p.grad_v, idx) + (j0 + kr) * p.grad_v.row_stride;
      const A scale = static_cast<A>(p.scale);
#pragma unroll
      for (int t = 0; t < NACC; ++t) {
        const int c = kc + 4 * t;
        if (c < dk_cols) store_acc(static_cast<A>(acc_k[t] * scale), gk + (c0 + c) * p.grad_k.col_stride);
        if (c < dv_cols) store_acc(acc_v[t], gv + (c0 + c) * p.grad_v.col_stride);
      }
    }
  }
}

template <typename A>
constexpr size_t bwd_q_smem() {
  constexpr int OC = BwdCfg<A>::kOC;
  return sizeof(A) * (kBM * kLdC + kBN * kLdC + kBM * kLdS + kBN * OC);
}

// dQ for (Q owner, query tile, column chunk). Accumulator layout: row r = t / 8, columns
// g + 8·jj.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_q_kernel(const __grid_constant__ AttentionParams p,
                                                         int64_t total) {
  using A = typename AccOf<T>::type;
  constexpr int OC = BwdCfg<A>::kOC;
  constexpr int NACC = OC / 8;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Xs = reinterpret_cast<A*>(smem_raw);
  A* Ys = Xs + kBM * kLdC;
  A* dSs = Ys + kBN * kLdC;
  A* Ko = dSs + kBM * kLdS;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const BatchSplit split(p, p.grad_q);
  const int64_t n_qt = ceil_div(p.n, kBM);
  const int64_t n_oc = imax(1, ceil_div(p.dk, OC));

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t oc = item % n_oc;
    const int64_t qt = (item / n_oc) % n_qt;
    const int64_t owner = item / (n_oc * n_qt);
    const int64_t i0 = qt * kBM, rows = imin(kBM, p.n - i0);
    const int64_t c0 = oc * OC, dk_cols = imax(0, imin(OC, p.dk - c0));
    A acc[NACC];
#pragma unroll
    for (int t = 0; t < NACC; ++t) acc[t] = A(0);
    int64_t idx[kMaxBatchDims];
    const int64_t key_end = visible_key_end(p, i0, rows);
    for (int64_t bc = 0; bc < split.num_bcast; ++bc) {
      split.index(p, owner, bc, idx);
      const int64_t b = ravel_batch(p, idx);
      const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx) + c0 * p.k.col_stride;
      for (int64_t j0 = visible_key_tile_begin(p, i0, kBN); j0 < key_end; j0 += kBN) {
        const int64_t cols = imin(kBN, p.m - j0);
        A pz[8], ds[8];
        score_gradient<T>(p, ctx, idx, b, i0, rows, j0, cols, Xs, Ys, r, g, pz, ds);
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) dSs[r * kLdS + 32 * h + 4 * g + e] = ds[h * 4 + e];
        load_tile<kBN, OC>(Ko, OC, k + j0 * p.k.row_stride, p.k.row_stride, p.k.col_stride, cols, dk_cols);
        __syncthreads();
        const A* dsrow = dSs + r * kLdS;
#pragma unroll 4
        for (int jj = 0; jj < kBN; ++jj) {
          const A dsv = dsrow[jj];
#pragma unroll
          for (int t = 0; t < NACC; ++t) acc[t] += dsv * Ko[jj * OC + g + 8 * t];
        }
      }
    }
    if (r < rows) {
      split.index(p, owner, 0, idx);
      T* gq = static_cast<T*>(p.grad_q.data) + batch_offset(p, p.grad_q, idx) + (i0 + r) * p.grad_q.row_stride;
      const A scale = static_cast<A>(p.scale);
#pragma unroll
      for (int t = 0; t < NACC; ++t) {
        const int c = g + 8 * t;
        if (c < dk_cols) store_acc(static_cast<A>(acc[t] * scale), gq + (c0 + c) * p.grad_q.col_stride);
      }
    }
  }
}

template <typename A>
constexpr size_t bwd_mask_smem() {
  return sizeof(A) * (kBM * kLdC + kBN * kLdC + kBM * kLdS);
}

// Gradient of a floating mask: item = (mask owner, mask row tile, mask key tile). When the mask
// broadcasts over query rows (row_stride 0 with n > 1) the row tile is all rows; when it
// broadcasts over keys the key tile is all keys. grad_mask is zero-filled by the caller.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_mask_kernel(const __grid_constant__ AttentionParams p,
                                                            int64_t total) {
  using A = typename AccOf<T>::type;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Xs = reinterpret_cast<A*>(smem_raw);
  A* Ys = Xs + kBM * kLdC;
  A* Gs = Ys + kBN * kLdC;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const BatchSplit split(p, p.grad_mask);
  const bool rows_bcast = p.n > 1 && p.grad_mask.row_stride == 0;
  const bool cols_bcast = p.m > 1 && p.grad_mask.col_stride == 0;
  const int64_t n_qt = ceil_div(p.n, kBM), n_kt = ceil_div(p.m, kBN);
  const int64_t n_row_items = rows_bcast ? 1 : n_qt;
  const int64_t n_col_items = cols_bcast ? 1 : n_kt;

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t ct = item % n_col_items;
    const int64_t rt = (item / n_col_items) % n_row_items;
    const int64_t owner = item / (n_col_items * n_row_items);
    const int64_t q_begin = rows_bcast ? 0 : rt * kBM;
    const int64_t q_end = rows_bcast ? p.n : imin(p.n, q_begin + kBM);
    const int64_t kt_begin = cols_bcast ? 0 : ct, kt_end = cols_bcast ? n_kt : ct + 1;
    const int64_t key_begin = visible_key_tile_begin(p, q_begin, kBN);
    const int64_t key_end = visible_key_end(p, q_begin, q_end - q_begin);
    int64_t idx[kMaxBatchDims];
    split.index(p, owner, 0, idx);
    T* gm = static_cast<T*>(p.grad_mask.data) + batch_offset(p, p.grad_mask, idx);
    A row_acc = A(0);  // cols_bcast: thread t < kBM sums mask row t (t = 0 when rows_bcast too)
    for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
      const int64_t j0 = kt * kBN;
      if (j0 >= key_end) break;  // invisible keys: gradient stays 0 (uniform over the CTA)
      if (j0 < key_begin) continue;
      const int64_t cols = imin(kBN, p.m - j0);
      A gacc[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) gacc[t] = A(0);
      const int64_t i_first = rows_bcast ? imax(q_begin, first_row_seeing(p, j0) / kBM * kBM) : q_begin;
      for (int64_t bc = 0; bc < split.num_bcast; ++bc) {
        split.index(p, owner, bc, idx);
        const int64_t b = ravel_batch(p, idx);
        for (int64_t i0 = i_first; i0 < imin(q_end, rows_seeing_end(p, j0 + cols)); i0 += kBM) {
          const int64_t rows = imin(kBM, q_end - i0);
          A pz[8], ds[8];
          score_gradient<T>(p, ctx, idx, b, i0, rows, j0, cols, Xs, Ys, r, g, pz, ds, /*of_scores=*/false);
#pragma unroll
          for (int t = 0; t < 8; ++t) gacc[t] += ds[t];
        }
      }
      __syncthreads();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) Gs[r * kLdS + 32 * h + 4 * g + e] = gacc[h * 4 + e];
      __syncthreads();
      if (!rows_bcast && !cols_bcast) {
        const int64_t i = q_begin + r;
        if (i < q_end) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = 32 * h + 4 * g + e;
              if (c < cols)
                store_acc(gacc[h * 4 + e], gm + i * p.grad_mask.row_stride + (j0 + c) * p.grad_mask.col_stride);
            }
        }
      } else if (rows_bcast && !cols_bcast) {
        if (tid < cols) {
          A sum = A(0);
          for (int rr = 0; rr < kBM; ++rr) sum += Gs[rr * kLdS + tid];
          store_acc(sum, gm + (j0 + tid) * p.grad_mask.col_stride);
        }
      } else if (!rows_bcast) {  // cols_bcast only
        if (tid < kBM) {
          A sum = A(0);
          for (int cc = 0; cc < kBN; ++cc) sum += Gs[tid * kLdS + cc];
          row_acc += sum;
        }
      } else {  // both broadcast: one scalar per owner
        if (tid == 0) {
          A sum = A(0);
          for (int rr = 0; rr < kBM; ++rr)
            for (int cc = 0; cc < kBN; ++cc) sum += Gs[rr * kLdS + cc];
          row_acc += sum;
        }
      }
    }
    if (cols_bcast) {
      if (rows_bcast) {
        if (tid == 0) store_acc(row_acc, gm);
      } else if (tid < kBM && q_begin + tid < q_end) {
        store_acc(row_acc, gm + (q_begin + tid) * p.grad_mask.row_stride);
      }
    }
  }
}

// The backward passes, in the order launch_backward runs them. Each returns the launch status.
// The tensor-core backward (tc_backward.cuh) replaces the kv and q passes and keeps the others.
template <typename T>
cudaError_t launch_backward_prologue(const AttentionParams& p, cudaStream_t stream) {  // shift, delta
  const int64_t rows = p.batch_numel * p.n;
  cudaError_t err = launch_row_shift<T>(p, stream);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(delta_kernel<T>, grid_for(ceil_div(rows, kThreads)), kThreads, 0, stream)(p, rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward_kv(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  constexpr int OC = BwdCfg<A>::kOC;
  const int64_t total = owners_of(p, p.grad_k) * ceil_div(p.m, kBN) * imax(1, ceil_div(imax(p.dk, p.dv), OC));
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = bwd_kv_smem<A>();
  cudaError_t err = prepare_smem(bwd_kv_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(bwd_kv_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward_q(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  constexpr int OC = BwdCfg<A>::kOC;
  const int64_t total = owners_of(p, p.grad_q) * ceil_div(p.n, kBM) * imax(1, ceil_div(p.dk, OC));
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = bwd_q_smem<A>();
  cudaError_t err = prepare_smem(bwd_q_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(bwd_q_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward_mask(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  if (p.grad_mask.data == nullptr) return cudaSuccess;
  const bool rows_bcast = p.n > 1 && p.grad_mask.row_stride == 0;
  const bool cols_bcast = p.m > 1 && p.grad_mask.col_stride == 0;
  const int64_t total = owners_of(p, p.grad_mask) * (rows_bcast ? 1 : ceil_div(p.n, kBM)) *
                        (cols_bcast ? 1 : ceil_div(p.m, kBN));
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = bwd_mask_smem<A>();
  cudaError_t err = prepare_smem(bwd_mask_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(bwd_mask_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream) {
  if (p.batch_numel * p.n <= 0) return cudaSuccess;
  cudaError_t err = launch_backward_prologue<T>(p, stream);
  if (err == cudaSuccess && plan.kv) err = launch_backward_kv<T>(p, stream);
  if (err == cudaSuccess && plan.q) err = launch_backward_q<T>(p, stream);
  if (err == cudaSuccess && plan.mask) err = launch_backward_mask<T>(p, stream);
  return err;
}

}  // namespace simt
}  // namespace cuda
}  // namespace attention_ext
