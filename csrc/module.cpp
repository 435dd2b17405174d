// Python module init for attention_ext._C. Importing it loads the shared library, whose static
// TORCH_LIBRARY blocks register the ops. The module adds direct entries to them for the package's
// hot calls (attention_ext/_ops.py, call_below_autograd): fwd_below_autograd and bwd_below_autograd,
// and a decode step's three (flash_attn_with_kvcache): kvcache_fwd_below_autograd,
// kvcache_append_below_autograd and rotary_below_autograd; kvcache_step, the whole of a common
// decode step (kv_cache_step.h); and lean_attention, the checks and call of the common attention
// call (api._lean_forward).
//
// Why: a torch.ops call converts each of its arguments (13 or 19 here) to an IValue through the schema in
// Python and pybind11 (measured on a decode-sized forward, (1,4,1,32) against 64 keys: 11.3 µs
// through torch.ops, 8.2 µs through the direct entry). These entries parse the arguments with the C API and
// call the same op through the dispatcher's typed handle, below the autograd keys (as the package
// calls it where autograd has nothing to record), with the GIL released. Dispatch keys, dispatch
// modes (FakeTensorMode, FlopCounterMode...) and errors are the op's own. They answer None,
// and the caller takes torch.ops, when a torch function mode is active or a tensor argument is a
// subclass (both expect to see the op called through torch.ops: __torch_function__), and for any
// argument beyond the plain kinds (torch.ops converts it or raises its own error).
// Only the prebuilt extension has them (a JIT build loads the ops alone): callers fall back.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "kv_cache_step.h"
#include "op_handles.h"

namespace {

using namespace attention_ext::op_handles;

// An entry's arguments in schema order. Anything but the plain kinds (a tensor subclass, a numpy
// scalar, an int beyond int64, a wrong type) defers the call to torch.ops, which converts it or
// raises its own error, so the direct entry never answers differently from the op; so does an active
// torch function mode, which must see the op. A wrong argument count is the caller's bug: a TypeError.
struct Args {
  PyObject* const* items;
  bool deferred;

  Args(const char* entry, PyObject* const* items_, Py_ssize_t count, Py_ssize_t expected)
      : items(items_), deferred(at::impl::torch_function_mode_enabled()) {
    TORCH_CHECK_TYPE(count == expected, "attention_ext: ", entry, " takes ", expected, " arguments, got ", count);
  }

  at::Tensor tensor(int i) {
    PyObject* o = items[i];
    if (!THPVariable_CheckExact(o)) {  // (Tensor or Parameter)
      deferred = true;
      return at::Tensor();
    }
    return THPVariable_Unpack(o);
  }
  OptTensor optional_tensor(int i) {
    if (items[i] == Py_None) return std::nullopt;
    return tensor(i);
  }
  double real(int i) {
    PyObject* o = items[i];
    if (PyFloat_CheckExact(o)) return PyFloat_AS_DOUBLE(o);
    deferred = true;
    return 0.0;
  }
  int64_t integer(int i) {
    PyObject* o = items[i];
    if (PyLong_CheckExact(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow == 0 && !(v == -1 && PyErr_Occurred())) return v;
      PyErr_Clear();
    }
    deferred = true;
    return 0;
  }
  bool boolean(int i) {
    PyObject* o = items[i];
    if (PyBool_Check(o)) return o == Py_True;
    deferred = true;
    return false;
  }
};

// The op through the dispatcher, below the autograd keys, with the GIL released.
template <typename Sig, const char* kName, typename... Args>
auto call_below_autograd(const Args&... args) {
  pybind11::gil_scoped_release no_gil;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return handle<Sig, kName>().call(args...);
}

PyObject* wrap_all(std::initializer_list<at::Tensor> tensors) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(tensors.size()));
  if (out == nullptr) return nullptr;
  Py_ssize_t i = 0;
  for (const at::Tensor& t : tensors) {
    PyObject* item = THPVariable_Wrap(t);
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, i++, item);
  }
  return out;
}

