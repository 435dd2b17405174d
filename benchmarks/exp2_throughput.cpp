// Isolated micro-benchmark: the vector exp2 of the softmax (csrc/cpu/vector_math.inc, exp2_vec) in
// its AVX-512 form, against two others, on one core. All write 2^x = 2^n · P(f) with a degree-6
// polynomial P and scale by 2^n with vscalefps, lanes below the smallest normal zeroed by a
// compare's mask; they differ in how x is split:
//   round:   n = round(x) by vrndscaleps, f = x − n by a subtract (the kernels' form until
//            vreduceps replaced it);
//   reduce:  f = x − round(x) by one vreduceps, n = x − f by a subtract (the kernels' form): both
//            exact, so the same f and n, bit for bit the same results;
//   floor:   f = x − floor(x) in [0, 1) by one vreduceps and vscalefps(P, x), which takes floor(x)
//            itself, P fitted on [0, 1): one instruction fewer, but vreduceps rounds x − floor(x)
//            down where it is not exact (−1 < x < 0: the scores nearest the row's max), which
//            costs accuracy (the kernels do not use it).
// On cores whose only 512-bit ports are the two FMA ports, each of those instructions takes an
// FMA's place in the forward, whose softmax runs beside its GEMMs.
//
//   g++ -O2 -o /tmp/exp2_throughput benchmarks/exp2_throughput.cpp && /tmp/exp2_throughput [rounds]
//
// Timed: an L1-resident array of 4096 logits read, shifted, exponentiated, stored and summed (the
// forward's softmax step), `rounds` passes, best of 5. Accuracy: the largest error in float ulps of
// 2^x (its float rounding's ulp) over 2^22 points in [−126, 0] and 2^22 random ones in (−1/2, 0);
// "same bits" compares each form with round's on those points and ±0, −inf, NaN, −126.5, −127.
// On a CPU without AVX-512 (F and DQ), a machine that is not x86-64 or a compiler too old for
// their intrinsics it says so and times nothing.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9))
#include <immintrin.h>
#define TARGET __attribute__((target("avx512f,avx512dq")))

TARGET static inline __m512 horner(const float* c, __m512 f) {
  // (written out: a loop was left rolled in some instantiations, timing the loop instead)
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(c[6]), f, _mm512_set1_ps(c[5]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[4]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[3]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[2]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[1]));
  return _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[0]));
}
// P(f) ≈ 2^f, minimal relative error, P(0) = 1: on [−1/2, 1/2] and on [0, 1)
static const float kCentred[7] = {1.0f, 6.931471825e-01f, 2.402264625e-01f, 5.550328642e-02f,
                                  9.618489072e-03f, 1.339993090e-03f, 1.534581097e-04f};
static const float kFromZero[7] = {1.0f, 6.931470633e-01f, 2.402293086e-01f, 5.548528209e-02f,
                                   9.675451554e-03f, 1.246784581e-03f, 2.161291632e-04f};

