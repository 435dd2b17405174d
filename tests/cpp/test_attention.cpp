// C++ API tests (ctest): attention_ext's typed entry points against a plain libtorch reference,
// softmax(q kᵀ · scale + mask) v, computed in float64; gradients against torch autograd of that
// reference. Exits non-zero, naming every failed check, if anything is off.
#include <attention_ext/attention_ext.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using attention_ext::Causal;

int g_failures = 0;
int g_checks = 0;
std::string g_case;

void fail(const std::string& what) {
  ++g_failures;
  std::fprintf(stderr, "FAIL [%s]: %s\n", g_case.c_str(), what.c_str());
}

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) fail(what);
}

// |a - b| <= atol + rtol |b| everywhere (both defined, same shape); NaN never passes.
void check_close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol,
                 const std::string& what) {
  ++g_checks;
  if (!a.defined() || !b.defined()) return fail(what + ": undefined tensor");
  if (a.sizes() != b.sizes()) {
    std::ostringstream os;
    os << what << ": shape " << a.sizes() << " vs expected " << b.sizes();
    return fail(os.str());
  }
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  const at::Tensor err = (x - y).abs();
  const bool finite_match = at::equal(at::isfinite(x), at::isfinite(y)) &&
                            at::equal(x.masked_select(~at::isfinite(x)), y.masked_select(~at::isfinite(y)));
  const at::Tensor fin = at::isfinite(y);
  const bool ok = finite_match &&
                  (x.numel() == 0 || (err.masked_select(fin) <= atol + rtol * y.abs().masked_select(fin))
                                         .all()
                                         .item<bool>());
  if (!ok) {
    std::ostringstream os;
    os << what << ": max abs error "
       << (x.numel() ? at::nan_to_num(err, 0.0, 1e300, 1e300).max().item<double>() : 0.0)
       << " (rtol " << rtol << ", atol " << atol << ")";
    fail(os.str());
  }
}

// Runs one case; a c10::Error (or any exception) counts as a failure with its message.
void run_case(const std::string& name, const std::function<void()>& body) {
  g_case = name;
  try {
    body();
  } catch (const std::exception& e) {
    fail(std::string("exception: ") + e.what());
  }
}

// Bool (n, m): true where key j is visible to query i.
at::Tensor visibility(int64_t n, int64_t m, Causal causal) {
  const int64_t shift = causal == Causal::kTopLeft ? 0 : m - n;
  const at::Tensor i = at::arange(n, at::kLong).unsqueeze(-1);
  const at::Tensor j = at::arange(m, at::kLong);
  return j <= i + shift;
}

struct Ref {
  at::Tensor out, lse, probs;
};

// The reference in float64 (differentiable): masked scores, softmax, probabilities times v.
// Fully masked rows give weights 0 (so output 0) and lse -inf, like the library.
// With modifiers: softcap·tanh(t / softcap), then −slope·|i + m − n − j|, before the mask; a sink
// is one more column in the softmax whose weight is dropped afterwards (its value is 0).
Ref reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const std::optional<at::Tensor>& mask, double scale, Causal causal,
              const attention_ext::ScoreModifiers& mods = {}) {
  const double inf = std::numeric_limits<double>::infinity();
  at::Tensor s = q.matmul(k.transpose(-2, -1)) * scale;
  const int64_t n = s.size(-2), m = s.size(-1);
  if (mods.softcap > 0) s = (s / mods.softcap).tanh() * mods.softcap;
  if (mods.alibi_slopes.has_value()) {
    const at::Tensor i = at::arange(n, at::kLong).unsqueeze(-1), j = at::arange(m, at::kLong);
    const at::Tensor distance = (i + (m - n) - j).abs().to(at::kDouble);
    s = s - mods.alibi_slopes->to(at::kDouble).unsqueeze(-1).unsqueeze(-1) * distance;
  }
  if (mask.has_value()) {
    if (mask->scalar_type() == at::kBool)
      s = s.masked_fill(mask->logical_not(), -inf);
    else
      s = s + mask->to(s.scalar_type());
  }
  if (causal != Causal::kNone) s = s.masked_fill(visibility(s.size(-2), s.size(-1), causal).logical_not(), -inf);
  if (mods.sinks.has_value()) {
    std::vector<int64_t> column(s.sizes().begin(), s.sizes().end());
    column.back() = 1;
    const at::Tensor sink = mods.sinks->to(at::kDouble).unsqueeze(-1).unsqueeze(-1).expand(column);
    const at::Tensor lse = at::logsumexp(at::cat({s, sink}, -1), -1, /*keepdim=*/true);
    const at::Tensor p = (s - lse).exp();  // the keys' weights; the sink's is 1 minus their sum
    return {p.matmul(v), lse.squeeze(-1), p};
  }
  const at::Tensor lse = at::logsumexp(s, -1, /*keepdim=*/true);
  const at::Tensor empty = at::isinf(lse).logical_and(lse < 0);
  at::Tensor p = at::softmax(s, -1);
  p = at::where(empty, at::zeros_like(p), p);
  return {p.matmul(v), lse.squeeze(-1), p};
}

