#pragma once
#include <string>

namespace attention_ext {

// "key=value" lines: torch version built against, compiler, OpenMP, CPU kernel variants
// (compiled, supported, active), CUDA support and architectures.
std::string build_info();
std::string cpu_variant();
std::string set_cpu_variant(std::string name);

}  // namespace attention_ext
