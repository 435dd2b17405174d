"""How the package loads its compiled ops: a build for another torch is refused with a message
that says so and how to rebuild, instead of an undefined-symbol traceback."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import attention_ext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, **env):
    environ = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(attention_ext.__file__)), **env)
    environ.pop("ATTENTION_EXT_JIT", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, cwd=REPO, timeout=120)


def test_build_for_another_torch_release_fails_with_rebuild_instructions():
    # Pretend the extension was compiled against torch 1.0.0 (setup.py records the real version in
    # attention_ext/_build_config.py).
    result = run_python("""
        import sys, types
        fake = types.ModuleType("attention_ext._build_config")
        fake.TORCH_VERSION = "1.0.0"
        sys.modules["attention_ext._build_config"] = fake
        try:
            import attention_ext
        except ImportError as e:
            print("IMPORT_ERROR:", e)
        else:
            print("imported")
    """)
    assert "IMPORT_ERROR:" in result.stdout, result.stdout + result.stderr
    message = result.stdout
    import torch
    assert "compiled against torch 1.0.0" in message
    assert f"torch {torch.__version__} is installed" in message
    assert "pip install --no-build-isolation" in message and "ATTENTION_EXT_JIT=1" in message


def test_same_release_with_another_local_tag_still_loads():
    # 2.13.0+cpu and 2.13.0 share the C++ ABI: only the release (major.minor) must match.
    import torch
    release = torch.__version__.split("+")[0]
    result = run_python(f"""
        import sys, types
        fake = types.ModuleType("attention_ext._build_config")
        fake.TORCH_VERSION = "{release}+somelocaltag"
        sys.modules["attention_ext._build_config"] = fake
        import torch, attention_ext
        q = torch.randn(2, 3, 4)
        out = attention_ext.scaled_dot_product_attention(q, q, q)
        print("ok", tuple(out.shape))
    """)
    assert "ok (2, 3, 4)" in result.stdout, result.stdout + result.stderr


def test_jit_mode_without_source_tree_explains_itself(tmp_path):
    # JIT builds from csrc/; a package without it (an installed wheel) must say so, not crash.
    result = run_python("""
        import attention_ext._build as b
        b.SOURCE_DIR = "/nonexistent/csrc"
        try:
            b.build_jit()
        except RuntimeError as e:
            print("RUNTIME_ERROR:", e)
    """)
    assert "RUNTIME_ERROR:" in result.stdout, result.stdout + result.stderr
    assert "needs the source tree" in result.stdout


def test_build_info_reports_what_was_built():
    import torch
    info = attention_ext.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    supported = info["cpu_variants_supported"].split(",")
    assert info["cpu_variant"] in supported
    assert set(supported) <= set(info["cpu_variants_compiled"].split(","))
    for key in ("compiler", "openmp", "cuda"):
        assert key in info, key
