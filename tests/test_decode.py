"""The decode forward: calls with at most 8 query rows take a kernel that reads K and V rows in
place and, when there are few (batch, head) pairs, splits the keys into ranges merged by their
log-sum-exp. It must agree with the reference and with the tiled forward in every semantic
corner (masks, causal alignments, dropout, fully masked rows and ranges, dtypes, strides,
gradients), and be bitwise independent of the thread count."""
from __future__ import annotations

import pytest
import torch

import attention_ext
from attention_ext import attention, draw_rng_state, dropout_mask, scaled_dot_product_attention
from attention_ext.reference import attention_reference

from conftest import (ATOL, amx_tiles, assert_close_to_reference, bf16_decode_on_pairs, low_precision_budget,
                      on_thread_counts, rand)

# One (batch, head) pair and 5000 keys: split into 9 ranges of 576 keys (the last one shorter).
# The decode path is the CPU kernels' own (the CUDA kernels have one forward for every n).
pytestmark = pytest.mark.cpu_kernels

SPLIT = dict(batch=(1, 1), m=5000)
# 64 pairs: one range each.
UNSPLIT = dict(batch=(4, 16), m=300)


def qkv(batch, n, m, dk=64, dv=64, dtype=torch.float64, requires_grad=False):
    return (rand(*batch, n, dk, dtype=dtype, requires_grad=requires_grad),
            rand(*batch, m, dk, dtype=dtype, requires_grad=requires_grad),
            rand(*batch, m, dv, dtype=dtype, requires_grad=requires_grad))


def tiled(monkeypatch, fn):
    """fn() computed by the tiled forward instead of the decode one."""
    with monkeypatch.context() as mp:
        mp.setenv("ATTENTION_EXT_CPU_FORWARD", "tiled")
        return fn()


@pytest.mark.parametrize("layout", [SPLIT, UNSPLIT], ids=["split_keys", "one_range"])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_decode_equals_reference(cpu_variant, layout, n, causal):
    q, k, v = qkv(layout["batch"], n, layout["m"])
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse, _ = attention_reference(q, k, v, causal=causal)
    assert_close_to_reference(out, ref, torch.float64)
    assert_close_to_reference(lse, ref_lse, torch.float64, what="lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", [SPLIT, UNSPLIT], ids=["split_keys", "one_range"])
@pytest.mark.parametrize("n", [1, 2])  # 1 reads fp16/bf16 K rows in place, 2 converts a K tile
def test_decode_low_precision_within_torch_error(cpu_variant, dtype, layout, n):
    q, k, v = qkv(layout["batch"], n, layout["m"], dtype=dtype)
    out = scaled_dot_product_attention(q, k, v)
    ref = attention_reference(q, k, v)[0]
    budget = low_precision_budget(((q, k, v), {}), dtype, ref)
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, dtype, budget=budget)


@pytest.mark.parametrize("dk,dv", [(1, 1), (5, 3), (64, 16), (130, 72)])
def test_decode_any_head_dims_and_strided_inputs(dk, dv):
    # Transposed storage (non-unit column stride) and head dims that are not a multiple of the
    # vector width take the converting path; the rest are read in place.
    q = rand(1, 2, dk, 3).transpose(-1, -2)
    k = rand(1, 2, dk, 1500).transpose(-1, -2)
    v = rand(1, 2, 1500, dv)
    out = scaled_dot_product_attention(q, k, v)
    assert_close_to_reference(out, attention_reference(q, k, v)[0], torch.float64)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64], ids=["bool", "float"])
def test_decode_with_broadcast_mask_and_empty_ranges(mask_dtype):
    # Only keys in the last range are visible to row 0: every other range of that row is empty
    # and must drop out of the merge; row 1 sees no key at all.
    q, k, v = qkv((1, 2), 2, SPLIT["m"])
    visible = torch.zeros(1, 1, 2, SPLIT["m"], dtype=torch.bool)
    visible[..., 0, 4900:] = True
    mask = visible if mask_dtype == torch.bool else torch.zeros(visible.shape, dtype=torch.float64).masked_fill(
        ~visible, float("-inf"))
    out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
    ref, ref_lse, _ = attention_reference(q, k, v, mask)
    assert torch.all(out[..., 1, :] == 0) and torch.all(torch.isneginf(lse[..., 1]))
    assert_close_to_reference(out, ref, torch.float64)
    assert_close_to_reference(lse[..., 0], ref_lse[..., 0], torch.float64, what="lse")


