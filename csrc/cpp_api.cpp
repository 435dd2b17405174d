// The typed C++ API of include/attention_ext/attention_ext.h: argument defaults and the same
// normalisation as the Python package (attention_ext/api.py), then the registered ops through the
// c10 dispatcher, so C++ callers get the same kernels, checks and device dispatch as Python.
// Compiled into the CMake library and (csrc/build_sources.txt lists it for setup.py too) into the
// Python extension as well, so it uses ATen and the dispatcher only (no <torch/torch.h>).
#ifndef ATTENTION_EXT_BUILDING_LIBRARY
#define ATTENTION_EXT_BUILDING_LIBRARY 1  // (Windows: dllexport) also in the setup.py build
#endif
#include "../include/attention_ext/attention_ext.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/randint.h>
#include <ATen/ExpandUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "op_arguments.h"
#include "op_handles.h"

#include <cmath>
#include <limits>
#include <vector>

namespace attention_ext {
inline namespace api {
namespace {

using namespace op_handles;

// The default scale (default_scale) of q's head dim. Bad shapes are left to the op, whose
// messages name the tensor.
double resolve_scale(const at::Tensor& q, std::optional<double> scale) {
  if (scale.has_value()) return *scale;
  return default_scale(q.dim() >= 1 ? q.size(-1) : 0);
}

// The backward kernels own dK/dV per key position, so the ops need key and value to have the
// same batch dims: expand them to their common broadcast shape (views, no copy), as Python does.
void expand_kv(at::Tensor& k, at::Tensor& v) {
  if (k.dim() < 2 || v.dim() < 2) return;  // the op reports the shapes
  const auto kb = k.sizes().slice(0, k.dim() - 2);
  const auto vb = v.sizes().slice(0, v.dim() - 2);
  if (kb == vb) return;
  const std::vector<int64_t> batch = at::infer_size(kb, vb);
  std::vector<int64_t> ks(batch), vs(batch);
  ks.push_back(k.size(-2));
  ks.push_back(k.size(-1));
  vs.push_back(v.size(-2));
  vs.push_back(v.size(-1));
  k = k.expand(ks);
  v = v.expand(vs);
}

// An optional holding an undefined tensor means "none" too (a mask, grad_lse, slopes, sinks).
std::optional<at::Tensor> defined_or_none(const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined()) return t;
  return std::nullopt;
}

// The sinks in the lse's dtype (float64 for float64 inputs, float32 otherwise), as the ops take
// them; the slopes go as they are (the op names the tensor if they are not float32).
std::optional<at::Tensor> sinks_for(const at::Tensor& q, const ScoreModifiers& modifiers) {
  const std::optional<at::Tensor> sinks = defined_or_none(modifiers.sinks);
  if (!sinks.has_value()) return std::nullopt;
  return sinks->to(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v,
                                                     const std::optional<at::Tensor>& attn_mask,
                                                     std::optional<double> scale, Causal causal,
                                                     double dropout_p,
                                                     const std::optional<at::Tensor>& rng_state,
                                                     Window window, const ScoreModifiers& modifiers) {
  at::Tensor key = k, value = v;
  expand_kv(key, value);
  return handle<FwdSig, kFwd>().call(q, key, value, defined_or_none(attn_mask), resolve_scale(q, scale),
                                     static_cast<int64_t>(causal), window.left, window.right, modifiers.softcap,
                                     defined_or_none(modifiers.alibi_slopes), sinks_for(q, modifiers), dropout_p,
                                     rng_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale, Causal causal, double dropout_p,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& grad_lse,
    bool mask_requires_grad, Window window, const ScoreModifiers& modifiers) {
  at::Tensor key = k, value = v;
  expand_kv(key, value);
  auto [gq, gk, gv, gmask] =
      handle<BwdSig, kBwd>().call(grad_out, defined_or_none(grad_lse), q, key, value, defined_or_none(attn_mask),
                                  out, lse, resolve_scale(q, scale), static_cast<int64_t>(causal), window.left,
                                  window.right, modifiers.softcap, defined_or_none(modifiers.alibi_slopes),
                                  sinks_for(q, modifiers), dropout_p, rng_state, mask_requires_grad,
                                  /*merged_lse=*/false);
  // Reduce the gradients of expanded key/value back to the caller's shapes.
  if (gk.sizes() != k.sizes()) gk = gk.sum_to_size(k.sizes());
  if (gv.sizes() != v.sizes()) gv = gv.sum_to_size(v.sizes());
  if (!mask_requires_grad) gmask = at::Tensor();
  return {gq, gk, gv, gmask};
}

at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v,
                                        const std::optional<at::Tensor>& attn_mask,
                                        double dropout_p, bool is_causal,
                                        std::optional<double> scale, bool enable_gqa) {
  TORCH_CHECK(!(is_causal && attn_mask.has_value() && attn_mask->defined()),
              "attention_ext: attn_mask must be empty when is_causal=true (as in torch)");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0,
              "attention_ext: dropout_p must be in [0, 1), got ", dropout_p);
  std::optional<at::Tensor> mask = defined_or_none(attn_mask);
  const double s = resolve_scale(q, scale);

  at::Tensor query = q, key = k, value = v;
  bool split_heads = false;
  if (enable_gqa) {
    // torch's enable_gqa without copying K/V: the query heads Hq split into (Hkv, Hq/Hkv) and
    // K/V gain a broadcast dim, so query head h reads key/value head h / (Hq/Hkv).
    TORCH_CHECK(q.dim() >= 3 && k.dim() >= 3 && v.dim() >= 3,
                "attention_ext: enable_gqa=true needs (..., heads, length, dim) inputs, got query ",
                q.sizes(), ", key ", k.sizes(), ", value ", v.sizes());
    const int64_t hq = q.size(-3), hk = k.size(-3), hv = v.size(-3);
    TORCH_CHECK(hk == hv, "attention_ext: enable_gqa=true needs key and value to have the same ",
                "number of heads, got key ", hk, " and value ", hv);
    TORCH_CHECK(hk != 0 && hq % hk == 0, "attention_ext: enable_gqa=true needs the query heads (",
                hq, ") to be a multiple of the key/value heads (", hk, ")");
    if (hq != hk) {
      const int64_t groups = hq / hk;
      query = q.unflatten(-3, {hk, groups});
      key = k.unsqueeze(-3);
      value = v.unsqueeze(-3);
      if (mask.has_value() && mask->dim() >= 3)
        mask = mask->size(-3) == hq ? mask->unflatten(-3, {hk, groups}) : mask->unsqueeze(-3);
      split_heads = true;
    }
  }
  std::optional<at::Tensor> rng_state;
  if (dropout_p > 0.0)
    rng_state = at::randint(std::numeric_limits<int64_t>::min(),
                            std::numeric_limits<int64_t>::max(), {2},
                            at::TensorOptions().dtype(at::kLong).device(q.device()));
  at::Tensor out = std::get<0>(attention_forward(query, key, value, mask, s,
                                                 is_causal ? Causal::kTopLeft : Causal::kNone,
                                                 dropout_p, rng_state));
  return split_heads ? out.flatten(-4, -3) : out;
}

at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k,
                             const std::optional<at::Tensor>& attn_mask,
                             std::optional<double> scale, Causal causal, Window window,
                             const ScoreModifiers& modifiers) {
  return handle<ProbsSig, kProbs>().call(q, k, defined_or_none(attn_mask), resolve_scale(q, scale),
                                         static_cast<int64_t>(causal), window.left, window.right, modifiers.softcap,
                                         defined_or_none(modifiers.alibi_slopes), sinks_for(q, modifiers));
}

// As the Python package's (attention_ext/function.py, sink_gradient): with delta = rowsum(dO ∘ O)
// − dlse per row, d loss / d sink = Σ_rows exp(sink − lse)·(0 − delta), the sink's key having
// value 0. Rows with lse = −inf (no visible key and a sink of −inf) have weight 0.
at::Tensor sink_gradient(const at::Tensor& sinks, const at::Tensor& out, const at::Tensor& lse,
                         const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse) {
  TORCH_CHECK(out.dim() >= 1 && lse.dim() == out.dim() - 1 && lse.sizes() == out.sizes().slice(0, out.dim() - 1),
              "attention_ext: sink_gradient needs out (..., n, d_v) and lse (..., n), got out ", out.sizes(),
              " and lse ", lse.sizes());
  TORCH_CHECK(grad_out.sizes() == out.sizes(), "attention_ext: sink_gradient needs grad_out shaped like out ",
              out.sizes(), ", got ", grad_out.sizes());
  const std::optional<at::Tensor> dlse = defined_or_none(grad_lse);
  TORCH_CHECK(!dlse.has_value() || dlse->sizes() == lse.sizes(),
              "attention_ext: sink_gradient needs grad_lse shaped like lse ", lse.sizes(), ", got ",
              dlse.has_value() ? dlse->sizes() : at::IntArrayRef{});
  // (Tensor methods, not operators: this file includes ATen's core only.)
  const at::ScalarType acc = lse.scalar_type();
  at::Tensor delta = grad_out.to(acc).mul(out.to(acc)).sum(-1);
  if (dlse.has_value()) delta = delta.sub(dlse->to(acc));
  // exp(sink − lse) <= 1, capped there: a dominant sink can sit an lse's rounding above it.
  // A sink of +inf has lse +inf and weight 1; a row with lse −inf has none.
  const at::Tensor sink = sinks.to(acc).unsqueeze(-1);
  const at::Tensor weight =
      sink.sub(lse).clamp_max(0.0).exp().masked_fill(sink.eq(lse), 1.0).masked_fill(lse.isneginf(), 0.0);
  const at::Tensor rows = weight.mul(delta);
  return rows.sum(-1).neg().sum_to_size(sinks.sizes()).to(sinks.scalar_type());
}

std::string build_info() {
  return handle<InfoSig, kBuildInfo>().call();
}

std::string cpu_variant() {
  return handle<InfoSig, kCpuVariant>().call();
}

std::string set_cpu_variant(const std::string& name) {
  return handle<SetVariantSig, kSetCpuVariant>().call(name);
}

}  // namespace api
}  // namespace attention_ext
