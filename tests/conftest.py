"""Shared test configuration: devices, dtypes, tolerances and the reference comparison.

Tolerances follow PyTorch's and FlashAttention's suites: a low-precision result may be off the
float64 reference by at most `k` times the error plain torch makes computing the same formula in
that precision (k = 2 forward, 4 for gradients), plus a small absolute floor.
"""
from __future__ import annotations

import functools
import os
import re

import pytest
import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

import attention_ext
from attention_ext import _build
from attention_ext.reference import attention_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# Absolute tolerances against the float64 reference for well-conditioned random inputs.
ATOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def pytest_report_header(config):
    info = attention_ext.build_info()
    return [f"attention_ext: cpu variant {info['cpu_variant']} (supported: {info['cpu_variants_supported']}), "
            f"cuda={info['cuda']}, cuda_emulation={info.get('cuda_emulation')}, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}",
            f"attention_ext: ops from {info['loaded_from']}"
            + (" (STALE: built from other sources than csrc/)" if _build.stale_build() and
               info["loaded_from"].startswith("prebuilt:") else "")]


# A build whose CPU ops run the CUDA kernels on host threads (.ci/cuda_emulation.sh).
CUDA_EMULATION = attention_ext.build_info().get("cuda_emulation") == "1"
# The environment asks for that build (.ci/cuda_emulation.sh exports the flag setup.py reads for
# the build and the test run): the session then refuses to start on any other build.
EMULATION_REQUESTED = _build.env_flag("ATTENTION_EXT_CUDA_EMULATION")

# Where the tests of the CUDA kernels put their tensors: the CPU in the emulation build (whose CUDA
# binding is registered for CPU tensors), else a CUDA device if there is one, else None.
CUDA_KERNELS_DEVICE = "cpu" if CUDA_EMULATION else ("cuda" if torch.cuda.is_available() else None)

def torch_sdpa_gqa(q, k, v, **kwargs):
    """torch's own SDPA with K/V heads shared by groups of query heads: enable_gqa where torch has
    it (2.5 on), else K/V repeated to the query heads (the same function, gradients summed back)."""
    try:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    except TypeError as e:
        if "enable_gqa" not in str(e):
            raise
    groups = q.shape[-3] // k.shape[-3]
    return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, -3),
                                                            v.repeat_interleave(groups, -3), **kwargs)


def gradcheck(fn, inputs, **kwargs):
    """torch.autograd.gradcheck; on the emulated CUDA kernels in fast mode: a randomized check of the
    same Jacobian (one random projection per input and output, not a finite difference per input
    element), for a hundredth of the launches, each of which costs the emulation a fiber per CUDA
    thread."""
    return torch.autograd.gradcheck(fn, inputs, fast_mode=CUDA_EMULATION, **kwargs)


def gradgradcheck(fn, inputs, **kwargs):
    """torch.autograd.gradgradcheck, in fast mode on the emulated CUDA kernels (see gradcheck)."""
    return torch.autograd.gradgradcheck(fn, inputs, fast_mode=CUDA_EMULATION, **kwargs)


OPS = ("attention_fwd", "attention_bwd", "attention_probs", "dropout_keep_mask")
# The source file of the CUDA binding (its TORCH_LIBRARY_IMPL block), as the dispatcher records it.
CUDA_BINDING_SOURCE = "cuda/attention_cuda.cpp"
# Ops with no CUDA kernel by design: flash_attn_with_kvcache's in-place append and its rotary run as
# ops on CPU caches only (on a GPU it appends with index_put_ and rotates with torch ops), so under
# the emulation, whose "CUDA" tensors are CPU tensors, it is the CPU ops that run.
CPU_ONLY_OPS = ("attention_kvcache_append", "attention_rotary")


def kernel_source(op, dispatch_key):
    """The source file of the kernel registered for attention_ext::<op> under `dispatch_key` ("CPU",
    "CUDA"), from the dispatcher's own registration record; None if there is none."""
    table = torch._C._dispatch_dump(f"attention_ext::{op}")
    found = re.search(rf"^{dispatch_key}: registered at (\S+):\d+ ", table, re.MULTILINE)
    return found.group(1).replace("\\", "/") if found else None


def served_by_cuda_binding(op, dispatch_key):
    source = kernel_source(op, dispatch_key)
    return source is not None and source.endswith("/" + CUDA_BINDING_SOURCE)


def cpuinfo():
    """The first processor's fields of /proc/cpuinfo (vendor_id, flags, ...); {} where there is none."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and fields:
                    break  # the blank line after the first processor
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_variants():
    if CUDA_EMULATION:  # the CUDA kernels run whatever the CPU variant: once is enough
        return [attention_ext.cpu_variant()]
    return attention_ext.build_info()["cpu_variants_supported"].split(",")


@functools.lru_cache(maxsize=None)
def amx_tiles() -> bool:
    """Whether the amx variant's bf16 kernels run on AMX tiles in this process: the CPU has AMX
    and Linux granted the tile state, which the first call that would run on tiles requests (one
    is made here); where it was refused they run the avx512 variant's code."""
    if CUDA_EMULATION or "amx" not in cpu_variants():
        return False
    previous = attention_ext.cpu_variant()
    try:
        attention_ext.set_cpu_variant("amx")
        attention_ext.attention(*torch.zeros(3, 1, 16, 32, dtype=torch.bfloat16).unbind())
    finally:
        attention_ext.set_cpu_variant(previous)
    return attention_ext.build_info()["amx_tile_state"] == "granted"


