// Isolated micro-benchmark: how many products per second one core gets from AVX512-BF16 dot products
// (VDPBF16PS: two bf16 products per fp32 lane, 32 per instruction) against fp32 FMAs (VFMADD231PS,
// 16 per instruction), in GFLOP/s (2 flops per product). It is what decides whether the avx512bf16
// variant's bf16 forward (forward_bf16_dot.inc) can beat the avx512 variant's, which converts bf16
// to fp32 for the FMAs: only where the dot products' GFLOP/s clearly exceed the FMAs' (the bf16
// path also pays for pairing its operands and rounding P). Where the CPU has AMX (and Linux grants
// a process its tile state), a last row times AMX-BF16 tile products (TDPBF16PS, 16x16 outputs of
// 32 products each, four independent accumulator tiles): the ceiling of a bf16 path on AMX, which
// the kernels here do not have (torch's bf16 GEMMs on such a CPU use it).
//
//   g++ -O2 -o /tmp/bf16_dot_throughput benchmarks/bf16_dot_throughput.cpp && /tmp/bf16_dot_throughput [iterations]
//
// Each kernel runs kChains independent accumulator chains (enough for the latency of two pipes:
// on an Intel Xeon, family 6 model 167, 24 chains gave the same rates as 12), `iterations` rounds,
// best of 5, on the calling thread; the inputs stay in registers, so nothing but the
// instruction's own throughput is timed. On a CPU without AVX512-BF16, a machine that is not
// x86-64 or a compiler without AVX512-BF16 (GCC < 10) it says so and times nothing.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define HAVE_BF16_DOT 1
#include <immintrin.h>
#if defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#endif

namespace {

constexpr int kChains = 12;

// Stores the accumulators' sum where the compiler must assume it is read, so no chain is removed.
__attribute__((target("avx512f"))) void keep(__m512 total) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, total);
  volatile float sink = 0.0f;
  for (float x : lanes) sink = sink + x;
}

__attribute__((target("avx512f,fma"), noinline)) double fp32_fma(int64_t iterations) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));  // the operands stay opaque: no constant folding
  }
  __m512 total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, acc[c]);
  keep(total);
  return 2.0 * 16 * kChains * static_cast<double>(iterations);
}

__attribute__((target("avx512f,avx512bf16"), noinline)) double bf16_dot(int64_t iterations) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  // bf16 1.0 and 2^-24: the sums stay finite and normal
  __m512i a = _mm512_set1_epi16(0x3f80), b = _mm512_set1_epi16(0x3380);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)a, (__m512bh)b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512 total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, acc[c]);
  keep(total);
  return 2.0 * 32 * kChains * static_cast<double>(iterations);  // 32 products per instruction
}

#ifdef HAVE_AMX
// The tile configuration: palette 1, tiles 0-7 of 16 rows x 64 bytes (16 fp32 or 32 bf16 a row).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
bool cpu_has_amx_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx >> 22 & 1) && (edx >> 24 & 1);
}

// Linux hands a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults.
bool amx_permitted() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

__attribute__((target("amx-tile,amx-bf16"), noinline)) double amx_bf16(int64_t iterations) {
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
  alignas(64) static uint16_t a[16 * 32], b[16 * 32];
  alignas(64) static float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = 0x3f80;  // bf16 1.0
    b[i] = 0x3380;  // bf16 2^-24
  }
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t it = 0; it < iterations; ++it) {  // four independent accumulator tiles
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  volatile float sink = c[0];
  (void)sink;
  return 2.0 * 4 * 16 * 16 * 32 * static_cast<double>(iterations);
}
#endif

double best_gflops(double (*kernel)(int64_t), int64_t iterations) {
  double best = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    const double flops = kernel(iterations);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (flops / seconds / 1e9 > best) best = flops / seconds / 1e9;
  }
  return best;
}

}  // namespace
#endif

int main(int argc, char** argv) {
  const int64_t iterations = argc > 1 ? std::atoll(argv[1]) : 50000000;
#ifndef HAVE_BF16_DOT
  (void)iterations;
  std::printf("this build has no AVX512-BF16 (not x86-64, or the compiler lacks it): nothing to time\n");
  return 0;
#else
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bf16")) {
    std::printf("this CPU has no AVX512-BF16: nothing to time\n");
    return 0;
  }
  const double fma = best_gflops(fp32_fma, iterations);
  const double dot = best_gflops(bf16_dot, iterations);
  std::printf("one thread, GFLOP/s (best of 5, %d independent chains, %lld rounds)\n", kChains,
              static_cast<long long>(iterations));
  std::printf("fp32 FMA (vfmadd231ps zmm)        %8.1f\n", fma);
  std::printf("bf16 dot product (vdpbf16ps zmm)  %8.1f\n", dot);
  std::printf("dot / FMA                         %8.2f\n", dot / fma);
#ifdef HAVE_AMX
  if (!cpu_has_amx_bf16())
    std::printf("bf16 AMX tiles (tdpbf16ps)        n/a: no AMX-BF16 on this CPU\n");
  else if (!amx_permitted())
    std::printf("bf16 AMX tiles (tdpbf16ps)        n/a: the kernel refused the tile state\n");
  else  // a tile product is ~100x a vector instruction's work: fewer rounds take as long
    std::printf("bf16 AMX tiles (tdpbf16ps)        %8.1f\n", best_gflops(amx_bf16, iterations / 16 + 1));
#else
  std::printf("bf16 AMX tiles (tdpbf16ps)        n/a: not built (needs Linux and GCC >= 11 or clang >= 12)\n");
#endif
  return 0;
#endif
}
