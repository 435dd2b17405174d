// A host emulation of the part of CUDA the kernels (simt_*.cuh, tc_*.cuh, dispatch.cu) use, so that
// their logic — tiling, masks, causal bounds, online softmax, dropout streams, the deterministic
// backward passes, the tensor-core fragment layouts — runs and is tested on a machine without a
// GPU (ATTENTION_EXT_CUDA_EMULATION=1 builds, .ci/cuda_emulation.sh). It checks what the kernels
// compute, not how fast.
//
// Model: a launch runs its blocks one after another on the calling thread. Every CUDA thread of
// the block is a fiber (ucontext, own stack below a guard page, own threadIdx); fibers run until
// they reach a barrier. __syncthreads() is a barrier of the block's threads, __shfl_xor_sync() an
// exchange through one slot per thread between two barriers of the warp (all 32 lanes must take
// part, as the full-mask form requires on a GPU), and the end of a block is a barrier of its own.
// Threads waiting at different barriers (a __syncthreads some threads skip: undefined behaviour
// on a GPU) abort with a message instead of hanging or passing.
// To expose missing barriers and uninitialised reads: dynamic shared memory is exactly the
// launch's size, filled with 0xFF bytes (NaN floats) before every block, and fibers run in
// ascending thread order in even-numbered launches and descending in odd ones, so a read that
// depends on another thread's write without a barrier in between fails in one of the two.
// Tensor-core instructions: mma.sync and ldmatrix are warp exchanges like the shuffles (every
// lane writes its operands, then reads the lanes its fragment comes from); ldmatrix aborts on an
// address outside the block's shared memory or not 16-byte aligned. cp.async copies land late, at
// the issuing thread's cp.async.wait_group, in two launches of four, and at once in the other two:
// a read of a buffer before its copy was waited for, or a copy into a buffer other threads still
// read, gives wrong results in one of the two.
// Launches are serialised by a mutex.
#pragma once
#ifndef ATTN_CUDA_EMULATION
#error "emulation.h is only for ATTN_CUDA_EMULATION builds"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace attention_ext {
namespace cuda_emulation {

// Counts arrivals; the waiters of a generation are released when the count is reached.
struct Barrier {
  int count = 0;
  int arrived = 0;
  uint64_t generation = 0;
};

// One cp.async: 16 bytes from src (or zeros) to dst, when the issuing thread waits for its group.
struct AsyncCopy {
  void* dst;
  const void* src;
  bool in_range;
};

struct Fiber {
  ucontext_t context;
  std::vector<AsyncCopy> open_copies;                // issued, not yet committed
  std::vector<std::vector<AsyncCopy>> copy_groups;  // committed, oldest first
  unsigned thread = 0, block = 0;
  Barrier* waiting_on = nullptr;
  uint64_t waiting_generation = 0;
  bool done = false;
  bool ready() const { return !done && (waiting_on == nullptr || waiting_on->generation != waiting_generation); }
};

// The running launch (one at a time: launches hold launch_mutex).
struct LaunchState {
  std::vector<Fiber> fibers;
  Barrier sync_barrier, end_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<std::array<uint32_t, 8>> operands;  // per thread, for warp_exchange
  bool copies_land_late = false;  // cp.async: at the wait (true) or at issue (false)
  std::vector<unsigned char> shared;  // dynamic shared memory, exactly the launch's size
  ucontext_t scheduler;
  Fiber* current = nullptr;
  unsigned grid = 0;
  std::function<void()> body;
};

// The largest dynamic shared memory a kernel may ask for (an H100/H200 block's maximum).
constexpr size_t kSharedBytes = 227 * 1024;
constexpr size_t kFiberStack = 128 * 1024;

// A fiber stack with an inaccessible page below it, so an overflow faults instead of writing
// into its neighbour. Kept from launch to launch (gradcheck makes thousands of small launches).
struct FiberStack {
  void* region = nullptr;
  size_t guard = 0;
  FiberStack() {
    guard = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    region = mmap(nullptr, guard + kFiberStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED || mprotect(region, guard, PROT_NONE) != 0) {
      fprintf(stderr, "cuda emulation: cannot map a fiber stack\n");
      abort();
    }
  }
  ~FiberStack() { munmap(region, guard + kFiberStack); }
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;
  void* base() const { return static_cast<char*>(region) + guard; }
};

inline std::mutex launch_mutex;
inline std::vector<std::unique_ptr<FiberStack>> fiber_stacks;
inline uint64_t launch_count = 0;
inline LaunchState* state = nullptr;
inline dim3 thread_index, block_index, block_dim, grid_dim;

inline void fill_shared() { memset(state->shared.data(), 0xFF, state->shared.size()); }

inline void wait_at(Barrier& barrier) {
  Fiber& self = *state->current;
  self.waiting_on = &barrier;
  self.waiting_generation = barrier.generation;
  if (++barrier.arrived == barrier.count) {
    barrier.arrived = 0;
    ++barrier.generation;  // releases every waiter, this fiber included
    if (&barrier == &state->end_barrier) fill_shared();  // the next block sees no stale data
    return;
  }
  swapcontext(&self.context, &state->scheduler);
}

// One warp-collective step (shuffle, mma.sync, ldmatrix): this lane publishes `bytes` bytes (at
// most 32) as its operands, the warp's 32 lanes meet, read(warp0, lane) computes this lane's
// result from the published operands (lane l's at operands[warp0 + l]), and the lanes meet again,
// so no operand is overwritten while another lane still reads it.
template <typename Read>
inline void warp_exchange(const void* mine, size_t bytes, Read&& read) {
  const unsigned t = thread_index.x;
  memcpy(state->operands[t].data(), mine, bytes);
  Barrier& warp = state->warp_barriers[t >> 5];
  wait_at(warp);
  read(t & ~31u, t & 31u);
  wait_at(warp);
}

inline void fiber_main() {
  Fiber& self = *state->current;
  for (unsigned b = 0; b < state->grid; ++b) {
    self.block = b;
    block_index = dim3(b, 1, 1);
    state->body();
    // Copies never waited for land nowhere: the block's shared memory is gone.
    self.open_copies.clear();
    self.copy_groups.clear();
    wait_at(state->end_barrier);
  }
  self.done = true;
  // Returning switches to uc_link, the scheduler.
}

template <typename... Params>
struct Launch {
  void (*kernel)(Params...);
  dim3 grid, block;
  size_t smem;

