// Tensor-core forward for float16 / bfloat16 with d_k == d_v == D in {64, 128} (FlashAttention-2
// style warp split): mma.sync.m16n8k16 (fp32 accumulate), 4 warps per CTA, each owning 16 of the
// CTA's 64 query rows, so the online-softmax row statistics never leave a warp (quad shuffles).
// Keys in tiles of 64. Q is staged once and kept as A fragments in registers; K (row-major) and
// V (transposed, so the P·V B fragments are contiguous pairs) are staged per key tile in padded
// shared memory (row pitch D + 8 elements: the 8 rows a fragment load touches hit distinct banks).
// The P tile is fed to the P·V MMA straight from the S accumulators (C layout == A layout), as
// FlashAttention does: P is rounded to the storage type there (fp32 on the SIMT path).
// Global loads go through TensorRef strides, so any layout works; masks, both causal kinds,
// dropout (same Philox stream) and fully masked rows behave exactly as on the SIMT path.
// Not implemented here (the SIMT path covers them): other head dims, d_k != d_v, backward,
// cp.async double buffering and ldmatrix (plain 32-bit shared loads).
#pragma once
#include <cstdlib>

#include "common.cuh"

namespace attention_ext {
namespace cuda {
namespace tc {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBM = 16 * kWarps;  // 64 query rows per CTA
constexpr int kBN = 64;           // keys per tile

template <typename T>
struct Mma;
template <>
struct Mma<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();  // never launched there: eligible() checks the device's compute capability
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
};
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();  // never launched there: eligible() checks the device's compute capability
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
};

template <typename T>
__device__ __forceinline__ uint32_t lds32(const T* p) {  // two consecutive elements, 4-byte aligned
  return *reinterpret_cast<const uint32_t*>(p);
}

template <int D>
constexpr size_t forward_smem() {
  return sizeof(uint16_t) * (kBM * (D + 8) + kBN * (D + 8) + D * (kBN + 8));
}

// Eligible calls: fp16/bf16, d_k == d_v == 64 or 128, a device of compute capability >= 8.0,
// and ATTENTION_EXT_CUDA_SIMT not set to 1 (which forces the SIMT path, for testing).
inline bool eligible(const AttentionParams& p) {
  if (!((p.dtype == ScalarType::kFloat16 || p.dtype == ScalarType::kBFloat16) && p.dk == p.dv &&
        (p.dk == 64 || p.dk == 128)))
    return false;
  const char* force_simt = std::getenv("ATTENTION_EXT_CUDA_SIMT");
  if (force_simt != nullptr && force_simt[0] == '1') return false;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return false;
  return major >= 8;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(const __grid_constant__ AttentionParams p,
                                                           int64_t total) {
  constexpr int LDQ = D + 8, LDV = kBN + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + kBM * LDQ;
  T* Vt = Ks + kBN * LDQ;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;  // mma groupID / thread-in-group
  const DevCtx<T> ctx(p);
  const int64_t n_qt = ceil_div(p.n, kBM);
  const float ninf = -INFINITY;

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t qt = item % n_qt, b = item / n_qt;
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const int64_t i0 = qt * kBM, rows = imin(kBM, p.n - i0);
    const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
    const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx);
    const T* v = static_cast<const T*>(p.v.data) + batch_offset(p, p.v, idx);
    const int64_t mask_base = p.mask_kind == MaskKind::kNone ? 0 : batch_offset(p, p.mask, idx);
    // This thread's two query rows: warp*16 + g and + 8.
    const int rl0 = warp * 16 + g, rl1 = rl0 + 8;
    const int64_t ia = i0 + rl0, ib = i0 + rl1;

    __syncthreads();  // previous item's readers of Qs are done
    for (int e = tid; e < kBM * D; e += kThreads) {
      const int r = e / D, c = e % D;
      Qs[r * LDQ + c] = r < rows ? q[r * p.q.row_stride + c * p.q.col_stride] : T(0.0f);
    }
    __syncthreads();
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      qf[ks][0] = lds32(Qs + rl0 * LDQ + ks * 16 + 2 * t4);
      qf[ks][1] = lds32(Qs + rl1 * LDQ + ks * 16 + 2 * t4);
      qf[ks][2] = lds32(Qs + rl0 * LDQ + ks * 16 + 8 + 2 * t4);
      qf[ks][3] = lds32(Qs + rl1 * LDQ + ks * 16 + 8 + 2 * t4);
    }

