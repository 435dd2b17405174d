"""How the compiled ops get loaded: the prebuilt extension (attention_ext._C) by default, or, with
ATTENTION_EXT_JIT=1, a build of csrc/ by torch.utils.cpp_extension.load with ninja, which
recompiles only the files that changed (the kernel-development loop)."""
from __future__ import annotations

import glob
import os

import torch

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.join(os.path.dirname(PACKAGE_DIR), "csrc")

CXX_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fvisibility=hidden"]
LD_FLAGS = ["-fopenmp"]

_loaded_from = None


def jit_requested() -> bool:
    return os.environ.get("ATTENTION_EXT_JIT", "0").lower() in ("1", "true", "yes", "on")


def jit_sources():
    srcs = glob.glob(os.path.join(SOURCE_DIR, "*.cpp")) + glob.glob(os.path.join(SOURCE_DIR, "cpu", "*.cpp"))
    # module.cpp is the Python module init of the prebuilt extension; the JIT library is loaded
    # with torch.ops.load_library instead.
    return sorted(s for s in srcs if os.path.basename(s) != "module.cpp")


def jit_build_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "attention_ext", "jit",
                           "torch-" + torch.__version__.replace("+", "_"))
    path = os.environ.get("ATTENTION_EXT_JIT_DIR", default)
    os.makedirs(path, exist_ok=True)
    return path


def build_jit(verbose: bool = False) -> str:
    """Builds (incrementally) and loads the ops from csrc/; returns the library path."""
    from torch.utils.cpp_extension import load

    if not os.path.isdir(SOURCE_DIR):
        raise RuntimeError(
            f"ATTENTION_EXT_JIT=1 needs the source tree, but {SOURCE_DIR} does not exist; "
            "JIT mode works from a checkout (pip install -e . or PYTHONPATH=<checkout>)")
    load(
        name="attention_ext_jit",
        sources=jit_sources(),
        extra_include_paths=[SOURCE_DIR],
        extra_cflags=CXX_FLAGS,
        extra_ldflags=LD_FLAGS,
        build_directory=jit_build_dir(),
        is_python_module=False,
        verbose=verbose,
    )
    return os.path.join(jit_build_dir(), "attention_ext_jit.so")


def load_extension() -> str:
    """Loads the ops once; returns where they came from."""
    global _loaded_from
    if _loaded_from is not None:
        return _loaded_from
    if jit_requested():
        _loaded_from = "jit:" + build_jit(verbose=os.environ.get("ATTENTION_EXT_JIT_VERBOSE") == "1")
        return _loaded_from
    built = _built_torch_version()
    hint = (
        "Rebuild it against the torch you have: pip install --no-build-isolation --force-reinstall "
        "--no-deps <path to attention_ext source>, or set ATTENTION_EXT_JIT=1 in a checkout."
    )
    if built and _minor(built) != _minor(torch.__version__):
        raise ImportError(
            f"attention_ext was compiled against torch {built} but torch {torch.__version__} is "
            f"installed; C++ extensions are only compatible within one torch release. {hint}")
    try:
        from . import _C  # noqa: F401  (registers the ops)
    except ImportError as e:
        msg = str(e)
        if "undefined symbol" in msg or (built and built != torch.__version__):
            raise ImportError(
                f"attention_ext's compiled ops were built for torch {built or '(unknown)'} but torch "
                f"{torch.__version__} is installed, and the two are not binary compatible. {hint}"
            ) from e
        raise ImportError(f"attention_ext's compiled ops failed to load ({msg}). {hint}") from e
    _loaded_from = "prebuilt:" + os.path.join(PACKAGE_DIR, "_C")
    return _loaded_from


def _minor(version: str):
    return tuple(version.split("+")[0].split(".")[:2])


def _built_torch_version():
    try:
        from ._build_config import TORCH_VERSION

        return TORCH_VERSION
    except ImportError:
        return None