def bf16_decode_on_pairs(cpu_variant: str, rows: int, dk: int, dv: int) -> bool:
    """Whether a bf16 decode call with `rows` query rows per K/V head (the heads sharing it x n),
    unit-stride K/V rows of widths dk and dv, takes its products on pairs of bf16: AVX512-BF16 dot
    products in the avx512bf16 variant from two rows, except exactly four (one register block of
    the vector code's four-row loops; csrc/cpu/decode_bf16_dot.inc) unless the CPU runs 512-bit
    operations as two halves (build_info's cpu_avx512_double_pumped), AMX tiles in the amx variant
    for 8 to 32 rows (decode_bf16_amx.inc). Both round P to bf16 and count subnormal inputs as
    zero; the vector code does neither."""
    if CUDA_EMULATION:
        return False
    if cpu_variant == "avx512bf16":
        four_on_pairs = attention_ext.build_info()["cpu_avx512_double_pumped"] == "1"
        return rows >= 2 and (rows != 4 or four_on_pairs) and dk > 0 and dk % 8 == 0 and dv % 32 == 0
    if cpu_variant == "amx" and amx_tiles():
        return 8 <= rows <= 32 and dk > 0 and dk % 32 == 0 and dv % 32 == 0
    return False


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cpu_kernels: tests the CPU kernels' own machinery (ISA variants, the decode path, "
        "work schedules, scratch memory); skipped where the ops run the emulated CUDA kernels")
    config.addinivalue_line(
        "markers", "slow_on_emulation: too large for the CUDA emulation (one host fiber per CUDA thread)")
    config.addinivalue_line(
        "markers", "cuda_kernels: runs the CUDA kernels on CUDA_KERNELS_DEVICE; every attention_ext op call "
        "on that device is recorded and must have gone to the CUDA binding, and there must be at least one")
    config.addinivalue_line(
        "markers", "xdist_group(name): pytest-xdist's --dist loadgroup runs a group's tests on one worker "
        "(set by pytest_collection_modifyitems for tests sharing a module-scoped fixture)")


def pytest_sessionstart(session):
    """Under ATTENTION_EXT_CUDA_EMULATION=1 a regular build would let the tests of the CUDA kernels
    skip and the CPU kernels pass everything else: refuse to run on anything but the emulation build."""
    if not EMULATION_REQUESTED:
        return
    info = attention_ext.build_info()
    if info.get("cuda_emulation") != "1":
        problem = (f"the loaded build ({info.get('loaded_from')}) is not one: build_info()['cuda_emulation'] "
                   f"is {info.get('cuda_emulation')!r}")
    else:
        wrong = {op: kernel_source(op, "CPU") for op in OPS if not served_by_cuda_binding(op, "CPU")}
        problem = "" if not wrong else (
            "in the loaded build CPU tensors do not reach the CUDA binding: " +
            ", ".join(f"attention_ext::{op} is served by {source}" for op, source in wrong.items()))
    if problem:
        pytest.exit(f"ATTENTION_EXT_CUDA_EMULATION=1 asks for the CUDA emulation build, but {problem}. "
                    "Run .ci/cuda_emulation.sh, or pytest from the root of a tree built with that flag.",
                    returncode=pytest.ExitCode.USAGE_ERROR)