double default_scale(const at::Tensor& q) { return 1.0 / std::sqrt(static_cast<double>(q.size(-1))); }

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

// Forward of attention_forward / attention_weights / the drop-in against the reference.
void forward_case(at::ScalarType dtype, std::vector<int64_t> qs, std::vector<int64_t> ks,
                  std::vector<int64_t> vs, Causal causal, bool with_bool_mask) {
  const at::TensorOptions opt = at::TensorOptions().dtype(dtype);
  const at::Tensor q = at::randn(qs, opt), k = at::randn(ks, opt), v = at::randn(vs, opt);
  std::optional<at::Tensor> mask;
  if (with_bool_mask) mask = at::rand({q.size(-2), k.size(-2)}) > 0.3;  // broadcast over batch
  const double scale = default_scale(q);
  const Ref ref = reference(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), mask, scale, causal);
  const double tol = dtype == at::kDouble ? 1e-10 : 2e-5;

  auto [out, lse] = attention_ext::attention_forward(q, k, v, mask, {}, causal);
  check(out.scalar_type() == dtype, "out dtype");
  check(lse.scalar_type() == (dtype == at::kDouble ? at::kDouble : at::kFloat), "lse dtype");
  check_close(out, ref.out, tol, tol, "attention_forward out");
  check_close(lse, ref.lse, tol, tol, "attention_forward lse");
  check_close(attention_ext::attention_weights(q, k, mask, {}, causal), ref.probs, tol, tol,
              "attention_weights");
  // An explicit scale equal to the default gives the same result, bit for bit.
  check(at::equal(std::get<0>(attention_ext::attention_forward(q, k, v, mask, scale, causal)), out),
        "explicit default scale");

  if (causal == Causal::kNone || (causal == Causal::kTopLeft && !with_bool_mask)) {
    const at::Tensor d = attention_ext::scaled_dot_product_attention(
        q, k, v, mask, 0.0, causal == Causal::kTopLeft);
    check_close(d, ref.out, tol, tol, "scaled_dot_product_attention");
  }
}

