// The registered ops' C++ signatures (registration.cpp's schemas) and their typed dispatcher
// handles, for the C++ code that calls an op through the dispatcher rather than its
// implementation: the Python module's direct entries (module.cpp), the KV-cache decode step
// (kv_cache_step.cpp) and the typed C++ API (cpp_api.cpp). Calls through a handle take every
// dispatch key and mode as torch.ops would.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <tuple>

namespace attention_ext {
namespace op_handles {

using OptTensor = std::optional<at::Tensor>;
using FwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const OptTensor&, double, int64_t, int64_t, int64_t, double,
                                                  const OptTensor&, const OptTensor&, double, const OptTensor&);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
    const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, int64_t, double, const OptTensor&,
    const OptTensor&, double, const OptTensor&, bool, bool);
using KVCacheFwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&, const OptTensor&, const OptTensor&,
                                                          const OptTensor&, double, int64_t, int64_t, int64_t, double,
                                                          const OptTensor&);
using KVCacheAppendSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const OptTensor&, const OptTensor&);
using RotarySig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool);
using ProbsSig = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, double, int64_t, int64_t, int64_t,
                            double, const OptTensor&, const OptTensor&);
using InfoSig = std::string();
using SetVariantSig = std::string(std::string);

inline constexpr char kFwd[] = "attention_ext::attention_fwd";
inline constexpr char kBwd[] = "attention_ext::attention_bwd";
inline constexpr char kKVCacheFwd[] = "attention_ext::attention_kvcache_fwd";
inline constexpr char kKVCacheAppend[] = "attention_ext::attention_kvcache_append";
inline constexpr char kRotary[] = "attention_ext::attention_rotary";
inline constexpr char kProbs[] = "attention_ext::attention_probs";
inline constexpr char kBuildInfo[] = "attention_ext::build_info";
inline constexpr char kCpuVariant[] = "attention_ext::cpu_variant";
inline constexpr char kSetCpuVariant[] = "attention_ext::set_cpu_variant";

// The op's typed handle, looked up once per (op, signature): kName is the op's name as a
// character array with static storage, so that two ops of one signature keep separate handles.
// (findSchemaOrThrow fails with torch's message if the library that registers the ops is not loaded.)
template <typename Sig, const char* kName>
const c10::TypedOperatorHandle<Sig>& handle() {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow(kName, "").typed<Sig>();
  return h;
}

}  // namespace op_handles
}  // namespace attention_ext
