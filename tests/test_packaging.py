"""How the package finds and loads its compiled ops, and what it says when it cannot:
- a build for another torch release is refused with a message that says so and how to rebuild,
  instead of an undefined-symbol traceback;
- imported from a checkout that was installed with a plain `pip install .` (Python puts the current
  directory first, so the checkout's attention_ext/ shadows the installed one), the installed build's
  ops are used if they were compiled from the same csrc/; otherwise the error names the source tree
  and the ways out, never a torch mismatch;
- an installed copy without its ops is called an incomplete installation."""
from __future__ import annotations

import glob
import os
import shutil
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


@pytest.mark.skipif(not os.path.isdir(attention_ext._build.SOURCE_DIR)
                    or attention_ext._build._find_compiled_ops(attention_ext._build.PACKAGE_DIR) is None,
                    reason="needs a checkout with an in-place build")
@pytest.mark.parametrize("digest", ["current", "other"])
def test_an_in_place_build_from_other_sources_warns_on_import(digest):
    """Editing a kernel and forgetting to rebuild would test the old kernel: the import says so."""
    import torch
    recorded = attention_ext._build.source_digest(attention_ext._build.SOURCE_DIR) if digest == "current" else "0" * 64
    result = run_python(f"""
        import sys, types, warnings
        fake = types.ModuleType("attention_ext._build_config")
        fake.TORCH_VERSION, fake.CSRC_DIGEST = {torch.__version__!r}, {recorded!r}
        sys.modules["attention_ext._build_config"] = fake
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import attention_ext
        print("WARNINGS:", [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])
    """)
    assert "WARNINGS:" in result.stdout, result.stdout + result.stderr
    stale = "built from other sources than" in result.stdout
    assert stale == (digest == "other"), result.stdout
    if stale:
        assert "pip install --no-build-isolation -e" in result.stdout and "ATTENTION_EXT_JIT=1" in result.stdout


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


# --- Finding the compiled ops from a checkout --------------------------------------------------------

PACKAGE_DIR = os.path.dirname(os.path.abspath(attention_ext.__file__))
SOURCE_TREE = os.path.dirname(PACKAGE_DIR)


def compiled_ops():
    return attention_ext._build._find_compiled_ops(attention_ext._build.compiled_ops_dir())


def make_checkout(root):
    """A checkout as a fresh clone has it: the package's Python files and csrc/, no compiled ops."""
    os.makedirs(root / "attention_ext")
    for f in glob.glob(os.path.join(PACKAGE_DIR, "*.py")):
        if os.path.basename(f) != "_build_config.py":
            shutil.copy(f, root / "attention_ext")
    shutil.copytree(os.path.join(SOURCE_TREE, "csrc"), root / "csrc")
    return root