// Gradients of attention_backward against autograd through the float64 reference.
void backward_case(at::ScalarType dtype, std::vector<int64_t> qs, std::vector<int64_t> ks,
                   std::vector<int64_t> vs, Causal causal, int mask_kind /*0 none, 1 bool, 2 float*/,
                   std::optional<double> scale = {}) {
  const at::TensorOptions opt = at::TensorOptions().dtype(dtype);
  const at::Tensor q = at::randn(qs, opt), k = at::randn(ks, opt), v = at::randn(vs, opt);
  const int64_t n = q.size(-2), m = k.size(-2);
  std::optional<at::Tensor> mask;
  if (mask_kind == 1) {
    at::Tensor b = at::rand({n, m}) > 0.3;
    b.select(-1, m - 1).fill_(true);  // every row keeps a key (so autograd has no NaN)
    mask = b;
  } else if (mask_kind == 2) {
    mask = at::randn({q.size(-3), n, m}, opt);  // broadcast over the leading batch dim
  }
  const double s = scale.value_or(default_scale(q));

  auto [out, lse] = attention_ext::attention_forward(q, k, v, mask, scale, causal);
  const at::Tensor grad_out = at::randn(out.sizes(), opt);
  const at::Tensor grad_lse = at::randn(lse.sizes(), lse.options());
  auto [gq, gk, gv, gmask] = attention_ext::attention_backward(
      grad_out, q, k, v, out, lse, mask, scale, causal, 0.0, {}, grad_lse, mask_kind == 2);

  // Autograd of the reference in float64.
  torch::AutoGradMode grad_mode(true);
  at::Tensor q64 = q.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor k64 = k.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor v64 = v.to(at::kDouble).detach().requires_grad_(true);
  std::optional<at::Tensor> mask64;
  if (mask_kind == 1) mask64 = mask;
  if (mask_kind == 2) mask64 = mask->to(at::kDouble).detach().requires_grad_(true);
  const Ref ref = reference(q64, k64, v64, mask64, s, causal);
  const at::Tensor loss = (ref.out * grad_out.to(at::kDouble)).sum() +
                          (ref.lse * grad_lse.to(at::kDouble)).sum();
  std::vector<at::Tensor> inputs = {q64, k64, v64};
  if (mask_kind == 2) inputs.push_back(*mask64);
  const auto grads = torch::autograd::grad({loss}, inputs);

  const double tol = dtype == at::kDouble ? 1e-9 : 1e-4;
  check_close(out, ref.out.detach(), tol, tol, "out");
  check_close(gq, grads[0], tol, tol, "grad_q");
  check_close(gk, grads[1], tol, tol, "grad_k");
  check_close(gv, grads[2], tol, tol, "grad_v");
  if (mask_kind == 2)
    check_close(gmask, grads[3], tol, tol, "grad_mask " + shape_str(mask->sizes()));
  else
    check(!gmask.defined(), "grad_mask is undefined when not requested");
}

// Softcap, ALiBi and sinks through the C++ API: forward, weights and gradients (the sinks' through
// sink_gradient) against autograd of the float64 reference.
void modifiers_case(at::ScalarType dtype, Causal causal, bool per_batch) {
  const at::TensorOptions opt = at::TensorOptions().dtype(dtype);
  const at::Tensor q = at::randn({2, 3, 6, 8}, opt), k = at::randn({2, 3, 9, 8}, opt),
                   v = at::randn({2, 3, 9, 5}, opt);
  const std::vector<int64_t> per_head = per_batch ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{3};
  attention_ext::ScoreModifiers mods;
  mods.softcap = 1.5;
  mods.alibi_slopes = at::rand(per_head, at::kFloat) * 0.5;
  mods.sinks = at::randn(per_head, opt);
  at::Tensor mask = at::ones({6, 9}, at::kBool);
  mask[2].fill_(false);  // a row with no visible key: the sink alone, output 0, lse = the sink

  auto [out, lse] = attention_ext::attention_forward(q, k, v, mask, {}, causal, 0.0, {}, {}, mods);
  const at::Tensor grad_out = at::randn(out.sizes(), opt);
  const at::Tensor grad_lse = at::randn(lse.sizes(), lse.options());
  auto [gq, gk, gv, gm] = attention_ext::attention_backward(grad_out, q, k, v, out, lse, mask, {}, causal, 0.0,
                                                            {}, grad_lse, false, {}, mods);
  const at::Tensor gsinks = attention_ext::sink_gradient(*mods.sinks, out, lse, grad_out, grad_lse);

  torch::AutoGradMode grad_mode(true);
  at::Tensor q64 = q.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor k64 = k.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor v64 = v.to(at::kDouble).detach().requires_grad_(true);
  attention_ext::ScoreModifiers mods64 = mods;
  mods64.sinks = mods.sinks->to(at::kDouble).detach().requires_grad_(true);
  const Ref ref = reference(q64, k64, v64, mask, default_scale(q), causal, mods64);
  const at::Tensor loss = (ref.out * grad_out.to(at::kDouble)).sum() + (ref.lse * grad_lse.to(at::kDouble)).sum();
  const auto grads = torch::autograd::grad({loss}, {q64, k64, v64, *mods64.sinks});

  const double tol = dtype == at::kDouble ? 1e-9 : 1e-4;
  check_close(out, ref.out.detach(), tol, tol, "out");
  check_close(lse, ref.lse.detach(), tol, tol, "lse");
  check(at::equal(out.select(-2, 2), at::zeros_like(out.select(-2, 2))), "the row with no key gives 0");
  check_close(attention_ext::attention_weights(q, k, mask, {}, causal, {}, mods), ref.probs.detach(), tol, tol,
              "attention_weights");
  check_close(gq, grads[0], tol, tol, "grad_q");
  check_close(gk, grads[1], tol, tol, "grad_k");
  check_close(gv, grads[2], tol, tol, "grad_v");
  check(gsinks.sizes() == mods.sinks->sizes() && gsinks.scalar_type() == dtype, "grad_sinks shape and dtype");
  check_close(gsinks, grads[3], tol, tol, "grad_sinks");
  // Each modifier is honoured: without it the result differs.
  for (int drop = 0; drop < 3; ++drop) {
    attention_ext::ScoreModifiers less = mods;
    if (drop == 0) less.softcap = 0.0;
    if (drop == 1) less.alibi_slopes.reset();
    if (drop == 2) less.sinks.reset();
    const at::Tensor other = std::get<0>(attention_ext::attention_forward(q, k, v, mask, {}, causal, 0.0, {}, {}, less));
    check(!at::allclose(other, out), "modifier " + std::to_string(drop) + " changes the output");
  }
}

}  // namespace

