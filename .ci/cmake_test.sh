#!/usr/bin/env bash
# CI for the C++ (libtorch) build: configure + build the library and its C++ tests with CMake,
# run them with ctest, install into a temporary prefix, then build and run examples/cpp against
# the installed package (find_package(AttentionExt)). Needs: cmake >= 3.20 (the project itself needs 3.18), a C++ compiler and a
# pip-installed torch (e.g. pip install torch==2.13.0). About 3-4 minutes on 2 cores.
#
# Environment: PYTHON (default python), JOBS (default 2), BUILD_DIR (default build/cmake),
# KEEP_TMP=1 keeps the install prefix and the example's build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PYTHON="${PYTHON:-python}"
JOBS="${JOBS:-2}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/cmake}"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/attention_ext_cmake.XXXXXX")"
if [ "${KEEP_TMP:-0}" != 1 ]; then trap 'rm -rf "$TMP"' EXIT; fi
PREFIX="$TMP/prefix"

TORCH_PREFIX="$("$PYTHON" -c 'import torch;print(torch.utils.cmake_prefix_path)')"
echo "== torch $("$PYTHON" -c 'import torch;print(torch.__version__, "cxx11_abi=%s" % torch.compiled_with_cxx11_abi())') at $TORCH_PREFIX"

SECONDS=0
phase() { echo; echo "== [$(printf '%3d' "$SECONDS")s] $*"; }

phase "configure (Release)"
cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=ON \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX"

phase "build (-j$JOBS)"
cmake --build "$BUILD_DIR" -j "$JOBS"

phase "ctest"
ctest --test-dir "$BUILD_DIR" --output-on-failure

phase "install into $PREFIX"
cmake --install "$BUILD_DIR" --prefix "$PREFIX"

phase "example: configure + build against the installed package"
cmake -S "$ROOT/examples/cpp" -B "$TMP/example" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX;$TORCH_PREFIX"
cmake --build "$TMP/example" -j "$JOBS"

phase "example: run"
"$TMP/example/attention_ext_example"

if command -v ldd >/dev/null 2>&1; then
  phase "one OpenMP runtime (ldd)"
  for bin in "$TMP/example/attention_ext_example" "$(ls "$PREFIX"/lib*/libattention_ext.so | head -n1)"; do
    omp="$(ldd "$bin" | grep -E 'lib(g|i)?omp' || true)"
    echo "$bin:"; echo "${omp:-  (no OpenMP runtime)}"
    if [ "$(printf '%s\n' "$omp" | grep -c 'omp')" -gt 1 ]; then
      echo "ERROR: more than one OpenMP runtime is loaded by $bin" >&2
      exit 1
    fi
    if grep -q "not found" <<<"$omp"; then
      echo "ERROR: unresolved OpenMP runtime for $bin" >&2
      exit 1
    fi
  done
fi

phase "done: C++ build, tests, install and example all passed"
