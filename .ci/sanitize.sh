#!/usr/bin/env bash
# The CPU extension built with AddressSanitizer + UndefinedBehaviorSanitizer (gcc, runtimes
# preloaded into python), running the test suite. Any sanitizer report aborts the process and
# so fails the job. The build happens in a scratch copy of the tree so the regular in-place
# build is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Tracked and untracked-but-not-ignored files: exactly what a checkout would have.
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$work"
cd "$work"

export ATTENTION_EXT_SANITIZE=address,undefined
export FORCE_CPU=1
MAX_JOBS="${MAX_JOBS:-2}" python setup.py build_ext --inplace > build.log 2>&1 || { tail -50 build.log; exit 1; }

asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
# detect_leaks=0: CPython and torch keep allocations alive until exit by design; leaks of our own
# are tested by tests/test_leaks.py instead. halt_on_error + no recovery: the first report fails.
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_odr_violation=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ATTENTION_EXT_SANITIZED=1
# Make sure the suite below really loads the instrumented build from this scratch tree.
so=$(ls "$work"/attention_ext/_C*.so)
ldd "$so" | grep -q libasan || { echo "$so is not linked against libasan"; exit 1; }
LD_PRELOAD="$asan:$ubsan" python -c "import attention_ext, sys; f = attention_ext._build.load_extension(); \
  sys.exit(0 if attention_ext.__file__.startswith('$work') else 'loaded ' + attention_ext.__file__)"
LD_PRELOAD="$asan:$ubsan" python -m pytest tests -q -x -p no:cacheprovider "$@" 2>&1 | tee pytest.log | tail -15
status=${PIPESTATUS[0]}
if grep -qE "ERROR: AddressSanitizer|runtime error:" pytest.log; then
  echo "sanitizer reported an error:"; grep -nE -A30 "ERROR: AddressSanitizer|runtime error:" pytest.log | head -80
  exit 1
fi
exit "$status"