  template <typename... Args>
  void operator()(Args&&... args) const {
    const int threads = static_cast<int>(block.x * block.y * block.z);
    if (block.y != 1 || block.z != 1 || grid.y != 1 || grid.z != 1 || threads % 32 != 0) {
      fprintf(stderr, "cuda emulation: only 1-d grids of whole warps are emulated\n");
      abort();
    }
    if (smem > kSharedBytes) {
      fprintf(stderr, "cuda emulation: %zu bytes of shared memory asked, %zu available\n", smem,
              kSharedBytes);
      abort();
    }
    if (grid.x == 0) return;
    std::lock_guard<std::mutex> lock(launch_mutex);
    LaunchState launch;
    launch.grid = grid.x;
    launch.sync_barrier.count = threads;
    launch.end_barrier.count = threads;
    launch.warp_barriers.resize(threads / 32);
    for (Barrier& w : launch.warp_barriers) w.count = 32;
    launch.operands.resize(threads);
    launch.shared.resize(smem);
    void (*entry)(Params...) = kernel;
    launch.body = [&] { entry(args...); };
    launch.fibers.resize(threads);
    while (fiber_stacks.size() < static_cast<size_t>(threads)) fiber_stacks.emplace_back(new FiberStack());
    for (int t = 0; t < threads; ++t) {
      Fiber& f = launch.fibers[t];
      f.thread = static_cast<unsigned>(t);
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = fiber_stacks[t]->base();
      f.context.uc_stack.ss_size = kFiberStack;
      f.context.uc_link = &launch.scheduler;
      makecontext(&f.context, fiber_main, 0);
    }
    state = &launch;
    fill_shared();
    block_dim = block;
    grid_dim = grid;
    const bool descending = (launch_count & 1) != 0;
    launch.copies_land_late = (launch_count & 2) != 0;
    ++launch_count;
    // Round robin over the fibers that can run, until all are done.
    for (;;) {
      bool ran = false, all_done = true;
      for (int n = 0; n < threads; ++n) {
        Fiber& f = launch.fibers[descending ? threads - 1 - n : n];
        if (f.done) continue;
        all_done = false;
        if (!f.ready()) continue;
        f.waiting_on = nullptr;
        launch.current = &f;
        thread_index = dim3(f.thread, 1, 1);
        block_index = dim3(f.block, 1, 1);
        swapcontext(&launch.scheduler, &f.context);
        ran = true;
      }
      if (all_done) break;
      if (!ran) {
        fprintf(stderr, "cuda emulation: the threads of a block wait at different barriers (deadlock)\n");
        abort();
      }
    }
    state = nullptr;
  }
};

template <typename... Params>
Launch<Params...> launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem) {
  return Launch<Params...>{kernel, grid, block, smem};
}

}  // namespace cuda_emulation
}  // namespace attention_ext