def test_decode_huge_bias_ranges_merge_without_overflow():
    # Ranges whose maxima differ by ~1e4 in log2 units: merging must rescale, not overflow.
    q, k, v = qkv((1, 1), 1, SPLIT["m"])
    bias = torch.zeros(1, 1, 1, SPLIT["m"], dtype=torch.float64)
    bias[..., :600] = 1e4
    out = attention(q, k, v, attn_mask=bias)
    assert torch.isfinite(out).all()
    assert_close_to_reference(out, attention_reference(q, k, v, bias)[0], torch.float64)


@pytest.mark.parametrize("layout", [SPLIT, UNSPLIT], ids=["split_keys", "one_range"])
def test_decode_dropout_equals_reference_with_drawn_mask(layout):
    p = 0.25
    q, k, v = qkv(layout["batch"], 3, layout["m"])
    torch.manual_seed(5)
    keep = dropout_mask(draw_rng_state(), (*layout["batch"], 3, layout["m"]), p)
    torch.manual_seed(5)
    out = scaled_dot_product_attention(q, k, v, dropout_p=p)
    ref = attention_reference(q, k, v, dropout_mask=keep, dropout_p=p)[0]
    assert_close_to_reference(out, ref, torch.float64)


@pytest.mark.parametrize("layout", [SPLIT, UNSPLIT], ids=["split_keys", "one_range"])
def test_decode_agrees_with_tiled_forward(monkeypatch, layout):
    q, k, v = qkv(layout["batch"], 4, layout["m"], dtype=torch.float32)
    mask = torch.rand(1, 1, 4, layout["m"]) < 0.9
    out, lse = attention(q, k, v, attn_mask=mask, causal="bottom_right", return_lse=True)
    out_t, lse_t = tiled(monkeypatch, lambda: attention(q, k, v, attn_mask=mask, causal="bottom_right",
                                                        return_lse=True))
    torch.testing.assert_close(out, out_t, atol=ATOL[torch.float32], rtol=0)
    torch.testing.assert_close(lse, lse_t, atol=ATOL[torch.float32], rtol=0)


def test_decode_gradients_gradcheck():
    q, k, v = qkv((1, 1), 2, 1100, dk=4, dv=3, requires_grad=True)  # 3 ranges
    mask = rand(1, 1, 2, 1100, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, mask: attention(q, k, v, attn_mask=mask, causal="bottom_right"), (q, k, v, mask))


def test_decode_is_bitwise_independent_of_thread_count():
    q, k, v = qkv(SPLIT["batch"], 1, SPLIT["m"], dtype=torch.float32)
    results = on_thread_counts(lambda: attention(q, k, v, return_lse=True))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_decode_no_keys_and_no_value_columns():
    q = rand(2, 1, 8)
    out, lse = attention(q, rand(2, 0, 8), rand(2, 0, 5), return_lse=True)
    assert out.shape == (2, 1, 5) and torch.all(out == 0) and torch.all(torch.isneginf(lse))
    out = scaled_dot_product_attention(q, rand(2, 700, 8), rand(2, 700, 0))
    assert out.shape == (2, 1, 0)


# GQA: the query heads sharing a K/V head are the rows of one decode item (up to 32 rows: heads × n),
# so each K/V row is read once for all of them; K/V heads stored interleaved (tokens major) are
# walked together, key tile by key tile. Every per-head part of the logits (ALiBi slopes,
# masks, sinks, dropout draws) must still be the head's own. (8, 2, 5): 4 heads of a group per item;
# (12, 2, 7): 3; (4, 1, 8): the whole group, 32 rows.
GQA_DECODE = [(8, 2, 1), (8, 2, 3), (16, 2, 5), (12, 2, 7), (4, 1, 8)]