// attention_fwd(query, key, value, attn_mask, scale, causal, window_left, window_right, softcap,
// alibi_slopes, sinks, dropout_p, rng_state) -> (out, lse) | None
PyObject* fwd_below_autograd(PyObject*, PyObject* const* items, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  Args a{"fwd_below_autograd", items, count, 13};
  const at::Tensor q = a.tensor(0), k = a.tensor(1), v = a.tensor(2);
  const OptTensor mask = a.optional_tensor(3);
  const double scale = a.real(4);
  const int64_t causal = a.integer(5), left = a.integer(6), right = a.integer(7);
  const double softcap = a.real(8);
  const OptTensor alibi = a.optional_tensor(9), sinks = a.optional_tensor(10);
  const double dropout_p = a.real(11);
  const OptTensor rng_state = a.optional_tensor(12);
  if (a.deferred) Py_RETURN_NONE;
  const auto [out, lse] = call_below_autograd<FwdSig, kFwd>(q, k, v, mask, scale, causal, left, right, softcap,
                                                            alibi, sinks, dropout_p, rng_state);
  return wrap_all({out, lse});
  END_HANDLE_TH_ERRORS
}

// attention_bwd(grad_out, grad_lse, query, key, value, attn_mask, out, lse, scale, causal,
// window_left, window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state,
// mask_requires_grad, merged_lse) -> (grad_query, grad_key, grad_value, grad_mask) | None
PyObject* bwd_below_autograd(PyObject*, PyObject* const* items, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  Args a{"bwd_below_autograd", items, count, 19};
  const at::Tensor grad_out = a.tensor(0);
  const OptTensor grad_lse = a.optional_tensor(1);
  const at::Tensor q = a.tensor(2), k = a.tensor(3), v = a.tensor(4);
  const OptTensor mask = a.optional_tensor(5);
  const at::Tensor out = a.tensor(6), lse = a.tensor(7);
  const double scale = a.real(8);
  const int64_t causal = a.integer(9), left = a.integer(10), right = a.integer(11);
  const double softcap = a.real(12);
  const OptTensor alibi = a.optional_tensor(13), sinks = a.optional_tensor(14);
  const double dropout_p = a.real(15);
  const OptTensor rng_state = a.optional_tensor(16);
  const bool mask_grad = a.boolean(17), merged_lse = a.boolean(18);
  if (a.deferred) Py_RETURN_NONE;
  const auto [dq, dk, dv, dmask] =
      call_below_autograd<BwdSig, kBwd>(grad_out, grad_lse, q, k, v, mask, out, lse, scale, causal, left, right,
                                        softcap, alibi, sinks, dropout_p, rng_state, mask_grad, merged_lse);
  return wrap_all({dq, dk, dv, dmask});
  END_HANDLE_TH_ERRORS
}

// attention_kvcache_fwd(query, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
// block_table, scale, causal, window_left, window_right, softcap, alibi_slopes) -> (out, lse) | None
PyObject* kvcache_fwd_below_autograd(PyObject*, PyObject* const* items, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  Args a{"kvcache_fwd_below_autograd", items, count, 13};
  const at::Tensor q = a.tensor(0), k_cache = a.tensor(1), v_cache = a.tensor(2), seqlens = a.tensor(3);
  const OptTensor batch_idx = a.optional_tensor(4), leftpad = a.optional_tensor(5), table = a.optional_tensor(6);
  const double scale = a.real(7);
  const int64_t causal = a.integer(8), left = a.integer(9), right = a.integer(10);
  const double softcap = a.real(11);
  const OptTensor alibi = a.optional_tensor(12);
  if (a.deferred) Py_RETURN_NONE;
  const auto [out, lse] =
      call_below_autograd<KVCacheFwdSig, kKVCacheFwd>(q, k_cache, v_cache, seqlens, batch_idx, leftpad, table,
                                                      scale, causal, left, right, softcap, alibi);
  return wrap_all({out, lse});
  END_HANDLE_TH_ERRORS
}

