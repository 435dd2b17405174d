#!/usr/bin/env bash
# The CPU extension built with AddressSanitizer + UndefinedBehaviorSanitizer (gcc, runtimes
# preloaded into python), running the test suite. Any sanitizer report aborts the process and
# so fails the job. The build happens in a scratch copy of the tree so the regular in-place
# build is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
# ATTENTION_EXT_SANITIZE_KEEP=1 keeps the scratch tree (build, pytest.log) for a look afterwards.
[ "${ATTENTION_EXT_SANITIZE_KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT

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
# Reports go to files (pytest captures the test's stderr, and a halted process never shows it).
# allocator_may_return_null=1: the fuzz tests ask torch for absurd sizes and expect its
# out-of-memory error, which needs malloc to fail rather than ASan to abort.
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_odr_violation=0:allocator_may_return_null=1:log_path=$work/sanitizer
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$work/sanitizer
export ATTENTION_EXT_SANITIZED=1
# Scratch the kernels leave unzeroed is filled with NaN bytes: a read before the write shows up
# as NaN in some test's result (csrc/cpu/scratch_arena.h). ASan cannot see such reads.
export ATTENTION_EXT_POISON_SCRATCH=1
# Make sure the suite below really loads the instrumented build from this scratch tree.
so=$(ls "$work"/attention_ext/_C*.so)
# (ldd's output is captured first: with pipefail, grep -q quitting at the first match can kill
# ldd with SIGPIPE and fail the pipeline although libasan is there.)
deps=$(ldd "$so")
grep -q libasan <<<"$deps" || { echo "$so is not linked against libasan"; exit 1; }
LD_PRELOAD="$asan:$ubsan" python -c "import attention_ext, sys; f = attention_ext._build.load_extension(); \
  sys.exit(0 if attention_ext.__file__.startswith('$work') else 'loaded ' + attention_ext.__file__)"
# (.ci/run installs pytest-xdist; run alone without it, the suite runs in one process.)
workers=(); python -c "import xdist" 2>/dev/null && workers=(-n "${PYTEST_WORKERS:-2}" --dist loadgroup) \
  || echo "pytest-xdist is not installed: one pytest process"
status=0
# Two pytest workers (pytest-xdist): much of the suite is single-threaded Python and ASan-slowed
# bookkeeping, which one process leaves the second core idle for. Each worker keeps the default
# thread count, so the kernels' parallel paths run instrumented too.
# (No -x: with it, a crashed xdist worker left the run waiting forever instead of ending with
# "worker crashed while running <test>". Under --dist loadgroup a crashed worker can still leave
# the controller waiting for its replacement's tests, so the run has a deadline: it takes about
# 15 minutes, and a hang fails the job with the log instead of using up the CI's time.)
# --capture=sys: pytest captures the tests' Python output only, so what the sanitizers' runtimes
# write to file descriptor 2 reaches pytest.log. (UBSan's reports did not go to log_path here:
# with fd capture, a UBSan halt was a worker that exited with status 1 and no word said why.)
LD_PRELOAD="$asan:$ubsan" timeout -k 60 "${ATTENTION_EXT_SANITIZE_TIMEOUT:-2700}" python -m pytest tests -q -p no:cacheprovider \
  --capture=sys "${workers[@]}" "$@" > pytest.log 2>&1 || status=$?
tail -15 pytest.log
# Reports are looked for in the runtimes' files and in pytest.log (what reached fd 2), each shown
# from its first line on. (The files also collect harmless warnings, e.g. "failed to allocate" for
# the fuzzed sizes.)
report='ERROR: AddressSanitizer|runtime error:'
reports=$(grep -lE "$report" "$work"/sanitizer.* pytest.log 2>/dev/null || true)
if [ -n "$reports" ]; then
  echo "sanitizer report(s):"; for f in $reports; do echo "== $f"; grep -E -A60 "$report" "$f" | head -80; done
  exit 1
fi
[ "$status" != 124 ] || echo "the test suite under the sanitizers did not finish in ${ATTENTION_EXT_SANITIZE_TIMEOUT:-2700} s"
[ "$status" = 0 ] || { echo "the test suite under the sanitizers failed (exit $status); the end of its log:"; tail -60 pytest.log; }
exit "$status"
