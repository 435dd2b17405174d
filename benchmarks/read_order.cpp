// Isolated micro-benchmark: how fast one K/V cache reads from DRAM in each order a decode could
// read it, with no work at all. decode_overlap.cpp times the decode's loops in the kernel's orders;
// this asks whether another order of the same loads would let the memory go faster, and what the
// plain read the benchmarks take as the bandwidth owes to its own order (benchmarks/README.md).
//
//   g++ -O3 -march=native -fopenmp -o /tmp/read_order benchmarks/read_order.cpp
//   /tmp/read_order [threads, default all] [tokens, default 32768] [rounds, default 4]
//
// Each thread reads its own fp32 K and V, (tokens, 8 K/V heads, d = 64) each: 64 MiB apiece at 32768
// tokens, past the caches. Every order loads each 64-byte line once (a head's row of a key is 256
// bytes, four lines; a key's row of every head 2 KiB), K before V:
//   plain, P parts    each thread's K (then V) as P parts side by side, 256 bytes of each in turn
//                     (8 parts is bench.measure_read_bandwidth's scheme: the "% of bandwidth"
//                     reference), or one part front to back;
//   chunk by head     the decode kernel's order before strand order (bf16's still): per chunk of 16
//                     keys, head by head, the head's 16 rows (2 KiB apart); the next chunk's rows of
//                     the head asked for into L2 just before (the kernel's NextChunk), or no asks;
//   key by key        storage order: per key, every head's row; each row asked for 16 keys ahead;
//   strands           per tile of 64 keys, 8 strands of 8 keys side by side: per key of a strand,
//                     head by head, that key's row of every strand (the decode kernel's strand
//                     order, forward_decode.inc); each row of the next tile asked for into L2 a
//                     step ahead of its own;
//   R ranges, ...     the keys cut into R ranges read in lockstep (as R of a thread's split items
//                     would be): per chunk, per range, head by head (chunk by head); or per key, per
//                     head, one row of each range in turn (key, head, range); or per key, per range,
//                     the key's 2 KiB row of every head (key, range); asks 16 keys ahead.
// Per order: GB/s of K and V read (all threads) in each round and their median, and the median's
// share of the median 8-part plain read. The orders run one after another in each round, so a
// change of the machine's pace between rounds shows in every order's column.

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr long kHeads = 8, kDim = 64, kChunk = 16, kAhead = 16;
constexpr long kHeadRowBytes = kDim * 4, kTokenBytes = kHeads * kHeadRowBytes;
typedef int v16i __attribute__((vector_size(64)));
volatile int sink;

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One thread's K and V and the running sum its loads feed (so none is left out).
struct Cache {
  char* key = nullptr;
  char* value = nullptr;
  long tokens = 0;
  v16i sum = {};

