"""How the compiled ops get loaded: the prebuilt extension (attention_ext._C) by default, or, with
ATTENTION_EXT_JIT=1, a build of csrc/ by torch.utils.cpp_extension.load with ninja, which
recompiles only the files that changed (the kernel-development loop)."""
from __future__ import annotations

import glob
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import warnings

import torch

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT_DIR = os.path.dirname(PACKAGE_DIR)
SOURCE_DIR = os.path.join(ROOT_DIR, "csrc")

_loaded_from = None


def env_flag(name: str) -> bool:
    """An on/off environment variable (1, true, yes, on), as setup.py and the tests read theirs too."""
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def jit_requested() -> bool:
    return env_flag("ATTENTION_EXT_JIT")


def build_description(root: str = ROOT_DIR) -> dict:
    """csrc/build_sources.txt, the one description of the build (sources, flags) that setup.py,
    the JIT build and CMakeLists.txt read: {kind: [values, in file order]}."""
    entries = {}
    with open(os.path.join(root, "csrc", "build_sources.txt")) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                entries.setdefault(words[0], []).extend(words[1:])
    return entries


def sources(kind: str, root: str = ROOT_DIR) -> list:
    """The files of one kind of csrc/build_sources.txt (globs expanded), relative to root, sorted."""
    files = set()
    for pattern in build_description(root).get(kind, []):
        files.update(os.path.relpath(f, root) for f in glob.glob(os.path.join(root, pattern)))
    return sorted(files)


