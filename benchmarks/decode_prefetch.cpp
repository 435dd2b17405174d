// Isolated micro-benchmark: how much of the streaming bandwidth one thread gets while reading K/V
// in the decode kernel's order, with some work per row, under three prefetch schemes; and whether
// the memory time and the work time of a row overlap or add up.
//
//   g++ -O3 -march=native -o /tmp/decode_prefetch benchmarks/decode_prefetch.cpp && /tmp/decode_prefetch [tokens]
//
// The vectors are the machine's widest (GCC vector extensions: 64 bytes with AVX-512, else 32).
// The cache is fp32 (tokens, heads, d) = (32768, 8, 64), K and V (64 MiB each, past the caches;
// a smaller `tokens` only checks that it runs).
// Order (forward_decode.inc with kBlockN = 64): for each tile of 64 tokens, for each head, the
// head's 64 K rows (256 B each, 2 KiB apart), then its 64 V rows. Per row: its vectors consumed
// by 4 accumulators, then `work` rounds of kWorkChains independent FMAs on registers (12 with 32
// vector registers, 8 with 16; the decode kernel does a few dozen vector operations per row).
// Schemes:
//   none:       hardware prefetchers only;
//   next tile:  before a head's rows, all its rows of the next tile (a burst per tile);
//   N ahead:    before each row, the row N further on in the same head's stream (PREFETCHT1/T2
//               into L2, or PREFETCHT0), so requests are spread through the work.
// One thread, best of 5 per cell; "stream" is a plain sequential read of both tensors.
//
// The second table puts the time of a row's memory beside the time of its work: per work level,
// ns per row for the work alone (the same loop over a 64-token cache, 256 KiB, which stays in L2),
// the memory alone (work 0, rows 32 ahead into L2, from DRAM) and both together (from DRAM);
// overlap = (added − together) / (added − overlapped): 1 if the shorter part hides entirely under
// the longer, 0 if the two add up.
//
// The third table walks the cache in storage order (per chunk of 16 tokens: every head's K rows of
// the chunk, then every head's V rows, as the kernel reads an interleaved cache) as R ranges of
// tokens side by side (a chunk of range 0, then of range 1, ...; hardware prefetchers only): more
// streams in flight for one thread, the scheme that lifts a plain read from one stream's rate to
// the machine's (the extension's bandwidth probe reads 8 parts per thread side by side).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64, kWorkChains = 12;
#else
constexpr int kVecBytes = 32, kWorkChains = 8;
#endif
typedef float Vec __attribute__((vector_size(kVecBytes)));
constexpr int kLanes = kVecBytes / 4;

constexpr long kHeads = 8, kDim = 64, kTile = 64, kRowVecs = kDim / kLanes;
long kTokens = 32768;
float* key_cache;
float* value_cache;
volatile float sink;

float total(Vec x) {
  float sum = 0;
  for (int i = 0; i < kLanes; ++i) sum += x[i];
  return sum;
}

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }

void stream() {
  Vec a = {}, b = {};
  for (float* x : {key_cache, value_cache})
    for (long i = 0; i < kTokens * kHeads * kDim; i += 2 * kLanes) {
      a += load(x + i);
      b += load(x + i + kLanes);
    }
  sink = total(a + b);
}

// The work on one row: its vectors consumed by 4 accumulators, then `work` rounds of kWorkChains
// independent FMAs on registers.
struct RowWork {
  static constexpr int kChains = 4 + kWorkChains;
  Vec acc[kChains] = {};
  Vec m;
  RowWork() {
    for (int i = 0; i < kLanes; ++i) m[i] = 0.999f;
  }
  void consume(const float* row, int work) {
    const Vec x0 = load(row);
#pragma GCC unroll 16
    for (int i = 0; i < kRowVecs; ++i) acc[i % 4] = acc[i % 4] * m + load(row + i * kLanes);
    for (int w = 0; w < work; ++w)
#pragma GCC unroll 16
      for (int i = 4; i < kChains; ++i) acc[i] = acc[i] * m + x0;
  }
  void finish() const {  // (so that the loads and FMAs are not optimised away)
    Vec s = acc[0];
    for (int i = 1; i < kChains; ++i) s += acc[i];
    sink = total(s);
  }
};

enum Scheme { kNone, kNextTile, kAhead };

template <int kLocality>
inline void fetch_row(const float* row) {
  for (int b = 0; b < kDim * 4; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, kLocality);
}

template <Scheme kScheme, int kLocality>
void decode_order(int work, long ahead) {
  RowWork rows;
  for (long j0 = 0; j0 < kTokens; j0 += kTile)
    for (long h = 0; h < kHeads; ++h)
      for (float* x : {key_cache, value_cache}) {
        auto row_at = [&](long token) { return x + (token * kHeads + h) * kDim; };
        if (kScheme == kNextTile && j0 + kTile < kTokens)
          for (long r = 0; r < kTile; ++r) fetch_row<kLocality>(row_at(j0 + kTile + r));
        for (long r = 0; r < kTile; ++r) {
          if (kScheme == kAhead && j0 + r + ahead < kTokens) fetch_row<kLocality>(row_at(j0 + r + ahead));
          rows.consume(row_at(j0 + r), work);
        }
      }
  rows.finish();
}

