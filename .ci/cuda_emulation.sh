#!/usr/bin/env bash
# The CUDA kernels (SIMT and tensor-core), compiled by the host compiler and run on CPU tensors by the emulation in
# csrc/cuda_emulation/emulation.h (every CUDA thread a fiber; __syncthreads, warp shuffles, mma.sync and ldmatrix as barriers),
# against the test suite: the kernels' semantics checked without a GPU. Tests of the CPU kernels'
# own machinery (ISA variants, decode path, schedules) are marked cpu_kernels and skipped there;
# the largest CUDA tests are marked slow_on_emulation or run smaller instances there.
# ATTENTION_EXT_CUDA_EMULATION=1 stays exported for pytest: tests/conftest.py then refuses to start
# on any build but the emulation one, and test_cuda.py / test_tensor_core.py check per test that
# their op calls went to the CUDA binding.
# The build happens in a scratch copy of the tree so the regular in-place build is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
# ATTENTION_EXT_EMULATION_KEEP=1 keeps the scratch tree (build.log, pytest.log) for a look afterwards.
[ "${ATTENTION_EXT_EMULATION_KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT

# Tracked and untracked-but-not-ignored files: exactly what a checkout would have.
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$work"
cd "$work"

export ATTENTION_EXT_CUDA_EMULATION=1 FORCE_CPU=1
MAX_JOBS="${MAX_JOBS:-2}" python setup.py build_ext --inplace > build.log 2>&1 || { tail -50 build.log; exit 1; }
# This copy's build, not an installed one (conftest.py checks only that it is an emulation build).
python -c "import attention_ext, sys; info = attention_ext.build_info(); \
  sys.exit(0 if info['cuda_emulation'] == '1' and attention_ext.__file__.startswith('$work') \
  else 'not the emulation build: ' + attention_ext.__file__)"
# (.ci/run installs pytest-xdist; run alone without it, the suite runs in one process.)
# The emulation runs a launch on the calling thread: two pytest workers (pytest-xdist), one thread
# each, keep both cores busy.
workers=(); python -c "import xdist" 2>/dev/null && { workers=(-n "${PYTEST_WORKERS:-2}" --dist loadgroup); export OMP_NUM_THREADS=1; } \
  || echo "pytest-xdist is not installed: one pytest process"
status=0
python -m pytest tests -q -p no:cacheprovider "${workers[@]}" "$@" > pytest.log 2>&1 || status=$?
tail -15 pytest.log
[ "$status" = 0 ] || { echo "the test suite on the emulated CUDA kernels failed (exit $status):"; grep -E "^(FAILED|ERROR)" pytest.log | head -40; }
exit "$status"