    float o[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m_run[2] = {ninf, ninf}, l_run[2] = {0.0f, 0.0f};

    const int64_t key_end = visible_key_end(p, i0, rows);
    for (int64_t j0 = 0; j0 < key_end; j0 += kBN) {
      const int64_t cols = imin(kBN, p.m - j0);
      __syncthreads();  // previous tile's readers of Ks / Vt are done
      for (int e = tid; e < kBN * D; e += kThreads) {
        const int r = e / D, c = e % D;
        const bool ok = r < cols;
        Ks[r * LDQ + c] = ok ? k[(j0 + r) * p.k.row_stride + c * p.k.col_stride] : T(0.0f);
        Vt[c * LDV + r] = ok ? v[(j0 + r) * p.v.row_stride + c * p.v.col_stride] : T(0.0f);
      }
      __syncthreads();

      // S = Q Kᵀ: 8 n-tiles of 8 keys; s[nt] = {(rl0, 2t), (rl0, 2t+1), (rl1, 2t), (rl1, 2t+1)}.
      float s[kBN / 8][4];
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          const T* kr = Ks + (nt * 8 + g) * LDQ + ks * 16 + 2 * t4;
          Mma<T>::run(s[nt], qf[ks], lds32(kr), lds32(kr + 8));
        }
      }

      // Logits (log2 units), row max over the quad.
      float mx[2] = {ninf, ninf};
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + 2 * t4 + (e & 1);
          const int64_t i = e < 2 ? ia : ib;
          const bool valid = i < p.n && c < cols;
          const float x = ctx.logit(p, s[nt][e], i, j0 + c, valid, mask_base);
          s[nt][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 2));
        const float m_new = fmaxf(m_run[h], mx[h]);
        alpha[h] = (m_new == ninf || m_run[h] == ninf) ? (m_new == ninf ? 1.0f : 0.0f) : exp2f(m_run[h] - m_new);
        mx[h] = m_new;  // now the max used for P
      }
      float psum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          // No visible key yet (max -inf): shift 0, so masked keys give 0 and NaN scores (which
          // fmaxf skips) give NaN, which reaches the row's sum and output, as on the CPU.
          const float pv = exp2f(s[nt][e] - (mx[h] == ninf ? 0.0f : mx[h]));
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
        // Columns nt*8 + 2t, +1 lie in the Philox group of 4 starting at nt*8 + (t / 2) * 4,
        // at word offset (t % 2) * 2.
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) {
          const int64_t j4 = j0 + nt * 8 + (t4 >> 1) * 4;
          const int w0 = (t4 & 1) * 2;
          const PhiloxWords wa = ctx.words(b, ia, j4);
          const PhiloxWords wb = ctx.words(b, ib, j4);
          s[nt][0] = wa.w[w0] >= p.dropout_threshold ? s[nt][0] * ctx.inv_keep : 0.0f;
          s[nt][1] = wa.w[w0 + 1] >= p.dropout_threshold ? s[nt][1] * ctx.inv_keep : 0.0f;
          s[nt][2] = wb.w[w0] >= p.dropout_threshold ? s[nt][2] * ctx.inv_keep : 0.0f;
          s[nt][3] = wb.w[w0 + 1] >= p.dropout_threshold ? s[nt][3] * ctx.inv_keep : 0.0f;
        }
      }

      // O += P V: P's C fragments of key n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
          const T* vr = Vt + (nt * 8 + g) * LDV + kk * 16 + 2 * t4;
          Mma<T>::run(o[nt], pa, lds32(vr), lds32(vr + 8));
        }
      }
    }

    // Epilogue: O / l, lse = (m + log2 l) ln 2; l == 0: fully masked row (output 0, lse -inf);
    // l NaN: NaN scores (output and lse NaN).
    T* out = static_cast<T*>(p.out.data) + batch_offset(p, p.out, idx);
    float* lse = static_cast<float*>(p.lse.data) + batch_offset(p, p.lse, idx);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = h == 0 ? ia : ib;
      if (i >= p.n) continue;
      const float inv = l_run[h] > 0.0f ? 1.0f / l_run[h] : (l_run[h] == 0.0f ? 0.0f : NAN);
      T* orow = out + i * p.out.row_stride;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        const int c = nt * 8 + 2 * t4;
        store_acc(o[nt][2 * h] * inv, orow + c * p.out.col_stride);
        store_acc(o[nt][2 * h + 1] * inv, orow + (c + 1) * p.out.col_stride);
      }
      if (t4 == 0)
        lse[i * p.lse.row_stride] = l_run[h] > 0.0f ? (m_run[h] + log2f(l_run[h])) * static_cast<float>(kLn2)
                                                    : (l_run[h] == 0.0f ? ninf : NAN);
    }
  }
}

template <typename T, int D>
cudaError_t launch_forward_d(const AttentionParams& p, cudaStream_t stream) {
  const int64_t total = p.batch_numel * ceil_div(p.n, kBM);
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = forward_smem<D>();
  cudaError_t err = prepare_smem(forward_kernel<T, D>, smem);
  if (err != cudaSuccess) return err;
  forward_kernel<T, D><<<grid_for(total), kThreads, smem, stream>>>(p, total);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream) {
  return p.dk == 64 ? launch_forward_d<T, 64>(p, stream) : launch_forward_d<T, 128>(p, stream);
}

}  // namespace tc
}  // namespace cuda
}  // namespace attention_ext
