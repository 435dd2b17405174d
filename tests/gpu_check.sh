#!/usr/bin/env bash
# The GPU check: one short run on a fresh CUDA machine (torch with CUDA, nvcc, compute-sanitizer)
# that builds the extension with the CUDA kernels in place (sm_90 only, against the machine's torch)
# and then runs, most valuable first, what fits in GPU_CHECK_BUDGET seconds (default 450: made for
# a device run of at most 8 minutes, started with a limit of about 480-540 s).
#
#   step              needs  cap    expected on an H200 host (16 cores)
#   build             -      300 s  60-90 s. Each object is one core's work; timed on the 2-core dev
#                                   box: csrc/cuda/bwd_fp16.cu 23-29 s of CPU (nvcc -O3, sm_90 only;
#                                   bwd_bf16.cu alike, the 7 other .cu files 2-14 s, 114 s for all
#                                   nine), the torch-heavy .cpp files ~40 s each (g++ -O3 -g). 22
#                                   objects on 16 jobs: about the slowest file (~45 s), then the link
#   smoke             -       90 s  ~10 s: build_info says cuda, one forward+backward per dtype
#   test_cuda         30 s   150 s  60-100 s (estimate): 430 tests, CUDA_LAUNCH_BLOCKING=1, --maxfail=10
#   memcheck          30 s    90 s  ~45 s (estimate): every kernel, PYTORCH_NO_CUDA_MEMORY_CACHING=1
#   bench_gpu         45 s   100 s  its --budget-s is the cap less 25 s; fp16/bf16 rows first
#   memcheck_splitkv  15 s    45 s  ~15 s: the tensor-core forward split 3 ways + the combine kernel
#   racecheck         30 s    90 s  ~45 s (estimate)
#   synccheck         15 s    45 s  ~25 s (estimate)
#
# build and smoke always run (nothing else means anything without them); a failed build stops the
# run, a failed smoke does not (the tests and memcheck then say where it breaks). Every later step
# starts only if it gets at least its "needs" (else: "skipped: no time"), and runs for at most
# min(cap, what is left of the budget less 10 s for packing); the estimates add up to ~430 s. The
# exit status is 0 when no step failed or timed out at its own cap (skipped ones and ones cut
# short by the budget, "incomplete", do not fail the run; summary.txt lists them).
#
# What lands in $OUT (default: gpu_check_out in the checkout), flat, 6 files at most (a device run
# returns 8):
#   summary.txt       one "stage NAME: STATUS" line per step (ok, FAIL, TIMEOUT, incomplete,
#                     skipped: REASON), the commit, csrc/ tree and GPU, failure tails, the result
#   build.log         the build's output
#   test_cuda.log     pytest on tests/test_cuda.py and tests/test_tensor_core.py
#   results_gpu.md/.json  the benchmark, rewritten after every row
#   logs.tar.gz       every other log (env, smoke, bench, sanitizers), re-packed after every step
# Failure tails also go to stdout (for the build: its first lines with "error").
#
#   OUT=/tmp/out bash tests/gpu_check.sh                       # on the GPU machine, from anywhere
#   GPU_CHECK_DRY_RUN=1 OUT=/tmp/out bash tests/gpu_check.sh   # no GPU: see below
#
# Environment: GPU_CHECK_BUDGET (seconds), GPU_CHECK_STEPS (the optional steps to run, e.g.
# "memcheck racecheck"; the others are reported "skipped: not selected"), GPU_CHECK_PYTEST_ARGS
# (added to the pytest line), GPU_CHECK_SANITIZER (the compute-sanitizer to use), PYTHON
# (default python3), MAX_JOBS (default: all cores).
#
# attention_ext is imported from this checkout (its root goes first on PYTHONPATH): the in-place
# build made by the build step, or, in a dry run, whatever build that import finds (the checkout's
# in-place CPU or CUDA-emulation build, or an installed one of the same csrc/).
#
# Dry run (GPU_CHECK_DRY_RUN=1), the script's own test (tests/test_gpu_check.py): every stage without
# a GPU. No build (the build stage reports the importable build), the smoke run, a tiny pytest
# selection, bench_gpu.py --device cpu --dry-run and the sanitizer snippets on CPU tensors, the
# snippets without compute-sanitizer unless GPU_CHECK_SANITIZER names one; then the same check
# of $OUT as a real run. Its caps are 3x the ones above (an emulation build is slow), its budget
# the same.
set -u -o pipefail
OUT=${OUT:-}
if [ -n "$OUT" ]; then  # relative to where the script was started from
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
fi
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu_check_out}