// Launch attributes mean nothing here (nvcc's host pass drops them the same way).
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __grid_constant__
#define __grid_constant__

// The CUDA built-ins, as the kernels spell them.
#define threadIdx (::attention_ext::cuda_emulation::thread_index)
#define blockIdx (::attention_ext::cuda_emulation::block_index)
#define blockDim (::attention_ext::cuda_emulation::block_dim)
#define gridDim (::attention_ext::cuda_emulation::grid_dim)

inline void __syncthreads() {
  using namespace ::attention_ext::cuda_emulation;
  wait_at(state->sync_barrier);
}

template <typename V>
inline V __shfl_xor_sync(unsigned mask, V value, int lane_mask) {
  static_assert(sizeof(V) <= 8, "shuffles of at most 8 bytes");
  using namespace ::attention_ext::cuda_emulation;
  if (mask != 0xFFFFFFFFu) {
    fprintf(stderr, "cuda emulation: only full-warp shuffles are emulated\n");
    abort();
  }
  V other;
  warp_exchange(&value, sizeof(V), [&](unsigned warp0, unsigned lane) {
    memcpy(&other, state->operands[warp0 + (lane ^ static_cast<unsigned>(lane_mask))].data(), sizeof(V));
  });
  return other;
}

// Launch configuration and the runtime calls the launchers make.
#define ATTN_LAUNCH(kernel, grid, block, smem, stream) \
  ::attention_ext::cuda_emulation::launch(kernel, dim3(grid), dim3(block), smem)
#define ATTN_DYNAMIC_SHARED(name) \
  unsigned char* name = ::attention_ext::cuda_emulation::state->shared.data()

