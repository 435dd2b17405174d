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