case "${GPU_CHECK_DRY_RUN:-0}" in 1 | true | yes | on) DRY=1 ;; *) DRY=0 ;; esac
PY=${PYTHON:-$(command -v python3 || command -v python)}
# The machine's cores (nproc alone reports OMP_NUM_THREADS when that is set).
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
BUDGET=${GPU_CHECK_BUDGET:-450}
RESERVE=10  # seconds kept back for packing and the check of $OUT
# A dry run's steps may take 3x their GPU caps: an emulation build runs the CUDA kernels on host
# fibers, far slower than the GPU (the budget still decides what starts).
CAP_FACTOR=1
[ "$DRY" = 1 ] && CAP_FACTOR=3
OPTIONAL_STEPS="test_cuda memcheck bench_gpu memcheck_splitkv racecheck synccheck"
SELECTED=$(echo "${GPU_CHECK_STEPS:-$OPTIONAL_STEPS}" | tr ',' ' ')
for s in $SELECTED; do
  case " $OPTIONAL_STEPS " in *" $s "*) ;; *) echo "gpu_check: GPU_CHECK_STEPS: unknown step '$s' (steps: $OPTIONAL_STEPS)" >&2; exit 2 ;; esac
done
case "$BUDGET" in '' | *[!0-9]*) echo "gpu_check: GPU_CHECK_BUDGET must be whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac

mkdir -p "$OUT" || exit 2
rm -f "$OUT"/{summary.txt,build.log,test_cuda.log,results_gpu.md,results_gpu.json,logs.tar.gz} "$OUT"/results_gpu.*.tmp
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_logs.XXXXXX") || exit 2
START=$(date +%s)
FAILED=0
SKIPPED=0
INCOMPLETE=0
PACKED=0

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a step killed by its timeout still leaves what it printed

say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((BUDGET - $(elapsed))); }
record() {  # record NAME STATUS: the stage's line in summary.txt and on stdout
  say "stage $1: $2"
  case "$2" in
    ok*) ;;
    skipped*) SKIPPED=$((SKIPPED + 1)) ;;
    incomplete*) INCOMPLETE=$((INCOMPLETE + 1)) ;;
    *) FAILED=$((FAILED + 1)) ;;
  esac
}
indent() { sed 's/^/      /' | tee -a "$SUMMARY"; }

