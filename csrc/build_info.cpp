#include "build_info.h"

#include <c10/util/StringUtil.h>
#include <torch/version.h>

#include <sstream>

#include "cpu/cpu_dispatch.h"

#ifndef ATTENTION_EXT_CUDA_ARCHS
#define ATTENTION_EXT_CUDA_ARCHS ""
#endif

namespace attention_ext {

std::string build_info() {
  std::ostringstream os;
  os << "torch_version=" << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "."
     << TORCH_VERSION_PATCH << "\n";
#if defined(__clang__)
  os << "compiler=clang " << __clang_version__ << "\n";
#elif defined(__GNUC__)
  os << "compiler=gcc " << __VERSION__ << "\n";
#elif defined(_MSC_VER)
  os << "compiler=msvc " << _MSC_VER << "\n";
#endif
#if defined(_OPENMP)
  os << "openmp=" << _OPENMP << "\n";
#else
  os << "openmp=none\n";
#endif
  os << "cpu_variants_compiled=" << c10::Join(",", cpu::compiled_variants()) << "\n";
  os << "cpu_variants_supported=" << c10::Join(",", cpu::supported_variants()) << "\n";
  os << "cpu_variant_auto=" << cpu::auto_variant() << "\n";
  os << "cpu_variant=" << cpu::active_kernels().name << "\n";
  os << "cpu_vector_bytes=" << cpu::active_kernels().vector_bytes << "\n";
  os << "amx_tile_state=" << cpu::amx_tile_state() << "\n";
  os << "cpu_avx512_double_pumped=" << (cpu::avx512_double_pumped() ? 1 : 0) << "\n";
#if defined(ATTENTION_EXT_WITH_CUDA)
  os << "cuda=1\n";
#else
  os << "cuda=0\n";
#endif
  os << "cuda_archs=" << ATTENTION_EXT_CUDA_ARCHS << "\n";
#if defined(ATTN_CUDA_EMULATION)
  // CPU tensors run the CUDA kernels on host threads (cuda_emulation/emulation.h): a test build.
  os << "cuda_emulation=1\n";
#else
  os << "cuda_emulation=0\n";
#endif
  return os.str();
}

std::string cpu_variant() { return cpu::active_kernels().name; }

std::string set_cpu_variant(std::string name) { return cpu::set_variant(name); }

}  // namespace attention_ext