TARGET static inline __m512 exp2_round(__m512 x) {
  const __m512 n = _mm512_mask_roundscale_ps(x, 0xFFFF, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 normal = _mm512_cmp_ps_mask(n, _mm512_set1_ps(-127.0f), _CMP_NLE_UQ);
  return _mm512_maskz_scalef_ps(normal, horner(kCentred, _mm512_sub_ps(x, n)), n);
}
TARGET static inline __m512 exp2_reduce(__m512 x) {
  const __m512 f = _mm512_mask_reduce_ps(x, 0xFFFF, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(x, f);
  const __mmask16 normal = _mm512_cmp_ps_mask(n, _mm512_set1_ps(-127.0f), _CMP_NLE_UQ);
  return _mm512_maskz_scalef_ps(normal, horner(kCentred, f), n);
}
TARGET static inline __m512 exp2_floor(__m512 x) {
  const __m512 f = _mm512_mask_reduce_ps(x, 0xFFFF, x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(normal, horner(kFromZero, f), x);
}

template <__m512 (*Exp2)(__m512)>
TARGET static double ns_per_vector(long rounds) {
  constexpr int kN = 4096;
  alignas(64) static float logits[kN];
  for (int i = 0; i < kN; ++i) logits[i] = -0.01f * static_cast<float>(i % 997);
  alignas(64) static float p[kN];
  double best = 1e30;
  float sink = 0.0f;
  for (int trial = 0; trial < 5; ++trial) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long r = 0; r < rounds; ++r) {
      const __m512 shift = _mm512_set1_ps(0.125f * static_cast<float>(r & 7));
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
      for (int i = 0; i < kN; i += 32) {
        const __m512 e0 = Exp2(_mm512_sub_ps(_mm512_load_ps(logits + i), shift));
        const __m512 e1 = Exp2(_mm512_sub_ps(_mm512_load_ps(logits + i + 16), shift));
        _mm512_store_ps(p + i, e0);
        _mm512_store_ps(p + i + 16, e1);
        s0 = _mm512_add_ps(s0, e0);
        s1 = _mm512_add_ps(s1, e1);
      }
      alignas(64) float sums[16];
      _mm512_store_ps(sums, _mm512_add_ps(s0, s1));
      sink += sums[r & 15] + p[r % kN];
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s / static_cast<double>(rounds) / (kN / 16) * 1e9);
  }
  if (sink == 1.2345f) std::puts("");  // (keeps the loop)
  return best;
}

// The accuracy test's i-th input: [−126, 0] evenly; then (−1/2, 0) at random with full mantissas
// (the scores nearest the row's max, where x − floor(x) = 1 + x rounds: random mantissas find its
// worst cases, a grid's round numbers do not).
static float test_input(int i, int points) {
  if (i < points) return -126.0f * static_cast<float>(i) / static_cast<float>(points);
  unsigned h = static_cast<unsigned>(i) * 2654435761u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  const float mantissa = 1.0f + static_cast<float>(h >> 9) / static_cast<float>(1 << 23);
  return -std::ldexp(mantissa, -2 - static_cast<int>(h % 40));
}

template <__m512 (*Exp2)(__m512)>
TARGET static double max_ulp_error() {
  double worst = 0.0;
  const int points = 1 << 22;
  alignas(64) float x[16], y[16];
  for (int i = 0; i < 2 * points; i += 16) {
    for (int j = 0; j < 16; ++j) x[j] = test_input(i + j, points);
    _mm512_store_ps(y, Exp2(_mm512_load_ps(x)));
    for (int j = 0; j < 16; ++j) {
      const double exact = std::exp2(static_cast<double>(x[j]));
      const float rounded = static_cast<float>(exact);
      const double ulp = static_cast<double>(std::nextafter(rounded, INFINITY)) - rounded;
      worst = std::max(worst, std::fabs(y[j] - exact) / ulp);
    }
  }
  return worst;
}

// Whether Exp2 gives exp2_round's bits on the accuracy test's inputs and the special ones.
template <__m512 (*Exp2)(__m512)>
TARGET static bool same_bits_as_round() {
  const int points = 1 << 22;
  alignas(64) float x[16], a[16], b[16];
  for (int i = 0; i < 2 * points + 16; i += 16) {
    for (int j = 0; j < 16; ++j) x[j] = test_input(i + j, points);
    if (i == 2 * points) {
      const float special[6] = {0.0f, -0.0f, -INFINITY, NAN, -126.5f, -127.0f};
      for (int j = 0; j < 6; ++j) x[j] = special[j];
    }
    _mm512_store_ps(a, exp2_round(_mm512_load_ps(x)));
    _mm512_store_ps(b, Exp2(_mm512_load_ps(x)));
    if (std::memcmp(a, b, sizeof(a)) != 0) return false;
  }
  return true;
}

template <__m512 (*Exp2)(__m512)>
TARGET static void report(const char* name, double ns, double ns_round) {
  std::printf("%-8s %.3f  %.3f  %.2f  %s\n", name, ns, ns / ns_round, max_ulp_error<Exp2>(),
              same_bits_as_round<Exp2>() ? "yes" : "no");
}

int main(int argc, char** argv) {
  const long rounds = argc > 1 ? std::atol(argv[1]) : 100000;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq")) {
    std::puts("no AVX-512 F and DQ on this CPU: nothing to time");
    return 0;
  }
  const double t_round = ns_per_vector<exp2_round>(rounds), t_reduce = ns_per_vector<exp2_reduce>(rounds),
               t_floor = ns_per_vector<exp2_floor>(rounds);
  std::printf("one thread, ns per vector of 16 exps (shift, exp2, store, sum)\n");
  std::printf("form     ns     / round  max ulp  same bits\n");
  report<exp2_round>("round", t_round, t_round);
  report<exp2_reduce>("reduce", t_reduce, t_round);
  report<exp2_floor>("floor", t_floor, t_round);
  return 0;
}
#else
int main() {
  std::puts("not x86-64 or a compiler without AVX-512 intrinsics: nothing to time");
  return 0;
}
#endif
