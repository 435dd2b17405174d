#pragma once
// Scratch memory of the CPU kernels: a per-thread stack of 64-byte aligned blocks.
//
// Every work chunk of every kernel takes its tiles (a few tens of KiB) when it starts and gives
// them back when it ends. From malloc that cost a small call more than its arithmetic (measured,
// (1, 8, 16, 16, 64) forward: malloc, free and their consolidation were ~20% of the call, freshly
// mapped pages another share). Blocks come from one buffer per thread that is kept between calls;
// a request that does not fit is served by the heap once and the buffer grows to fit it at the
// next chunk (up to kScratchArenaMaxBytes, beyond which the heap serves it every time).
//
// Blocks are released in the reverse order of their acquisition (scopes and struct members do
// that); a block released out of order is reclaimed when the thread's last block is. A thread
// keeps its buffer (at most kScratchArenaMaxBytes) until it exits. Under AddressSanitizer every
// block is a heap allocation of its own, so overruns between tiles still hit redzones.
#include <stddef.h>

namespace attention_ext {
namespace cpu {

constexpr size_t kScratchArenaMaxBytes = size_t(8) << 20;

// bytes (a multiple of 64, > 0) of uninitialised, 64-byte aligned memory owned by the caller
// until scratch_release(ptr, bytes) on the same thread.
void* scratch_acquire(size_t bytes);
void scratch_release(void* ptr, size_t bytes);

// ATTENTION_EXT_POISON_SCRATCH=1 (read once): uninitialised blocks are filled with 0xFF bytes, a
// NaN in every float type, so a kernel that reads scratch it did not write first gives NaN in
// its results instead of whatever a previous call left there. The tests run once with it.
bool scratch_poisoned();

}  // namespace cpu
}  // namespace attention_ext
