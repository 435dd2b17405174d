#include "cpu_dispatch.h"

#include <c10/util/Exception.h>

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(ATTN_AMX_COMPILED)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace attention_ext {
namespace cpu {
namespace {

struct Variant {
  const char* name;
  const KernelTable& (*table)();
  bool (*supported)();
  // Whether "auto" takes this variant on a CPU that supports it (else it goes on down the list).
  bool (*preferred)();
};

// A variant's table, assembled from its stages on first use (only after its CPU check).
template <void (*FillForward)(KernelTable&), void (*FillBackward)(KernelTable&)>
const KernelTable& table_of(const char* name) {
  static const KernelTable table = [name] {
    KernelTable t{};
    t.name = name;
    FillForward(t);
    FillBackward(t);
    return t;
  }();
  return table;
}
const KernelTable& kernels_generic() {
  return table_of<generic::fill_forward_kernels, generic::fill_backward_kernels>("generic");
}
#if defined(__x86_64__) || defined(_M_X64)
const KernelTable& kernels_avx2() {
  return table_of<avx2::fill_forward_kernels, avx2::fill_backward_kernels>("avx2");
}
const KernelTable& kernels_avx512() {
  return table_of<avx512::fill_forward_kernels, avx512::fill_backward_kernels>("avx512");
}
const KernelTable& kernels_avx512bf16() {
  return table_of<avx512bf16::fill_forward_kernels, avx512bf16::fill_backward_kernels>("avx512bf16");
}
#endif
#if defined(ATTN_AMX_COMPILED)
const KernelTable& kernels_amx() { return table_of<amx::fill_forward_kernels, amx::fill_backward_kernels>("amx"); }
#endif

#if defined(__x86_64__) || defined(_M_X64)
// Every feature isa_begin.h's target() lists for a variant is checked, not only the vector width:
// the compiler uses F16C (fp16 conversions) and BMI2 (shlx, rorx) in both variants, and a
// hypervisor's CPU model may offer AVX2 and FMA without them.
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi2");
}
bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && has_avx2();
}
bool has_avx512bf16() {
  __builtin_cpu_init();
  return has_avx512() && __builtin_cpu_supports("avx512bf16");
}
// The avx512bf16 variant's bf16 forward (forward_bf16_dot.inc) pays only where its VDPBF16PS (two
// bf16 products per fp32 lane) delivers more products per second than the fp32 FMAs: on AMD's
// cores (Zen 4, Zen 5), where it was measured faster. On the Intel Xeon measured (family 6 model 167,
// benchmarks/bf16_dot_throughput.cpp) one core did 106 GFLOP/s of bf16 dot products against 209 of
// FMAs: half the flop rate (a quarter of the instructions per cycle), and with 24 chains as with 12,
// so not latency. Its bf16 forward then ran at 146-149 GFLOP/s against 223 for the avx512 variant's,
// which converts bf16 to fp32 for the FMAs (1x8x1024x1024x64, side by side). Other Intel cores with
// AVX512-BF16 are taken to behave alike until measured (ATTENTION_EXT_CPU_ISA=avx512bf16 still forces
// it). The choice follows the vendor, never a timing, so "auto" is the same on every run of a machine
// (and so are the results).
bool bf16_dot_pays() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
}
#endif
#if defined(ATTN_AMX_COMPILED)
constexpr long kXfeatureXtiledata = 18;
// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), and a kernel that can hand out the
// tile state (arch_prctl ARCH_GET_XCOMP_SUPP lists XFEATURE_XTILEDATA). The state itself is
// requested only when a tile kernel first runs (amx_tile_state_granted): a process without it
// faults on the first tile instruction.
bool has_amx() {
  static const bool usable = [] {
    if (!has_avx512bf16()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1u) || !((edx >> 22) & 1u)) return false;
    constexpr long kArchGetXcompSupp = 0x1021;
    unsigned long features = 0;
    return syscall(SYS_arch_prctl, kArchGetXcompSupp, &features) == 0 && ((features >> kXfeatureXtiledata) & 1ul);
  }();
  return usable;
}

std::atomic<int>& amx_request_state() {  // 0: not requested, 1: granted, 2: refused
  static std::atomic<int> state{0};
  return state;
}
#endif
bool always() { return true; }

const std::vector<Variant>& variants() {  // in order of preference
  static const std::vector<Variant> all = {
#if defined(ATTN_AMX_COMPILED)
      {"amx", &kernels_amx, &has_amx, &always},
#endif
#if defined(__x86_64__) || defined(_M_X64)
      {"avx512bf16", &kernels_avx512bf16, &has_avx512bf16, &bf16_dot_pays},
      {"avx512", &kernels_avx512, &has_avx512, &always},
      {"avx2", &kernels_avx2, &has_avx2, &always},
#endif
      {"generic", &kernels_generic, &always, &always},
  };
  return all;
}

const KernelTable* pick(const std::string& name) {
  for (const Variant& v : variants()) {
    if (name == "auto" ? v.supported() && v.preferred() : name == v.name) {
      TORCH_CHECK(v.supported(), "attention_ext: CPU kernel variant '", name,
                  "' is not supported by this CPU; supported: ",
                  c10::Join(", ", supported_variants()));
      return &v.table();
    }
  }
  TORCH_CHECK(false, "attention_ext: unknown CPU kernel variant '", name,
              "'; expected 'auto' or one of: ", c10::Join(", ", compiled_variants()));
}

std::atomic<const KernelTable*>& active_slot() {
  static std::atomic<const KernelTable*> slot{nullptr};
  return slot;
}

}  // namespace