def heads_then_tokens(batch, heads, rows, d, generator, tokens_major):
    """(batch, heads, rows, d), stored as such or (tokens_major) as a (batch, rows, heads, d)
    tensor, FlashAttention's and a KV cache's layout, whose K/V heads the kernel walks in lockstep."""
    if tokens_major:
        return torch.randn(batch, rows, heads, d, dtype=torch.float64, generator=generator).transpose(1, 2)
    return torch.randn(batch, heads, rows, d, dtype=torch.float64, generator=generator)


@pytest.mark.parametrize("hq,hkv,n", GQA_DECODE, ids=[f"{a}q{b}kv_n{c}" for a, b, c in GQA_DECODE])
@pytest.mark.parametrize("m", [1500, 200], ids=["split_keys", "one_range"])
@pytest.mark.parametrize("tokens_major", [False, True], ids=["heads_major", "tokens_major"])
def test_decode_gqa_heads_keep_their_own_modifiers_and_masks(cpu_variant, hq, hkv, n, m, tokens_major):
    g = torch.Generator().manual_seed(hq * 100 + n)
    q = heads_then_tokens(2, hq, n, 32, g, tokens_major)
    k, v = (heads_then_tokens(2, hkv, m, 32, g, tokens_major) for _ in range(2))
    mask = torch.rand(1, hq, n, m, generator=g) < 0.9
    options = dict(causal="bottom_right", window=(m // 2, 0), softcap=30.0,
                   alibi_slopes=torch.rand(hq, dtype=torch.float32, generator=g) / 8,
                   sinks=torch.randn(hq, dtype=torch.float64, generator=g))
    out, lse = attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True, **options)
    ref, ref_lse, _ = attention_reference(q, k, v, mask, enable_gqa=True, **options)
    assert_close_to_reference(out, ref, torch.float64)
    assert_close_to_reference(lse, ref_lse, torch.float64, what="lse")


@pytest.mark.parametrize("hq,hkv,n", [(8, 2, 1), (16, 2, 5), (6, 6, 2)], ids=["8q2kv_n1", "16q2kv_n5", "6q6kv_n2"])
@pytest.mark.parametrize("tokens_major", [False, True], ids=["heads_major", "tokens_major"])
def test_decode_gqa_dropout_draws_are_each_heads_own(hq, hkv, n, tokens_major):
    p, m = 0.25, 1500
    g = torch.Generator().manual_seed(3)
    q = heads_then_tokens(1, hq, n, 16, g, tokens_major)
    k, v = (heads_then_tokens(1, hkv, m, 16, g, tokens_major) for _ in range(2))
    torch.manual_seed(7)
    keep = dropout_mask(draw_rng_state(), (1, hq, n, m), p)
    torch.manual_seed(7)
    out = scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=True)
    ref = attention_reference(q, k, v, dropout_mask=keep, dropout_p=p, enable_gqa=True)[0]
    assert_close_to_reference(out, ref, torch.float64)


@pytest.mark.parametrize("n", [1, 4])
def test_decode_gqa_low_precision_and_thread_count(n):
    g = torch.Generator().manual_seed(n)
    q = heads_then_tokens(1, 8, n, 64, g, True).to(torch.bfloat16)
    k, v = (heads_then_tokens(1, 2, 3000, 64, g, True).to(torch.bfloat16) for _ in range(2))
    ref = attention_reference(q, k, v, enable_gqa=True)[0]
    results = on_thread_counts(lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True))
    assert all(torch.equal(r, results[0]) for r in results[1:])
    budget = low_precision_budget(((q, k, v), {"enable_gqa": True}), torch.bfloat16, ref)
    assert_close_to_reference(results[0], ref, torch.bfloat16, budget=budget)


def four_rows_interleaved(dtype):
    """Whether the active variant's fp32 decode takes a K/V head's rows four at a time in an order
    of its own (interleaved; csrc/cpu/decode_products.inc's kInterleavedRows): on 64-byte vectors,
    16 fp32 lanes, as build_info() reports the variant's width."""
    return attention_ext.build_info()["cpu_vector_bytes"] == "64" and dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("groups", [4, 3, 2])  # four rows share each key vector; two, three: row by row
