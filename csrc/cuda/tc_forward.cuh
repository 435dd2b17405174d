// Tensor-core forward for float16 / bfloat16 with d_k == d_v == D in {64, 128}, FlashAttention-2
// style: each CTA owns BM = 128 query rows of one batch position, 4 warps of 32 rows (two 16-row
// m-tiles) each, so the online-softmax row statistics never leave a warp (quad shuffles). Keys go
// by in tiles of BN = 64 (D = 64) or 32 (D = 128).
//
// Per CTA: Q (BM x D) is copied once to shared memory (cp.async); K and V tiles (BN x D,
// row-major) are double buffered: tile t + 1 is in flight (cp.async) while tile t is computed.
// S = Q Kᵀ and O += P V run on mma.sync.m16n8k16 (fp32 accumulate), A fragments of Q and the B
// fragments read by ldmatrix (.trans for V, so V needs no transposed copy); each B fragment
// feeds both m-tiles of its warp. Shared tiles are swizzled (tc_common.cuh).
// P never leaves registers: the S accumulators (C layout) are the A fragments of P·V, rounded to
// the storage type there, as FlashAttention does (the SIMT path keeps P in fp32).
// Memory traffic per CTA: Q once, K and V once per visible key tile, O and lse once; causal
// calls stop at the last key tile a row of the CTA can see. Shared-memory reads per key tile and
// warp: (2 Q + BN/16 K + BN/16 V) x4 ldmatrix per 16 columns of D, for 2·BN/4 mma's each.
// Masks, both causal kinds, dropout (the same Philox stream) and fully masked rows behave exactly
// as on the SIMT path, through the same DevCtx::logit. Calls tc::eligible() refuses (other layouts,
// head dims, d_k != d_v) take the SIMT path. Split-KV (plan_kv_splits) for calls with fewer CTAs
// than SMs: each CTA takes one range of keys, combine_kernel merges the ranges.
#pragma once
#include "tc_common.cuh"

