"""Build of attention_ext: the CPU kernels always, the CUDA kernels when torch has CUDA and nvcc
is found (FORCE_CUDA=1 insists, FORCE_CPU=1 skips them). ATTENTION_EXT_CUDA_EMULATION=1 is a test
build that runs the CUDA kernels on CPU tensors (.ci/cuda_emulation.sh).

Build against the installed torch:  pip install --no-build-isolation .
"""
import os
import re
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - the message is the point
    sys.exit(
        "attention_ext builds against an installed PyTorch: install torch first, then run\n"
        "  pip install --no-build-isolation .\n"
        "(a CPU-only torch is enough for the CPU kernels, e.g. pip install torch==2.13.0)"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
# The version's one place is attention_ext/_version.py (pyproject.toml reads it too).
VERSION = re.search(r'__version__ = "([^"]+)"', open(os.path.join(ROOT, "attention_ext", "_version.py")).read()).group(1)


def _load_build_module():
    """attention_ext/_build.py, loaded by path: the package itself cannot be imported before its
    compiled ops exist."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_attention_ext_build", os.path.join(ROOT, "attention_ext", "_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_build = _load_build_module()


def torch_requirement():
    """The torch release this build is compiled against: C++ extensions are binary compatible only
    within one release (major.minor), so the wheel says so and pip brings or keeps a matching torch."""
    major, minor = (int(x) for x in _build._minor(torch.__version__))
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


def want_cuda():
    if _build.env_flag("FORCE_CPU"):
        return False
    if _build.env_flag("FORCE_CUDA"):
        if CUDA_HOME is None:
            sys.exit("FORCE_CUDA=1 but no CUDA toolkit (nvcc) was found; set CUDA_HOME")
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None


def cuda_headers():
    """The CUDA toolkit's include directory (CUDA_HOME, torch's guess, or /usr/local/cuda)."""
    for home in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return os.path.join(home, "include")
    sys.exit("ATTENTION_EXT_CUDA_EMULATION=1 needs the CUDA headers (cuda_runtime.h); set CUDA_HOME")


def extensions():
    description = _build.build_description(ROOT)  # csrc/build_sources.txt
    cpu_sources = _build.sources("cpu", ROOT)
    # -g0: Python's own CFLAGS carry -g, which doubles the compile time of every file that includes
    # torch's headers; ATTENTION_EXT_DEBUG=1 keeps the debug info.
    cxx_flags = description["cxxflags"] + ([] if _build.env_flag("ATTENTION_EXT_DEBUG") else ["-g0"])
    link_flags = description["ldflags"]
    define_macros = []
    if os.environ.get("ATTENTION_EXT_SANITIZE"):
        # e.g. ATTENTION_EXT_SANITIZE=address,undefined for the sanitizer CI job; -g1: line tables
        # for the reports' stack traces, without the cost of full debug info
        san = "-fsanitize=" + os.environ["ATTENTION_EXT_SANITIZE"]
        cxx_flags = [f for f in cxx_flags if f != "-O3"] + ["-O1", "-g1", "-fno-omit-frame-pointer", san,
                                                             "-fno-sanitize-recover=all"]
        link_flags.append(san)
    if _build.env_flag("ATTENTION_EXT_CUDA_EMULATION"):
        # A test build: the CUDA binding and kernels compiled by the host compiler, registered
        # for CPU tensors and run on host threads (csrc/cuda_emulation/emulation.h). Needs the CUDA headers
        # only, no GPU and no CUDA runtime; never a build to install.
        cuda_include = cuda_headers()
        emulated = _build.sources("emulation", ROOT)
        return [
            CppExtension(
                "attention_ext._C",
                cpu_sources + emulated,
                include_dirs=[os.path.join(ROOT, "csrc"), cuda_include],
                define_macros=define_macros + [("ATTN_CUDA_EMULATION", None)],
                # #pragma unroll is nvcc's; the CPU binding's op functions are unregistered there.
                extra_compile_args={"cxx": cxx_flags + ["-Wno-unknown-pragmas", "-Wno-unused-function"]},
                extra_link_args=link_flags,
            )
        ]
    if want_cuda():
        cuda_sources = _build.sources("cuda", ROOT)
        # The default is set for torch's CUDAExtension too (it would otherwise pick the visible
        # GPU's or every architecture it knows); +PTX runs on GPUs newer than sm_90 by JIT.
        archs = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        define_macros += [("ATTENTION_EXT_WITH_CUDA", None), ("ATTENTION_EXT_CUDA_ARCHS", '"%s"' % archs)]
        nvcc_flags = description["nvccflags"] + ["--threads", os.environ.get("NVCC_THREADS", "4")]
        return [
            CUDAExtension(
                "attention_ext._C",
                cpu_sources + cuda_sources,
                include_dirs=[os.path.join(ROOT, "csrc")],
                define_macros=define_macros,
                extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
                extra_link_args=link_flags,
            )
        ]
    return [
        CppExtension(
            "attention_ext._C",
            cpu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    ]


def write_build_config():
    """Records the torch this build compiles against, so a mismatch fails with a clear message."""
    with open(os.path.join(ROOT, "attention_ext", "_build_config.py"), "w") as f:
        f.write('"""Written by setup.py at build time."""\n')
        f.write("TORCH_VERSION = %r\n" % torch.__version__)
        f.write("VERSION = %r\n" % VERSION)
        # Which csrc/ this build compiled: a checkout finds an installed build of the same sources.
        f.write("CSRC_DIGEST = %r\n" % _build.source_digest(os.path.join(ROOT, "csrc")))


write_build_config()


class BuildExtensionKeepingObjects(BuildExtension.with_options(use_ninja=True)):
    """torch's ninja build, with the objects of an editable install (pip install -e .) kept in
    build/ like those of every other build of this checkout. setuptools hands an editable build a
    fresh temporary folder, so each editable install used to recompile all of csrc/ (minutes); in
    build/, ninja recompiles only what changed, by source, header or command line."""

    def finalize_options(self):
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            from setuptools.command.build import build

            default = build(self.distribution)  # setuptools' own rule for the folder's name
            default.initialize_options()
            default.finalize_options()
            self.build_temp = os.path.join(ROOT, default.build_temp)


# Name, description, extras and the rest of the metadata are in pyproject.toml.
setup(
    license="BSD-3-Clause",
    # numpy: torch warns on import ("Failed to initialize NumPy") when it is missing.
    install_requires=[torch_requirement(), "numpy"],
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtensionKeepingObjects},
    zip_safe=False,
)