int main() {
  at::manual_seed(0);
  const std::vector<Causal> kinds = {Causal::kNone, Causal::kTopLeft, Causal::kBottomRight};

  run_case("build_info", [] {
    const std::string info = attention_ext::build_info();
    check(!info.empty(), "build_info() is empty");
    check(info.find("torch_version=") != std::string::npos, "build_info() has torch_version=");
    check(!attention_ext::cpu_variant().empty(), "cpu_variant() is empty");
    std::printf("build_info:\n%s", info.c_str());
  });

  // Forward: float64 and float32, several shapes (n < m, n > m, d_k != d_v, odd sizes, broadcast
  // batch dims), all causal kinds, with and without a bool mask.
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    for (const Causal causal : kinds) {
      for (const bool masked : {false, true}) {
        const std::vector<std::vector<std::vector<int64_t>>> shapes = {
            {{2, 3, 5, 8}, {2, 3, 7, 8}, {2, 3, 7, 4}},
            {{1, 2, 70, 16}, {1, 2, 33, 16}, {1, 2, 33, 16}},  // n > m: bottom-right masks rows
            {{3, 1, 9, 5}, {1, 4, 9, 5}, {3, 4, 9, 3}},        // broadcast batch dims
            {{4, 3}, {6, 3}, {6, 2}},                          // no batch dims
        };
        for (const auto& s : shapes) {
          std::ostringstream name;
          name << "forward " << c10::toString(dtype) << " causal=" << static_cast<int>(causal)
               << " mask=" << masked << " q" << shape_str(s[0]);
          run_case(name.str(), [&] { forward_case(dtype, s[0], s[1], s[2], causal, masked); });
        }
      }
    }
  }

  // Backward against autograd.
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    const std::string d = c10::toString(dtype);
    for (const Causal causal : kinds) {
      const std::string c = " causal=" + std::to_string(static_cast<int>(causal));
      run_case("backward " + d + c, [&] {
        backward_case(dtype, {2, 3, 6, 8}, {2, 3, 9, 8}, {2, 3, 9, 5}, causal, 0);
      });
      run_case("backward bool mask " + d + c, [&] {
        backward_case(dtype, {2, 2, 7, 4}, {2, 2, 7, 4}, {2, 2, 7, 4}, causal, 1);
      });
      run_case("backward float mask (grad reduced to its broadcast shape) " + d + c, [&] {
        backward_case(dtype, {2, 2, 5, 4}, {2, 2, 8, 4}, {2, 2, 8, 6}, causal, 2, 0.3);
      });
    }
    // K and V with different batch dims: expanded for the op, gradients summed back.
    run_case("backward k/v broadcast " + d, [&] {
      backward_case(dtype, {2, 3, 5, 4}, {1, 3, 6, 4}, {2, 3, 6, 4}, Causal::kNone, 0);
    });
  }

  // Score modifiers: softcap, ALiBi (per head and per batch entry), sinks.
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    for (const Causal causal : kinds) {
      for (const bool per_batch : {false, true}) {
        run_case("modifiers " + std::string(c10::toString(dtype)) + " causal=" +
                     std::to_string(static_cast<int>(causal)) + (per_batch ? " per batch" : " per head"),
                 [&] { modifiers_case(dtype, causal, per_batch); });
      }
    }
  }

  // A row where no key takes part: output 0, lse -inf, finite zero gradients for that row.
  run_case("fully masked row", [] {
    const auto opt = at::TensorOptions().dtype(at::kDouble);
    const at::Tensor q = at::randn({2, 4, 3}, opt), k = at::randn({2, 5, 3}, opt),
                     v = at::randn({2, 5, 2}, opt);
    at::Tensor mask = at::ones({4, 5}, at::kBool);
    mask[1].fill_(false);
    auto [out, lse] = attention_ext::attention_forward(q, k, v, mask);
    check(at::equal(out.select(-2, 1), at::zeros({2, 2}, opt)), "masked row's output is 0");
    check(at::isfinite(out).all().item<bool>(), "output has no NaN/inf");
    check((lse.select(-1, 1) == -std::numeric_limits<double>::infinity()).all().item<bool>(),
          "masked row's lse is -inf");
    auto [gq, gk, gv, gm] =
        attention_ext::attention_backward(at::ones_like(out), q, k, v, out, lse, mask);
    check(at::isfinite(gq).all().item<bool>() && at::isfinite(gk).all().item<bool>() &&
              at::isfinite(gv).all().item<bool>(),
          "gradients are finite");
    check(at::equal(gq.select(-2, 1), at::zeros({2, 3}, opt)), "masked row's grad_q is 0");
    const Ref ref = reference(q, k, v, mask, default_scale(q), Causal::kNone);
    check_close(out, ref.out, 1e-10, 1e-10, "other rows match the reference");
    // The drop-in agrees with torch wherever torch is defined (torch gives NaN for that row).
    const at::Tensor torch_out = at::scaled_dot_product_attention(q, k, v, mask);
    const at::Tensor ours = attention_ext::scaled_dot_product_attention(q, k, v, mask);
    check_close(ours.select(-2, 0), torch_out.select(-2, 0), 1e-10, 1e-10, "row 0 vs torch");
  });

  // The drop-in against torch's own scaled_dot_product_attention, incl. is_causal and GQA.
  run_case("drop-in vs at::scaled_dot_product_attention", [] {
    const at::Tensor q = at::randn({2, 8, 12, 16}), k = at::randn({2, 8, 10, 16}),
                     v = at::randn({2, 8, 10, 16});
    check_close(attention_ext::scaled_dot_product_attention(q, k, v),
                at::scaled_dot_product_attention(q, k, v), 1e-4, 1e-5, "plain");
    check_close(attention_ext::scaled_dot_product_attention(q, k, v, {}, 0.0, true),
                at::scaled_dot_product_attention(q, k, v, {}, 0.0, true), 1e-4, 1e-5, "is_causal");
    const at::Tensor fmask = at::randn({12, 10});
    check_close(attention_ext::scaled_dot_product_attention(q, k, v, fmask, 0.0, false, 0.5),
                at::scaled_dot_product_attention(q, k, v, fmask, 0.0, false, 0.5), 1e-4, 1e-5,
                "float mask + scale");
    const at::Tensor kg = at::randn({2, 2, 10, 16}), vg = at::randn({2, 2, 10, 16});
    check_close(attention_ext::scaled_dot_product_attention(q, kg, vg, {}, 0.0, false, {}, true),
                at::scaled_dot_product_attention(q, kg, vg, {}, 0.0, false, {}, true), 1e-4, 1e-5,
                "enable_gqa");
    bool threw = false;
    try {
      attention_ext::scaled_dot_product_attention(q, k, v, fmask, 0.0, true);
    } catch (const c10::Error&) {
      threw = true;
    }
    check(threw, "is_causal with attn_mask throws");
  });

  // Dropout: reproducible from the default generator's seed, scaled like torch, same via both APIs.
  run_case("dropout", [] {
    const auto opt = at::TensorOptions().dtype(at::kDouble);
    const at::Tensor q = at::randn({2, 6, 4}, opt), k = at::randn({2, 6, 4}, opt),
                     v = at::randn({2, 6, 3}, opt);
    at::manual_seed(123);
    const at::Tensor a = attention_ext::scaled_dot_product_attention(q, k, v, {}, 0.4);
    at::manual_seed(123);
    const at::Tensor b = attention_ext::scaled_dot_product_attention(q, k, v, {}, 0.4);
    check(at::equal(a, b), "same seed, same output");
    const at::Tensor plain = attention_ext::scaled_dot_product_attention(q, k, v);
    check(!at::allclose(a, plain), "dropout changes the output");
    // The rng_state the drop-in drew, then the keep mask it applied.
    at::manual_seed(123);
    const at::Tensor rng = at::randint(std::numeric_limits<int64_t>::min(),
                                       std::numeric_limits<int64_t>::max(), {2}, at::kLong);
    auto [out, lse] = attention_ext::attention_forward(q, k, v, {}, {}, Causal::kNone, 0.4, rng);
    check(at::equal(out, a), "attention_forward with the drawn rng_state matches");
    static const auto keep_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("attention_ext::dropout_keep_mask", "")
                                    .typed<at::Tensor(const at::Tensor&, c10::ArrayRef<int64_t>,
                                                      int64_t, int64_t, double)>();
    const at::Tensor keep = keep_op.call(rng, {2}, 6, 6, 0.4);
    const Ref ref = reference(q, k, v, {}, default_scale(q), Causal::kNone);
    const at::Tensor expect = (ref.probs * keep.to(at::kDouble) / 0.6).matmul(v);
    check_close(out, expect, 1e-10, 1e-10, "dropout = keep mask / (1 - p)");
    // Backward with dropout against autograd of the masked reference.
    torch::AutoGradMode grad_mode(true);
    const at::Tensor go = at::randn(out.sizes(), opt);
    auto [gq, gk, gv, gm] =
        attention_ext::attention_backward(go, q, k, v, out, lse, {}, {}, Causal::kNone, 0.4, rng);
    at::Tensor q2 = q.detach().requires_grad_(true), k2 = k.detach().requires_grad_(true),
               v2 = v.detach().requires_grad_(true);
    const Ref r2 = reference(q2, k2, v2, {}, default_scale(q), Causal::kNone);
    const at::Tensor o2 = (r2.probs * keep.to(at::kDouble) / 0.6).matmul(v2);
    const auto g = torch::autograd::grad({(o2 * go).sum()}, {q2, k2, v2});
    check_close(gq, g[0], 1e-9, 1e-9, "dropout grad_q");
    check_close(gk, g[1], 1e-9, 1e-9, "dropout grad_k");
    check_close(gv, g[2], 1e-9, 1e-9, "dropout grad_v");
  });

  // Errors come from the op's checks, as c10::Error with the library's message.
  run_case("errors", [] {
    std::string msg;
    try {
      attention_ext::attention_forward(at::randn({3, 4}), at::randn({5, 3}), at::randn({5, 2}));
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    check(msg.find("same head dim") != std::string::npos, "head dim mismatch message, got: " + msg);
    msg.clear();
    try {
      attention_ext::ScoreModifiers mods;
      mods.alibi_slopes = at::ones({3}, at::kDouble);
      attention_ext::attention_forward(at::randn({3, 4, 2}), at::randn({3, 5, 2}), at::randn({3, 5, 2}), {}, {},
                                       Causal::kNone, 0.0, {}, {}, mods);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    check(msg.find("alibi_slopes") != std::string::npos, "float64 slopes are refused by name, got: " + msg);
  });

  if (g_failures) {
    std::fprintf(stderr, "attention_ext C++ tests: %d of %d checks FAILED\n", g_failures, g_checks);
    return 1;
  }
  std::printf("attention_ext C++ tests: all %d checks passed\n", g_checks);
  return 0;
}
