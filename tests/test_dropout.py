"""Dropout: the keep mask's statistics, replay under torch.manual_seed, equality with the float64
reference run with the very mask the call drew (forward and gradients), gradcheck, validation,
and that dropout_p=0 leaves torch's generator untouched."""
from __future__ import annotations

import math

import pytest
import torch

from attention_ext import (
    attention,
    attention_reference,
    draw_rng_state,
    dropout_mask,
    flash_attn_func,
    flash_attn_varlen_func,
    scaled_dot_product_attention,
)

from conftest import rand

B, H, N, M, D, DV = 2, 3, 6, 9, 4, 5


def qkv(dtype=torch.float64, batch=(B, H), n=N, m=M, requires_grad=False):
    return (rand(*batch, n, D, dtype=dtype, requires_grad=requires_grad),
            rand(*batch, m, D, dtype=dtype, requires_grad=requires_grad),
            rand(*batch, m, DV, dtype=dtype, requires_grad=requires_grad))


def drawn_mask(seed, shape, p, device="cpu"):
    """The keep mask a dropout call makes right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return dropout_mask(draw_rng_state(device), shape, p)


def assert_close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.1e}"


# ----------------------------------------------------------------------------------------------
# The keep mask.

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p_within_four_sigma(p):
    shape = (4, 4, 64, 96)
    keep = drawn_mask(123, shape, p)
    assert keep.dtype == torch.bool and keep.shape == shape
    count = keep.numel()
    rate = keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / count)
    assert abs(rate - (1 - p)) <= 4 * sigma, f"keep rate {rate:.5f}, expected {1 - p} +- {4 * sigma:.5f}"
    # Each batch entry on its own is also within bounds (no batch index left without dropout).
    per_batch = keep.flatten(0, 1).flatten(1).double().mean(-1)
    sigma_b = math.sqrt(p * (1 - p) / (64 * 96))
    assert ((per_batch - (1 - p)).abs() <= 5 * sigma_b).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_mask_has_no_row_or_column_structure(p):
    """Rows and columns are not copies of one another and adjacent entries are uncorrelated."""
    keep = drawn_mask(7, (1, 1, 256, 256), p)[0, 0].double()
    x = keep - keep.mean()
    var = (x * x).mean()
    bound = 4 / math.sqrt(keep.numel())
    for shifted, other in ((x[1:, :], x[:-1, :]), (x[:, 1:], x[:, :-1])):
        corr = ((shifted * other).mean() / var).item()
        assert abs(corr) <= bound, f"lag-1 correlation {corr:.4f} > {bound:.4f}"
    assert len({tuple(r.tolist()) for r in keep.bool()}) == 256


def test_batch_entries_and_heads_get_different_masks():
    keep = drawn_mask(0, (2, 3, 16, 16), 0.5).flatten(0, 1)
    for i in range(keep.shape[0]):
        for j in range(i + 1, keep.shape[0]):
            assert not torch.equal(keep[i], keep[j]), f"batch entries {i} and {j} share a mask"


def test_draw_rng_state_replays_under_manual_seed_and_advances_the_generator():
    torch.manual_seed(5)
    a = draw_rng_state()
    b = draw_rng_state()
    torch.manual_seed(5)
    assert torch.equal(draw_rng_state(), a)
    assert a.dtype == torch.int64 and a.shape == (2,)
    assert not torch.equal(a, b)


def test_dropout_mask_is_a_pure_function_of_rng_state_and_position():
    state = torch.tensor([12345, 678], dtype=torch.int64)
    big = dropout_mask(state, (2, 3, 8, 8), 0.3)
    assert torch.equal(big, dropout_mask(state, (2, 3, 8, 8), 0.3))
    other = dropout_mask(torch.tensor([12345, 679], dtype=torch.int64), (2, 3, 8, 8), 0.3)
    assert not torch.equal(big, other)


def test_dropout_mask_rejects_bad_arguments():
    state = draw_rng_state()
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_mask(state, (1, 4, 4), 1.5)
    with pytest.raises(ValueError, match=r"dropout_mask shape must be \(\*batch, n, m\), got \(4,\)"):
        dropout_mask(state, (4,), 0.5)
    with pytest.raises(TypeError, match="rng_state"):
        dropout_mask(state.to(torch.int32), (1, 4, 4), 0.5)


# ----------------------------------------------------------------------------------------------
# The output is the reference run with the drawn mask.

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_output_equals_reference_with_the_drawn_mask(p, dtype):
    q, k, v = qkv(dtype)
    keep = drawn_mask(11, (B, H, N, M), p)
    torch.manual_seed(11)
    out = scaled_dot_product_attention(q, k, v, dropout_p=p)
    expected, _, _ = attention_reference(q, k, v, dropout_mask=keep, dropout_p=p)
    assert_close(out, expected, 1e-10 if dtype == torch.float64 else 5e-5, "output")


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_dropout_with_masks_and_causal_equals_reference(causal):
    p = 0.3
    q, k, v = qkv(torch.float64, n=7, m=5)
    mask = None if causal else (torch.rand(1, H, 7, 5) < 0.7)
    keep = drawn_mask(3, (B, H, 7, 5), p)
    torch.manual_seed(3)
    out, lse = attention(q, k, v, attn_mask=mask, causal=causal, dropout_p=p, return_lse=True)
    expected, expected_lse, _ = attention_reference(q, k, v, mask, causal=causal, dropout_mask=keep, dropout_p=p)
    assert_close(out, expected, 1e-10, "output")
    # lse is that of the scores, before dropout.
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))
    finite = torch.isfinite(lse)
    assert_close(lse[finite], expected_lse[finite], 1e-10, "lse")


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [3, 70], ids=["decode", "tiled"])
def test_lse_is_bitwise_the_same_with_and_without_dropout(cpu_variant, dtype, n):
    # The lse is that of the scores, before dropout: dropout only scales the weights the softmax
    # made, so the row statistics are the same bits whatever dropout_p. (The bf16 forwards once took
    # a more precise exp2 on their dropout path than on the other: the lse differed in its last bit.)
    torch.manual_seed(0)
    q, k, v = (rand(2, 3, n if i == 0 else 150, 64, dtype=dtype) for i in range(3))
    _, lse = attention(q, k, v, return_lse=True)
    _, lse_dropout = attention(q, k, v, dropout_p=0.3, return_lse=True)
    assert torch.equal(lse, lse_dropout)


def test_dropout_mask_batch_index_is_the_broadcast_batch_in_row_major_order():
    """q (B, 1, ...) with k/v (1, H, ...) broadcast to batch (B, H): the mask is (B, H, n, m)."""
    p = 0.4
    q = rand(B, 1, N, D)
    k, v = rand(1, H, M, D), rand(1, H, M, DV)
    keep = drawn_mask(9, (B, H, N, M), p)
    torch.manual_seed(9)
    out = scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert out.shape == (B, H, N, DV)
    assert_close(out, attention_reference(q, k, v, dropout_mask=keep, dropout_p=p)[0], 1e-10, "output")


def test_dropout_with_gqa_uses_the_query_head_order():
    p = 0.4
    hq, hkv = 6, 2
    q = rand(B, hq, N, D)
    k, v = rand(B, hkv, M, D), rand(B, hkv, M, DV)
    keep = drawn_mask(4, (B, hq, N, M), p)
    # The split (kv_heads, groups) keeps the row-major order: the same bits.
    assert torch.equal(keep, drawn_mask(4, (B, hkv, hq // hkv, N, M), p).flatten(1, 2))
    torch.manual_seed(4)
    out = scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=True)
    expected = attention_reference(q, k, v, dropout_mask=keep, dropout_p=p, enable_gqa=True)[0]
    assert_close(out, expected, 1e-10, "output")


def test_dropped_weights_are_zero_and_kept_ones_scaled_by_one_over_keep_probability():
    """With V = identity the output is the weight matrix after dropout."""
    p = 0.5
    q = rand(1, 1, N, D)
    k = rand(1, 1, M, D)
    v = torch.eye(M, dtype=torch.float64).expand(1, 1, M, M)
    keep = drawn_mask(21, (1, 1, N, M), p)
    torch.manual_seed(21)
    out = scaled_dot_product_attention(q, k, v, dropout_p=p)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1)
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))
    assert_close(out[keep], (w / (1 - p))[keep], 1e-12, "kept weights")


def test_dropout_on_fully_masked_rows_still_gives_zeros():
    q, k, v = qkv(requires_grad=True)
    mask = torch.ones(N, M, dtype=torch.bool)
    mask[2] = False
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], torch.randn_like(out))
    assert torch.equal(dq[..., 2, :], torch.zeros_like(dq[..., 2, :]))
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


# ----------------------------------------------------------------------------------------------
# Replay and seeds.

def _run_with_grads(seed, p=0.5):
    torch.manual_seed(0)
    q, k, v = qkv(torch.float32, requires_grad=True)
    mask = torch.randn(1, H, N, M).requires_grad_(True)
    torch.manual_seed(seed)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    grads = torch.autograd.grad(out, [q, k, v, mask], torch.ones_like(out))
    return out, grads


def test_same_seed_replays_output_and_gradients_bitwise():
    out1, g1 = _run_with_grads(42)
    out2, g2 = _run_with_grads(42)
    assert torch.equal(out1, out2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_replay_is_bitwise_across_thread_counts():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out1, g1 = _run_with_grads(42)
        torch.set_num_threads(2)
        out2, g2 = _run_with_grads(42)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out1, out2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_different_seeds_give_different_outputs():
    out1, _ = _run_with_grads(1)
    out2, _ = _run_with_grads(2)
    assert not torch.equal(out1, out2)


def test_consecutive_calls_draw_different_masks():
    q, k, v = qkv()
    torch.manual_seed(0)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Gradients with dropout.

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("p", [0.2, 0.7])
def test_gradients_equal_autograd_through_reference_with_the_drawn_mask(p, dtype):
    q, k, v = qkv(dtype, requires_grad=True)
    mask = rand(B, 1, N, M, dtype=dtype, requires_grad=True)
    keep = drawn_mask(17, (B, H, N, M), p)
    torch.manual_seed(17)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v, mask], grad_out)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mask)]
    ref, _, _ = attention_reference(*leaves, dropout_mask=keep, dropout_p=p)
    expected = torch.autograd.grad(ref, leaves, grad_out.double())
    atol = 1e-10 if dtype == torch.float64 else 2e-4
    for name, g, e in zip("qkvm", grads, expected):
        assert_close(g, e, atol, f"d{name}")
    assert grads[3].shape == mask.shape


def _reseeded(fn, seed=0):
    def wrapped(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return wrapped


def test_gradcheck_with_dropout_reseeded_each_call():
    q = rand(1, 2, 3, 2, requires_grad=True)
    k = rand(1, 2, 4, 2, requires_grad=True)
    v = rand(1, 2, 4, 2, requires_grad=True)
    mask = rand(2, 1, 4, requires_grad=True)
    fn = _reseeded(lambda q, k, v, m: scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.4))
    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


def test_gradcheck_with_dropout_and_lse():
    q = rand(1, 3, 2, requires_grad=True)
    k = rand(1, 4, 2, requires_grad=True)
    v = rand(1, 4, 2, requires_grad=True)
    fn = _reseeded(lambda q, k, v: attention(q, k, v, causal="bottom_right", dropout_p=0.5, return_lse=True))
    assert torch.autograd.gradcheck(fn, (q, k, v))


# ----------------------------------------------------------------------------------------------
# Validation and dropout_p = 0.

@pytest.mark.parametrize("p", [-0.1, 1.0000001, 1.5, float("nan"), float("inf")])
def test_dropout_p_outside_zero_one_raises_value_error(p):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=p)
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, k, v, dropout_p=p)


def test_dropout_p_one_drops_every_weight_zeros_and_zero_gradients_as_torch():
    """torch drops every weight at dropout_p = 1: the output and every gradient are zeros."""
    q, k, v = qkv(requires_grad=True)
    mask = torch.randn(q.shape[-2], k.shape[-2], dtype=q.dtype, requires_grad=True)
    for p in (1.0, 1):
        for call in (lambda: scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p),
                     lambda: attention(q, k, v, attn_mask=mask, causal="bottom_right", dropout_p=p)):
            out = call()
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=1.0)
            assert torch.equal(out, torch.zeros_like(out)) and torch.equal(out, expected)
            grads = torch.autograd.grad(out, (q, k, v, mask), torch.randn_like(out))
            assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    # FlashAttention's functions too, dense and packed
    qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))  # (B, length, H, d)
    out = flash_attn_func(qf, kf, vf, dropout_p=1.0, causal=True)
    assert torch.equal(out, torch.zeros_like(out))
    cu_q = torch.arange(0, B * N + 1, N, dtype=torch.int32)
    cu_k = torch.arange(0, B * M + 1, M, dtype=torch.int32)
    out = flash_attn_varlen_func(qf.flatten(0, 1), kf.flatten(0, 1), vf.flatten(0, 1), cu_q, cu_k, N, M, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    # the lse does not depend on dropout; nothing survives in the keep mask
    _, lse = attention(q, k, v, dropout_p=1.0, return_lse=True)
    assert torch.equal(lse, attention(q, k, v, return_lse=True)[1])
    assert not dropout_mask(draw_rng_state(), (2, 4, 4), 1.0).any()


def test_dropout_p_of_a_wrong_type_raises_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p="0.1")


@pytest.mark.parametrize("p", [0.0, 0])
def test_dropout_p_zero_draws_no_random_numbers_and_equals_no_dropout(p):
    q, k, v = qkv(requires_grad=True)
    state = torch.get_rng_state()
    out = scaled_dot_product_attention(q, k, v, dropout_p=p)
    out.sum().backward()
    out2 = attention(q, k, v, dropout_p=p)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(out, out2)
    assert torch.equal(out, attention(q, k, v))


def test_dropout_call_advances_the_generator_exactly_like_draw_rng_state():
    q, k, v = qkv()
    torch.manual_seed(8)
    scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    after_call = torch.get_rng_state()
    torch.manual_seed(8)
    draw_rng_state()
    assert torch.equal(torch.get_rng_state(), after_call)