// attention_kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
// -> () | None: the op returns nothing, the entry an empty tuple (None says "call torch.ops").
PyObject* kvcache_append_below_autograd(PyObject*, PyObject* const* items, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  Args a{"kvcache_append_below_autograd", items, count, 7};
  const at::Tensor k_cache = a.tensor(0), v_cache = a.tensor(1), k = a.tensor(2), v = a.tensor(3);
  const at::Tensor starts = a.tensor(4);
  const OptTensor batch_idx = a.optional_tensor(5), table = a.optional_tensor(6);
  if (a.deferred) Py_RETURN_NONE;
  call_below_autograd<KVCacheAppendSig, kKVCacheAppend>(k_cache, v_cache, k, v, starts, batch_idx, table);
  return PyTuple_New(0);
  END_HANDLE_TH_ERRORS
}

// The common attention call with nothing to normalise (attention_ext/api.py, _lean_forward):
// lean_attention(query, key, value, causal_code, scale, enable_gqa) with plain tensors (Tensor or
// Parameter, no other subclass, no torch function mode) of one float dtype, strided and not nested, on the CPU or on
// one CUDA device whose kernels are built; the same rank (2 + at most 8 batch dims), head dim,
// key count and leading dims (with enable_gqa: all but the heads, the query's a multiple of K/V's);
// scale None (1/sqrt(d)) or a finite float within the dtype's rule. Answers None for anything
// else (the full path then checks the call and names what is wrong), else:
//   * (out, lse): nothing for autograd to record (grad mode off, or no input requires grad), the
//     op run below the autograd keys (GQA: the query heads split into (K/V heads, groups) as views
//     and joined again);
//   * (query, key, value, scale, groups): autograd must record the call, on these tensors (the
//     GQA views made here, recorded by autograd), through the package's autograd Function.
//   * (out, lse) also while jit.trace records with autograd on: the op with its registered autograd.
// The checks are _lean_forward's, in C++ (a small call spent 4 µs of its 7.5 in them in Python).
// The caller has ruled out forward-mode AD, functorch transforms, torch.compile and autocast.
PyObject* lean_attention(PyObject*, PyObject* const* items, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  Args a{"lean_attention", items, count, 6};
  at::Tensor q = a.tensor(0), k = a.tensor(1), v = a.tensor(2);
  const int64_t causal = a.integer(3);
  const bool gqa = a.boolean(5);
  if (a.deferred) Py_RETURN_NONE;
  for (const at::Tensor* t : {&q, &k, &v})
    if (t->layout() != at::kStrided || t->is_nested()) Py_RETURN_NONE;
  // A functorch wrapper (with no transform active, as the caller has made sure, one whose
  // transform has ended): torch's apply unwraps those, which the caller skips; the full path then.
  const c10::DispatchKeySet wrappers({c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched});
  for (const at::Tensor* t : {&q, &k, &v})
    if (t->key_set().has_any(wrappers)) Py_RETURN_NONE;
  const at::ScalarType dtype = q.scalar_type();
  if ((dtype != at::kDouble && dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) ||
      k.scalar_type() != dtype || v.scalar_type() != dtype)
    Py_RETURN_NONE;
  if (q.is_cpu()) {
    if (!k.is_cpu() || !v.is_cpu()) Py_RETURN_NONE;
  } else {
    static const bool cuda_kernels = c10::Dispatcher::singleton()
                                         .findSchemaOrThrow(attention_ext::op_handles::kFwd, "")
                                         .hasKernelForDispatchKey(c10::DispatchKey::CUDA);
    if (!q.is_cuda() || !k.is_cuda() || !v.is_cuda() || k.get_device() != q.get_device() ||
        v.get_device() != q.get_device() || !cuda_kernels)
      Py_RETURN_NONE;
  }
  const int64_t rank = q.dim();
  if (rank < 2 || k.dim() != rank || v.dim() != rank || q.size(-1) != k.size(-1) || k.size(-2) != v.size(-2) ||
      rank - 2 > 8)
    Py_RETURN_NONE;
  int64_t groups = 1;
  if (gqa) {  // as _apply_gqa: query heads split into (K/V heads, groups), K/V a broadcast dim
    if (rank < 3 || k.size(-3) != v.size(-3) || k.size(-3) == 0 || q.size(-3) % k.size(-3) != 0 || rank - 1 > 8)
      Py_RETURN_NONE;
    groups = q.size(-3) / k.size(-3);
  }
  for (int64_t i = 0; i < rank - 2 - (groups > 1 ? 1 : 0); ++i)
    if (q.size(i) != k.size(i) || k.size(i) != v.size(i)) Py_RETURN_NONE;
  double scale;
  if (items[4] == Py_None) {
    const int64_t d = k.size(-1);
    scale = d > 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : 1.0;
  } else {
    if (!PyFloat_CheckExact(items[4])) Py_RETURN_NONE;
    scale = PyFloat_AS_DOUBLE(items[4]);
    // finite, and scale·log2(e) within the accumulation dtype (_constants.scale_overflows)
    const double acc_max = dtype == at::kDouble ? std::numeric_limits<double>::max()
                                                : static_cast<double>(std::numeric_limits<float>::max());
    if (!(std::abs(scale) < std::numeric_limits<double>::infinity()) ||
        std::abs(scale) * 1.4426950408889634 > acc_max)
      Py_RETURN_NONE;
  }
  if (groups > 1) {
    q = q.unflatten(-3, {k.size(-3), groups});
    k = k.unsqueeze(-3);
    v = v.unsqueeze(-3);
  }
  const bool record = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!record || torch::jit::tracer::isTracing()) {
    // Nothing to record: the op below the autograd keys. jit.trace recording autograd: the op
    // itself with its registered autograd, which a trace can save (the autograd Function is a
    // Python call it cannot); the trace records it and the views around it.
    auto [out, lse] = record ? handle<FwdSig, kFwd>().call(q, k, v, std::nullopt, scale, causal, int64_t{-1},
                                                           int64_t{-1}, 0.0, std::nullopt, std::nullopt, 0.0,
                                                           std::nullopt)
                             : call_below_autograd<FwdSig, kFwd>(q, k, v, std::nullopt, scale, causal, int64_t{-1},
                                                                 int64_t{-1}, 0.0, std::nullopt, std::nullopt, 0.0,
                                                                 std::nullopt);
    if (groups > 1) {
      out = out.flatten(-4, -3);
      lse = lse.flatten(-3, -2);
    }
    return wrap_all({out, lse});
  }
  // Autograd records the call: the tensors for the autograd Function.
  PyObject* out = PyTuple_New(5);
  if (out == nullptr) return nullptr;
  PyObject* parts[5] = {THPVariable_Wrap(q), THPVariable_Wrap(k), THPVariable_Wrap(v), PyFloat_FromDouble(scale),
                        PyLong_FromLongLong(groups)};
  for (int i = 0; i < 5; ++i) {
    if (parts[i] == nullptr) {
      for (int j = 0; j < 5; ++j) Py_XDECREF(parts[j]);
      Py_DECREF(out);
      return nullptr;
    }
  }
  for (int i = 0; i < 5; ++i) PyTuple_SET_ITEM(out, i, parts[i]);
  return out;
  END_HANDLE_TH_ERRORS
}

