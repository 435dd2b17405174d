// Philox4x32-10 counter-based random numbers (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC'11), usable from host and CUDA code so that one seed gives one dropout mask on
// every device.
//
// Dropout keys one draw by (seed, offset, batch index, row, column): the counter is
// (column / 4, row, batch index, offset) and the key is the 64-bit seed; the four 32-bit words of
// one draw serve four consecutive columns. A weight survives iff its word >= floor(p * 2^32).
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTN_HOST_DEVICE inline
#endif

namespace attention_ext {

struct PhiloxWords {
  uint32_t w[4];
};

ATTN_HOST_DEVICE PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                           uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// The four random words for columns [4*(col/4), 4*(col/4)+4) of one attention row.
ATTN_HOST_DEVICE PhiloxWords dropout_words(uint64_t seed, uint64_t offset, uint64_t batch_index,
                                           uint64_t row, uint64_t col) {
  return philox4x32_10(static_cast<uint32_t>(col >> 2), static_cast<uint32_t>(row),
                       static_cast<uint32_t>(batch_index), static_cast<uint32_t>(offset),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// floor(p * 2^32), saturating; p in [0, 1).
ATTN_HOST_DEVICE uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace attention_ext
