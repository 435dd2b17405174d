// attention_ext from C++: the README's worked example through the libtorch API.
//
//   Q = [[1,0],[0,1],[1,1]]   K = [[1,0],[0,1],[.5,.5]]   V = [[10,0],[0,10],[5,5]]
//   O = softmax(Q Kᵀ / sqrt(2)) V ≈ [[6.15,3.85],[3.85,6.15],[5,5]]
#include <attention_ext/attention_ext.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <iostream>

int main() {
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::tensor({1.0, 0.0, 0.0, 1.0, 1.0, 1.0}, opt).view({3, 2});
  const at::Tensor k = at::tensor({1.0, 0.0, 0.0, 1.0, 0.5, 0.5}, opt).view({3, 2});
  const at::Tensor v = at::tensor({10.0, 0.0, 0.0, 10.0, 5.0, 5.0}, opt).view({3, 2});

  // Extended API: output and row logsumexp (default scale 1/sqrt(d_k)).
  auto [out, lse] = attention_ext::attention_forward(q, k, v);
  // The attention weights themselves, and the drop-in spelling of the same computation.
  const at::Tensor weights = attention_ext::attention_weights(q, k);
  const at::Tensor dropin = attention_ext::scaled_dot_product_attention(q, k, v);

  std::cout << "attention_ext " << ATTENTION_EXT_VERSION_MAJOR << "." << ATTENTION_EXT_VERSION_MINOR
            << "." << ATTENTION_EXT_VERSION_PATCH << ", CPU kernels: " << attention_ext::cpu_variant()
            << "\n\nweights = softmax(Q K^T / sqrt(2)):\n";
  for (int64_t i = 0; i < 3; ++i)
    std::printf("  [%.4f, %.4f, %.4f]\n", weights[i][0].item<double>(),
                weights[i][1].item<double>(), weights[i][2].item<double>());
  std::cout << "\nO = weights V:\n";
  for (int64_t i = 0; i < 3; ++i)
    std::printf("  [%.2f, %.2f]\n", out[i][0].item<double>(), out[i][1].item<double>());

  const at::Tensor expected = at::tensor({6.15, 3.85, 3.85, 6.15, 5.0, 5.0}, opt).view({3, 2});
  const bool ok = at::allclose(out, expected, 0.0, 0.01) && at::allclose(dropin, out);
  std::cout << (ok ? "\nmatches the worked example [[6.15,3.85],[3.85,6.15],[5,5]]\n"
                   : "\nMISMATCH with the worked example [[6.15,3.85],[3.85,6.15],[5,5]]\n");
  return ok ? 0 : 1;
}
