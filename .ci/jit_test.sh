#!/usr/bin/env bash
# The kernel-development loop: ATTENTION_EXT_JIT=1 builds csrc/ with ninja, the JIT library passes
# the quick check, and touching one kernel file recompiles only that file (plus the link).
set -euo pipefail
cd "$(dirname "$0")/.."
export ATTENTION_EXT_JIT=1
export ATTENTION_EXT_JIT_DIR=$(mktemp -d)
trap 'rm -rf "$ATTENTION_EXT_JIT_DIR"' EXIT
export MAX_JOBS="${MAX_JOBS:-2}"

start=$(date +%s.%N)
python -c "import attention_ext, sys; src = attention_ext._build.load_extension(); \
  sys.exit(0 if src.startswith('jit:') else 'not a JIT build: ' + src)"
echo "JIT full build: $(python -c "print(f'{$(date +%s.%N) - $start:.1f}')") s"
python -m attention_ext check --quick --dtype float32 | tail -1

log="$ATTENTION_EXT_JIT_DIR/.ninja_log"
before=$(wc -l < "$log")
touch csrc/cpu/variants/avx2_forward.cpp
start=$(date +%s.%N)
python -c "import attention_ext"
echo "JIT rebuild after touching csrc/cpu/variants/avx2_forward.cpp (incl. python + torch import): $(python -c "print(f'{$(date +%s.%N) - $start:.1f}')") s"
rebuilt=$(tail -n +"$((before + 1))" "$log" | awk '{print $4}' | sort | tr '\n' ' ')
echo "ninja rebuilt: $rebuilt"
[ "$rebuilt" = "attention_ext_jit.so avx2_forward.o " ] || { echo "expected only avx2_forward.o and the link"; exit 1; }
