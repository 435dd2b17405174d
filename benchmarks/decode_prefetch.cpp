// Isolated micro-benchmark: how much of the streaming bandwidth one thread gets while reading K/V
// in the decode kernel's order, with some work per row, under three prefetch schemes.
//
//   g++ -O3 -march=native -o /tmp/decode_prefetch benchmarks/decode_prefetch.cpp && /tmp/decode_prefetch [tokens]
//
// The cache is fp32 (tokens, heads, d) = (32768, 8, 64), K and V (64 MiB each, past the caches;
// a smaller `tokens` only checks that it runs).
// Order (forward_decode.inc with kBlockN = 64): for each tile of 64 tokens, for each head, the
// head's 64 K rows (256 B each, 2 KiB apart), then its 64 V rows. Per row: `work` rounds of 12
// independent FMAs on registers besides the 4 that consume the row (the decode kernel does a few
// dozen vector operations per row). Schemes:
//   none:       hardware prefetchers only;
//   next tile:  before a head's rows, all its rows of the next tile (a burst per tile);
//   N ahead:    before each row, the row N further on in the same head's stream (PREFETCHT1/T2
//               into L2, or PREFETCHT0), so requests are spread through the work.
// One thread, best of 5 per cell; "stream" is a plain sequential read of both tensors.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr long kHeads = 8, kDim = 64, kTile = 64;
long kTokens = 32768;
float* key_cache;
float* value_cache;
volatile float sink;

float total(__m512 x) {  // (not _mm512_reduce_add_ps: GCC 12's -Wall flags its header)
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
  float sum = 0;
  for (float lane : lanes) sum += lane;
  return sum;
}

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void stream() {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  for (float* x : {key_cache, value_cache})
    for (long i = 0; i < kTokens * kHeads * kDim; i += 32) {
      a = _mm512_add_ps(a, _mm512_load_ps(x + i));
      b = _mm512_add_ps(b, _mm512_load_ps(x + i + 16));
    }
  sink = total(_mm512_add_ps(a, b));
}

enum Scheme { kNone, kNextTile, kAhead };

template <int kLocality>
inline void fetch_row(const float* row) {
  for (int b = 0; b < kDim * 4; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, kLocality);
}

template <Scheme kScheme, int kLocality>
void decode_order(int work, long ahead) {
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(0.999f);
  for (long j0 = 0; j0 < kTokens; j0 += kTile)
    for (long h = 0; h < kHeads; ++h)
      for (float* x : {key_cache, value_cache}) {
        auto row_at = [&](long token) { return x + (token * kHeads + h) * kDim; };
        if (kScheme == kNextTile && j0 + kTile < kTokens)
          for (long r = 0; r < kTile; ++r) fetch_row<kLocality>(row_at(j0 + kTile + r));
        for (long r = 0; r < kTile; ++r) {
          if (kScheme == kAhead && j0 + r + ahead < kTokens) fetch_row<kLocality>(row_at(j0 + r + ahead));
          const float* row = row_at(j0 + r);
          const __m512 x0 = _mm512_load_ps(row);
          acc[0] = _mm512_fmadd_ps(acc[0], m, x0);
          acc[1] = _mm512_fmadd_ps(acc[1], m, _mm512_load_ps(row + 16));
          acc[2] = _mm512_fmadd_ps(acc[2], m, _mm512_load_ps(row + 32));
          acc[3] = _mm512_fmadd_ps(acc[3], m, _mm512_load_ps(row + 48));
          for (int w = 0; w < work; ++w)
            for (int i = 4; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, x0);
        }
      }
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  sink = total(s);
}

template <typename F>
double gbps(F&& f) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t = seconds();
    f();
    best = std::min(best, seconds() - t);
  }
  return 2.0 * kTokens * kHeads * kDim * sizeof(float) / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) kTokens = std::max(2 * kTile, std::atol(argv[1]) / kTile * kTile);
  const size_t bytes = kTokens * kHeads * kDim * sizeof(float);
  key_cache = static_cast<float*>(aligned_alloc(4096, bytes));
  value_cache = static_cast<float*>(aligned_alloc(4096, bytes));
  for (size_t i = 0; i < bytes / sizeof(float); ++i) {
    key_cache[i] = 1e-3f * static_cast<float>(i % 7);
    value_cache[i] = 1e-3f * static_cast<float>(i % 5);
  }
  std::printf("one thread, GB/s of K and V read; stream (plain sequential read): %.1f\n", gbps(stream));
  std::printf("%-6s %-6s %-10s %-10s %-12s %-12s %-12s %-12s\n", "work", "FMAs", "none", "next tile", "16 ahead L2",
              "32 ahead L2", "64 ahead L2", "32 ahead L1");
  for (int work : {0, 2, 4, 6}) {
    std::printf("%-6d %-6d %-10.1f %-10.1f %-12.1f %-12.1f %-12.1f %-12.1f\n", work, 4 + 12 * work,
                gbps([&] { decode_order<kNone, 3>(work, 0); }), gbps([&] { decode_order<kNextTile, 3>(work, 0); }),
                gbps([&] { decode_order<kAhead, 1>(work, 16); }), gbps([&] { decode_order<kAhead, 1>(work, 32); }),
                gbps([&] { decode_order<kAhead, 1>(work, 64); }), gbps([&] { decode_order<kAhead, 3>(work, 32); }));
  }
  free(key_cache);
  free(value_cache);
}