class KernelCalls(TorchDispatchMode):
    """Records every attention_ext op call under it (forward, backward, weights, dropout masks)
    with the device types of its tensor arguments. The dispatcher picks the kernel by those, and
    its registration record says which source registered that kernel: together, which binding
    served each call. (Which kernel inside the CUDA binding — SIMT, tensor-core, split-KV — is not
    recorded; the tests tell those apart by their results.)"""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "attention_ext":
            tensors = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors:
                self.calls.append((func._opname, {t.device.type for t in tensors}))
        return func(*args, **kwargs)

    def check_cuda_kernels_ran(self, device_type):
        """At least one call on `device_type`, and each of them dispatched to the CUDA binding."""
        key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
        on_device = sorted({op for op, devices in self.calls if device_type in devices and op not in CPU_ONLY_OPS})
        assert on_device, (f"no attention_ext op ran on {device_type} tensors (calls: {self.calls}): "
                           "this test does not exercise the CUDA kernels")
        for op in on_device:
            assert served_by_cuda_binding(op, key), (
                f"attention_ext::{op} on {device_type} tensors went to the kernel registered in "
                f"{kernel_source(op, key)}, not the CUDA binding")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("cuda_kernels") is None:
        return (yield)
    with KernelCalls() as calls:
        result = yield
    calls.check_cuda_kernels_ran(CUDA_KERNELS_DEVICE)
    return result


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (--dist loadgroup, as the CI scripts run it) the tests that share a
    # module-scoped fixture run on one worker, so the fixture (processes started for the fuzzing, the
    # process groups, the dry runs) is set up once, not once per worker.
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures and any(defs[-1].scope == "module" for defs in fixtures.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if not CUDA_EMULATION:
        return
    skip_cpu = pytest.mark.skip(reason="CPU-kernel machinery; this build runs the emulated CUDA kernels")
    skip_slow = pytest.mark.skip(reason="too large for the CUDA emulation")
    for item in items:
        if "cpu_kernels" in item.keywords:
            item.add_marker(skip_cpu)
        if "slow_on_emulation" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(params=cpu_variants())
def cpu_variant(request):
    """Runs a test once per CPU kernel variant this machine supports."""
    previous = attention_ext.cpu_variant()
    attention_ext.set_cpu_variant(request.param)
    yield request.param
    attention_ext.set_cpu_variant(previous)


def rand(*shape, dtype=torch.float64, device="cpu", requires_grad=False, scale=1.0):
    t = (torch.randn(*shape, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def on_thread_counts(fn, counts=(1, 2, 3)):
    """fn() run with each of torch's thread counts in turn."""
    threads = torch.get_num_threads()
    try:
        results = []
        for t in counts:
            torch.set_num_threads(t)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)


def low_precision_budget(fn_args, dtype, ref):
    """Error of plain torch computing the reference formula in `dtype` (k x this is allowed)."""
    out_lp = attention_reference(*fn_args[0], **fn_args[1], dtype=None)[0]
    return (out_lp.double() - ref).abs().max().item()


def assert_close_to_reference(actual, expected, dtype, budget=None, k=2.0, what="output"):
    """actual vs float64 `expected` (the same shape): within ATOL[dtype] or k * budget (plain
    torch's own error)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    tol = ATOL[dtype]
    if budget is not None and dtype in (torch.float16, torch.bfloat16):
        tol = max(tol, k * budget)
    assert err <= tol, f"{what}: max abs error {err:.3e} > tolerance {tol:.3e} ({dtype})"


def assert_grads_close_to_reference(got, want, low, dtype, names=("dq", "dk", "dv")):
    """Gradients vs the float64 reference `want`: within 4x the dtype's absolute tolerance (scaled
    by the gradient's size) or, for fp16/bf16, 4x the error plain torch makes in that dtype (`low`,
    the reference's gradients computed in it). Every gradient named, each of its reference's shape."""
    assert len(got) == len(want) == len(low) == len(names), \
        f"{len(got)} gradients, {len(want)} references, {len(low)} low-precision ones for {names}"
    for name, g, w, lo in zip(names, got, want, low):
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        scale = max(1.0, w.abs().max().item())
        budget = (lo.double() - w).abs().max().item()
        err = (g.double() - w).abs().max().item()
        tol = max(ATOL[dtype] * 4 * scale, 4 * budget if dtype in (torch.float16, torch.bfloat16) else 0.0)
        assert err <= tol, f"{name}: max abs error {err:.3e} > {tol:.3e}"


def assert_lse_close(lse, ref_lse, dtype):
    """The lse is accumulated in float64 for float64 inputs and in float32 for every other storage
    dtype, from the stored inputs themselves, so its error is the accumulation's: float64 to 1e-9,
    else 2e-5 relative (fp32 sums over up to a few hundred terms), whatever the storage precision.
    The same shape; rows of -inf (no key seen) must be -inf in both."""
    assert lse.shape == ref_lse.shape, f"lse: shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}"
    hidden = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), hidden), "lse: -inf rows differ from the reference's"
    lse, ref_lse = lse[~hidden], ref_lse[~hidden]
    if lse.numel() == 0:
        return
    err = (lse.double() - ref_lse).abs()
    if dtype == torch.float64:
        tol = torch.full_like(err, 1e-9)
    else:
        tol = 2e-5 * ref_lse.abs().clamp(min=1.0)
    worst = (err - tol).argmax()
    assert (err <= tol).all(), (f"lse: error {err.flatten()[worst]:.3e} > tolerance "
                                f"{tol.flatten()[worst]:.3e} at lse {ref_lse.flatten()[worst]:.4f} ({dtype})")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


SLOW = os.environ.get("ATTENTION_EXT_SLOW_TESTS", "0") == "1"
# The run under ASan/UBSan (.ci/sanitize.sh sets ATTENTION_EXT_SANITIZED).
SANITIZED = os.environ.get("ATTENTION_EXT_SANITIZED", "0") == "1"
# A build that runs several times slower than the plain one (the CUDA emulation, or the
# sanitizers), where CI also runs two pytest workers side by side: the time limits that only
# catch hangs are raised there.
SLOW_BUILD = CUDA_EMULATION or SANITIZED
