// attention_ext: typed C++ entry points for libtorch users.
//
// Every function here calls the registered ops (attention_ext::attention_fwd, ...) through the
// c10 dispatcher, so C++ and Python run exactly the same kernels, checks and CPU/CUDA dispatch.
// Link the CMake target AttentionExt::attention_ext (find_package(AttentionExt)); loading the
// library registers the ops.
//
// These functions are not differentiable through torch's autograd (the autograd formulas are
// registered from Python): call attention_backward() yourself, or use the Python package for
// autograd. Shapes: q (..., n, d_k), k (..., m, d_k), v (..., m, d_v) -> out (..., n, d_v);
// leading dims broadcast like torch. See the README's "Semantics" table for masks, causal kinds,
// fully masked rows (output 0, lse -inf), dropout and the score modifiers (softcap, ALiBi, sinks).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#if defined(_WIN32)
#if defined(ATTENTION_EXT_BUILDING_LIBRARY)
#define ATTENTION_EXT_API __declspec(dllexport)
#else
#define ATTENTION_EXT_API __declspec(dllimport)
#endif
#else
#define ATTENTION_EXT_API __attribute__((visibility("default")))
#endif

#define ATTENTION_EXT_VERSION_MAJOR 0
#define ATTENTION_EXT_VERSION_MINOR 1
#define ATTENTION_EXT_VERSION_PATCH 0

namespace attention_ext {
// The public API lives in an inline namespace: users write attention_ext::attention_forward, and
// the exported symbols cannot collide with the library's internal functions of the same name.
inline namespace api {

// Causal alignment. kTopLeft: key j visible to query i iff j <= i (torch's is_causal).
// kBottomRight: key j visible iff j <= i + (m - n) (FlashAttention, torch's causal_lower_right).
// With attn_mask too, a key takes part only if both allow it.
enum class Causal { kNone = 0, kTopLeft = 1, kBottomRight = 2 };

// Sliding window (FlashAttention's window_size), aligned bottom-right: key j visible to query i
// iff i + m - n - left <= j <= i + m - n + right; -1 leaves that side unbounded. Combined with a
// causal kind (right becomes 0); with kTopLeft only when n == m.
struct Window {
  int64_t left = -1;
  int64_t right = -1;
};

// Score modifiers, applied to the scaled logit t = q·k·scale in this order, before attn_mask and
// the causal / window band (as FlashAttention and the Python package):
//   softcap > 0: t -> softcap·tanh(t / softcap) (Gemma 2); 0: none.
//   alibi_slopes: float32, one slope per head in a shape broadcasting to the batch dims ((heads,),
//     or (batch, heads) for (batch, heads, n, d) inputs): adds -slope·|i + m - n - j| (ALiBi,
//     aligned bottom-right as FlashAttention's). Constants: no gradient.
//   sinks: one logit per head, shaped like alibi_slopes, any floating dtype (converted to the
//     lse's): an extra key with value 0 in every row's softmax (GPT-OSS), so a row's weights sum
//     to 1 minus the sink's and the lse includes it; a row with no visible key then has lse = the
//     sink and output 0. Its gradient is sink_gradient()'s.
struct ScoreModifiers {
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;
  std::optional<at::Tensor> sinks;
};

// softmax(q kᵀ · scale + mask) v and the row logsumexp lse (..., n) of the masked scaled scores
// (float64 for float64 inputs, float32 otherwise; -inf for a row where no key takes part).
// attn_mask: bool (True = the key takes part) or the query's dtype (added to the scores), any
//   shape broadcasting to (..., n, m).
// scale: default 1/sqrt(d_k) (1 when d_k == 0).
// dropout_p > 0 needs rng_state, an int64 (seed, offset) tensor of 2 elements on q's device; the
//   same rng_state must be passed to attention_backward.
// k and v may broadcast differently against each other; they are expanded (views, no copy).
ATTENTION_EXT_API std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask = {}, std::optional<double> scale = {},
    Causal causal = Causal::kNone, double dropout_p = 0.0,
    const std::optional<at::Tensor>& rng_state = {}, Window window = {},
    const ScoreModifiers& modifiers = {});

// Gradients of attention_forward: returns (grad_q, grad_k, grad_v, grad_mask) with the shapes
// of q, k, v and attn_mask. grad_mask is computed only when mask_requires_grad (needs a floating
// attn_mask) and is an undefined tensor otherwise. out and lse are attention_forward's outputs
// for the same arguments; grad_lse (optional) is the gradient flowing into lse. The gradient into
// modifiers.sinks is sink_gradient()'s.
ATTENTION_EXT_API std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask = {}, std::optional<double> scale = {},
    Causal causal = Causal::kNone, double dropout_p = 0.0,
    const std::optional<at::Tensor>& rng_state = {},
    const std::optional<at::Tensor>& grad_lse = {}, bool mask_requires_grad = false,
    Window window = {}, const ScoreModifiers& modifiers = {});

// The gradient into the sinks of attention_forward(..., modifiers) (sinks' shape and dtype), from
// its out and lse and the gradients flowing into them: each row's sink weight exp(sink - lse)
// times -(rowsum(grad_out * out) - grad_lse), summed over the rows of each sink. O(n·d_v).
ATTENTION_EXT_API at::Tensor sink_gradient(const at::Tensor& sinks, const at::Tensor& out,
                                           const at::Tensor& lse, const at::Tensor& grad_out,
                                           const std::optional<at::Tensor>& grad_lse = {});

// Drop-in for at::scaled_dot_product_attention (forward only): same arguments and semantics,
// except that rows where no key takes part give 0 instead of NaN. is_causal means top-left
// causal and needs attn_mask to be empty (as in torch). With dropout_p > 0 the (seed, offset)
// pair is drawn with at::randint from the default generator of q's device, so at::manual_seed
// makes it reproducible (and matches the Python package's draw).
ATTENTION_EXT_API at::Tensor scaled_dot_product_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask = {}, double dropout_p = 0.0,
    bool is_causal = false, std::optional<double> scale = {}, bool enable_gqa = false);

// The exact attention probabilities (..., n, m): rows sum to 1 (with sinks: 1 minus the sink's
// weight), masked entries are 0, rows with no visible key are all 0.
ATTENTION_EXT_API at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k,
                                               const std::optional<at::Tensor>& attn_mask = {},
                                               std::optional<double> scale = {},
                                               Causal causal = Causal::kNone,
                                               Window window = {},
                                               const ScoreModifiers& modifiers = {});

// "key=value" lines: torch version built against, compiler, OpenMP, CPU kernel variants, CUDA.
ATTENTION_EXT_API std::string build_info();
// The CPU kernel variant in use ("avx512bf16", "avx512", "avx2" or "generic").
ATTENTION_EXT_API std::string cpu_variant();
// Selects the CPU kernel variant ("auto" = the best this CPU supports); returns the active one.
ATTENTION_EXT_API std::string set_cpu_variant(const std::string& name);

}  // namespace api
}  // namespace attention_ext
