// Isolated micro-benchmark: the GQA decode's own inner loops reading a K/V cache from DRAM. Does
// the memory time hide under the work, or do the two add up; and does a read order, a prefetch
// scheme or huge pages change that? This is the ceiling the decode forward meets on a machine
// where they add up (benchmarks/README.md).
//
//   g++ -O3 -march=native -fopenmp -o /tmp/decode_overlap benchmarks/decode_overlap.cpp
//   /tmp/decode_overlap [threads, default all] [tokens, default 32768; a multiple of 512, at least 1024]
//
// Each thread reads its own fp32 cache, (tokens, 8 K/V heads, d = 64) for K and again for V, 64 MiB
// each at 32768 tokens, past the caches. The work is forward_decode.inc's for four query rows per
// K/V head (GQA with four query heads per K/V head, one row each):
//   scores: the four rows' dot products with eight keys at a time, the rows interleaved by four
//           lanes and each key's four elements broadcast to them (dot_groups_of_four_rows<1, 8>);
//   values: O (4 rows x 64) += P V with O in 16 registers (the 4x4 register block of gemm_block);
// the softmax in between is left out (a scale of the scores), so the work is a lower bound of the
// kernel's. Orders:
//   kernel      per tile of 64 tokens, per chunk of 16: each head's K rows of the chunk (2 KiB
//               apart), then the chunk's V rows head by head (storage order, as the kernel reads a
//               (tokens, heads, d) cache); software prefetch of the rows 32 tokens ahead, every
//               head's span of a token at once, into L2 (PREFETCHT2, as the kernel), or none, or
//               128 ahead, or with the caches on transparent huge pages, or (next chunk/head) each
//               head's rows of the next chunk asked for into L2 just before the head's work in
//               this one, the kernel's NextChunk since it was measured here;
//   paged       the kernel's order and asks over a paged cache: blocks of 16 or 256 tokens, the
//               blocks in a shuffled order (a block table), as bench_kvcache.py's paged caches; a
//               chunk of 16 tokens never crosses a block, so the asks for the next chunk go
//               through the table as the kernel's NextChunk does;
//   strands     the kernel's order now (forward_decode.inc's strand order): per tile of 64 keys,
//               8 strands of 8 keys side by side; step k reads key k of every strand, head by
//               head, as one block of eight keys 8 rows apart (K: the eight-key dot products; V:
//               O += P V over the eight), each row of the next tile asked for into L2 a step
//               ahead of its own; the rows above with "kernel," are its order before (a chunk of
//               16 keys at a time, each head's 16 rows 2 KiB apart);
//   8 ranges    the keys cut into 8 ranges walked in lockstep, as 8 of a thread's split items
//               could be: K key by key, per key and head the eight ranges' rows as the eight keys
//               of one dot-product block (each range's row asked for into L2 16 keys ahead),
//               so each range is read in storage order and eight are in flight at once (a plain
//               read's parts side by side; read_order.cpp); V as the kernel, chunk by head, range
//               by range;
//   sequential  the same chunks, K read two tokens at a time for every head (the cache's own byte
//               order: each FMA loads its head's query vector), V as above; no software prefetch.
// Per order, ns per (key, K/V head), i.e. per 512 bytes of K and V:
//   work        the same loops over a 64-token cache (256 KiB per thread, in L2), over and over
//               (8 ranges: 512 tokens, a tile per range, 2 MiB per thread in L2 and L3);
//   memory      the same order from DRAM, one load per 64-byte line and no work;
//   together    the loops from DRAM;
// and, for "together", GB/s of K and V read (all threads) and its share of a plain read of the same
// caches in the same run (each thread's as 8 parts side by side, as the extension's probe);
// overlap = (work + memory − together) / min(work, memory): 1 when the shorter part hides under
// the longer, 0 when they add up.
// Where the CPU has AVX512-BF16, a second table does the same for a bf16 cache of the same shape
// (half the bytes) with the avx512bf16 variant's decode loops (decode_bf16_dot.inc) in the kernel's
// order with its next chunk/head asks:
//   scores: the four rows' pairs interleaved by four lanes against each key's four pairs broadcast
//           (vdpbf16ps), sixteen keys at a time (keys_block<16>);
//   values: each chunk's V rows interleaved into pairs of consecutive keys (store_interleaved_pairs),
//           then per tile P rounded to bf16 pairs and O (4 rows x 64) += P V, a pair of keys per
//           step (gemm_bf16_block<4, 4>); 256 bytes of K and V per (key, K/V head);
// and the same loops in a strand order for pairs ("bf16, strands", contiguous and paged in blocks
// of 16): per tile, 8 strands of 8 keys side by side, step k reading keys 2k and 2k + 1 of every
// strand (a pair of consecutive rows each, so V's pairs stay those of the tile's places), head by
// head, sixteen keys per step, each row of the next tile asked for into L2 a step ahead of its own.