namespace attention_ext {
namespace cuda {
namespace tc {

// Query rows per warp = 16·MT: a K or V fragment read by ldmatrix feeds MT mma's, which is what
// sets the shared-memory traffic per flop (FlashAttention-2 gives each warp 32 rows, MT = 2).
// Registers hold O (MT·D/2 floats per thread) and S (MT·BN/2); Q is re-read from shared memory
// per key tile. At D = 128 the key tile is 32 keys (as FlashAttention-2's) so that both fit in
// registers without spilling.
constexpr int kMTiles = 2;
constexpr int kBlockRows = 16 * kWarps * kMTiles;  // query rows per CTA
template <int D>
constexpr int block_keys() {  // keys per tile; split-KV ranges are multiples of 64
  return D == 64 ? 64 : 32;
}

template <int D>
constexpr size_t forward_smem() {
  return sizeof(uint16_t) * (kBlockRows * D + 4 * block_keys<D>() * D);  // Q, K[2], V[2]
}

// One 16-row m-tile's online-softmax step on the S tile s (C layout: rows ia, ib of this thread,
// keys j0 + 8 nt + 2 t4 + {0, 1}): logits, running max / sum, O rescaled, s becomes P (dropped
// out and scaled when dropout is on), ready to be the A operand of P V.
template <typename T, int D, int BN>
__device__ __forceinline__ void softmax_step(const AttentionParams& p, const DevCtx<T>& ctx, bool interior,
                                             int64_t b, int64_t ia, int64_t ib, int64_t j0, int64_t cols,
                                             const BatchTerms<float>& at, int t4, float (&s)[BN / 8][4],
                                             float (&m_run)[2], float (&l_run)[2], float (&o)[D / 8][4]) {
  const float ninf = -INFINITY;
  float mx[2] = {ninf, ninf};
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = nt * 8 + 2 * t4 + (e & 1);
      const int64_t i = e < 2 ? ia : ib;
      const bool valid = i < p.n && c < cols;
      const float x = interior ? s[nt][e] * ctx.scale_log2 : ctx.logit(p, s[nt][e], i, j0 + c, valid, at);
      s[nt][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  float alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 2));
    const float m_new = fmaxf(m_run[h], mx[h]);
    alpha[h] = rescale_factor(m_run[h], m_new);
    mx[h] = m_new;  // now the max used for P
  }
  float psum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e >> 1;
      // No visible key yet (max -inf): shift 0, so masked keys give 0 and NaN scores (which
      // fmaxf skips) give NaN, which reaches the row's sum and output, as on the CPU.
      const float pv = exp2f(s[nt][e] - softmax_shift(mx[h]));
      s[nt][e] = pv;
      psum[h] += pv;
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    psum[h] += __shfl_xor_sync(0xFFFFFFFFu, psum[h], 1);
    psum[h] += __shfl_xor_sync(0xFFFFFFFFu, psum[h], 2);
    l_run[h] = l_run[h] * alpha[h] + psum[h];
    m_run[h] = mx[h];
  }
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    o[nt][0] *= alpha[0];
    o[nt][1] *= alpha[0];
    o[nt][2] *= alpha[1];
    o[nt][3] *= alpha[1];
  }
  if (ctx.dropout) {
    // Keys nt*8 + 2t, +1 lie in the Philox group of 4 starting at nt*8 + (t / 2) * 4, at word
    // offset (t % 2) * 2.
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const int64_t j4 = j0 + nt * 8 + (t4 >> 1) * 4;
      const int w0 = (t4 & 1) * 2;
      const PhiloxWords wa = ctx.words(b, ia, j4);
      const PhiloxWords wb = ctx.words(b, ib, j4);
      // (Indexed by the run-time w0, the draws live in local memory: only when dropout is on,
      // and it keeps this kernel's registers free of spills.)
      s[nt][0] = wa.w[w0] >= p.dropout_threshold ? s[nt][0] * ctx.inv_keep : 0.0f;
      s[nt][1] = wa.w[w0 + 1] >= p.dropout_threshold ? s[nt][1] * ctx.inv_keep : 0.0f;
      s[nt][2] = wb.w[w0] >= p.dropout_threshold ? s[nt][2] * ctx.inv_keep : 0.0f;
      s[nt][3] = wb.w[w0 + 1] >= p.dropout_threshold ? s[nt][3] * ctx.inv_keep : 0.0f;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(const __grid_constant__ AttentionParams p,
                                                           int64_t total) {
  constexpr int MT = kMTiles, BM = kBlockRows, BN = block_keys<D>();
  ATTN_DYNAMIC_SHARED(smem_raw);
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + BM * D;  // two buffers of BN x D
  T* Vs = Ks + 2 * BN * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;  // mma groupID / thread-in-group
  const int wr0 = warp * 16 * MT;          // the warp's first row in the tile
  const DevCtx<T> ctx(p);
  const int64_t n_qt = ceil_div(p.n, BM);
  const int64_t n_splits = p.kv_splits;
  const float ninf = -INFINITY;

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t split = item % n_splits, qt = (item / n_splits) % n_qt, b = item / (n_splits * n_qt);
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const int64_t i0 = qt * BM, rows = imin(BM, p.n - i0);
    const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
    const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx);
    const T* v = static_cast<const T*>(p.v.data) + batch_offset(p, p.v, idx);
    const auto at = ctx.terms(p, idx);
    // Keys [k_begin, k_stop): all visible ones, or this item's range of them (split-KV).
    const int64_t key_begin = visible_key_tile_begin(p, i0, BN), key_end = visible_key_end(p, i0, rows);
    const int64_t range_begin = p.split_key_begin + split * p.split_keys;
    const int64_t k_begin = n_splits == 1 ? key_begin : imax(key_begin, range_begin);
    const int64_t k_stop = n_splits == 1 ? key_end : imin(key_end, range_begin + p.split_keys);
    const int64_t n_tiles = k_stop > k_begin ? ceil_div(k_stop - k_begin, BN) : 0;

    // The previous item's copies have landed and its readers of every buffer are done.
    cp_async_wait<0>();
    __syncthreads();
    load_tile_async<T, D, BM>(Qs, q, p.q.row_stride, rows, tid);
    if (n_tiles > 0) {
      const int64_t cols = imin(BN, p.m - k_begin);
      load_tile_async<T, D, BN>(Ks, k + k_begin * p.k.row_stride, p.k.row_stride, cols, tid);
      load_tile_async<T, D, BN>(Vs, v + k_begin * p.v.row_stride, p.v.row_stride, cols, tid);
    }
    cp_async_commit();

    // Per m-tile mt: this thread's rows wr0 + 16 mt + g and + 8; O, running max and sum.
    float o[MT][D / 8][4], m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;
      m_run[mt][0] = m_run[mt][1] = ninf;
      l_run[mt][0] = l_run[mt][1] = 0.0f;
    }

    for (int64_t t = 0; t < n_tiles; ++t) {
      const int64_t j0 = k_begin + t * BN, cols = imin(BN, p.m - j0);
      const T* Kb = Ks + (t & 1) * BN * D;
      const T* Vb = Vs + (t & 1) * BN * D;
      // Tile t has landed for every thread, and every thread is done with tile t - 1, whose
      // buffers receive tile t + 1 below.
      cp_async_wait<0>();
      __syncthreads();
      if (t + 1 < n_tiles) {
        const int64_t j1 = j0 + BN, cols1 = imin(BN, p.m - j1);
        T* Kn = Ks + ((t + 1) & 1) * BN * D;
        T* Vn = Vs + ((t + 1) & 1) * BN * D;
        load_tile_async<T, D, BN>(Kn, k + j1 * p.k.row_stride, p.k.row_stride, cols1, tid);
        load_tile_async<T, D, BN>(Vn, v + j1 * p.v.row_stride, p.v.row_stride, cols1, tid);
      }
      cp_async_commit();

      // S = Q Kᵀ: per m-tile 8 n-tiles of 8 keys. One ldmatrix.x4 gives the B fragments
      // (k-halves 0 and 1) of two n-tiles, used by every m-tile.
      float s[MT][BN / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a<D>(qa[mt], Qs, wr0 + 16 * mt, ks * 16, lane);
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          uint32_t kb[4];
          load_b_nk<D>(kb, Kb, np * 16, ks * 16, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_m16n8k16<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
            mma_m16n8k16<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
          }
        }
      }

      const bool interior = interior_tile<BM, BN>(p, i0, rows, j0, cols);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int64_t ia = i0 + wr0 + 16 * mt + g;
        softmax_step<T, D, BN>(p, ctx, interior, b, ia, ia + 8, j0, cols, at, t4, s[mt], m_run[mt], l_run[mt],
                           o[mt]);
      }

      // O += P V: P's C fragments of key n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
      // One ldmatrix.x4.trans gives the B fragments of two value-column n-tiles.
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) a_from_c<T>(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t vb[4];
          load_b_kn<D>(vb, Vb, kk * 16, dp * 16, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_m16n8k16<T>(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
            mma_m16n8k16<T>(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
          }
        }
      }
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = i0 + wr0 + 16 * mt + g + 8 * h;
        if (i >= p.n) continue;
        if (n_splits > 1) {  // unnormalised O, running max (log2 units) and sum, for combine_kernel
          float* part_out = static_cast<float*>(p.split_out) + ((b * n_splits + split) * p.n + i) * D;
          float* part_stats = static_cast<float*>(p.split_stats) + ((b * n_splits + split) * p.n + i) * 2;
#pragma unroll
          for (int nt = 0; nt < D / 8; ++nt) {
            *reinterpret_cast<float2*>(part_out + nt * 8 + 2 * t4) = make_float2(o[mt][nt][2 * h], o[mt][nt][2 * h + 1]);
          }
          if (t4 == 0) {
            part_stats[0] = m_run[mt][h];
            part_stats[1] = l_run[mt][h];
          }
          continue;
        }
        T* out = static_cast<T*>(p.out.data) + batch_offset(p, p.out, idx) + i * p.out.row_stride;
        const RowEnd<float> end = row_end(m_run[mt][h], l_run[mt][h], sink_log2<float>(p, idx));
        store_acc_row<D>(o[mt], h, t4, end.out_factor, out, p.out.col_stride);
        if (t4 == 0) {
          float* lse = static_cast<float*>(p.lse.data) + batch_offset(p, p.lse, idx);
          lse[i * p.lse.row_stride] = end.lse;
        }
      }
  }
  cp_async_wait<0>();  // an item with no visible key tile leaves its Q copy open
}