const KernelTable& active_kernels() {
  const KernelTable* t = active_slot().load(std::memory_order_acquire);
  if (t == nullptr) {
    const char* env = std::getenv("ATTENTION_EXT_CPU_ISA");
    t = pick(env != nullptr && *env != '\0' ? std::string(env) : std::string("auto"));
    active_slot().store(t, std::memory_order_release);
  }
  return *t;
}

std::vector<std::string> supported_variants() {
  std::vector<std::string> names;
  for (const Variant& v : variants())
    if (v.supported()) names.emplace_back(v.name);
  return names;
}

std::string auto_variant() { return pick("auto")->name; }

std::vector<std::string> compiled_variants() {
  std::vector<std::string> names;
  for (const Variant& v : variants()) names.emplace_back(v.name);
  return names;
}

namespace {
// Runs probe(iterations) on every torch thread at once; the flops of all of them per second.
double probe_gflops(double (*probe)(int64_t), int64_t iterations) {
  TORCH_CHECK(iterations > 0, "attention_ext: iterations must be positive, got ", iterations);
  const int64_t threads = at::get_num_threads();
  std::vector<double> flops(threads, 0.0);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) flops[t] = probe(iterations);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = 0.0;
  for (double f : flops) {
    TORCH_CHECK(f > 0.0, "attention_ext: a CPU probe could not allocate its buffers");
    total += f;
  }
  return total / seconds / 1e9;
}
}  // namespace

#if defined(ATTN_AMX_COMPILED)
// arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: once per process, for all its threads.
// (Linux refuses it where a thread's signal stack is too small for the tile state.)
bool amx_tile_state_granted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    const bool ok = has_amx() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    amx_request_state().store(ok ? 1 : 2, std::memory_order_release);
    return ok;
  }();
  return granted;
}

const char* amx_tile_state() {
  switch (amx_request_state().load(std::memory_order_acquire)) {
    case 1: return "granted";
    case 2: return "refused";
    default: return "not requested";
  }
}
#else
bool amx_tile_state_granted() { return false; }
const char* amx_tile_state() { return "not compiled"; }
#endif

#if defined(__x86_64__) || defined(_M_X64)
// AMD family 25 (19h) is Zen 3 and Zen 4, and of those only Zen 4 has AVX-512, which it executes
// in two 256-bit halves: a 512-bit FMA issues at one per cycle per pipe pair, half Zen 5's rate.
// Other cores are taken to be full width until measured. From CPUID, never a timing.
bool avx512_double_pumped() {
  static const bool split = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_is("amd") || !__builtin_cpu_supports("avx512f")) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xF, extended = (eax >> 20) & 0xFF;
    return (base == 0xF ? base + extended : base) == 25;
  }();
  return split;
}
#else
bool avx512_double_pumped() { return false; }
#endif

double fma_peak_gflops(int64_t iterations) { return probe_gflops(active_kernels().fma_probe, iterations); }

double tile_gemm_gflops(int64_t iterations) { return probe_gflops(active_kernels().tile_gemm_probe, iterations); }

double tile_forward_gflops(int64_t iterations) {
  return probe_gflops(active_kernels().tile_forward_probe, iterations);
}

double tile_backward_gflops(int64_t iterations) {
  return probe_gflops(active_kernels().tile_backward_probe, iterations);
}

namespace {
// Sums count floats as kStreams consecutive parts read side by side (count a multiple of
// 32·kStreams), into eight independent 16-byte accumulators: loads far faster than memory feeds
// them, so the loop runs at the rate the data arrives. One sequential stream per core does not
// reach the machine's rate: the hardware prefetchers keep too few lines in flight for one stream
// (measured on a Xeon model 167 VM, 2 threads: 17.4 GB/s for one stream per thread, 21 for two,
// 24-25 for 4-16; torch's sum 20.6), and a kernel reading K and V with prefetches ahead reached 23.
constexpr int64_t kStreams = 8;
float sum_streams(const float* x, int64_t count) {
  typedef float V4 __attribute__((vector_size(16)));
  V4 acc[8] = {};
  const int64_t part = count / kStreams;
  for (int64_t i = 0; i < part; i += 32)
    for (int64_t s = 0; s < kStreams; ++s)
      for (int c = 0; c < 8; ++c) {
        V4 v;
        memcpy(&v, x + s * part + i + 4 * c, sizeof(v));
        acc[c] += v;
      }
  V4 total = acc[0];
  for (int c = 1; c < 8; ++c) total += acc[c];
  return total[0] + total[1] + total[2] + total[3];
}
}  // namespace

double stream_read_gbps(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.scalar_type() == at::kFloat && buffer.is_contiguous() &&
                  buffer.numel() >= 32 * kStreams * 1024,
              "attention_ext: cpu_stream_read_gbps reads a contiguous float32 CPU tensor of at least 262144 elements, "
              "got ", buffer.scalar_type(), " ", buffer.sizes(), " on ", buffer.device());
  const int64_t threads = at::get_num_threads();
  const int64_t per_thread = buffer.numel() / threads / (32 * kStreams) * (32 * kStreams);  // each its share
  const float* data = buffer.data_ptr<float>();
  std::vector<float> sums(threads, 0.0f);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sums[t] = sum_streams(data + t * per_thread, per_thread);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = 0.0f;  // keeps the sums from being optimised away
  for (float s : sums) sink = sink + s;
  return static_cast<double>(per_thread) * threads * sizeof(float) / seconds / 1e9;
}

std::string set_variant(const std::string& name) {
  const KernelTable* t = pick(name);
  active_slot().store(t, std::memory_order_release);
  return t->name;
}

}  // namespace cpu
}  // namespace attention_ext
