// Isolated micro-benchmark: how many products per second one core gets from AVX512-BF16 dot products
// (VDPBF16PS: two bf16 products per fp32 lane, 32 per instruction) against fp32 FMAs (VFMADD231PS,
// 16 per instruction), in GFLOP/s (2 flops per product). It is what decides whether the avx512bf16
// variant's bf16 forward (forward_bf16_dot.inc) can beat the avx512 variant's, which converts bf16
// to fp32 for the FMAs: only where the dot products' GFLOP/s clearly exceed the FMAs' (the bf16
// path also pays for pairing its operands and rounding P).
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
  return 0;
#endif
}