// Split-KV merge: one thread per (row, output column) merges the row's key ranges in range order,
//   M = max_s m_s,  l = Σ_s l_s·2^(m_s − M),  O = Σ_s O_s·2^(m_s − M) / l,  lse = (M + log2 l)·ln 2,
// as the CPU's forward_combine, with merge_weight (attention_semantics.h).
template <typename T>
__global__ void __launch_bounds__(256) combine_kernel(const __grid_constant__ AttentionParams p, int64_t total) {
  const int64_t S = p.kv_splits, n = p.n, dv = p.dv;
  const float ninf = -INFINITY;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = t % dv, row = t / dv, i = row % n, b = row / n;
    const float* stats = static_cast<const float*>(p.split_stats) + b * S * n * 2;
    const float* parts = static_cast<const float*>(p.split_out) + b * S * n * dv;
    float mx = ninf;
    for (int64_t s = 0; s < S; ++s) mx = fmaxf(mx, stats[(s * n + i) * 2]);
    float sum = 0.0f, acc = 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      const float f = merge_weight(stats[(s * n + i) * 2], mx);
      sum += stats[(s * n + i) * 2 + 1] * f;
      acc += parts[(s * n + i) * dv + c] * f;
    }
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    T* out = static_cast<T*>(p.out.data) + batch_offset(p, p.out, idx) + i * p.out.row_stride;
    const RowEnd<float> end = row_end(mx, sum, sink_log2<float>(p, idx));
    store_acc(acc * end.out_factor, out + c * p.out.col_stride);
    if (c == 0) {
      float* lse = static_cast<float*>(p.lse.data) + batch_offset(p, p.lse, idx);
      lse[i * p.lse.row_stride] = end.lse;
    }
  }
}