def make_installed_copy(site, csrc_digest):
    """site-packages as `pip install .` leaves it: the package with _C, its build config, and a
    dist-info whose RECORD lists the files."""
    package = site / "attention_ext"
    os.makedirs(package)
    files = []
    for f in glob.glob(os.path.join(PACKAGE_DIR, "*.py")) + [compiled_ops()]:
        if os.path.basename(f) != "_build_config.py":
            shutil.copy(f, package)
            files.append("attention_ext/" + os.path.basename(f))
    import torch
    (package / "_build_config.py").write_text(
        f"TORCH_VERSION = {torch.__version__!r}\nVERSION = '0.1.0'\nCSRC_DIGEST = {csrc_digest!r}\n")
    files.append("attention_ext/_build_config.py")
    dist_info = site / "attention_ext-0.1.0.dist-info"
    os.makedirs(dist_info)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: attention_ext\nVersion: 0.1.0\n")
    (dist_info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return package


def import_from(cwd, code="", pythonpath=None, hide_installed=False):
    """`python -c` run in `cwd` (first on sys.path, as for a user in a checkout) importing attention_ext."""
    prelude = ""
    if hide_installed:  # no distribution of attention_ext is installed anywhere
        prelude = "import importlib.metadata as m; m.distributions = lambda **kw: iter(())\n"
    script = prelude + textwrap.dedent("""
        try:
            import attention_ext
        except ImportError as e:
            print("IMPORT_ERROR:", e)
            raise SystemExit
        print("FILE:", attention_ext.__file__)
        print("LOADED:", attention_ext.build_info()["loaded_from"])
    """) + textwrap.dedent(code)
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTENTION_EXT_JIT")}
    if pythonpath:
        environ["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ,
                          cwd=cwd, timeout=120)


def test_checkout_without_compiled_ops_or_install_names_the_source_tree_and_the_ways_out(tmp_path):
    checkout = make_checkout(tmp_path / "checkout")
    result = import_from(checkout, hide_installed=True)
    message = result.stdout
    assert "IMPORT_ERROR:" in message, message + result.stderr
    assert f"imported from the source tree at {checkout / 'attention_ext'}" in message
    assert "no installed build of attention_ext was found" in message
    assert "pip install --no-build-isolation -e ." in message  # way out 1: build in place
    assert f"pip install --no-build-isolation {checkout}" in message  # way out 2: install it
    assert "torch" not in message.split("(ATTENTION_EXT_JIT")[0], "not a torch mismatch: " + message


def test_checkout_uses_the_installed_build_of_the_same_sources(tmp_path):
    checkout = make_checkout(tmp_path / "checkout")
    digest = attention_ext._build.source_digest(str(checkout / "csrc"))
    installed = make_installed_copy(tmp_path / "site", digest)
    result = import_from(checkout, pythonpath=tmp_path / "site", code="""
        import torch
        q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
        out = attention_ext.scaled_dot_product_attention(q, q, q)
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        print("MATCH:", torch.allclose(out, ref))
    """)
    assert "IMPORT_ERROR" not in result.stdout, result.stdout + result.stderr
    assert f"FILE: {checkout / 'attention_ext' / '__init__.py'}" in result.stdout  # the checkout's Python
    assert f"LOADED: prebuilt:{installed}" in result.stdout  # the installed copy's compiled ops
    assert "MATCH: True" in result.stdout


def test_checkout_refuses_an_installed_build_of_other_sources(tmp_path):
    checkout = make_checkout(tmp_path / "checkout")
    digest = attention_ext._build.source_digest(str(checkout / "csrc"))
    make_installed_copy(tmp_path / "site", digest)
    with open(checkout / "csrc" / "philox.h", "a") as f:
        f.write("// edited after the install\n")
    result = import_from(checkout, pythonpath=tmp_path / "site")
    message = result.stdout
    assert "IMPORT_ERROR:" in message, message + result.stderr
    assert "was compiled from other sources than this checkout's csrc/" in message
    assert "pip install --no-build-isolation -e ." in message
    assert "compiled against torch" not in message


def test_installed_copy_without_compiled_ops_is_an_incomplete_installation(tmp_path):
    package = make_installed_copy(tmp_path / "site", "unused")
    os.remove(glob.glob(str(package / "_C*"))[0])
    result = import_from(tmp_path, pythonpath=tmp_path / "site")
    message = result.stdout
    assert "IMPORT_ERROR:" in message, message + result.stderr
    assert f"attention_ext at {package} has no compiled ops (_C): the installation is incomplete" in message
    assert "compiled against torch" not in message


def test_source_digest_covers_paths_and_contents(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.h").write_text("int x;")
    first = attention_ext._build.source_digest(str(tmp_path))
    (tmp_path / "a" / "x.h").write_text("int y;")
    second = attention_ext._build.source_digest(str(tmp_path))
    os.rename(tmp_path / "a" / "x.h", tmp_path / "a" / "z.h")
    third = attention_ext._build.source_digest(str(tmp_path))
    assert len({first, second, third}) == 3