@pytest.mark.parametrize("m", [70, 200])  # whole vectors of keys and a few more; one key range
def test_decode_a_head_alone_or_in_its_gqa_group_is_bitwise_the_same(cpu_variant, dtype, groups, m):
    """Each logit is one dot product summed in one fixed order, whichever other query rows share
    the call (one row, or a GQA group's two to four: fp16/bf16 K read in place for four, packed
    for two and three; V in place through the GEMM). (Where its key falls in the tile:
    test_kv_cache's paged-against-contiguous test.) Not for fp32 groups of four or more on
    16-lane vectors, which take their own order (the next test), nor for bf16 groups whose
    products run on pairs of bf16 (test_decode_bf16_rows_on_dot_products_... and
    test_decode_bf16_groups_on_tiles_...)."""
    if groups >= 4 and four_rows_interleaved(dtype):
        pytest.skip("fp32 groups of four on 16-lane vectors: test_decode_fp32_rows_four_at_a_time_...")
    if dtype == torch.bfloat16 and bf16_decode_on_pairs(cpu_variant, groups, 64, 64):
        pytest.skip("bf16 products on pairs: test_decode_bf16_rows_on_dot_products_give_each_row_one_order")
    g = torch.Generator().manual_seed(m)
    q = torch.randn(1, groups, 1, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 1, m, 64, generator=g).to(dtype) for _ in range(2))
    grouped, grouped_lse = attention(q, k, v, enable_gqa=True, return_lse=True)
    for h in range(groups):
        alone, alone_lse = attention(q[:, h:h + 1], k, v, return_lse=True)
        assert torch.equal(alone, grouped[:, h:h + 1]) and torch.equal(alone_lse, grouped_lse[:, h:h + 1]), h


def group_parts_and_heads_alone(q, k, v, parts, rows_of_one_head=4):
    """The GQA call of all of q's heads against one K/V head, and its heads one call each, after
    checking that each part (size, first) of its heads called alone, and its first
    rows_of_one_head heads as that many query rows of one head (the same logits), give those
    heads' bits and lse."""
    whole, whole_lse = attention(q, k, v, enable_gqa=True, return_lse=True)
    for size, first in parts:
        part, part_lse = attention(q[:, first:first + size], k, v, enable_gqa=True, return_lse=True)
        assert torch.equal(part, whole[:, first:first + size]), (size, first)
        assert torch.equal(part_lse, whole_lse[:, first:first + size]), (size, first)
    r = rows_of_one_head
    rows, rows_lse = attention(q[:, :r].transpose(1, 2), k, v, return_lse=True)
    assert torch.equal(rows, whole[:, :r].transpose(1, 2)) and torch.equal(rows_lse, whole_lse[:, :r].transpose(1, 2))
    return whole, torch.cat([attention(q[:, h:h + 1], k, v) for h in range(q.shape[1])], 1)


@pytest.mark.parametrize("m", [70, 203])  # whole vectors of keys, then single keys; one key range
def test_decode_fp32_rows_four_at_a_time_give_each_row_one_order(cpu_variant, m):
    """fp32 on 16-lane vectors: a K/V head with four or more query rows (a GQA group, several
    rows of one head, or both) sums each logit as four partial sums over d mod 4, in d order,
    added pairwise, with no horizontal sums (dot_four_rows_interleaved). Up to four groups of
    four rows share each key's loads over whole chunks of 16 keys (dot_rows_interleaved: 8 rows
    make two groups, 9 three with a short last one, 13 four), each row keeping its chain. A row's
    bits are then the same in a group of 4 to 16 rows and whatever its place in the group (a
    short last group is padded with zero rows), and close to the one-row order's. Fewer
    rows (1 to 3) keep the one-row order: the test above. (Several K/V heads walked together,
    with rows padded to four: test_decode_interleaved_heads_..., 6q2kv_n3; a key in a block of
    eight or taken alone: test_kv_cache's paged-against-contiguous test.)"""
    g = torch.Generator().manual_seed(m)
    q = torch.randn(1, 16, 1, 64, generator=g)
    k, v = (torch.randn(1, 1, m, 64, generator=g) for _ in range(2))
    parts = [(4, 0), (4, 4), (5, 3), (6, 2), (8, 8), (9, 2), (12, 4), (13, 3)]
    sixteen, alone = group_parts_and_heads_alone(q, k, v, parts, rows_of_one_head=8)
    if four_rows_interleaved(torch.float32):
        assert not torch.equal(alone, sixteen), "the four-row order gave the one-row order's bits"
    else:
        assert torch.equal(alone, sixteen)
    ref = attention_reference(q.double(), k.double(), v.double(), enable_gqa=True)[0]
    assert_close_to_reference(sixteen, ref, torch.float32)
    assert_close_to_reference(alone, ref, torch.float32)