  void allocate(long count) {
    tokens = count;
    const size_t bytes = (count * kTokenBytes + (size_t{1} << 21) - 1) >> 21 << 21;  // aligned_alloc's multiple
    key = static_cast<char*>(aligned_alloc(size_t{1} << 21, bytes));
    value = static_cast<char*>(aligned_alloc(size_t{1} << 21, bytes));
    if (key == nullptr || value == nullptr) {
      std::fprintf(stderr, "read_order: could not allocate %zu bytes\n", 2 * bytes);
      std::exit(1);
    }
    memset(key, 1, count * kTokenBytes);  // by this thread: its pages on its side of the machine
    memset(value, 2, count * kTokenBytes);
  }
  void release() {
    free(key);
    free(value);
  }
  // `bytes` (a multiple of 128) at p, every line loaded once
  void load(const char* p, long bytes) {
    v16i a = {}, b = {};
    for (long o = 0; o < bytes; o += 128) {
      a += *reinterpret_cast<const v16i*>(p + o);
      b += *reinterpret_cast<const v16i*>(p + o + 64);
    }
    sum += a + b;
  }
  static void ask(const char* p, long bytes) {  // into L2 (PREFETCHT2)
    for (long o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
  }
  const char* row(const char* base, long t, long h) const { return base + t * kTokenBytes + h * kHeadRowBytes; }

  void plain(long parts) {
    const long part = tokens * kTokenBytes / parts;
    for (const char* base : {key, value})
      for (long i = 0; i < part; i += 256)
        for (long k = 0; k < parts; ++k) load(base + k * part + i, 256);
  }
  // keys [t0, t0 + span) per range, `ranges` ranges span keys apart
  void chunk_by_head(long ranges, bool asks) {
    const long span = tokens / ranges;
    for (const char* base : {key, value})
      for (long c = 0; c < span; c += kChunk)
        for (long r = 0; r < ranges; ++r)
          for (long h = 0; h < kHeads; ++h) {
            const long t = r * span + c;
            if (asks && c + kChunk < span)
              for (long i = 0; i < kChunk; ++i) ask(row(base, t + kChunk + i, h), kHeadRowBytes);
            for (long i = 0; i < kChunk; ++i) load(row(base, t + i, h), kHeadRowBytes);
          }
  }
  void key_head_range(long ranges) {
    const long span = tokens / ranges;
    for (const char* base : {key, value})
      for (long k = 0; k < span; ++k)
        for (long h = 0; h < kHeads; ++h)
          for (long r = 0; r < ranges; ++r) {
            const long t = r * span + k;
            if (k + kAhead < span) ask(row(base, t + kAhead, h), kHeadRowBytes);
            load(row(base, t, h), kHeadRowBytes);
          }
  }
  void strands() {
    constexpr long kTileKeys = 64, kStrands = 8, kStrandKeys = kTileKeys / kStrands;
    for (const char* base : {key, value})
      for (long t0 = 0; t0 + kTileKeys <= tokens; t0 += kTileKeys)
        for (long k = 0; k < kStrandKeys; ++k)
          for (long h = 0; h < kHeads; ++h)
            for (long i = 0; i < kStrands; ++i) {
              const long t = t0 + k + i * kStrandKeys;
              if (t0 + 2 * kTileKeys <= tokens) ask(row(base, t + kTileKeys, h), kHeadRowBytes);
              load(row(base, t, h), kHeadRowBytes);
            }
  }
  void key_range(long ranges) {
    const long span = tokens / ranges;
    for (const char* base : {key, value})
      for (long k = 0; k < span; ++k)
        for (long r = 0; r < ranges; ++r) {
          const long t = r * span + k;
          if (k + kAhead < span) ask(row(base, t + kAhead, 0), kTokenBytes);
          load(row(base, t, 0), kTokenBytes);
        }
  }
};

struct Order {
  const char* name;
  int kind;  // 0 plain, 1 chunk by head, 2 key/head/range, 3 key/range, 4 strands
  long count;  // parts or ranges
  bool asks;
};

void run(Cache& c, const Order& o) {
  switch (o.kind) {
    case 0: c.plain(o.count); break;
    case 1: c.chunk_by_head(o.count, o.asks); break;
    case 2: c.key_head_range(o.count); break;
    case 4: c.strands(); break;
    default: c.key_range(o.count); break;
  }
}

// GB/s of one pass of every thread (all in step), best of three
double rate(std::vector<Cache>& caches, const Order& o) {
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    double start = 0, elapsed = 0;
#pragma omp parallel num_threads(static_cast<int>(caches.size()))
    {
#pragma omp barrier
#pragma omp master
      start = seconds();
#pragma omp barrier
      run(caches[omp_get_thread_num()], o);
#pragma omp barrier
#pragma omp master
      elapsed = seconds() - start;
    }
    best = std::min(best, elapsed);
  }
  return 2.0 * caches[0].tokens * kTokenBytes * caches.size() / best / 1e9;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : omp_get_max_threads();
  // a multiple of 8 ranges' chunks
  const long tokens = argc > 2 ? std::max(8 * kChunk, std::atol(argv[2]) / (8 * kChunk) * (8 * kChunk)) : 32768;
  const int rounds = argc > 3 ? std::max(1, std::atoi(argv[3])) : 4;
  const Order orders[] = {
      {"plain, 8 parts", 0, 8, false},
      {"plain, 1 part", 0, 1, false},
      {"plain, 16 parts", 0, 16, false},
      {"chunk by head", 1, 1, true},
      {"chunk by head, no asks", 1, 1, false},
      {"key by key", 2, 1, true},
      {"strands", 4, 8, true},
      {"8 ranges, chunk by head", 1, 8, true},
      {"8 ranges, key/head/range", 2, 8, true},
      {"4 ranges, key/head/range", 2, 4, true},
      {"8 ranges, key/range", 3, 8, true},
  };
  constexpr int kOrders = sizeof(orders) / sizeof(orders[0]);
  std::vector<Cache> caches(threads);
#pragma omp parallel num_threads(threads)
  caches[omp_get_thread_num()].allocate(tokens);
  std::vector<std::vector<double>> rates(kOrders);
  for (int r = 0; r < rounds; ++r)
    for (int i = 0; i < kOrders; ++i) rates[i].push_back(rate(caches, orders[i]));
  v16i total = {};
  for (Cache& c : caches) {
    total += c.sum;
    c.release();
  }
  sink = total[0];
  const double reference = median(rates[0]);
  std::printf("%d thread(s), each with %ld tokens x %ld heads x d %ld of fp32 K and of V (%.0f MiB each), no work;\n"
              "GB/s of K and V read per round (best of 3 passes), the median, and its share of the 8-part read's:\n",
              threads, tokens, kHeads, kDim, tokens * kTokenBytes / double(1 << 20));
  std::printf("%-26s %-7s %-10s %s\n", "order", "median", "% of read", "rounds");
  for (int i = 0; i < kOrders; ++i) {
    const double m = median(rates[i]);
    std::printf("%-26s %-7.1f %-10.0f", orders[i].name, m, 100.0 * m / reference);
    for (double x : rates[i]) std::printf(" %.1f", x);
    std::printf("\n");
  }
}