// What cuda_runtime.h's template wrapper does under nvcc; every size up to kSharedBytes is fine.
template <typename... Params>
inline cudaError_t cudaFuncSetAttribute(void (*)(Params...), cudaFuncAttribute, int) {
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core instructions (warp_mma.cuh forwards here). Layouts as documented there.
namespace attention_ext {
namespace cuda_emulation {

inline void check_shared_row(const void* p, const char* what) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  const unsigned char* lo = state->shared.data();
  if (b < lo || b + 16 > lo + state->shared.size() || reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    fprintf(stderr, "cuda emulation: %s address %p is not a 16-byte aligned row inside the block's %zu bytes of "
            "shared memory\n", what, p, state->shared.size());
    abort();
  }
}

template <typename T>
float bits_to_float(uint16_t bits);
template <>
inline float bits_to_float<__half>(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
template <>
inline float bits_to_float<__nv_bfloat16>(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &word, sizeof(f));
  return f;
}
inline uint16_t half_of(uint32_t reg, unsigned which) { return static_cast<uint16_t>(which ? reg >> 16 : reg); }

// D += A·B with products exact (fp16/bf16 products fit a float) added one by one in float, in k
// order: no more accurate than the hardware's fp32 accumulation, so tolerances that hold here are
// not owed to extra precision.
template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  float out[4];
  warp_exchange(mine, sizeof(mine), [&](unsigned warp0, unsigned lane) {
    // A(row, k) is in lane 4 (row % 8) + (k % 8) / 2, register row / 8 + 2 (k / 8), half k % 2.
    // B(k, col) is in lane 4 col + (k % 8) / 2, register 4 + k / 8 (b0, b1), half k % 2.
    const unsigned g = lane >> 2, tq = lane & 3u;
    for (unsigned e = 0; e < 4; ++e) {
      const unsigned row = g + 8 * (e >> 1), col = 2 * tq + (e & 1);
      float sum = d[e];
      for (unsigned k = 0; k < 16; ++k) {
        const uint32_t ra = state->operands[warp0 + 4 * (row % 8) + (k % 8) / 2][row / 8 + 2 * (k / 8)];
        const uint32_t rb = state->operands[warp0 + 4 * col + (k % 8) / 2][4 + k / 8];
        const float product = bits_to_float<T>(half_of(ra, k & 1)) * bits_to_float<T>(half_of(rb, k & 1));
        sum += product;  // (exact product: an FMA here would round the same)
      }
      out[e] = sum;
    }
  });
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// Lane l names row l % 8 of matrix l / 8; register i gets matrix i's (row g, columns 2t, 2t+1),
// or with trans its (rows 2t, 2t+1, column g).
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  check_shared_row(row, "ldmatrix");
  uint32_t out[4];
  warp_exchange(&row, sizeof(row), [&](unsigned warp0, unsigned lane) {
    auto element = [&](unsigned matrix, unsigned mrow, unsigned mcol) -> uint32_t {
      const unsigned char* base;
      memcpy(&base, state->operands[warp0 + 8 * matrix + mrow].data(), sizeof(base));
      uint16_t v;
      memcpy(&v, base + 2 * mcol, sizeof(v));
      return v;
    };
    const unsigned g = lane >> 2, tq = lane & 3u;
    for (unsigned i = 0; i < 4; ++i)
      out[i] = trans ? element(i, 2 * tq, g) | (element(i, 2 * tq + 1, g) << 16)
                     : element(i, g, 2 * tq) | (element(i, g, 2 * tq + 1) << 16);
  });
  for (int i = 0; i < 4; ++i) r[i] = out[i];
}

inline void land(const AsyncCopy& c) {
  if (c.in_range)
    memcpy(c.dst, c.src, 16);
  else
    memset(c.dst, 0, 16);
}

inline void cp_async_16(void* dst, const void* src, bool in_range) {
  check_shared_row(dst, "cp.async destination");
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    fprintf(stderr, "cuda emulation: cp.async source %p is not 16-byte aligned\n", src);
    abort();
  }
  const AsyncCopy copy{dst, src, in_range};
  if (state->copies_land_late)
    state->current->open_copies.push_back(copy);
  else
    land(copy);
}

inline void cp_async_commit() {
  Fiber& self = *state->current;
  self.copy_groups.push_back(std::move(self.open_copies));
  self.open_copies.clear();
}

inline void cp_async_wait(int open_groups_allowed) {
  Fiber& self = *state->current;
  while (self.copy_groups.size() > static_cast<size_t>(open_groups_allowed)) {
    for (const AsyncCopy& c : self.copy_groups.front()) land(c);
    self.copy_groups.erase(self.copy_groups.begin());
  }
}

}  // namespace cuda_emulation
}  // namespace attention_ext