// attention_rotary(x, cos, sin, start, per_row, interleaved) -> Tensor | None
PyObject* rotary_below_autograd(PyObject*, PyObject* const* items, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  Args a{"rotary_below_autograd", items, count, 6};
  const at::Tensor x = a.tensor(0), cos = a.tensor(1), sin = a.tensor(2), start = a.tensor(3);
  const bool per_row = a.boolean(4), interleaved = a.boolean(5);
  if (a.deferred) Py_RETURN_NONE;
  const at::Tensor rotated = call_below_autograd<RotarySig, kRotary>(x, cos, sin, start, per_row, interleaved);
  return THPVariable_Wrap(rotated);
  END_HANDLE_TH_ERRORS
}

// flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
// cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
// rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse), its parameters in its order:
// out, or (out, softmax_lse), or None: the Python path decides. Taken here: exact tensors (no
// subclass) and None; cache_seqlens also as an exact int; softmax_scale None or a finite float
// (|scale| <= 1e30, within every dtype's rule); causal, rotary_interleaved and return_softmax_lse
// as bools; window_size a tuple of two ints; softcap a float; num_splits an int >= 0 (a
// hint the CPU kernels do not need). Everything else, and every call kv_cache_step declines,
// answers None.
PyObject* kvcache_step(PyObject*, PyObject* const* items, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  Args a{"kvcache_step", items, count, 19};
  attention_ext::KVCacheStepArgs step;
  step.q = a.tensor(0);
  step.k_cache = a.tensor(1);
  step.v_cache = a.tensor(2);
  step.k = a.optional_tensor(3);
  step.v = a.optional_tensor(4);
  step.rotary_cos = a.optional_tensor(5);
  step.rotary_sin = a.optional_tensor(6);
  if (PyLong_CheckExact(items[7]))
    step.seqlens_all = a.integer(7);
  else
    step.seqlens = a.optional_tensor(7);
  step.batch_idx = a.optional_tensor(8);
  step.leftpad = a.optional_tensor(9);
  step.block_table = a.optional_tensor(10);
  if (items[11] != Py_None) {
    const double scale = a.real(11);
    if (!(std::abs(scale) <= 1e30)) Py_RETURN_NONE;  // (NaN too)
    step.scale = scale;
  }
  step.causal = a.boolean(12);
  PyObject* window = items[13];
  if (!PyTuple_CheckExact(window) || PyTuple_GET_SIZE(window) != 2) Py_RETURN_NONE;
  for (int side = 0; side < 2; ++side) {
    PyObject* bound = PyTuple_GET_ITEM(window, side);
    int overflow = 0;
    const long long value = PyLong_CheckExact(bound) ? PyLong_AsLongLongAndOverflow(bound, &overflow) : 0;
    if (!PyLong_CheckExact(bound) || overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    (side == 0 ? step.window_left : step.window_right) = value;
  }
  if (items[14] == Py_None) Py_RETURN_NONE;  // (refused by the Python path, as FlashAttention's float argument)
  step.softcap = a.real(14);
  step.rotary_interleaved = a.boolean(15);
  step.alibi_slopes = a.optional_tensor(16);
  const bool splits_ok = PyLong_CheckExact(items[17]) && a.integer(17) >= 0;
  const bool return_lse = a.boolean(18);
  if (a.deferred || !splits_ok) Py_RETURN_NONE;
  std::optional<std::tuple<at::Tensor, at::Tensor>> result;
  {
    pybind11::gil_scoped_release no_gil;
    result = attention_ext::kv_cache_step(step);
  }
  if (!result.has_value()) Py_RETURN_NONE;
  const auto& [out, lse] = *result;
  return return_lse ? wrap_all({out, lse}) : THPVariable_Wrap(out);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"fwd_below_autograd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fwd_below_autograd)),
     METH_FASTCALL, "attention_fwd's arguments; the op below the autograd keys, or None: call torch.ops then."},
    {"bwd_below_autograd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(bwd_below_autograd)),
     METH_FASTCALL, "attention_bwd's arguments; the op below the autograd keys, or None: call torch.ops then."},
    {"kvcache_fwd_below_autograd",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(kvcache_fwd_below_autograd)), METH_FASTCALL,
     "attention_kvcache_fwd's arguments; the op below the autograd keys, or None: call torch.ops then."},
    {"kvcache_append_below_autograd",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(kvcache_append_below_autograd)), METH_FASTCALL,
     "attention_kvcache_append's arguments; the op below the autograd keys (an empty tuple), or None: call "
     "torch.ops then."},
    {"rotary_below_autograd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rotary_below_autograd)),
     METH_FASTCALL, "attention_rotary's arguments; the op below the autograd keys, or None: call torch.ops then."},
    {"lean_attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(lean_attention)), METH_FASTCALL,
     "(query, key, value, causal_code, scale, enable_gqa): (out, lse) computed, (query, key, value, scale, groups) "
     "for the autograd Function, or None: the full path then."},
    {"kvcache_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(kvcache_step)), METH_FASTCALL,
     "flash_attn_with_kvcache's arguments, in its order; a CPU decode step in one call (out, or (out, lse)), "
     "or None: the Python path decides."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}
