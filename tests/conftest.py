"""Shared test configuration: devices, dtypes, tolerances and the reference comparison.

Tolerances follow PyTorch's and FlashAttention's suites: a low-precision result may be off the
float64 reference by at most `k` times the error plain torch makes computing the same formula in
that precision (k = 2 forward, 4 for gradients), plus a small absolute floor.
"""
from __future__ import annotations

import os

import pytest
import torch

import attention_ext
from attention_ext.reference import attention_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# Absolute tolerances against the float64 reference for well-conditioned random inputs.
ATOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def pytest_report_header(config):
    info = attention_ext.build_info()
    return [f"attention_ext: cpu variant {info['cpu_variant']} (supported: {info['cpu_variants_supported']}), "
            f"cuda={info['cuda']}, cuda_emulation={info.get('cuda_emulation')}, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}"]


# A build whose CPU ops run the CUDA kernels on host threads (.ci/cuda_emulation.sh).
CUDA_EMULATION = attention_ext.build_info().get("cuda_emulation") == "1"


def cpu_variants():
    if CUDA_EMULATION:  # the CUDA kernels run whatever the CPU variant: once is enough
        return [attention_ext.cpu_variant()]
    return attention_ext.build_info()["cpu_variants_supported"].split(",")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cpu_kernels: tests the CPU kernels' own machinery (ISA variants, the decode path, "
        "work schedules, scratch memory); skipped where the ops run the emulated CUDA kernels")
    config.addinivalue_line(
        "markers", "slow_on_emulation: too large for the CUDA emulation (one host fiber per CUDA thread)")


def pytest_collection_modifyitems(config, items):
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


def low_precision_budget(fn_args, dtype, ref):
    """Error of plain torch computing the reference formula in `dtype` (k x this is allowed)."""
    out_lp = attention_reference(*fn_args[0], **fn_args[1], dtype=None)[0]
    return (out_lp.double() - ref).abs().max().item()


def assert_close_to_reference(actual, expected, dtype, budget=None, k=2.0, what="output"):
    """actual vs float64 `expected`: within ATOL[dtype] or k * budget (plain torch's own error)."""
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    tol = ATOL[dtype]
    if budget is not None and dtype in (torch.float16, torch.bfloat16):
        tol = max(tol, k * budget)
    assert err <= tol, f"{what}: max abs error {err:.3e} > tolerance {tol:.3e} ({dtype})"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


SLOW = os.environ.get("ATTENTION_EXT_SLOW_TESTS", "0") == "1"