// Storage order, `ranges` ranges of the tokens side by side (the third table).
void ranges_side_by_side(int work, long ranges) {
  constexpr long kChunk = 16;
  RowWork rows;
  const long per_range = kTokens / ranges;
  for (long c = 0; c < per_range; c += kChunk)
    for (long r = 0; r < ranges; ++r)
      for (float* x : {key_cache, value_cache})
        for (long h = 0; h < kHeads; ++h)
          for (long t = 0; t < kChunk; ++t) rows.consume(x + ((r * per_range + c + t) * kHeads + h) * kDim, work);
  rows.finish();
}

template <typename F>
double best_seconds(F&& f) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t = seconds();
    f();
    best = std::min(best, seconds() - t);
  }
  return best;
}

// A pass over the cache (K and V, every head) as GB/s read and as ns per row.
double rows_read() { return 2.0 * kTokens * kHeads; }
double gbps(double seconds) { return rows_read() * kDim * sizeof(float) / seconds / 1e9; }
double ns_per_row(double seconds) { return seconds / rows_read() * 1e9; }

void allocate(long tokens) {
  kTokens = tokens;
  const size_t bytes = kTokens * kHeads * kDim * sizeof(float);
  key_cache = static_cast<float*>(aligned_alloc(4096, bytes));
  value_cache = static_cast<float*>(aligned_alloc(4096, bytes));
  for (size_t i = 0; i < bytes / sizeof(float); ++i) {
    key_cache[i] = 1e-3f * static_cast<float>(i % 7);
    value_cache[i] = 1e-3f * static_cast<float>(i % 5);
  }
}

void release() {
  free(key_cache);
  free(value_cache);
}

}  // namespace

int main(int argc, char** argv) {
  const long tokens = argc > 1 ? std::max(2 * kTile, std::atol(argv[1]) / kTile * kTile) : kTokens;
  const int works[] = {0, 2, 4, 6};
  const auto fmas = [](int work) { return static_cast<int>(kRowVecs) + kWorkChains * work; };

  // Work alone: a 64-token cache (256 KiB of K and V) read over and over, in L2.
  double work_ns[4];
  allocate(kTile);
  for (int i = 0; i < 4; ++i)
    work_ns[i] = ns_per_row(best_seconds([&] {
                   for (int rep = 0; rep < 64; ++rep) decode_order<kNone, 3>(works[i], 0);
                 })) / 64;
  release();

  allocate(tokens);
  std::printf("one thread, GB/s of K and V read; stream (plain sequential read): %.1f; %d-byte vectors\n",
              gbps(best_seconds(stream)), kVecBytes);
  std::printf("%-6s %-6s %-10s %-10s %-12s %-12s %-12s %-12s\n", "work", "FMAs", "none", "next tile", "16 ahead L2",
              "32 ahead L2", "64 ahead L2", "32 ahead L1");
  double ahead32_l2_seconds[4];  // the kernel's scheme: the second table's "together"
  for (int i = 0; i < 4; ++i) {
    const int work = works[i];
    ahead32_l2_seconds[i] = best_seconds([&] { decode_order<kAhead, 1>(work, 32); });
    std::printf("%-6d %-6d %-10.1f %-10.1f %-12.1f %-12.1f %-12.1f %-12.1f\n", work, fmas(work),
                gbps(best_seconds([&] { decode_order<kNone, 3>(work, 0); })),
                gbps(best_seconds([&] { decode_order<kNextTile, 3>(work, 0); })),
                gbps(best_seconds([&] { decode_order<kAhead, 1>(work, 16); })), gbps(ahead32_l2_seconds[i]),
                gbps(best_seconds([&] { decode_order<kAhead, 1>(work, 64); })),
                gbps(best_seconds([&] { decode_order<kAhead, 3>(work, 32); })));
  }

  // Memory and work of a row, apart and together (rows 32 ahead into L2, the first table's
  // column). Work 0 is reading the row from L2 alone; the memory time already contains it, so it
  // counts once in "added".
  const double memory_ns = ns_per_row(ahead32_l2_seconds[0]);
  std::printf("\nns per 256-byte row: work alone (K/V in L2), memory alone (work 0, from DRAM), together (from\n"
              "DRAM); if they added up: memory + work - work at 0; if they overlapped: the larger\n");
  std::printf("%-6s %-6s %-8s %-8s %-9s %-8s %-10s %-8s\n", "work", "FMAs", "work", "memory", "together", "added",
              "overlapped", "overlap");
  for (int i = 0; i < 4; ++i) {
    const double together = ns_per_row(ahead32_l2_seconds[i]);
    const double added = memory_ns + work_ns[i] - work_ns[0], overlapped = std::max(memory_ns, work_ns[i]);
    std::printf("%-6d %-6d %-8.2f %-8.2f %-9.2f %-8.2f %-10.2f ", works[i], fmas(works[i]), work_ns[i], memory_ns,
                together, added, overlapped);
    // the share of the shorter part hidden: 1 when together = overlapped, 0 when together = added
    if (added > overlapped)
      std::printf("%.2f\n", (added - together) / (added - overlapped));
    else
      std::printf("-\n");
  }

  std::printf("\nstorage order, R ranges of tokens side by side (hardware prefetch only), GB/s\n");
  std::printf("%-6s %-6s %-8s %-8s %-8s %-8s\n", "work", "FMAs", "R=1", "R=2", "R=4", "R=8");
  for (int i = 0; i < 4; ++i) {
    std::printf("%-6d %-6d", works[i], fmas(works[i]));
    for (long ranges : {1, 2, 4, 8})
      std::printf(" %-8.1f", gbps(best_seconds([&] { ranges_side_by_side(works[i], ranges); })));
    std::printf("\n");
  }
  release();
}
