#!/usr/bin/env bash
# Builds the wheel, installs it into a fresh virtual environment with torch==2.13.0 and runs a
# smoke test from outside the checkout: nothing may be imported from the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

MAX_JOBS="${MAX_JOBS:-2}" pip wheel --no-build-isolation --no-deps -w "$work/dist" . > "$work/wheel.log" 2>&1 \
  || { tail -50 "$work/wheel.log"; exit 1; }
wheel=$(ls "$work"/dist/attention_ext-*.whl)
echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

python -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet torch==2.13.0
"$work/venv/bin/pip" install --quiet "$wheel"

cd "$work"
"$work/venv/bin/python" - "$root" <<'PY'
import sys, os
root = sys.argv[1]
import torch
import attention_ext
assert not attention_ext.__file__.startswith(root), f"imported from the checkout: {attention_ext.__file__}"
info = attention_ext.build_info()
print("build_info:", info)
q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64, requires_grad=True)
k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64, requires_grad=True)
v = torch.tensor([[10.0, 0.0], [0.0, 10.0], [5.0, 5.0]], dtype=torch.float64, requires_grad=True)
out = attention_ext.scaled_dot_product_attention(q, k, v)
assert torch.allclose(out, torch.tensor([[6.15, 3.85], [3.85, 6.15], [5.0, 5.0]], dtype=torch.float64), atol=6e-3)
assert torch.autograd.gradcheck(attention_ext.scaled_dot_product_attention, (q, k, v))
print("wheel smoke test: passed")
PY
"$work/venv/bin/python" -m attention_ext check --quick --dtype float32 | tail -1
"$work/venv/bin/pip" show attention_ext | grep -E "^(Name|Version|License|Requires)"