@pytest.mark.parametrize("m", [70, 203])  # whole chunks of keys, then a short one ending in single keys
def test_decode_bf16_rows_on_dot_products_give_each_row_one_order(cpu_variant, m):
    """bf16 in the avx512bf16 variant, two or more query rows per K/V head other than exactly four: the products run as
    AVX512-BF16 dot products (csrc/cpu/decode_bf16_dot.inc). Each logit is four partial sums of
    pairs over d, added pairwise, whatever the other rows; P is rounded to bf16 and each O element
    summed over pairs of consecutive keys in order. A row's bits are then the same in a group of
    2 to 16 rows other than four, wherever it sits in the group, and as rows of one head; one row
    alone takes the vector code, and so does a group of exactly four, except where 512-bit operations
    run as two halves (Zen 4), where it takes the dot products too. (Up to four groups of four rows share
    each key's loads: 9 rows make three groups, 13 four with a short last one.) Both within the
    bf16 budget of the float64 reference."""
    if not bf16_decode_on_pairs(cpu_variant, 2, 64, 64):
        pytest.skip("bf16 decode on dot products: the avx512bf16 variant only")
    g = torch.Generator().manual_seed(m)
    q = torch.randn(1, 16, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 1, m, 64, generator=g).bfloat16() for _ in range(2))
    parts = [(2, 0), (2, 5), (3, 1), (5, 3), (7, 0), (8, 8), (9, 2), (12, 4), (13, 3)]
    whole, alone = group_parts_and_heads_alone(q, k, v, parts, rows_of_one_head=8)
    assert not torch.equal(alone, whole), "the dot products gave the vector code's bits"
    four = attention(q[:, 4:8], k, v, enable_gqa=True)
    if bf16_decode_on_pairs(cpu_variant, 4, 64, 64):  # (where 512-bit operations run as two halves)
        assert torch.equal(four, whole[:, 4:8]), "a group of four did not take the dot products"
    else:
        assert not torch.equal(four, whole[:, 4:8]), "a group of four took the dot products"
    ref = attention_reference(q.double(), k.double(), v.double(), enable_gqa=True)[0]
    budget = low_precision_budget(((q, k, v), dict(enable_gqa=True)), torch.bfloat16, ref)
    assert_close_to_reference(whole, ref, torch.bfloat16, budget=budget)
    assert_close_to_reference(alone, ref, torch.bfloat16, budget=budget)


