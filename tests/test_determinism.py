"""Results are bitwise identical run to run and independent of the thread count."""
import pytest
import torch

import attention_ext

from conftest import rand


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run_all(dtype, causal, mask=False):
    torch.manual_seed(1)
    q = rand(2, 3, 150, 40, dtype=dtype, requires_grad=True)
    k = rand(1, 3, 170, 40, dtype=dtype, requires_grad=True)  # broadcast over batch: dK sums
    v = rand(1, 3, 170, 24, dtype=dtype, requires_grad=True)
    m = rand(3, 150, 170, dtype=dtype, requires_grad=True) if mask else None
    out = attention_ext.attention(q, k, v, attn_mask=m, causal=causal)
    out.backward(torch.randn_like(out))
    grads = [q.grad, k.grad, v.grad] + ([m.grad] if mask else [])
    return [out.detach()] + grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("causal,mask", [(None, False), ("top_left", False), (None, True)])
def test_bitwise_identical_across_runs_and_thread_counts(dtype, causal, mask, restore_threads):
    torch.set_num_threads(2)
    first = run_all(dtype, causal, mask)
    second = run_all(dtype, causal, mask)
    torch.set_num_threads(1)
    single = run_all(dtype, causal, mask)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_deterministic_algorithms_mode_does_not_raise():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        outs = run_all(torch.float32, "top_left", mask=True)
        assert all(torch.isfinite(o).all() for o in outs)
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_fused_and_split_backward_schedules_are_bitwise_identical(dtype, causal, monkeypatch):
    # The CPU backward picks a schedule by shape and thread count; both must agree to the bit.
    def grads(mode):
        monkeypatch.setenv("ATTENTION_EXT_CPU_BACKWARD", mode)
        torch.manual_seed(0)
        q = rand(2, 4, 70, 16, dtype=dtype, requires_grad=True)
        k = rand(2, 2, 130, 16, dtype=dtype, requires_grad=True)
        v = rand(2, 2, 130, 8, dtype=dtype, requires_grad=True)
        out = attention_ext.attention(q, k, v, causal=causal, enable_gqa=True)
        out.backward(torch.randn_like(out))
        return q.grad, k.grad, v.grad

    for a, b in zip(grads("fused"), grads("split")):
        assert torch.equal(a, b)


POISONED_RUN = r"""
import sys, torch, attention_ext
sys.path.insert(0, {tests!r})
from test_determinism import run_all, short_and_decode_calls
results = []
for dtype in (torch.float32, torch.bfloat16, torch.float64):
    results += run_all(dtype, "top_left", mask=True) + short_and_decode_calls(dtype)
torch.save(results, {path!r})
"""


def short_and_decode_calls(dtype):
    """Short tiles (a few queries and keys, 1-row decode with a cache longer than a tile) with
    the score modifiers, forward and backward."""
    torch.manual_seed(2)
    results = []
    for n, m in ((5, 19), (1, 300), (3, 70)):
        q = rand(2, 2, n, 24, dtype=dtype, requires_grad=True)
        k = rand(2, 2, m, 24, dtype=dtype, requires_grad=True)
        v = rand(2, 2, m, 16, dtype=dtype, requires_grad=True)
        out = attention_ext.attention(q, k, v, causal="bottom_right", softcap=20.0,
                                      alibi_slopes=torch.tensor([0.5, 0.25]))
        out.backward(torch.randn_like(out))
        results += [out.detach(), q.grad, k.grad, v.grad]
    return results


def test_scratch_the_kernels_leave_unzeroed_is_never_read_before_it_is_written(tmp_path):
    """With ATTENTION_EXT_POISON_SCRATCH=1 every scratch tile a kernel does not zero starts as NaN
    bytes: if a kernel read one before writing it, the results would differ (the sanitizer job runs
    the whole suite so). Forward and backward, tiled and decode, masks and modifiers, three dtypes."""
    import os
    import subprocess
    import sys
    path = tmp_path / "poisoned.pt"
    script = POISONED_RUN.format(tests=os.path.dirname(__file__), path=str(path))
    env = dict(os.environ, ATTENTION_EXT_POISON_SCRATCH="1")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=600)
    poisoned = torch.load(path)
    clean = []
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        clean += run_all(dtype, "top_left", mask=True) + short_and_decode_calls(dtype)
    assert len(poisoned) == len(clean)
    for a, b in zip(poisoned, clean):
        assert torch.equal(a, b)
