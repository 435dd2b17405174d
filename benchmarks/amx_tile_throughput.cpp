// One core's AMX rates, the building blocks of the amx variant's bf16 forward (TDPBF16PS products
// on 16 x 16 fp32 tiles, tiles loaded from memory), on Linux x86-64 with AMX-BF16:
//
//   g++ -O2 -mamx-tile -mamx-bf16 -o /tmp/amx_tile_throughput benchmarks/amx_tile_throughput.cpp && /tmp/amx_tile_throughput
//
// Prints ns per operation, best of 50 rounds (or the one argument's count) of 2000 calls:
//   * TDPBF16PS alone: 16 products onto four independent C tiles, operands already in tiles;
//   * tile loads alone: 20 loads of 16 rows x 64 bytes from L1;
//   * S = Q Kᵀ for 16 query rows x 64 keys at d = 128 as the forward computes it with 16-row
//     blocks (1 x 2 tile blocks: per 32 columns and 16-pair step one A and two B loads, two
//     products; 16 products, 24 loads, 4 stores), its Kᵀ tile in L1 or one of 16 in L2;
//   * the same for 32 rows with 2 x 2 blocks (32 products, 32 loads, 8 stores: each A and B tile
//     serves two products), the forward's blocks past d = 64.
// The tile state is asked of Linux first (arch_prctl ARCH_REQ_XCOMP_PERM); without it, or
// without AMX, the program says so and exits 0.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int kPairs = 64;           // d = 128: 64 bf16 pairs per row
constexpr int kKeys = 64;            // one key tile
constexpr int kTilesInL2 = 16;       // 16 Kᵀ tiles of 16 KiB: 256 KiB, past L1
alignas(64) uint32_t q_pairs[32 * kPairs];                    // 32 rows x 64 pairs
alignas(64) uint32_t kt_pairs[kTilesInL2][kPairs * kKeys];    // Kᵀ: 64 pair rows x 64 keys
alignas(64) float scores[32 * kKeys];
int tile_index = 0;  // which Kᵀ tile the S products read (0: the same one, in L1)
int rounds = 50;

__attribute__((noinline)) void products_alone() {
  for (int s = 0; s < 4; ++s) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
}

__attribute__((noinline)) void loads_alone() {
  const char* b = reinterpret_cast<const char*>(kt_pairs[0]);
  for (int s = 0; s < 4; ++s) {
    _tile_loadd(4, reinterpret_cast<const char*>(q_pairs) + s * 64, kPairs * 4);
    _tile_loadd(5, b + s * 16 * kKeys * 4, kKeys * 4);
    _tile_loadd(6, b + s * 16 * kKeys * 4 + 64, kKeys * 4);
    _tile_loadd(7, b + s * 16 * kKeys * 4 + 128, kKeys * 4);
    _tile_loadd(5, b + s * 16 * kKeys * 4 + 192, kKeys * 4);
  }
}

// S for 16 rows (1 x 2 tile blocks) or 32 (kTwoRowBlocks: 2 x 2), per 32 key columns over the 4
// pair steps (the tile numbers are instruction immediates, hence the constant branches).
template <bool kTwoRowBlocks>
__attribute__((noinline)) void scores_rows() {
  const char* a = reinterpret_cast<const char*>(q_pairs);
  const char* b = reinterpret_cast<const char*>(kt_pairs[tile_index]);
  for (int j = 0; j < kKeys; j += 32) {
    _tile_zero(0);
    _tile_zero(1);
    if (kTwoRowBlocks) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int s = 0; s < kPairs / 16; ++s) {
      _tile_loadd(4, a + s * 64, kPairs * 4);
      _tile_loadd(6, b + (s * 16 * kKeys + j) * 4, kKeys * 4);
      _tile_loadd(7, b + (s * 16 * kKeys + j) * 4 + 64, kKeys * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (kTwoRowBlocks) {
        _tile_loadd(5, a + 16 * kPairs * 4 + s * 64, kPairs * 4);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, scores + j, kKeys * 4);
    _tile_stored(1, scores + j + 16, kKeys * 4);
    if (kTwoRowBlocks) {
      _tile_stored(2, scores + 16 * kKeys + j, kKeys * 4);
      _tile_stored(3, scores + 16 * kKeys + j + 16, kKeys * 4);
    }
  }
}

// Best time per call of f over `rounds` rounds of 2000 calls; in_l2: each call reads the next Kᵀ tile.
template <typename F>
double best_ns(F f, bool in_l2) {
  double best = 1e30;
  for (int round = 0; round < rounds; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 2000; ++i) {
      tile_index = in_l2 ? i % kTilesInL2 : 0;
      f();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s / 2000 * 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) rounds = std::max(1, std::atoi(argv[1]));
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("no AVX-512 on this CPU, so no AMX: nothing to measure\n");
    return 0;
  }
  unsigned eax, ebx, ecx, edx;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  if (!amx_bf16 || !amx_tile || syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) != 0) {
    std::printf("no AMX-BF16, or Linux refused this process the tile state: nothing to measure\n");
    return 0;
  }
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  for (auto& x : q_pairs) x = 0x3f803f80u;  // (1, 1) in bf16
  for (auto& tile : kt_pairs)
    for (auto& x : tile) x = 0x3f803f80u;
  const double products = best_ns(products_alone, false) / 16, loads = best_ns(loads_alone, false) / 20;
  std::printf("TDPBF16PS, four independent C tiles:   %6.2f ns per product\n", products);
  std::printf("tile load (16 x 64 bytes) from L1:     %6.2f ns per load\n", loads);
  std::printf("S for 16 rows x 64 keys, d = 128 (1 x 2 blocks, 16 products): Kt in L1 %6.1f ns, in L2 %6.1f ns "
              "(products alone %.1f)\n", best_ns(scores_rows<false>, false), best_ns(scores_rows<false>, true), 16 * products);
  std::printf("S for 32 rows x 64 keys, d = 128 (2 x 2 blocks, 32 products): Kt in L1 %6.1f ns, in L2 %6.1f ns "
              "(products alone %.1f)\n", best_ns(scores_rows<true>, false), best_ns(scores_rows<true>, true), 32 * products);
  _tile_release();
  return 0;
}
