// Rotary position embeddings on CPU tensors (rotary.h states the rule).
//
// Algorithm: the tables' rows at the positions the call uses are converted once into float
// buffers (one row per entry, or per (entry, row) with per_row); then each (entry, row) of x,
// in parallel, rotates its heads' pairs with that row's (c, s).
// Memory traffic: x read once and its rotated copy written once; one table row per position.
#include "rotary.h"

#include "kv_cache.h"
#include "op_arguments.h"
#include "rounding_barrier.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace attention_ext {
namespace {

// v as computed, rounded on its own (rounding_barrier.h): the formula's torch ops round each
// product before the sum.
template <typename A>
inline A rounded(A v) {
  ATTN_ROUNDING_BARRIER(v);
  return v;
}

// rows[i·half + j] = table[positions[i], j] converted to A (as torch's .to(): round to nearest).
template <typename A>
std::vector<A> table_rows(const at::Tensor& table, const std::vector<int64_t>& positions, int64_t half) {
  std::vector<A> rows(positions.size() * half);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, table.scalar_type(), "rotary table", [&] {
    const scalar_t* base = table.data_ptr<scalar_t>();
    const int64_t s0 = table.stride(0), s1 = table.stride(1);
    for (size_t i = 0; i < positions.size(); ++i)
      for (int64_t j = 0; j < half; ++j) {
        const scalar_t v = base[positions[i] * s0 + j * s1];
        // (half and bfloat16 widen exactly to float first; a double table rounds once to A)
        using Wide = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        rows[i * half + j] = static_cast<A>(static_cast<Wide>(v));
      }
  });
  return rows;
}

template <typename T, typename A>
void rotate(const at::Tensor& x, at::Tensor& out, const std::vector<A>& cos_rows, const std::vector<A>& sin_rows,
            int64_t half, bool per_row, bool interleaved) {
  const int64_t rows = x.size(1), heads = x.size(2), d = x.size(3);
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2), xs3 = x.stride(3);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, heads * d));
  at::parallel_for(0, x.size(0) * rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / rows, t = i % rows;
      const A* c = cos_rows.data() + (per_row ? i : b) * half;
      const A* s = sin_rows.data() + (per_row ? i : b) * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xi = src + b * xs0 + t * xs1 + h * xs2;
        T* o = dst + (i * heads + h) * d;
        for (int64_t j = 0; j < half; ++j) {
          const int64_t first = interleaved ? 2 * j : j, second = interleaved ? 2 * j + 1 : j + half;
          const A x1 = static_cast<A>(xi[first * xs3]), x2 = static_cast<A>(xi[second * xs3]);
          o[first] = static_cast<T>(rounded(x1 * c[j]) - rounded(x2 * s[j]));
          o[second] = static_cast<T>(rounded(x2 * c[j]) + rounded(x1 * s[j]));
        }
        for (int64_t j = 2 * half; j < d; ++j) o[j] = xi[j * xs3];
      }
    }
  });
}

}  // namespace

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& start, bool per_row, bool interleaved) {
  TORCH_CHECK(x.dim() == 4, "attention_ext: rotary rotates (batch, rows, heads, head_dim) tensors, got shape ",
              x.sizes());
  TORCH_CHECK(supported_dtype(x.scalar_type()),
              "attention_ext: rotary rotates float64/float32/float16/bfloat16 tensors, got ", x.scalar_type());
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes(), "attention_ext: rotary_cos / rotary_sin must both be ",
              "(seqlen_ro, rotary_dim / 2), got ", cos.sizes(), " and ", sin.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos, "rotary_cos"}, {sin, "rotary_sin"}})
    TORCH_CHECK(supported_dtype(t.scalar_type()),
                "attention_ext: ", name, " must be float64/float32/float16/bfloat16, got ", t.scalar_type());
  const int64_t batch = x.size(0), rows = x.size(1), half = cos.size(1), seqlen_ro = cos.size(0);
  TORCH_CHECK(2 * half <= x.size(3), "attention_ext: rotary_dim ", 2 * half, " (twice rotary_cos's ", half,
              " columns) exceeds the head dim ", x.size(3));
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{x, "x"}, {cos, "rotary_cos"},
                                {sin, "rotary_sin"}})
    TORCH_CHECK(t.device().is_cpu(), "attention_ext: the rotary op takes CPU tensors (flash_attn_with_kvcache ",
                "rotates with torch ops on other devices), got ", name, " on ", t.device());
  const std::vector<int64_t> first = read_per_entry(start, "the rotary start positions", batch, x);
  // The position of each (entry, row), or of each entry when all its rows share one.
  std::vector<int64_t> positions;
  positions.reserve(per_row ? batch * rows : batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t last = first[b] + (per_row ? rows - 1 : 0);
    TORCH_CHECK(rows == 0 || (first[b] >= 0 && last < seqlen_ro), "attention_ext: rotary positions ", first[b],
                "..", last, " of entry ", b, " are outside the rotary tables' ", seqlen_ro, " positions");
    for (int64_t t = 0; t < (per_row ? rows : 1); ++t) positions.push_back(first[b] + t);
  }
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotary", [&] {
    using A = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    rotate<scalar_t, A>(x, out, table_rows<A>(cos, positions, half), table_rows<A>(sin, positions, half), half,
                        per_row, interleaved);
  });
  return out;
}

}  // namespace attention_ext