def jit_sources():
    # The Python module init belongs to the prebuilt extension; the JIT library is loaded with
    # torch.ops.load_library instead.
    module_init = set(sources("pymodule"))
    return [os.path.join(ROOT_DIR, f) for f in sources("cpu") if f not in module_init]


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
    description = build_description()
    load(
        name="attention_ext_jit",
        sources=jit_sources(),
        extra_include_paths=[SOURCE_DIR],
        extra_cflags=description["cxxflags"],
        extra_ldflags=description["ldflags"],
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
        _loaded_from = "jit:" + build_jit(verbose=env_flag("ATTENTION_EXT_JIT_VERBOSE"))
        return _loaded_from
    ops_dir = compiled_ops_dir()
    built = _built_torch_version(ops_dir)
    hint = (
        "Rebuild it against the torch you have: pip install --no-build-isolation --force-reinstall "
        "--no-deps <path to attention_ext source>, or set ATTENTION_EXT_JIT=1 in a checkout."
    )
    if built and _minor(built) != _minor(torch.__version__):
        raise ImportError(
            f"attention_ext was compiled against torch {built} but torch {torch.__version__} is "
            f"installed; C++ extensions are only compatible within one torch release. {hint}")
    try:
        from . import _C  # noqa: F401  (registers the ops; found in ops_dir, see compiled_ops_dir)
    except ImportError as e:
        msg = str(e)
        if "undefined symbol" in msg:
            raise ImportError(
                f"attention_ext's compiled ops ({_find_compiled_ops(ops_dir)}) were built for torch "
                f"{built or '(unknown)'} but torch {torch.__version__} is installed, and the two are not "
                f"binary compatible. {hint}") from e
        raise ImportError(
            f"attention_ext's compiled ops ({_find_compiled_ops(ops_dir)}) failed to load: {msg}") from e
    _loaded_from = "prebuilt:" + _C.__file__
    return _loaded_from


# --- Where the compiled ops are -------------------------------------------------------------------
#
# A normal install puts attention_ext/_C*.so beside these files, and an editable install
# (pip install -e .) builds it into the checkout. The one other case users meet: running Python from
# the root of a checkout after a non-editable `pip install .` — the current directory comes first on
# sys.path, so the checkout's attention_ext/ (no _C) shadows the installed one. Then the installed
# copy's compiled ops are used, provided they were built from the same csrc/ as the checkout's.


def _find_compiled_ops(directory: str):
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(directory, "_C" + suffix)
        if os.path.exists(path):
            return path
    return None


def _installed_package_dir():
    """The attention_ext/ directory of an installed distribution that holds compiled ops, if any (a
    checkout can also hold an attention_ext.egg-info of its own, without them, so look at all)."""
    for dist in importlib.metadata.distributions(name="attention_ext"):
        for f in dist.files or ():
            parts = f.parts
            if len(parts) == 2 and parts[0] == "attention_ext" and parts[1].startswith("_C."):
                directory = os.path.dirname(os.path.abspath(str(dist.locate_file(f))))
                if _find_compiled_ops(directory) and not os.path.samefile(directory, PACKAGE_DIR):
                    return directory
    return None


def source_digest(csrc_dir: str) -> str:
    """sha256 over csrc/ (relative paths and contents): which sources a build was compiled from."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(csrc_dir):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, csrc_dir).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
    return h.hexdigest()


def stale_build(directory: str = PACKAGE_DIR) -> bool:
    """Whether the compiled ops in a checkout were built from other sources than its csrc/ (a
    kernel edited since the last build). False for an installed package (no csrc/ beside it)."""
    recorded = _build_config(directory).get("CSRC_DIGEST")
    return os.path.isdir(SOURCE_DIR) and recorded is not None and recorded != source_digest(SOURCE_DIR)


def _warn_if_stale(directory: str) -> None:
    if stale_build(directory):
        warnings.warn(
            f"attention_ext: the compiled ops in {directory} were built from other sources than "
            f"{SOURCE_DIR} (edited since the last build), and they are what runs. Rebuild: pip install "
            f"--no-build-isolation -e {ROOT_DIR} (or python setup.py build_ext --inplace), or set "
            "ATTENTION_EXT_JIT=1 to compile csrc/ on import.", RuntimeWarning, stacklevel=4)


def compiled_ops_dir() -> str:
    """The directory holding _C: this package's own, or the installed copy's (see above). Raises an
    ImportError that says which case it is and the ways out when there is none."""
    if _find_compiled_ops(PACKAGE_DIR):
        _warn_if_stale(PACKAGE_DIR)
        return PACKAGE_DIR
    checkout = os.path.dirname(PACKAGE_DIR)
    if not os.path.isdir(SOURCE_DIR):
        raise ImportError(
            f"attention_ext at {PACKAGE_DIR} has no compiled ops (_C): the installation is incomplete. "
            "Reinstall it: pip install --no-build-isolation --force-reinstall <path to attention_ext source>")
    ways_out = (
        f"Either build them in place, from {checkout}: pip install --no-build-isolation -e . ; "
        f"or install the package (pip install --no-build-isolation {checkout}) and it is used from here too, "
        "or run Python outside the checkout. (ATTENTION_EXT_JIT=1 compiles csrc/ on import instead.)")
    installed = _installed_package_dir()
    if installed is None:
        raise ImportError(
            f"attention_ext was imported from the source tree at {PACKAGE_DIR}, which has no compiled ops "
            f"(no _C extension was built there), and no installed build of attention_ext was found. {ways_out}")
    recorded = _build_config(installed).get("CSRC_DIGEST")
    if recorded != source_digest(SOURCE_DIR):
        raise ImportError(
            f"attention_ext was imported from the source tree at {PACKAGE_DIR}, which has no compiled ops; "
            f"the installed build at {installed} was compiled from other sources than this checkout's csrc/, "
            f"so it is not used. {ways_out.replace('install the package', 'reinstall the package')}")
    # Submodules this tree lacks (_C, _build_config) are then found in the installed copy.
    package = sys.modules[__package__]
    if installed not in package.__path__:
        package.__path__.append(installed)
    return installed


def _build_config(directory: str) -> dict:
    """The values setup.py recorded for the build in `directory` (attention_ext/_build_config.py)."""
    module = sys.modules.get(__package__ + "._build_config")  # tests substitute their own
    if module is not None:
        return vars(module)
    path = os.path.join(directory, "_build_config.py")
    if not os.path.exists(path):
        return {}
    spec = importlib.util.spec_from_file_location(__package__ + "._build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _minor(version: str):
    return tuple(version.split("+")[0].split(".")[:2])


def _built_torch_version(directory: str = PACKAGE_DIR):
    return _build_config(directory).get("TORCH_VERSION")