shrink() {  # shrink FILE BYTES: keeps the first and last BYTES/2 of a longer file
  local f=$1 max=$2 size
  size=$(stat -c %s "$f" 2>/dev/null || echo 0)
  [ "$size" -le "$max" ] && return 0
  { head -c $((max / 2)) "$f"; printf '\n[... %d bytes cut by gpu_check.sh ...]\n' $((size - max)); tail -c $((max / 2)) "$f"; } >"$f.cut"
  mv -f "$f.cut" "$f"
}
pack() {  # every log but the ones kept as files, as one archive (replaced whole, never half-written)
  local f
  for f in "$LOGS"/*.log; do [ -f "$f" ] && shrink "$f" $((6 * 1024 * 1024)); done
  for f in "$OUT/build.log" "$OUT/test_cuda.log"; do [ -f "$f" ] && shrink "$f" $((12 * 1024 * 1024)); done
  tar -czf "$LOGS.tar.gz" -C "$LOGS" . && mv -f "$LOGS.tar.gz" "$OUT/logs.tar.gz"
}
finish() {  # on any exit: the last logs into the archive, the scratch folder removed
  [ "$PACKED" = 1 ] || pack
  rm -rf "$LOGS" "$LOGS.tar.gz"
}
trap finish EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

selected() { case " $SELECTED " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# plan NAME NEED CAP: sets STEP_T (the step's time limit) and returns 0 if the step is to run;
# otherwise records why not. NEED "-": the step runs whatever the budget (build, smoke).
plan() {
  local name=$1 need=$2 cap=$3 avail
  cap=$((cap * CAP_FACTOR))
  STEP_CAP=$cap
  if [ "$need" = - ]; then STEP_T=$cap; return 0; fi
  if ! selected "$name"; then record "$name" "skipped: not selected (GPU_CHECK_STEPS)"; return 1; fi
  if [ -n "${BLOCKED:-}" ]; then record "$name" "skipped: $BLOCKED"; return 1; fi
  avail=$(($(left) - RESERVE))
  STEP_T=$((avail < cap ? avail : cap))
  if [ "$STEP_T" -lt "$need" ]; then
    record "$name" "skipped: no time (needs ${need}s, $((avail > 0 ? avail : 0))s of the budget left)"
    return 1
  fi
}
# execute NAME LOG CMD...: runs CMD for at most STEP_T seconds, output to LOG.
execute() {
  local name=$1
  STEP_LOG=$2
  shift 2
  echo "-- $name: up to ${STEP_T}s, at $(elapsed)s: $*"
  local s0
  s0=$(date +%s)
  timeout --kill-after=5 "$STEP_T" "$@" </dev/null >"$STEP_LOG" 2>&1
  STEP_RC=$?
  STEP_DT=$(($(date +%s) - s0))
}
# judge NAME [TAIL_FUNCTION]: ok / TIMEOUT / incomplete (cut short by the budget, not its cap) /
# FAIL with the tail of the log in summary.txt and on stdout; then re-packs the logs.
judge() {
  local name=$1 tail_fn=${2:-tail_of}
  case $STEP_RC in
    0) record "$name" "ok (${STEP_DT}s)" ;;
    124 | 137)
      if [ "$STEP_T" -lt "$STEP_CAP" ]; then
        record "$name" "incomplete: stopped at the end of the budget after ${STEP_T}s (cap ${STEP_CAP}s)"
      else
        record "$name" "TIMEOUT after ${STEP_T}s"
      fi
      "$tail_fn" "$STEP_LOG" | indent ;;
    *)
      record "$name" "FAIL (rc=$STEP_RC, ${STEP_DT}s)"
      "$tail_fn" "$STEP_LOG" | indent ;;
  esac
  pack
}
tail_of() { tail -n 30 "$1"; }
build_errors() {  # the compiler's own messages, not setuptools' traceback at the end
  local lines
  lines=$(grep -m 40 -E '(^|[^A-Za-z_])error([^A-Za-z_]|$)|^FAILED: ' "$1")
  if [ -n "$lines" ]; then echo "$lines"; else tail -n 30 "$1"; fi
}
sanitizer_errors() {  # the first reports, then the end (the program's own traceback, the error summary)
  if [ "$(wc -l <"$1")" -le 60 ]; then cat "$1"; return; fi
  grep -m 40 '^========= ' "$1"
  echo "..."
  tail -n 15 "$1"
}
step() {  # step NAME NEED CAP LOG CMD...
  local name=$1 need=$2 cap=$3 logf=$4
  shift 4
  plan "$name" "$need" "$cap" || return 0
  execute "$name" "$logf" "$@"
  judge "$name"
}

# --- What is measured, on what -------------------------------------------------------------------
# csrc/ as committed (0) or not (1), by read-only git commands: `git diff` would refresh and rewrite
# the index, under the feet of whoever works in this checkout.
csrc_as_committed() {
  local committed present
  committed=$(git -C "$ROOT" ls-tree -r --name-only HEAD -- csrc | LC_ALL=C sort) || return 1
  present=$({ git -C "$ROOT" ls-files -- csrc; git -C "$ROOT" ls-files --others --exclude-standard -- csrc; } | LC_ALL=C sort -u)
  [ "$committed" = "$present" ] || return 1
  [ "$(git -C "$ROOT" ls-tree -r HEAD -- csrc | LC_ALL=C sort -k 4 | awk '{print $3}')" = \
    "$(cd "$ROOT" && git hash-object --stdin-paths <<<"$committed" 2>/dev/null)" ]
}
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  commit=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
  tree=$(git -C "$ROOT" rev-parse HEAD:csrc 2>/dev/null || echo unknown)
  if csrc_as_committed; then
    changes="no uncommitted changes in csrc/"
  else
    changes="csrc/ HAS UNCOMMITTED CHANGES (the smoke step prints the digest of what was built)"
  fi
else
  commit="unknown (not a git checkout)" tree=unknown changes="csrc/ digest: see the smoke step"
fi
{
  echo "== env"
  command -v nvidia-smi && nvidia-smi
  command -v nvcc && nvcc --version
  echo "python: $PY"
  "$PY" --version
  echo "cores: $CORES"
} >"$LOGS/env.log" 2>&1
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
say "gpu_check: $([ "$DRY" = 1 ] && echo "DRY RUN (GPU_CHECK_DRY_RUN=1): no build, CPU tensors" || echo "GPU run"), budget ${BUDGET}s, started $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
say "commit: $commit; csrc tree: $tree; $changes"
say "gpu: ${gpu:-none (nvidia-smi found no GPU)}; nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo none); $CORES cores"

# --- 1. Build -----------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  DEV=cpu
  plan build - 120
  execute build "$OUT/build.log" "$PY" -c "import attention_ext, json; print('dry run: no build; the importable one:'); \
print(json.dumps(attention_ext.build_info(), indent=1))"
else
  DEV=cuda
  if ! torch_cuda=$("$PY" -c "import torch, sys; print(torch.__version__, 'cuda', torch.version.cuda); \
sys.exit(0 if torch.cuda.is_available() else 1)" 2>&1); then
    say "gpu_check: torch sees no CUDA device ($(echo "$torch_cuda" | tail -n 1)): nothing to check here;"
    say "  GPU_CHECK_DRY_RUN=1 walks every stage without a GPU"
    exit 2
  fi
  # The machine's own torch (its headers and ABI), this GPU's architecture only, all cores. The
  # variables of the other build kinds would make a CPU-only or emulation build: cleared.
  unset FORCE_CPU ATTENTION_EXT_CUDA_EMULATION ATTENTION_EXT_SANITIZE ATTENTION_EXT_JIT
  export FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-$CORES}
  plan build - 300
  execute build "$OUT/build.log" "$PY" setup.py build_ext --inplace
fi
judge build build_errors
if [ "$STEP_RC" != 0 ]; then
  BLOCKED="build failed"
fi

# --- 2. Smoke: one call per dtype before the suite, so a fault shows as itself --------------------
if [ -z "${BLOCKED:-}" ]; then
  plan smoke - 90
  if [ "$DRY" = 1 ]; then
    execute smoke "$LOGS/smoke.log" "$PY" tests/gpu_check_snippet.py smoke --device cpu --dry-run
  else
    execute smoke "$LOGS/smoke.log" env CUDA_LAUNCH_BLOCKING=1 "$PY" tests/gpu_check_snippet.py smoke --device cuda
  fi
  judge smoke
  grep '^info: ' "$LOGS/smoke.log" | sed 's/^info: /  /' | tee -a "$SUMMARY"
else
  record smoke "skipped: $BLOCKED"
fi

# --- 3. The CUDA tests -------------------------------------------------------------------------
# CUDA_LAUNCH_BLOCKING=1: a kernel fault is reported by the call that made it, not by some later
# test; --maxfail=10: a fault that poisons the context stops the run instead of failing 400 tests.
# In a dry run, a selection that runs on CPU tensors in an emulation build (skipped in a CPU build).
if [ "$DRY" = 1 ]; then
  select_tests=(-k "build_has_cuda_kernels or ineligible_calls_take_the_simt_kernel")
else
  select_tests=()
fi
# shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS: words
step test_cuda 30 150 "$OUT/test_cuda.log" env CUDA_LAUNCH_BLOCKING=1 "$PY" -m pytest tests/test_cuda.py \
  tests/test_tensor_core.py -q -rfEs -p no:cacheprovider --maxfail=10 --durations=15 "${select_tests[@]}" \
  ${GPU_CHECK_PYTEST_ARGS:-}
[ -f "$OUT/test_cuda.log" ] && grep -E '(passed|failed|skipped|error|deselected).* in [0-9.]+s' "$OUT/test_cuda.log" | tail -n 1 | sed 's/^/  pytest: /' | tee -a "$SUMMARY"

# --- 4. Sanitizers and the benchmark -------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  SAN=${GPU_CHECK_SANITIZER:-}  # empty: the snippets alone
else
  SAN=${GPU_CHECK_SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
  if [ ! -x "$SAN" ]; then
    SAN_MISSING="compute-sanitizer not found (set GPU_CHECK_SANITIZER)"
  fi
fi
[ -n "$SAN" ] && "$SAN" --version >>"$LOGS/env.log" 2>&1
# sanitize NAME NEED CAP TOOL [TOOL OPTIONS] -- [ENV=VALUE...] -- SNIPPET ARGS
sanitize() {
  local name=$1 need=$2 cap=$3 tool=$4
  shift 4
  local opts=() envs=()
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  if [ -n "${SAN_MISSING:-}" ] && selected "$name" && [ -z "${BLOCKED:-}" ]; then
    record "$name" "skipped: $SAN_MISSING"
    return 0
  fi
  plan "$name" "$need" "$cap" || return 0
  local prefix=()
  [ -n "$SAN" ] && prefix=("$SAN" --tool "$tool" --error-exitcode 1 --print-limit 30 "${opts[@]}")
  execute "$name" "$LOGS/$name.log" env "${envs[@]}" "${prefix[@]}" "$PY" tests/gpu_check_snippet.py "$@" --device "$DEV"
  if [ -n "$SAN" ] && grep -qi 'device not supported' "$STEP_LOG"; then
    # compute-sanitizer cannot attach on this machine (seen under gVisor): nothing was checked.
    SAN_MISSING="compute-sanitizer reports: device not supported"
    record "$name" "skipped: $SAN_MISSING"
    pack
    return 0
  fi
  judge "$name" "$([ -n "$SAN" ] && echo sanitizer_errors || echo tail_of)"
}

# Without torch's caching allocator every tensor is its own allocation, so memcheck sees an access
# past a tensor's end (inside a cached block it would be "valid" memory).
sanitize memcheck 30 90 memcheck --leak-check no -- PYTORCH_NO_CUDA_MEMORY_CACHING=1 -- full

if [ "$DRY" = 1 ]; then
  bench_args=(--device cpu --dry-run --dtypes float32,float16 --d 64)
else
  bench_args=()
fi
if plan bench_gpu 45 100; then
  execute bench_gpu "$LOGS/bench_gpu.log" "$PY" benchmarks/bench_gpu.py "${bench_args[@]}" \
    --budget-s $((STEP_T > 35 ? STEP_T - 25 : 10)) --out "$OUT/results_gpu"
  judge bench_gpu
  grep -E '^(target|[0-9]+ rows skipped)' "$LOGS/bench_gpu.log" | sed 's/^/  /' | tee -a "$SUMMARY"
fi

# The split-KV path (tensor-core forward on key ranges + the combine kernel) forced 3 ways.
sanitize memcheck_splitkv 15 45 memcheck --leak-check no -- PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  ATTENTION_EXT_CUDA_KV_SPLITS=3 -- splitkv
sanitize racecheck 30 90 racecheck --racecheck-report all -- -- small
sanitize synccheck 15 45 synccheck -- -- small

# --- Result --------------------------------------------------------------------------------------
say "result: $FAILED failed, $INCOMPLETE incomplete, $SKIPPED skipped; $(elapsed)s in all (budget ${BUDGET}s)"
pack
PACKED=1

# The check of what a device run sends back: at most 8 files, 16 MiB each, 64 MiB in all, files at
# most 2 folders down, names of letters, digits, '.', '_', '-'; summary.txt there.
check_out() {
  local files=0 bytes=0 problems="" path rel size part
  while IFS= read -r -d '' path; do
    rel=${path#"$OUT"/}
    IFS=/ read -r -a parts <<<"$rel"
    for part in "${parts[@]}"; do
      [[ $part =~ ^[A-Za-z0-9._-]+$ ]] || problems+=" '$rel': name;"
    done
    if [ -L "$path" ]; then
      problems+=" '$rel': a link;"
    elif [ -d "$path" ]; then
      [ "${#parts[@]}" -le 2 ] || problems+=" '$rel': folder too deep;"
    elif [ -f "$path" ]; then
      files=$((files + 1))
      size=$(stat -c %s "$path")
      bytes=$((bytes + size))
      [ "${#parts[@]}" -le 3 ] || problems+=" '$rel': too deep;"
      [ "$size" -le $((16 * 1024 * 1024)) ] || problems+=" '$rel': $size bytes > 16 MiB;"
    else
      problems+=" '$rel': not a plain file;"
    fi
  done < <(find "$OUT" -mindepth 1 -print0)
  [ "$files" -le 8 ] || problems+=" $files files > 8;"
  [ "$bytes" -le $((64 * 1024 * 1024)) ] || problems+=" $bytes bytes > 64 MiB;"
  [ -f "$SUMMARY" ] || problems+=" no summary.txt;"
  if [ -z "$problems" ]; then
    say "out: $files files, $((bytes / 1024)) KiB in $OUT: fits what a device run returns"
  else
    say "out: PROBLEM:$problems"
    FAILED=$((FAILED + 1))
  fi
}
check_out
[ "$FAILED" -eq 0 ]