#include <cstdio>

#if !defined(__AVX512F__)
// The loops measured are the kernel's AVX-512 ones (the four-row interleaved dot products exist
// only for 16-lane vectors).
int main() {
  std::printf("decode_overlap: built without AVX-512 (-march=native on a CPU without it): nothing to time\n");
  return 0;
}
#else
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

// (GCC 12 warns that its broadcast and shuffle intrinsics read an uninitialised "undefined"
// operand, which they never read: a false positive.)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

constexpr long kHeads = 8, kDim = 64, kRows = 4, kTile = 64, kChunk = 16;
constexpr long kRanges = 8;  // ranges in lockstep: one block of eight keys per key and head
constexpr long kStrands = 8, kStrandKeys = kTile / kStrands;  // strand order (forward_decode.inc)
volatile float sink;

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// `bytes` 2 MiB aligned (a huge page's), the size rounded up to a multiple of it as aligned_alloc
// asks; on huge pages if `huge`.
void* allocate_cache(size_t bytes, bool huge) {
  constexpr size_t kAlign = size_t{1} << 21;
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = aligned_alloc(kAlign, rounded);
  if (p == nullptr) {
    std::fprintf(stderr, "decode_overlap: could not allocate %zu bytes\n", rounded);
    std::exit(1);
  }
  if (huge) madvise(p, rounded, MADV_HUGEPAGE);
  return p;
}

enum class Order { kKernel, kSequential, kStrands };
enum class Fetch { kNone, kAhead32, kAhead128, kNextChunkByHead };

// One thread's K and V cache of element type T, (tokens, kHeads, kDim) each, and what the fp32 and
// bf16 decoders share: the score tile and O rows, the next chunk's asks, one load per line, the
// plain read.
template <typename T>
struct CacheRows {
  static constexpr long kTokenElems = kHeads * kDim;                   // one token's row of every head
  static constexpr long kLineElems = 64 / static_cast<long>(sizeof(T));  // elements per cache line
  long tokens = 0;
  T* key = nullptr;
  T* value = nullptr;
  long block_tokens = 0;          // 0: contiguous; else paged in blocks of this many tokens,
  std::vector<long> block_of;     // logical block b stored at block block_of[b]
  alignas(64) float scores[kHeads][kRows][kTile];
  alignas(64) float out[kHeads][kRows][kDim];
  float touched = 0;

  // K and V of `count` tokens, each element set to fill(i) by this thread (the one that reads it),
  // and O zeroed.
  template <typename Fill>
  void allocate_rows(long count, bool huge, Fill&& fill) {
    tokens = count;
    const size_t elems = tokens * kTokenElems;
    key = static_cast<T*>(allocate_cache(elems * sizeof(T), huge));
    value = static_cast<T*>(allocate_cache(elems * sizeof(T), huge));
    for (size_t i = 0; i < elems; ++i) {
      key[i] = fill(i, 7);
      value[i] = fill(i, 5);
    }
    memset(out, 0, sizeof out);
  }
  void release() {
    free(key);
    free(value);
  }
  // Store the cache in blocks of `count` tokens in a shuffled order (0: contiguous); a last partial
  // block stays last. The contents do not matter to the timings, so the blocks are only renamed,
  // not moved.
  void page(long count, unsigned seed) {
    block_tokens = count;
    block_of.resize(count > 0 ? (tokens + count - 1) / count : 0);
    std::iota(block_of.begin(), block_of.end(), 0L);
    if (count > 0) std::shuffle(block_of.begin(), block_of.begin() + tokens / count, std::mt19937(seed));
  }
  // token t's row of every head; the rows of tokens t .. t + kChunk - 1 (t a multiple of kChunk)
  // follow it, as a chunk never crosses a block
  const T* token_row(const T* base, long t) const {
    const long stored = block_tokens > 0 ? block_of[t / block_tokens] * block_tokens + t % block_tokens : t;
    return base + stored * kTokenElems;
  }
  // one head's row (kDim elements) into L2
  static void row_into_l2(const T* row) {
    for (long b = 0; b < kDim; b += kLineElems) _mm_prefetch(reinterpret_cast<const char*>(row + b), _MM_HINT_T2);
  }
  // head h's rows of tokens [t, t + kChunk) into L2 (the kernel's NextChunk, one head at a time)
  void fetch_head(const T* base, long h, long t) const {
    if (t >= tokens) return;
    const T* rows = token_row(base, t) + h * kDim;
    for (long r = 0; r < std::min(kChunk, tokens - t); ++r) row_into_l2(rows + r * kTokenElems);
  }
  // one load per line of head h's rows of tokens [t, t + count), count <= kChunk
  void touch(const T* base, long h, long t, long count) {
    float a = 0;
    const T* rows = token_row(base, t) + h * kDim;
    for (long r = 0; r < count; ++r)
      for (long b = 0; b < kDim; b += kLineElems) a += static_cast<float>(rows[r * kTokenElems + b]);
    touched += a;
  }
  void scale_scores() {  // (the softmax's place)
    for (long h = 0; h < kHeads; ++h)
      for (long r = 0; r < kRows; ++r)
        for (long c = 0; c < kTile; ++c) scores[h][r][c] *= 0.999f;
  }
  // K then V read as 8 parts side by side, 256 bytes of each in turn (the extension's read probe's
  // scheme: more streams in flight than one sequential read keeps on some machines).
  void stream() {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    const long part = tokens * kTokenElems * static_cast<long>(sizeof(T)) / 8;  // bytes
    for (const T* x : {key, value})
      for (long i = 0; i < part; i += 256)
        for (long k = 0; k < 8; ++k) {
          const char* p = reinterpret_cast<const char*>(x) + k * part + i;
          a = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_load_si512(p), _mm512_load_si512(p + 64)));
          b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_load_si512(p + 128), _mm512_load_si512(p + 192)));
        }
    touched += static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(a, b)));
  }
  float result() const { return out[0][0][0] + out[kHeads - 1][kRows - 1][kDim - 1] + touched; }
};

