// Rotary position embeddings (RoPE), as flash_attn_with_kvcache applies them to the new keys and
// the queries before it appends and attends (FlashAttention's rotary_cos / rotary_sin):
//   x (batch, rows, heads, d); row t of entry b sits at position start[b] + t (per_row) or at
//   start[b] (every row: FlashAttention's rule for the queries of a call without a causal mask
//   or window); cos / sin (seqlen_ro, rotary_dim / 2), any float dtype. Each pair (x1, x2) of the
//   first rotary_dim dims — neighbours (2i, 2i + 1) when interleaved, else (i, i + rotary_dim / 2)
//   (GPT-NeoX's halves) — becomes (x1·c − x2·s, x2·c + x1·s), c and s the tables' entry i at the
//   row's position; the dims past rotary_dim are copied.
// Precision: the tables' entries and x converted to float32 (float64 for float64 x), two products
// and one sum per element, each rounded on its own (never a fused multiply-add), the result stored
// in x's dtype: the bits of the formula's torch ops, which flash_attn_with_kvcache runs on the
// other devices.
#pragma once
#include <ATen/core/Tensor.h>

namespace attention_ext {

// Returns the rotated rows as a new contiguous (batch, rows, heads, d) tensor of x's dtype. CPU
// tensors; start int32 (batch,). Every position is checked to lie in the tables first.
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& start, bool per_row, bool interleaved);

}  // namespace attention_ext