STORAGE_ORDER = [(2, 2, 1), (8, 2, 1), (4, 2, 2), (4, 4, 4), (2, 2, 3), (8, 2, 2), (6, 2, 3), (16, 2, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hq,hkv,n", STORAGE_ORDER, ids=[f"{a}q{b}kv_n{c}" for a, b, c in STORAGE_ORDER])
def test_decode_interleaved_heads_give_the_same_bits_as_heads_stored_apart(cpu_variant, dtype, hq, hkv, n):
    """K/V heads stored interleaved ((batch, tokens, heads, d), a KV cache's layout) are read a
    key's rows of every head at a time and copied head by head before the arithmetic; every sum
    is the one of heads stored apart, so the bits are too when the keys are split into the same
    ranges (16q2kv_n2: 16 rows per K/V head, four groups of four on bf16 dot products sharing
    each key's loads). (64 batch entries: one key range per head either way; 203 keys: three whole tiles and
    a short one, whose last chunk of 11 keys ends with keys taken one by one. bf16/fp16 rows are
    copied as they are, or converted: K for three rows, V for more than four, both for nine.)"""
    g = torch.Generator().manual_seed(hq * 10 + n)
    q = heads_then_tokens(64, hq, n, 64, g, True).to(dtype)
    k, v = (heads_then_tokens(64, hkv, 203, 64, g, True).to(dtype) for _ in range(2))
    interleaved, interleaved_lse = attention(q, k, v, enable_gqa=True, return_lse=True)
    apart, apart_lse = attention(q, k.contiguous(), v.contiguous(), enable_gqa=True, return_lse=True)
    assert torch.equal(interleaved, apart) and torch.equal(interleaved_lse, apart_lse)


# bf16 calls with 8 to 32 rows per K/V head (heads x n) take the products on AMX tiles in the amx
# variant (csrc/cpu/decode_bf16_amx.inc): Sᵀ = K Qᵀ per chunk of 16 keys, O += P V per 32; from 2
# rows, except exactly four, on AVX512-BF16 dot products in the avx512bf16 variant
# (decode_bf16_dot.inc), four rows per vector.
# Rows: 2, 3, 5 (a short last group of four), 8, 16 (one block of tile rows), 20 and 32
# (two); keys: whole chunks, a short last chunk (203, 70) and several key ranges merged (3000);
# dv != dk, dk = 8 (two steps of four pairs).
TILE_DECODE = [(8, 1, 1, 64, 64, 203), (16, 4, 4, 64, 64, 70), (20, 1, 1, 64, 64, 100), (32, 1, 1, 128, 128, 3000),
               (8, 1, 2, 64, 128, 203), (12, 4, 3, 32, 32, 130), (2, 1, 1, 64, 64, 203), (6, 2, 1, 8, 32, 77),
               (5, 1, 1, 128, 96, 130), (2, 2, 1, 64, 64, 3000)]


@pytest.mark.parametrize("hq,hkv,n,dk,dv,m", TILE_DECODE, ids=[f"{a}q{b}kv_n{c}_d{d}x{e}_m{f}" for a, b, c, d, e, f in TILE_DECODE])
@pytest.mark.parametrize("tokens_major", [False, True], ids=["heads_major", "tokens_major"])
def test_decode_bf16_groups_on_tiles_match_the_reference(cpu_variant, hq, hkv, n, dk, dv, m, tokens_major):
    """Each head keeps its own masks and modifiers (applied to the score tile's rows after the
    tile product), and the result is within the bf16 budget whatever the variant."""
    g = torch.Generator().manual_seed(hq + n + m)
    q = heads_then_tokens(1, hq, n, dk, g, tokens_major).to(torch.bfloat16)
    k = heads_then_tokens(1, hkv, m, dk, g, tokens_major).to(torch.bfloat16)
    v = heads_then_tokens(1, hkv, m, dv, g, tokens_major).to(torch.bfloat16)
    for options in ({}, dict(causal="bottom_right", window=(m // 2, 0), softcap=30.0,
                             alibi_slopes=torch.rand(hq, dtype=torch.float32, generator=g) / 8)):
        out, lse = attention(q, k, v, enable_gqa=True, return_lse=True, **options)
        ref, ref_lse, _ = attention_reference(q, k, v, enable_gqa=True, **options)
        budget = low_precision_budget(((q, k, v), dict(enable_gqa=True, **options)), torch.bfloat16, ref)
        assert_close_to_reference(out, ref, torch.bfloat16, budget=budget)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
    results = on_thread_counts(lambda: attention(q, k, v, enable_gqa=True, return_lse=True))
    assert all(torch.equal(a, results[0][0]) and torch.equal(b, results[0][1]) for a, b in results[1:])


def test_decode_bf16_group_on_tiles_draws_dropout_by_position(cpu_variant):
    p, m = 0.25, 300
    g = torch.Generator().manual_seed(5)
    q = heads_then_tokens(1, 16, 1, 64, g, True).to(torch.bfloat16)
    k, v = (heads_then_tokens(1, 2, m, 64, g, True).to(torch.bfloat16) for _ in range(2))
    torch.manual_seed(11)
    keep = dropout_mask(draw_rng_state(), (1, 16, 1, m), p)
    torch.manual_seed(11)
    out = scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=True)
    ref = attention_reference(q, k, v, dropout_mask=keep, dropout_p=p, enable_gqa=True)[0]
    budget = low_precision_budget(((q, k, v), dict(dropout_mask=keep, dropout_p=p, enable_gqa=True)),
                                  torch.bfloat16, ref)
    assert_close_to_reference(out, ref, torch.bfloat16, budget=budget)


def test_decode_bf16_on_tiles_counts_subnormal_values_as_zero(cpu_variant):
    """One key, so each output is 1 x v: exact on vector units; the products on pairs (amx
    variant, 8 or more rows; avx512bf16, 2 or more but not 4) treat subnormal bf16 inputs as zero, as every
    AMX/AVX512-BF16 product does."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16)
    finite = torch.isfinite(values)
    v = values[finite][:8192].reshape(1, 1, 1, -1)
    q = torch.ones(1, 8, 1, 32, dtype=torch.bfloat16)
    k = torch.ones(1, 1, 1, 32, dtype=torch.bfloat16)
    out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    subnormal = (v != 0) & (v.float().abs() < torch.finfo(torch.bfloat16).tiny)
    assert subnormal.any()
    want = torch.where(subnormal, torch.zeros_like(v), v) if bf16_decode_on_pairs(cpu_variant, 8, 32, v.shape[-1]) else v
    for h in range(8):
        assert torch.equal(out[0, h].float(), want[0, 0].float()), (cpu_variant, h)  # (-0 == +0)


@pytest.mark.parametrize("rows, tail", [(1, 0), (1, 5), (2, 0), (2, 5), (8, 0)],
                         ids=["in_place", "one_row_packed", "several_rows_in_place", "several_rows_tail",
                              "many_rows_packed"])
def test_decode_reads_every_bf16_value_exactly(cpu_variant, rows, tail):
    """V rows of bf16 are widened to fp32 as they are read: in place with whole vectors (dv =
    65536) by one query row, or by up to four through the GEMM's register block; converted into a
    tile otherwise (a partial last vector: dv = 65541; or more rows than one register block). With
    one key each output is 1 x v, so every one of the 65536 bit patterns, infinities and NaNs
    included, must come back unchanged (-0 comes back +0: the sum starts from +0), but for the
    subnormals where the products run on pairs of bf16 (avx512bf16, two rows and whole vectors),
    which count them as zero."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = torch.cat([bits, bits[:tail]]).view(torch.bfloat16)
    v = values.reshape(1, 1, 1, -1)
    q = torch.ones(1, 1, rows, 8, dtype=torch.bfloat16)
    k = torch.ones(1, 1, 1, 8, dtype=torch.bfloat16)
    out = scaled_dot_product_attention(q, k, v)
    nan = torch.isnan(values)
    want = values
    if bf16_decode_on_pairs(cpu_variant, rows, 8, v.shape[-1]):
        subnormal = (values != 0) & (values.float().abs() < torch.finfo(torch.bfloat16).tiny)
        want = torch.where(subnormal, torch.zeros_like(values), values)
    for r in range(rows):
        got = out[0, 0, r]
        assert torch.equal(torch.isnan(got), nan), cpu_variant
        assert torch.equal(got[~nan].float(), want[~nan].float()), cpu_variant  # (-0 == +0)


def test_the_decode_prefetches_are_in_the_compiled_ops():
    """The decode asks for K/V lines ahead of its products (into L1 per head in storage order, into
    L2 rows ahead where an item walks one K/V head; csrc/cpu/forward_decode.inc). No result shows
    a prefetch, and GCC 12 once deleted every one of them (loops of bare __builtin_prefetch calls)
    without a warning: the disassembly of the built ops must hold both kinds."""
    import platform
    import shutil
    import subprocess
    from attention_ext import _ops
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None:
        pytest.skip("needs an x86-64 build and objdump")
    if not _ops._LOADED_FROM.startswith("prebuilt:"):
        pytest.skip("a JIT build: its library is not the prebuilt one")
    path = _ops._LOADED_FROM.split(":", 1)[1]
    result = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    listing = result.stdout
    assert "prefetcht0" in listing, "the L1 prefetches of the decode were compiled away"
    assert "prefetcht2" in listing, "the L2 prefetches of the decode were compiled away"