// One thread's fp32 cache and decode state.
struct Decoder : CacheRows<float> {
  alignas(64) float q4[kHeads][kDim * kRows];        // four rows interleaved by four lanes

  void allocate(long count, bool huge) {
    allocate_rows(count, huge, [](size_t i, size_t m) { return 1e-3f * static_cast<float>(i % m); });
    for (long h = 0; h < kHeads; ++h)
      for (long i = 0; i < kDim * kRows; ++i) q4[h][i] = 1e-2f * static_cast<float>(i % 11);
  }

  static __m512 sum_four_keys(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  }
  static void store_rows(__m512 u, float* s) {  // lane 4r + i: key i of row r
    _mm_storeu_ps(s, _mm512_castps512_ps128(u));
    _mm_storeu_ps(s + kTile, _mm512_extractf32x4_ps(u, 1));
    _mm_storeu_ps(s + 2 * kTile, _mm512_extractf32x4_ps(u, 2));
    _mm_storeu_ps(s + 3 * kTile, _mm512_extractf32x4_ps(u, 3));
  }
  // scores of eight keys of head h (rows ld floats apart) for its four rows
  void eight_keys(long h, const float* keys, long ld, float* s) {
    __m512 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm512_setzero_ps();
    for (long j = 0; j < kDim / 4; ++j) {
      const __m512 q = _mm512_load_ps(q4[h] + 16 * j);
      for (int c = 0; c < 8; ++c)
        acc[c] = _mm512_fmadd_ps(q, _mm512_broadcast_f32x4(_mm_loadu_ps(keys + c * ld + 4 * j)), acc[c]);
    }
    store_rows(sum_four_keys(acc[0], acc[1], acc[2], acc[3]), s);
    store_rows(sum_four_keys(acc[4], acc[5], acc[6], acc[7]), s + 4);
  }
  // scores of two tokens' keys of every head, read in the cache's byte order
  void two_tokens(const float* keys, long c) {
    __m512 acc[2 * kHeads];
    for (int i = 0; i < 2 * kHeads; ++i) acc[i] = _mm512_setzero_ps();
    for (long j = 0; j < kDim / 4; ++j)
      for (long h = 0; h < kHeads; ++h) {
        const __m512 q = _mm512_load_ps(q4[h] + 16 * j);
        acc[h] = _mm512_fmadd_ps(q, _mm512_broadcast_f32x4(_mm_loadu_ps(keys + h * kDim + 4 * j)), acc[h]);
        acc[kHeads + h] = _mm512_fmadd_ps(
            q, _mm512_broadcast_f32x4(_mm_loadu_ps(keys + kTokenElems + h * kDim + 4 * j)), acc[kHeads + h]);
      }
    for (long t = 0; t < 2; ++t)
      for (long h = 0; h < kHeads; h += 4) {
        alignas(64) float u[16];
        _mm512_store_ps(u, sum_four_keys(acc[t * kHeads + h], acc[t * kHeads + h + 1], acc[t * kHeads + h + 2],
                                         acc[t * kHeads + h + 3]));
        for (long r = 0; r < kRows; ++r)
          for (long i = 0; i < 4; ++i) scores[h + i][r][c + t] = u[4 * r + i];
      }
  }
  // O of head h += Σ_c P[r][c] · V rows (ld apart), count rows
  void weighted_values(long h, const float* rows, long ld, long c0, long count) {
    __m512 acc[kRows][4];
    for (long r = 0; r < kRows; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_load_ps(out[h][r] + 16 * v);
    for (long c = 0; c < count; ++c) {
      const float* row = rows + c * ld;
      const __m512 x0 = _mm512_loadu_ps(row), x1 = _mm512_loadu_ps(row + 16), x2 = _mm512_loadu_ps(row + 32),
                   x3 = _mm512_loadu_ps(row + 48);
      for (long r = 0; r < kRows; ++r) {
        const __m512 w = _mm512_set1_ps(scores[h][r][c0 + c]);
        acc[r][0] = _mm512_fmadd_ps(w, x0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w, x1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(w, x2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(w, x3, acc[r][3]);
      }
    }
    for (long r = 0; r < kRows; ++r)
      for (int v = 0; v < 4; ++v) _mm512_store_ps(out[h][r] + 16 * v, acc[r][v]);
  }
  void fetch(const float* base, long t, long ahead) const {  // every head's rows of tokens [t, t + kChunk) + ahead
    for (long r = t + ahead; r < std::min(t + ahead + kChunk, tokens); ++r)
      for (long b = 0; b < kTokenElems; b += 16)
        _mm_prefetch(reinterpret_cast<const char*>(base + r * kTokenElems + b), _MM_HINT_T2);
  }

  // K of tokens [t0, t0 + kTile) of each of the kRanges ranges `span` tokens apart, key by key: per
  // key and head, the ranges' rows as one block of eight keys (rows span·kTokenElems apart)
  void keys_in_lockstep(long t0, long span, bool work) {
    for (long k = t0; k < t0 + kTile; ++k)
      for (long h = 0; h < kHeads; ++h) {
        if (k + kChunk < span)
          for (long r = 0; r < kRanges; ++r) row_into_l2(key + (r * span + k + kChunk) * kTokenElems + h * kDim);
        if (work)
          eight_keys(h, key + k * kTokenElems + h * kDim, span * kTokenElems, &scores[h][0][(k - t0) & ~7L]);
        else
          for (long r = 0; r < kRanges; ++r) touch(key, h, r * span + k, 1);
      }
  }

  // Strand order (the kernel's now): per tile, kStrands strands of kStrandKeys keys side by side;
  // step k reads key k of every strand, head by head, as one block of eight keys kStrandKeys rows
  // apart, the next tile's same rows of the head asked for into L2 first; K, then V.
  void strand_tile(const float* base, long t0, bool work, bool values) {
    for (long k = 0; k < kStrandKeys; ++k)
      for (long h = 0; h < kHeads; ++h) {
        if (t0 + kTile < tokens)
          for (long i = 0; i < kStrands; ++i)
            row_into_l2(base + (t0 + kTile + k + i * kStrandKeys) * kTokenElems + h * kDim);
        const float* rows = base + (t0 + k) * kTokenElems + h * kDim;
        if (!work)
          for (long i = 0; i < kStrands; ++i) touch(base, h, t0 + k + i * kStrandKeys, 1);
        else if (values)
          weighted_values(h, rows, kStrandKeys * kTokenElems, k * kStrands, kStrands);
        else
          eight_keys(h, rows, kStrandKeys * kTokenElems, &scores[h][0][k * kStrands]);
      }
  }

  // One pass over the cache in `order`; work = false: one load per line instead of the work.
  // lockstep: K key by key over kRanges ranges (a contiguous cache; V with the next chunk/head asks).
  void pass(Order order, Fetch fetch_scheme, bool work, bool lockstep = false) {
    const long ahead = fetch_scheme == Fetch::kAhead32 ? 32 : 128;
    const bool burst = fetch_scheme == Fetch::kAhead32 || fetch_scheme == Fetch::kAhead128;
    const bool by_head = fetch_scheme == Fetch::kNextChunkByHead;
    if (order == Order::kStrands) {
      for (long t0 = 0; t0 < tokens; t0 += kTile) {
        strand_tile(key, t0, work, false);
        scale_scores();
        strand_tile(value, t0, work, true);
      }
      return;
    }
    if (lockstep) {
      const long span = tokens / kRanges;  // a multiple of kTile (main's tokens are of kRanges · kTile)
      for (long t0 = 0; t0 < span; t0 += kTile) {
        keys_in_lockstep(t0, span, work);
        for (long r = 0; r < kRanges; ++r) scale_scores();
        for (long c = 0; c < kTile; c += kChunk)
          for (long r = 0; r < kRanges; ++r)
            for (long h = 0; h < kHeads; ++h) {
              const long t = r * span + t0 + c;
              if (t0 + c + kChunk < span) fetch_head(value, h, t + kChunk);
              if (work)
                weighted_values(h, value + t * kTokenElems + h * kDim, kTokenElems, c, kChunk);
              else
                touch(value, h, t, kChunk);
            }
      }
      return;
    }
    for (long t0 = 0; t0 < tokens; t0 += kTile) {
      for (long c = 0; c < kTile; c += kChunk) {
        const long t = t0 + c;
        if (burst) fetch(key, t, ahead);
        if (!work) {
          if (order == Order::kKernel)
            for (long h = 0; h < kHeads; ++h) {
              if (by_head) fetch_head(key, h, t + kChunk);
              touch(key, h, t, kChunk);
            }
          else
            for (long b = 0; b < kChunk * kTokenElems; b += 16) touched += key[t * kTokenElems + b];
        } else if (order == Order::kKernel) {
          for (long h = 0; h < kHeads; ++h) {
            if (by_head) fetch_head(key, h, t + kChunk);
            for (long i = 0; i < kChunk; i += 8)
              eight_keys(h, token_row(key, t) + i * kTokenElems + h * kDim, kTokenElems, &scores[h][0][c + i]);
          }
        } else {
          for (long i = 0; i < kChunk; i += 2) two_tokens(key + (t + i) * kTokenElems, c + i);
        }
      }
      scale_scores();
      for (long c = 0; c < kTile; c += kChunk) {
        const long t = t0 + c;
        if (burst) fetch(value, t, ahead);
        for (long h = 0; h < kHeads; ++h) {
          if (by_head) fetch_head(value, h, t + kChunk);
          if (work)
            weighted_values(h, token_row(value, t) + h * kDim, kTokenElems, c, kChunk);
          else
            touch(value, h, t, kChunk);
        }
      }
    }
  }
};

// Best of five: seconds for `passes` passes of every thread (all in step, each over its own cache).
template <typename D, typename F>
double best_seconds(std::vector<D>& decoders, int passes, F&& f, int reps = 5) {
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    double elapsed = 0;
#pragma omp parallel num_threads(static_cast<int>(decoders.size()))
    {
      D& d = decoders[omp_get_thread_num()];
#pragma omp barrier
      const double start = seconds();
      for (int i = 0; i < passes; ++i) f(d);
#pragma omp barrier
#pragma omp master
      elapsed = seconds() - start;
    }
    best = std::min(best, elapsed);
  }
  return best;
}

// Median of seven single passes of every thread: GB/s of a plain read.
template <typename D>
double read_gbps(std::vector<D>& decoders, double bytes) {
  std::vector<double> rates;
  for (int rep = 0; rep < 7; ++rep)
    rates.push_back(bytes / best_seconds(decoders, 1, [](D& d) { d.stream(); }, 1) / 1e9);
  std::sort(rates.begin(), rates.end());
  return rates[3];
}

template <typename D>
void allocate_all(std::vector<D>& decoders, long tokens, bool huge) {
#pragma omp parallel num_threads(static_cast<int>(decoders.size()))
  decoders[omp_get_thread_num()].allocate(tokens, huge);
}
// every thread's cache paged in shuffled blocks of `block_tokens` (0: contiguous), its own order
template <typename D>
void page_all(std::vector<D>& decoders, long block_tokens) {
  for (size_t i = 0; i < decoders.size(); ++i) decoders[i].page(block_tokens, static_cast<unsigned>(i + 1));
}
template <typename D>
float release_all(std::vector<D>& decoders) {
  float total = 0;
  for (D& d : decoders) {
    total += d.result();
    d.release();
  }
  return total;
}

// The table's header, and one row: ns per (key, K/V head) per thread for the work alone, the
// memory alone and both together; the GB/s of `bytes` read in `together` ns per each of `pairs`,
// as % of the plain read; overlap = (work + memory − together) / min(work, memory).
void print_header() {
  std::printf("%-24s %-7s %-7s %-9s %-7s %-10s %-7s\n", "order", "work", "memory", "together", "GB/s", "% of read",
              "overlap");
}
void print_row(const char* name, double work, double memory, double together, double bytes, double pairs,
               double read) {
  const double gbps = bytes / (together * pairs * 1e-9) / 1e9;
  std::printf("%-24s %-7.2f %-7.2f %-9.2f %-7.1f %-10.0f %-7.2f\n", name, work, memory, together, gbps,
              100.0 * gbps / read, (work + memory - together) / std::min(work, memory));
}

#if defined(__AVX512BF16__)
// One thread's bf16 cache and decode state (the avx512bf16 variant's loops; values not meaningful).
struct DecoderBf16 : CacheRows<uint16_t> {
  alignas(64) uint32_t q4[kHeads][kDim / 8 * 16];  // step j: lane 4r + t = row r's pair 4j + t
  alignas(64) uint32_t p_pairs[kHeads][kRows][kTile / 2];
  alignas(64) uint32_t v_pairs[kHeads][kTile / 2][kDim];

  void allocate(long count, bool huge) {  // small bf16 values
    allocate_rows(count, huge, [](size_t i, size_t m) { return static_cast<uint16_t>(0x3a00 + i % m); });
    for (long h = 0; h < kHeads; ++h)
      for (long i = 0; i < kDim / 8 * 16; ++i) q4[h][i] = 0x3c003c00u + static_cast<uint32_t>(i % 11);
  }
  // head h's tile: P rounded to bf16 pairs, then O (4 rows x 64, in registers) += P V a pair at a time
  void tile_values(long h) {
    for (long r = 0; r < kRows; ++r)
      for (long c = 0; c < kTile; c += 32)
        _mm512_store_si512(p_pairs[h][r] + c / 2,
                           (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(scores[h][r] + c + 16),
                                                        _mm512_load_ps(scores[h][r] + c)));
    __m512 acc[kRows][4];
    for (long r = 0; r < kRows; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_load_ps(out[h][r] + 16 * v);
    for (long t = 0; t < kTile / 2; ++t) {
      const __m512bh x0 = (__m512bh)_mm512_load_si512(v_pairs[h][t]), x1 = (__m512bh)_mm512_load_si512(v_pairs[h][t] + 16),
                     x2 = (__m512bh)_mm512_load_si512(v_pairs[h][t] + 32), x3 = (__m512bh)_mm512_load_si512(v_pairs[h][t] + 48);
      for (long r = 0; r < kRows; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[h][r][t]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, x0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w, x1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w, x2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w, x3);
      }
    }
    for (long r = 0; r < kRows; ++r)
      for (int v = 0; v < 4; ++v) _mm512_store_ps(out[h][r] + 16 * v, acc[r][v]);
  }
  // scores of the sixteen keys rows[c] (head h's rows) for its four rows, into s[c]
  void sixteen_listed_keys(long h, const uint16_t* const* rows, float* s) {
    __m512 acc[16];
    for (int c = 0; c < 16; ++c) acc[c] = _mm512_setzero_ps();
    for (long j = 0; j < kDim / 8; ++j) {
      const __m512bh q = (__m512bh)_mm512_load_si512(q4[h] + 16 * j);
      for (int c = 0; c < 16; ++c)
        acc[c] = _mm512_dpbf16_ps(
            acc[c], q, (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[c] + 8 * j))));
    }
    for (int c = 0; c < 16; c += 4)
      Decoder::store_rows(Decoder::sum_four_keys(acc[c], acc[c + 1], acc[c + 2], acc[c + 3]), s + c);
  }
  // head h's V rows of the key pairs rows[2t], rows[2t + 1] (t < 8) as pair row pair_row[t]
  void gather_listed_pairs(long h, const uint16_t* const* rows, const long* pair_row) {
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                            38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (long t = 0; t < kChunk / 2; ++t)
      for (long x = 0; x < kDim; x += 32) {
        const __m512i a = _mm512_loadu_si512(rows[2 * t] + x), b = _mm512_loadu_si512(rows[2 * t + 1] + x);
        uint32_t* o = v_pairs[h][pair_row[t]] + x;
        _mm512_store_si512(o, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_store_si512(o + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
  }
  // scores of sixteen keys of head h (rows ld elements apart) for its four rows
  void sixteen_keys(long h, const uint16_t* keys, long ld, float* s) {
    const uint16_t* rows[16];
    for (int c = 0; c < 16; ++c) rows[c] = keys + c * ld;
    sixteen_listed_keys(h, rows, s);
  }
  // head h's V rows of a chunk (ld elements apart) as pairs of consecutive keys at pair row c0 / 2
  void gather_pairs(long h, const uint16_t* rows, long ld, long c0) {
    const uint16_t* listed[kChunk];
    long pair_row[kChunk / 2];
    for (long c = 0; c < kChunk; ++c) listed[c] = rows + c * ld;
    for (long t = 0; t < kChunk / 2; ++t) pair_row[t] = c0 / 2 + t;
    gather_listed_pairs(h, listed, pair_row);
  }
  // Strand order with pairs: per tile, kStrands strands of kStrandKeys keys side by side; step k
  // reads keys 2k and 2k + 1 of every strand (a pair, consecutive rows), head by head, sixteen
  // keys at a time, the next tile's same rows of the head asked for into L2 first; K, then V (the
  // pairs by their places in the tile, as the kernel's). The scores are left in the steps' order
  // (the kernel puts them back into key order; a permutation of the tile's 64 columns).
  void strand_tile(const uint16_t* base, long t0, bool work, bool values) {
    for (long k = 0; k < kStrandKeys / 2; ++k)
      for (long h = 0; h < kHeads; ++h) {
        const uint16_t* rows[kChunk];
        long pair_row[kChunk / 2];
        for (long i = 0; i < kStrands; ++i) {
          const long key0 = i * kStrandKeys + 2 * k;
          if (t0 + kTile < tokens) {
            row_into_l2(token_row(base, t0 + kTile + key0) + h * kDim);
            row_into_l2(token_row(base, t0 + kTile + key0 + 1) + h * kDim);
          }
          rows[2 * i] = token_row(base, t0 + key0) + h * kDim;
          rows[2 * i + 1] = token_row(base, t0 + key0 + 1) + h * kDim;
          pair_row[i] = key0 / 2;
        }
        if (!work)
          for (long i = 0; i < kStrands; ++i) touch(base, h, t0 + i * kStrandKeys + 2 * k, 2);
        else if (values)
          gather_listed_pairs(h, rows, pair_row);
        else
          sixteen_listed_keys(h, rows, &scores[h][0][k * kChunk]);
      }
  }
  void strand_pass(bool work) {
    for (long t0 = 0; t0 < tokens; t0 += kTile) {
      strand_tile(key, t0, work, false);
      scale_scores();
      strand_tile(value, t0, work, true);
      if (work)
        for (long h = 0; h < kHeads; ++h) tile_values(h);
    }
  }
  // One pass in the kernel's order with its next chunk/head asks; work = false: one load per line.
  void pass(bool work) {
    for (long t0 = 0; t0 < tokens; t0 += kTile) {
      for (long c = 0; c < kTile; c += kChunk)
        for (long h = 0; h < kHeads; ++h) {
          fetch_head(key, h, t0 + c + kChunk);
          if (work)
            sixteen_keys(h, token_row(key, t0 + c) + h * kDim, kTokenElems, &scores[h][0][c]);
          else
            touch(key, h, t0 + c, kChunk);
        }
      scale_scores();
      for (long c = 0; c < kTile; c += kChunk)
        for (long h = 0; h < kHeads; ++h) {
          fetch_head(value, h, t0 + c + kChunk);
          if (work)
            gather_pairs(h, token_row(value, t0 + c) + h * kDim, kTokenElems, c);
          else
            touch(value, h, t0 + c, kChunk);
        }
      if (work)
        for (long h = 0; h < kHeads; ++h) tile_values(h);
    }
  }
};

// The bf16 table: work alone (a 64-token cache), memory alone, together, against a plain read.
float bf16_table(int threads, long tokens) {
  std::vector<DecoderBf16> decoders(threads);
  const double pairs = static_cast<double>(tokens) * kHeads;
  const double bytes = 2.0 * tokens * DecoderBf16::kTokenElems * sizeof(uint16_t) * threads;
  struct Layout {
    const char* name;
    long blocks;
    bool strands;
  };
  const Layout layouts[] = {{"bf16, next chunk/head", 0, false}, {"bf16, paged 16", 16, false},
                            {"bf16, paged 256", 256, false},      {"bf16, strands", 0, true},
                            {"bf16, strands, paged 16", 16, true}};
  constexpr int kLayouts = sizeof(layouts) / sizeof(layouts[0]);
  double work[kLayouts], memory[kLayouts], together[kLayouts];
  const auto pass = [](const Layout& layout, bool work_too) {
    return [&layout, work_too](DecoderBf16& d) { layout.strands ? d.strand_pass(work_too) : d.pass(work_too); };
  };
  allocate_all(decoders, kTile, false);
  for (int i = 0; i < kLayouts; ++i) {
    page_all(decoders, std::min(layouts[i].blocks, kTile));
    work[i] = best_seconds(decoders, 512, pass(layouts[i], true)) / 512 / (static_cast<double>(kTile) * kHeads) * 1e9;
  }
  float total = release_all(decoders);
  allocate_all(decoders, tokens, false);
  const double read_before = read_gbps(decoders, bytes);
  for (int i = 0; i < kLayouts; ++i) {
    page_all(decoders, layouts[i].blocks);
    memory[i] = best_seconds(decoders, 1, pass(layouts[i], false)) / pairs * 1e9;
    together[i] = best_seconds(decoders, 1, pass(layouts[i], true)) / pairs * 1e9;
  }
  const double read_after = read_gbps(decoders, bytes), best_read = std::max(read_before, read_after);
  total += release_all(decoders);
  std::printf("\nbf16 K and V of the same shape (%.1f MiB each per thread), the avx512bf16 decode loops; a plain\n"
              "read: %.1f GB/s before, %.1f after (the larger used). ns per (key, K/V head) per thread:\n",
              tokens * DecoderBf16::kTokenElems * 2.0 / (1 << 20), read_before, read_after);
  print_header();
  for (int i = 0; i < kLayouts; ++i) print_row(layouts[i].name, work[i], memory[i], together[i], bytes, pairs, best_read);
  return total;
}
#endif  // __AVX512BF16__

struct Variant {
  const char* name;
  Order order;
  Fetch fetch;
  bool huge;
  long blocks;    // 0: contiguous; else paged in shuffled blocks of this many tokens
  bool lockstep;  // K key by key over kRanges ranges
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : omp_get_max_threads();
  // a multiple of the lockstep's kRanges tiles
  constexpr long kUnit = kRanges * kTile;
  const long tokens = argc > 2 ? std::max(2 * kUnit, std::atol(argv[2]) / kUnit * kUnit) : 32768;
  std::vector<Decoder> decoders(threads);
  const double pairs = static_cast<double>(tokens) * kHeads;  // (key, K/V head) pairs per pass
  const double bytes = 2.0 * tokens * Decoder::kTokenElems * sizeof(float) * threads;

  const Variant variants[] = {
      {"kernel, 32 ahead", Order::kKernel, Fetch::kAhead32, false, 0, false},
      {"kernel, no prefetch", Order::kKernel, Fetch::kNone, false, 0, false},
      {"kernel, 128 ahead", Order::kKernel, Fetch::kAhead128, false, 0, false},
      {"kernel, 32 ahead, THP", Order::kKernel, Fetch::kAhead32, true, 0, false},
      {"kernel, next chunk/head", Order::kKernel, Fetch::kNextChunkByHead, false, 0, false},
      {"sequential", Order::kSequential, Fetch::kNone, false, 0, false},
      {"kernel, paged 16", Order::kKernel, Fetch::kNextChunkByHead, false, 16, false},
      {"kernel, paged 256", Order::kKernel, Fetch::kNextChunkByHead, false, 256, false},
      {"8 ranges, K by key", Order::kKernel, Fetch::kNextChunkByHead, false, 0, true},
      {"kernel, strands", Order::kStrands, Fetch::kNone, false, 0, false},
  };
  constexpr int kVariants = sizeof(variants) / sizeof(variants[0]);
  // Work alone: a 64-token cache per thread (in L2), read 512 times per timing; the lockstep's
  // eight ranges need a tile each: kRanges · 64 tokens (2 MiB of K and V per thread, read 64 times).
  double work_ns[kVariants];
  float total = 0;
  for (const long cached : {kTile, kUnit}) {
    allocate_all(decoders, cached, false);
    for (int i = 0; i < kVariants; ++i) {
      const Variant& v = variants[i];
      if ((cached == kUnit) != v.lockstep) continue;
      page_all(decoders, std::min(v.blocks, cached));
      const int passes = static_cast<int>(32768 / cached);
      work_ns[i] = best_seconds(decoders, passes, [&](Decoder& d) { d.pass(v.order, v.fetch, true, v.lockstep); }) /
                   passes / (static_cast<double>(cached) * kHeads) * 1e9;
    }
    total += release_all(decoders);
  }

  allocate_all(decoders, tokens, false);
  const double read_before = read_gbps(decoders, bytes);
  std::vector<double> row_memory, row_together;
  for (int i = 0; i < kVariants; ++i) {
    const Variant& v = variants[i];
    if (v.huge) {
      total += release_all(decoders);
      allocate_all(decoders, tokens, true);
    }
    page_all(decoders, v.blocks);
    const double memory = best_seconds(decoders, 1, [&](Decoder& d) { d.pass(v.order, v.fetch, false, v.lockstep); });
    const double together = best_seconds(decoders, 1, [&](Decoder& d) { d.pass(v.order, v.fetch, true, v.lockstep); });
    row_memory.push_back(memory / pairs * 1e9);
    row_together.push_back(together / pairs * 1e9);
    if (v.huge) {
      total += release_all(decoders);
      allocate_all(decoders, tokens, false);
    }
  }
  const double read_after = read_gbps(decoders, bytes), read = std::max(read_before, read_after);
  total += release_all(decoders);
  sink = total;
  std::printf("%d thread(s), each with %ld tokens x %ld heads x d %ld of fp32 K and of V (%.0f MiB each); a plain\n"
              "read of them (8 parts per thread side by side, median of 7): %.1f GB/s before the table, %.1f\n"
              "after (the larger used). ns per (key, K/V head) per thread:\n",
              threads, tokens, kHeads, kDim, tokens * Decoder::kTokenElems * 4.0 / (1 << 20), read_before, read_after);
  print_header();
  for (int i = 0; i < kVariants; ++i)
    print_row(variants[i].name, work_ns[i], row_memory[i], row_together[i], bytes, pairs, read);
#if defined(__AVX512BF16__)
  sink = sink + bf16_table(threads, tokens);
#else
  std::printf("\n(no AVX512-BF16 here: no bf16 table)\n");
#endif
}
#endif  // __AVX512F__