template <typename T, int D>
cudaError_t launch_forward_d(const AttentionParams& p, cudaStream_t stream) {
  const int64_t total = p.batch_numel * ceil_div(p.n, kBlockRows) * p.kv_splits;
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = forward_smem<D>();
  cudaError_t err = prepare_smem(forward_kernel<T, D>, smem);
  if (err != cudaSuccess) return err;
  auto* const kernel = forward_kernel<T, D>;
  ATTN_LAUNCH(kernel, grid_for(total), kThreads, smem, stream)(p, total);
  if ((err = cudaGetLastError()) != cudaSuccess || p.kv_splits == 1) return err;
  const int64_t cells = p.batch_numel * p.n * p.dv;
  constexpr int kCombineThreads = 256;
  ATTN_LAUNCH(combine_kernel<T>, grid_for(imin(ceil_div(cells, kCombineThreads), 65536)), kCombineThreads, 0,
              stream)(p, cells);
  return cudaGetLastError();
}

// Split-KV for calls that cannot fill the GPU (decode: few query tiles per batch position): the
// keys are cut into ranges of split_keys (a multiple of 64, so of every key tile) when there are fewer CTAs than SMs,
// aiming at two CTAs per SM, each range at least kMinSplitKeys keys. A function of the shape and
// the device's SM count only, so results are reproducible on a given GPU model.
// ATTENTION_EXT_CUDA_KV_SPLITS=N forces N ranges (1: none), for testing.
constexpr int64_t kMinSplitKeys = 256;

inline void plan_kv_splits(AttentionParams& p) {
  p.kv_splits = 1;
  p.split_keys = 0;
  if (!eligible(p) || p.m <= 0) return;
  int64_t splits = 1;
  const char* forced = std::getenv("ATTENTION_EXT_CUDA_KV_SPLITS");
  if (forced != nullptr && forced[0] != '\0') {
    splits = imax(1, std::atoll(forced));
  } else {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return;
    const int64_t ctas = p.batch_numel * ceil_div(p.n, kBlockRows);
    if (ctas >= sms) return;
    splits = imin(ceil_div(2 * static_cast<int64_t>(sms), ctas),
                  (visible_key_end(p, 0, p.n) - visible_key_begin(p, 0)) / kMinSplitKeys);
  }
  if (splits <= 1) return;
  // The ranges cover only the keys some row can see (a sliding window's few, of a long cache).
  p.split_key_begin = visible_key_tile_begin(p, 0, kTile);
  const int64_t keys = imax(1, visible_key_end(p, 0, p.n) - p.split_key_begin);
  p.split_keys = ceil_div(ceil_div(keys, splits), kTile) * kTile;
  p.kv_splits = ceil_div(keys, p.split_keys);
  if (p.kv_splits == 1) p.split_keys = 0;
}

template <typename T>
cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream) {
  return p.dk == 64 ? launch_forward_d<T, 64>(p, stream) : launch_forward_d<T, 128>(p, stream);
}

}  // namespace tc
}  // namespace cuda
}  // namespace attention_ext
