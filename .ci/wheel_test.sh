#!/usr/bin/env bash
# Builds the source distribution, checks that it carries every tracked build input, builds the
# wheel from the unpacked sdist (what `pip install attention_ext-*.tar.gz` does), installs only the
# wheel into an empty virtual environment (pip must bring the torch release it was compiled for, and
# refuse another one clearly), and runs a smoke test from outside the checkout: nothing may be
# imported from the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python setup.py -q sdist -d "$work/sdist" > "$work/sdist.log" 2>&1 || { tail -50 "$work/sdist.log"; exit 1; }
sdist=$(ls "$work"/sdist/attention_ext-*.tar.gz)
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  tar tzf "$sdist" | sed 's|^[^/]*/||' | sort > "$work/in_sdist"
  missing=$(git ls-files csrc include cmake CMakeLists.txt setup.py pyproject.toml attention_ext | sort \
            | comm -13 "$work/in_sdist" -)
  [ -z "$missing" ] || { echo "the sdist lacks tracked build inputs:"; echo "$missing"; exit 1; }
fi
echo "built $(basename "$sdist") ($(du -h "$sdist" | cut -f1)): every tracked build input is in it"
mkdir "$work/unpacked" && tar xzf "$sdist" -C "$work/unpacked"
(cd "$work"/unpacked/attention_ext-* && MAX_JOBS="${MAX_JOBS:-2}" pip wheel --no-build-isolation --no-deps \
  -w "$work/dist" . > "$work/wheel.log" 2>&1) || { tail -50 "$work/wheel.log"; exit 1; }
wheel=$(ls "$work"/dist/attention_ext-*.whl)
echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

built_release=$(python -c "import torch; print('.'.join(torch.__version__.split('+')[0].split('.')[:2]))")
requires=$(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist: torch')
echo "$requires"
major=${built_release%.*}; minor=${built_release#*.}
[ "$requires" = "Requires-Dist: torch<$major.$((minor + 1)),>=$built_release" ] \
  || { echo "the wheel should require torch>=$built_release,<$major.$((minor + 1))"; exit 1; }

python -m venv "$work/venv"
# Beside a torch of another release (a stand-in dist-info for torch 2.4.0) and nothing to upgrade
# it from, pip refuses, naming the requirement, instead of installing a wheel that cannot load.
site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir "$site/torch-2.4.0.dist-info"
printf 'Metadata-Version: 2.1\nName: torch\nVersion: 2.4.0\n' > "$site/torch-2.4.0.dist-info/METADATA"
echo "torch-2.4.0.dist-info/METADATA,," > "$site/torch-2.4.0.dist-info/RECORD"
if env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$work/venv/bin/pip" install --no-index "$wheel" \
     > "$work/conflict.log" 2>&1; then
  echo "pip installed the wheel beside torch 2.4.0"; exit 1
fi
grep -q "torch<$major.$((minor + 1)),>=$built_release" "$work/conflict.log" \
  || { tail -20 "$work/conflict.log"; echo "pip did not name the wheel's torch requirement"; exit 1; }
echo "beside torch 2.4.0: pip refuses: $(grep -m1 'ERROR' "$work/conflict.log")"
rm -r "$site/torch-2.4.0.dist-info"
# Alone, the wheel brings its torch.
"$work/venv/bin/pip" install --quiet "$wheel" 2>&1 | grep -v "^WARNING: Location" || true
"$work/venv/bin/python" -c "import torch; print('pip brought torch', torch.__version__)"

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
