// The per-thread scratch stack (scratch_arena.h).
#include "scratch_arena.h"

#include <stdint.h>
#include <stdlib.h>

#include <algorithm>

namespace attention_ext {
namespace cpu {

bool scratch_poisoned() {
  static const bool poisoned = [] {
    const char* env = getenv("ATTENTION_EXT_POISON_SCRATCH");
    return env != nullptr && env[0] == '1';
  }();
  return poisoned;
}

#if defined(__SANITIZE_ADDRESS__)
// Under AddressSanitizer every block is its own allocation, so an overrun from one tile into the
// next hits a redzone instead of the neighbouring tile.
void* scratch_acquire(size_t bytes) {
  void* own = aligned_alloc(64, bytes);
  if (own == nullptr) abort();
  return own;
}

void scratch_release(void* ptr, size_t) { free(ptr); }

#else

namespace {

struct Arena {
  char* base = nullptr;
  size_t capacity = 0;  // bytes at base
  size_t used = 0;      // the stack's top
  size_t wanted = 0;    // the largest stack a chunk asked for (bounded), the next capacity
  int64_t live = 0;     // blocks not yet released, the arena's and the heap's
  ~Arena() {
    free(base);
    base = nullptr;
    capacity = 0;
  }
};

thread_local Arena arena;

}  // namespace

void* scratch_acquire(size_t bytes) {
  Arena& a = arena;
  if (a.live == 0 && a.wanted > a.capacity) {  // nothing handed out: safe to move the buffer
    free(a.base);
    a.base = static_cast<char*>(aligned_alloc(64, a.wanted));
    a.capacity = a.base == nullptr ? 0 : a.wanted;
    a.used = 0;
  }
  void* out;
  if (a.used + bytes <= a.capacity) {
    out = a.base + a.used;
    a.used += bytes;
  } else {
    if (a.used + bytes <= kScratchArenaMaxBytes) a.wanted = std::max(a.wanted, a.used + bytes);
    out = aligned_alloc(64, bytes);
    if (out == nullptr) abort();
  }
  ++a.live;
  return out;
}

void scratch_release(void* ptr, size_t bytes) {
  Arena& a = arena;
  char* p = static_cast<char*>(ptr);
  --a.live;
  if (a.base != nullptr && p >= a.base && p < a.base + a.capacity) {
    if (p + bytes == a.base + a.used) a.used -= bytes;
  } else {
    free(ptr);
  }
  if (a.live == 0) a.used = 0;
}

#endif  // __SANITIZE_ADDRESS__

}  // namespace cpu
}  // namespace attention_ext
