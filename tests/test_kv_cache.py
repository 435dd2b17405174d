"""flash_attn_with_kvcache: inference against a key/value cache, contiguous or paged.

The reference keeps its own copy of the cache as plain (batch, length, kv_heads, d) tensors,
appends the new keys there itself, rotates with complex multiplication (an independent form of the
rotary formula) and runs each batch entry through the float64 reference. The cache the call wrote
in place must equal the reference's copy, and every slot outside the written positions must be
bitwise untouched. On the CUDA emulation build the same tests run the CUDA kernels.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import attention_ext
from attention_ext import flash_attn_with_kvcache
from attention_ext.reference import attention_reference

from conftest import CUDA_KERNELS_DEVICE, FLOAT_DTYPES, assert_close_to_reference

ops = torch.ops.attention_ext


def rotary_tables(positions, rotary_dim, dtype=torch.float32):
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(positions, dtype=torch.float64).unsqueeze(-1) * inv
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_reference(x, cos, sin, positions, interleaved):
    """x (rows, heads, d) float64 rotated at positions (rows,) by complex multiplication."""
    half = cos.shape[1]
    part = x[..., :2 * half]
    if interleaved:
        pairs = part.reshape(*part.shape[:-1], half, 2)
    else:
        pairs = torch.stack((part[..., :half], part[..., half:]), dim=-1)
    z = torch.view_as_complex(pairs.contiguous())
    w = torch.complex(cos[positions].double(), sin[positions].double())
    r = torch.view_as_real(z * w.unsqueeze(1))
    rotated = r.flatten(-2) if interleaved else torch.cat((r[..., 0], r[..., 1]), dim=-1)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


class Cache:
    """A (batch, length, kv_heads, d) cache, and the same content paged into shuffled blocks."""

    def __init__(self, rows, length, kv_heads, d, dtype, block_size=None, generator=None):
        self.k = torch.randn(rows, length, kv_heads, d, generator=generator, dtype=torch.float64).to(dtype)
        self.v = torch.randn(rows, length, kv_heads, d, generator=generator, dtype=torch.float64).to(dtype)
        self.block_size = block_size
        if block_size is not None:
            per_row = -(-length // block_size)
            blocks = rows * per_row + 3  # spare blocks no entry uses
            order = torch.randperm(blocks, generator=generator)
            self.table = order[:rows * per_row].view(rows, per_row).to(torch.int32)
            self.k_paged = torch.randn(blocks, block_size, kv_heads, d, generator=generator).to(dtype)
            self.v_paged = torch.randn(blocks, block_size, kv_heads, d, generator=generator).to(dtype)
            for r in range(rows):
                for i in range(per_row):
                    span = slice(i * block_size, min(length, (i + 1) * block_size))
                    self.k_paged[self.table[r, i], :span.stop - span.start] = self.k[r, span]
                    self.v_paged[self.table[r, i], :span.stop - span.start] = self.v[r, span]

    def tensors(self):
        if self.block_size is None:
            return self.k, self.v, {}
        return self.k_paged, self.v_paged, {"block_table": self.table}

    def logical(self, which):
        """The cache as (rows, length, kv_heads, d), read back from whatever the call wrote."""
        if self.block_size is None:
            return self.k if which == "k" else self.v
        paged = self.k_paged if which == "k" else self.v_paged
        rows, per_row = self.table.shape
        return paged[self.table.long()].reshape(rows, per_row * self.block_size, *paged.shape[2:])[:, :self.k.shape[1]]


def reference_call(q, cache_k, cache_v, k_new, v_new, lengths, rows, leftpad, causal=False, window=(-1, -1),
                   softcap=0.0, alibi_slopes=None, rotary=None, interleaved=True):
    """The reference: append into float64 copies, rotate, attend per batch entry."""
    dtype = q.dtype
    cache_k, cache_v = cache_k.double().clone(), cache_v.double().clone()
    q = q.double()
    outs, lses = [], []
    new = 0 if k_new is None else k_new.shape[1]
    # FlashAttention rotates q row by row for a causal or windowed call, a window side as long as
    # the cache counting as none
    local = causal or any(0 <= side < cache_k.shape[1] for side in window)
    for b in range(q.shape[0]):
        row, start, pad = rows[b], lengths[b], leftpad[b]
        qb = q[b]
        if k_new is not None:
            kb = k_new[b].double()
            if rotary is not None:
                cos, sin = rotary
                # rotated values are stored in the inputs' dtype, as the call stores them
                # positions are cache indices (FlashAttention's test rotates at cache_seqlens,
                # whatever the left padding)
                kb = rotate_reference(kb, cos, sin, torch.arange(new) + start, interleaved)
                kb = kb.to(k_new.dtype).double()
                q_pos = torch.arange(q.shape[1]) + start if local else torch.full((q.shape[1],), start)
                qb = rotate_reference(qb, cos, sin, q_pos, interleaved).to(dtype).double()
            cache_k[row, start:start + new] = kb
            cache_v[row, start:start + new] = v_new[b].double()
        keys = cache_k[row, pad:start + new].transpose(0, 1)
        values = cache_v[row, pad:start + new].transpose(0, 1)
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        w = (window[0], 0) if causal else window
        o, lse, _ = attention_reference(qb.transpose(0, 1), keys, values, enable_gqa=True,
                                        window=tuple(None if x == -1 else x for x in w), softcap=softcap,
                                        alibi_slopes=slopes)
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), cache_k, cache_v


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(6, -1)),
    "window_both": dict(window=(5, 2)),
    "softcap_alibi": dict(causal=True, softcap=20.0, alibi="per_head"),
    "alibi_per_entry": dict(alibi="per_entry"),
    "rotary": dict(causal=True, rotary=True),
    "rotary_halves_noncausal": dict(rotary=True, interleaved=False),
    "rotary_window_as_long_as_the_cache": dict(rotary=True, window=(64, 64)),  # (q rotated as without one)
}


def run_case(dtype, case, seqlen_q, new, block_size, kv_heads=2, heads=4, d=32, batch_idx=False, leftpad=False,
             device="cpu", generator_seed=0):
    g = torch.Generator().manual_seed(generator_seed)
    kwargs = dict(CASES[case])
    rotary = kwargs.pop("rotary", False)
    interleaved = kwargs.pop("interleaved", True)
    alibi = kwargs.pop("alibi", None)
    batch, rows, length = 3, 4, 50
    cache = Cache(rows, length, kv_heads, d, dtype, block_size, g)
    q = torch.randn(3, seqlen_q, heads, d, generator=g, dtype=torch.float64).to(dtype)
    k_new = v_new = None
    if new:
        k_new = torch.randn(batch, new, kv_heads, d, generator=g, dtype=torch.float64).to(dtype)
        v_new = torch.randn(batch, new, kv_heads, d, generator=g, dtype=torch.float64).to(dtype)
    lengths = [7, 0, length - new]
    row_ids = [2, 0, 3] if batch_idx and block_size is None else list(range(batch))
    pads = [3, 0, 10] if leftpad else [0, 0, 0]
    if alibi == "per_head":
        kwargs["alibi_slopes"] = torch.rand(heads, generator=g) * 0.3
    elif alibi == "per_entry":
        kwargs["alibi_slopes"] = torch.rand(batch, heads, generator=g) * 0.3
    tables = rotary_tables(length + 8, 16) if rotary else None
    want, want_lse, want_k, want_v = reference_call(q, cache.k, cache.v, k_new, v_new, lengths, row_ids, pads,
                                                    rotary=tables, interleaved=interleaved, **kwargs)
    k_cache, v_cache, extra = cache.tensors()
    before = (k_cache.clone(), v_cache.clone())
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    extra = {key: on(t[:batch]) for key, t in extra.items()}  # the block table's first rows: entries 0..2
    if batch_idx and block_size is None:
        extra["cache_batch_idx"] = torch.tensor(row_ids, dtype=torch.int32, device=device)
    if leftpad:
        extra["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32, device=device)
    if rotary:
        extra.update(rotary_cos=on(tables[0]), rotary_sin=on(tables[1]), rotary_interleaved=interleaved)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = on(kwargs["alibi_slopes"])
    k_dev, v_dev = on(k_cache), on(v_cache)
    call_kwargs = {("window_size" if key == "window" else key): value for key, value in kwargs.items()}
    out, lse = flash_attn_with_kvcache(on(q), k_dev, v_dev, on(k_new), on(v_new),
                                       cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
                                       return_softmax_lse=True, **extra, **call_kwargs)
    cache.k_paged, cache.v_paged = (k_dev.cpu(), v_dev.cpu()) if block_size is not None else (None, None)
    if block_size is None:
        cache.k, cache.v = k_dev.cpu(), v_dev.cpu()
    return dict(out=out.cpu(), lse=lse.cpu(), want=want, want_lse=want_lse, want_k=want_k, want_v=want_v,
                cache=cache, before=before, written=[(row_ids[b], lengths[b], new) for b in range(batch)])


CACHE_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check(result, dtype):
    out, want = result["out"], result["want"]
    assert out.shape == want.shape and out.is_contiguous()
    assert_close_to_reference(out, want, dtype)
    hidden = torch.isneginf(result["want_lse"])
    assert torch.equal(torch.isneginf(result["lse"]), hidden)
    # (1e-4 below float64: the call rounds the rotated q to the storage dtype, the reference does not)
    lse_tol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(result["lse"][~hidden].double(), result["want_lse"][~hidden], rtol=lse_tol,
                               atol=lse_tol)
    cache = result["cache"]
    untouched = torch.ones(cache.k.shape[:2], dtype=torch.bool)
    for row, start, new in result["written"]:
        untouched[row, start:start + new] = False
    for index, (which, want_cache) in enumerate((("k", result["want_k"]), ("v", result["want_v"]))):
        got = cache.logical(which)
        # the new rows as the reference wrote them (rotated in float64; the call rotates in float32)
        torch.testing.assert_close(got.double(), want_cache, rtol=0, atol=CACHE_TOL[dtype] * 4)
        if cache.block_size is None:  # every other slot bitwise as it was
            assert torch.equal(got[untouched], result["before"][index][untouched])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_size", [None, 16, 5], ids=["contiguous", "paged16", "paged5"])
@pytest.mark.parametrize("seqlen_q,new", [(1, 1), (4, 4), (3, 0), (12, 12)], ids=["decode", "speculative",
                                                                              "no_append", "prefill"])
def test_matches_the_reference_and_writes_only_the_new_rows(dtype, case, block_size, seqlen_q, new):
    if CASES[case].get("rotary") and new == 0:  # FlashAttention's rule: rotary tables rotate new keys
        with pytest.raises(ValueError, match="only with new k / v"):
            run_case(dtype, case, seqlen_q, new, block_size)
        return
    result = run_case(dtype, case, seqlen_q, new, block_size)
    check(result, dtype)


@pytest.mark.parametrize("block_size", [None, 7], ids=["contiguous", "paged7"])
def test_cache_batch_idx_leftpad_and_gqa_ratios(block_size):
    for kv_heads, heads in ((1, 4), (2, 6), (3, 3)):
        result = run_case(torch.float32, "rotary", 2, 2, block_size, kv_heads=kv_heads, heads=heads, batch_idx=True,
                          leftpad=True)
        check(result, torch.float32)


def test_paged_slots_outside_the_written_positions_are_bitwise_untouched():
    result = run_case(torch.float32, "causal", 1, 1, 16)
    cache, (k_before, _) = result["cache"], result["before"]
    written = set()
    for b, (row, start, new) in enumerate(result["written"]):
        for pos in range(start, start + new):
            written.add((int(cache.table[b, pos // 16]), pos % 16))
    for block in range(k_before.shape[0]):
        for slot in range(16):
            if (block, slot) not in written:
                assert torch.equal(cache.k_paged[block, slot], k_before[block, slot])


def test_strided_arguments_a_non_contiguous_block_table_and_query():
    """Every tensor argument may be a strided view: a block table sliced out of a wider one (the
    kernels read a contiguous copy, kept alive through the call) and a transposed query."""
    g = torch.Generator().manual_seed(3)
    cache = Cache(2, 40, 2, 16, torch.float32, 8, g)
    wide = torch.zeros(2, 2 * cache.table.shape[1], dtype=torch.int32)
    wide[:, ::2] = cache.table
    table = wide[:, ::2]
    assert not table.is_contiguous()
    q = torch.randn(2, 4, 1, 16, generator=g).transpose(1, 2)  # (batch, 1, heads, d), not contiguous
    lengths = [30, 17]
    out = flash_attn_with_kvcache(q, cache.k_paged, cache.v_paged, cache_seqlens=torch.tensor(lengths,
                                  dtype=torch.int32), block_table=table, causal=True)
    want = reference_call(q, cache.k, cache.v, None, None, lengths, [0, 1], [0, 0], causal=True)[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_a_generate_loop_appending_one_token_at_a_time_equals_full_attention():
    """64 steps of one new token each, into a paged cache of block size 3: every step's output
    equals causal attention over the whole prefix computed at once."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, steps, block = 4, 2, 16, 64, 3
    ks = torch.randn(2, steps, kv_heads, d, generator=g)
    vs = torch.randn(2, steps, kv_heads, d, generator=g)
    qs = torch.randn(2, steps, heads, d, generator=g)
    per_row = -(-steps // block)
    table = torch.randperm(2 * per_row, generator=g).view(2, per_row).to(torch.int32)
    k_cache = torch.zeros(2 * per_row, block, kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    full = attention_ext.flash_attn_func(qs, ks, vs, causal=True)
    for t in range(steps):
        out = flash_attn_with_kvcache(qs[:, t:t + 1], k_cache, v_cache, ks[:, t:t + 1], vs[:, t:t + 1],
                                      cache_seqlens=t, block_table=table, causal=True)
        torch.testing.assert_close(out[:, 0], full[:, t], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("empty", ["k", "v"])
def test_a_head_dim_of_zero_appends_and_attends(empty):
    """d_k = 0 (every score 0: each row the mean of the visible values) or d_v = 0 (an empty
    output): the append writes the other cache's rows and leaves the empty one alone (its data
    pointer may be null, which the copy must never be handed)."""
    g = torch.Generator().manual_seed(3)
    dk, dv = (0, 8) if empty == "k" else (8, 0)
    k_cache, v_cache = torch.zeros(2, 10, 2, dk), torch.zeros(2, 10, 2, dv)
    q = torch.randn(2, 1, 4, dk, generator=g)
    k, v = torch.randn(2, 3, 2, dk, generator=g), torch.randn(2, 3, 2, dv, generator=g)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    assert out.shape == (2, 1, 4, dv)
    assert torch.equal(k_cache[0, :3], k[0]) and torch.equal(k_cache[1, 4:7], k[1])
    assert torch.equal(v_cache[0, :3], v[0]) and torch.equal(v_cache[1, 4:7], v[1])
    if empty == "k":  # entry 0 sees its 3 new keys, entry 1 the 4 zero rows before them too
        want = torch.stack([v[0].mean(0), torch.cat([torch.zeros(4, 2, dv), v[1]]).mean(0)])
        torch.testing.assert_close(out[:, 0], want.repeat_interleave(2, dim=1), rtol=1e-6, atol=1e-6)


BAD = [
    (dict(cache_seqlens=48, new=4), ValueError, "overflows the cache's 50 positions"),
    (dict(cache_seqlens=torch.tensor([1, 2, 3])), TypeError, "cache_seqlens must be an int32 tensor of shape"),
    (dict(cache_batch_idx=torch.tensor([0, 1, 9], dtype=torch.int32)), IndexError, "outside the cache's 4 rows"),
    (dict(cache_leftpad=torch.tensor([0, 5, 0], dtype=torch.int32)), ValueError, r"cache_leftpad\[1\] = 5"),
    (dict(k_only=True), ValueError, "k and v must be given together"),
    (dict(rotary_without_new=True), ValueError, "only with new k / v"),
    (dict(requires_grad=True), RuntimeError, "inference function"),
    (dict(dtype_mismatch=True), TypeError, "must have q's dtype"),
    (dict(window_size=(0.5, 0)), TypeError, "window_size must be a pair of ints"),
    (dict(bad_block=True), IndexError, r"block_table\[2, 0\] = 99 is outside the cache's 23 blocks"),
    (dict(alibi_slopes=torch.ones(3)), TypeError, r"alibi_slopes must be float32 of shape \(4,\)"),
    (dict(five_entries=True), IndexError, "larger than the cache's 4 rows: pass cache_batch_idx"),
    (dict(softcap=1e39), ValueError, "softcap must be within the"),
    (dict(softcap=None), TypeError, "softcap must be a float, got NoneType"),
    (dict(bad_read_block=True), IndexError, r"block_table\[0, 0\] = 99 is outside the cache's 23 blocks"),
    (dict(meta_table=True), ValueError, "block_table must be on cpu, got meta"),
    (dict(expanded=True), ValueError, r"k_cache is an expanded view \(stride 0 in dim 0"),
    (dict(rotary_int=True), TypeError, "rotary_cos must be a floating tensor on cpu, got torch.int64"),
    (dict(k_list=True), TypeError, "k must be a torch.Tensor"),
    (dict(cache_seqlens=-1), ValueError, r"cache_seqlens\[0\] = -1 must be >= 0"),
    (dict(sparse_q=True), TypeError, r"q must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    (dict(cache_batch_idx=torch.tensor([0, 1, 1], dtype=torch.int32), cache_seqlens=torch.tensor([1, 2, 2],
          dtype=torch.int32)), ValueError, "entries 1 and 2 both append to cache row 1, position 2 "
     r"\(through cache_batch_idx\): each cache slot takes one new key per call"),
    (dict(shared_block=True), ValueError, r"entries 0 and 1 both append to block 7, slot 1 \(through block_table\)"),
    (dict(same_caches=True), ValueError, "k_cache and v_cache are the same memory"),
    (dict(int64_table=True), TypeError, r"block_table must be an int32 tensor of shape \(3, max_blocks\), got "
     r"torch.int64 of shape \(3, 5\)"),
]


@pytest.mark.parametrize("bad,error,message", BAD, ids=[b[2][:28] for b in BAD])
def test_bad_arguments_raise_before_anything_is_written(bad, error, message):
    paged = any(bad.get(key) for key in ("bad_block", "bad_read_block", "meta_table", "shared_block", "int64_table"))
    cache = Cache(4, 50, 2, 8, torch.float32, 10 if paged else None, torch.Generator().manual_seed(0))
    k_cache, v_cache, extra = cache.tensors()
    if bad.get("expanded"):  # every entry's row one memory row
        k_cache, v_cache = (t[:1].expand_as(t) for t in (k_cache, v_cache))
    if bad.get("same_caches"):
        v_cache = k_cache
    before = k_cache.clone()
    q = torch.randn(3, 1, 4, 8)
    new = bad.get("new", 1)
    k_new, v_new = torch.randn(3, new, 2, 8), torch.randn(3, new, 2, 8)
    if bad.get("five_entries"):  # more entries than cache rows, without cache_batch_idx
        q, k_new, v_new = (torch.cat([t, t[:2]]) for t in (q, k_new, v_new))
    kwargs = {key: bad[key] for key in ("cache_batch_idx", "cache_leftpad", "window_size", "alibi_slopes", "softcap")
              if key in bad}
    kwargs["cache_seqlens"] = bad.get("cache_seqlens", torch.tensor([1, 2, 3] + [4] * (q.shape[0] - 3),
                                                                    dtype=torch.int32))
    if bad.get("k_only"):
        v_new = None
    if bad.get("rotary_without_new"):
        k_new = v_new = None
        kwargs.update(rotary_cos=torch.ones(60, 4), rotary_sin=torch.zeros(60, 4))
    if bad.get("requires_grad"):
        q.requires_grad_()
    if bad.get("dtype_mismatch"):
        k_new = k_new.double()
    if bad.get("bad_block") or bad.get("bad_read_block") or bad.get("meta_table") or bad.get("shared_block"):
        extra["block_table"] = extra["block_table"][:3].clone()
    if bad.get("bad_block"):  # where entry 2's new key goes
        extra["block_table"][2, 0] = 99
    if bad.get("bad_read_block"):  # a block entry 0 only reads (its new key goes to block 1)
        kwargs["cache_seqlens"] = torch.tensor([12, 2, 3], dtype=torch.int32)
        extra["block_table"][0, 0] = 99
    if bad.get("meta_table"):
        extra["block_table"] = extra["block_table"].to("meta")
    if bad.get("shared_block"):  # entries 0 and 1 append at position 1 of one block
        kwargs["cache_seqlens"] = torch.tensor([1, 1, 3], dtype=torch.int32)
        extra["block_table"][0, 0] = extra["block_table"][1, 0] = 7
    if bad.get("int64_table"):
        extra["block_table"] = extra["block_table"][:3].long()
    if bad.get("rotary_int"):
        kwargs.update(rotary_cos=torch.ones(60, 4, dtype=torch.int64), rotary_sin=torch.zeros(60, 4, dtype=torch.int64))
    if bad.get("k_list"):
        k_new = k_new.tolist()
    if bad.get("sparse_q"):  # (the append used to run before q.stride() failed)
        q = q.to_sparse()
    with pytest.raises(error, match=message):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **extra, **kwargs)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("which", ["rotary", "alibi"])
def test_rotary_tables_and_alibi_slopes_that_require_grad_are_refused_and_under_no_grad_leave_no_graph(which):
    """The function has no backward: rotary tables or ALiBi slopes that require grad are refused
    with grad mode on, as q and the caches are (their gradients would otherwise be dropped without a
    word). Under no_grad they are taken, and make neither the rotated keys, nor so the cache they
    are written into, part of a graph (the next step would then be refused as a cache that requires
    grad)."""
    k_cache, v_cache = torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4)
    cos, sin = (t.requires_grad_() for t in rotary_tables(8, 4))
    slopes = torch.rand(1, requires_grad=True)
    extra = dict(rotary_cos=cos, rotary_sin=sin) if which == "rotary" else dict(alibi_slopes=slopes)
    name = "rotary_cos" if which == "rotary" else "alibi_slopes"
    for step in range(2):
        args = (torch.randn(1, 1, 1, 4), k_cache, v_cache, torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
        with pytest.raises(RuntimeError, match=f"flash_attn_with_kvcache: {name} requires grad: this is an "
                                               "inference function"):
            flash_attn_with_kvcache(*args, cache_seqlens=step, **extra)
        assert torch.equal(k_cache[0, step], torch.zeros(1, 4))  # (refused before the append)
        with torch.no_grad():
            out = flash_attn_with_kvcache(*args, cache_seqlens=step, **extra)
        assert not k_cache.requires_grad and k_cache.grad_fn is None and not out.requires_grad
        assert not torch.equal(k_cache[0, step], torch.zeros(1, 4))


def test_meta_tensors_run_shape_only_but_per_entry_arguments_need_values():
    """On the meta device the call gives the output's shape (what shape inference needs), while the
    per-entry arguments, whose values every check and write reads, must be real tensors."""
    q, k_cache, v_cache = (torch.empty(*shape, device="meta") for shape in ((1, 1, 2, 8), (1, 16, 1, 8),
                                                                              (1, 16, 1, 8)))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([3], dtype=torch.int32))
    assert out.shape == (1, 1, 2, 8) and out.device.type == "meta"
    with pytest.raises(ValueError, match="cache_seqlens is on the meta device and holds no values: give it on the "
                                         "CPU"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([3], dtype=torch.int32,
                                                                                device="meta"))


@pytest.mark.parametrize("python_path", [False, True], ids=["cxx_step", "python_path"])
@pytest.mark.parametrize("source", ["ahead", "behind", "v_cache"])
def test_new_rows_that_are_a_view_of_a_cache_are_written_as_passed(python_path, source, monkeypatch):
    """k / v that are views of the cache itself (slots just before or after the ones written, or of
    the other cache) go in with the values they had when the call began: they are copied first
    where they share memory with a cache. Copied row by row in place, a second new row would read a
    slot the first had just overwritten."""
    if python_path:
        monkeypatch.setattr(attention_ext._ops, "KVCACHE_STEP", None)
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(1, 16, 2, 4, generator=g), torch.randn(1, 16, 2, 4, generator=g)
    views = {"ahead": (k_cache[:, 4:7], v_cache[:, 4:7]), "behind": (k_cache[:, 6:9], v_cache[:, 6:9]),
             "v_cache": (v_cache[:, 4:7], k_cache[:, 4:7])}
    k, v = views[source]
    want_k, want_v = k.clone(), v.clone()
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = torch.randn(1, 1, 4, 4, generator=g)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5], dtype=torch.int32))
    assert torch.equal(k_cache[:, 5:8], want_k) and torch.equal(v_cache[:, 5:8], want_v)
    outside = torch.ones(16, dtype=torch.bool)
    outside[5:8] = False
    assert torch.equal(k_cache[:, outside], k_before[:, outside]) and torch.equal(v_cache[:, outside],
                                                                                  v_before[:, outside])
    want = reference_call(q, k_before, v_before, want_k, want_v, [5], [0], [0])[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_caches_that_share_memory_without_sharing_slots_take_appends():
    """Refused as the same memory: k_cache and v_cache with a common first element, dense views
    whose bytes overlap, or views with equal strides that share a slot. Taken: caches in one tensor
    that share no element, as a packed cache's K and V halves (kv[:, :, 0] and kv[:, :, 1]); two
    entries appending to disjoint positions of one cache row; entries reading one row or block
    together."""
    kv = torch.zeros(2, 8, 2, 1, 4)
    q, k, v = torch.randn(2, 1, 1, 4), torch.ones(2, 1, 1, 4), torch.full((2, 1, 1, 4), 2.0)
    flash_attn_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], k, v, cache_seqlens=torch.tensor([0, 3], dtype=torch.int32))
    assert torch.equal(kv[0, 0, 0], k[0, 0]) and torch.equal(kv[0, 0, 1], v[0, 0])
    assert torch.equal(kv[1, 3, 0], k[1, 0]) and torch.equal(kv[1, 3, 1], v[1, 0])
    memory = torch.zeros(68)
    cache = memory[:64].view(2, 8, 1, 4)
    with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
        flash_attn_with_kvcache(q, cache, cache[:, :], k, v, cache_seqlens=0)
    with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):  # one slot apart
        flash_attn_with_kvcache(q, cache, memory[4:].view(2, 8, 1, 4), k, v, cache_seqlens=0)
    assert not memory.any()
    # Views of one tensor that share some slots (heads 0-1 and 1-2 of three) but neither their first
    # element nor dense memory: refused on both paths, nothing written; heads 0-1 and 2-3 of four
    # are apart, and taken.
    heads = torch.zeros(2, 8, 3, 4)
    for cxx_step in (attention_ext._ops.KVCACHE_STEP, None):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention_ext._ops, "KVCACHE_STEP", cxx_step)
            with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
                flash_attn_with_kvcache(q.expand(2, 1, 2, 4), heads[:, :, 0:2], heads[:, :, 1:3],
                                        k.expand(2, 1, 2, 4), v.expand(2, 1, 2, 4), cache_seqlens=0)
    assert not heads.any()
    # One position apart along the keys, one view carrying another stride on its size-1 head dim
    # (strides there say nothing): refused too.
    rows = torch.zeros(2, 9, 1, 4)
    shifted = rows[:, 1:]
    shifted = shifted.as_strided(shifted.shape, (shifted.stride(0), shifted.stride(1), 999, 1),
                                 shifted.storage_offset())
    with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
        flash_attn_with_kvcache(q[:, :, :1], rows[:, :8], shifted, k[:, :, :1], v[:, :, :1], cache_seqlens=0)
    assert not rows.any()
    apart = torch.zeros(2, 8, 4, 4)
    flash_attn_with_kvcache(q.expand(2, 1, 2, 4), apart[:, :, 0:2], apart[:, :, 2:4], k.expand(2, 1, 2, 4),
                            v.expand(2, 1, 2, 4), cache_seqlens=1)
    assert torch.equal(apart[:, 1], torch.cat([k.expand(2, 1, 2, 4), v.expand(2, 1, 2, 4)], 2)[:, 0])
    k_cache, v_cache = torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4)
    one_row = torch.zeros(2, dtype=torch.int32)
    scaled = k * torch.tensor([1.0, 3.0]).view(2, 1, 1, 1)
    flash_attn_with_kvcache(q, k_cache, v_cache, scaled, v, cache_seqlens=torch.tensor([2, 5], dtype=torch.int32),
                            cache_batch_idx=one_row)
    assert k_cache[0, 2, 0, 0] == 1.0 and k_cache[0, 5, 0, 0] == 3.0
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([6, 6], dtype=torch.int32),
                                  cache_batch_idx=one_row)
    assert out.shape == (2, 1, 1, 4)


def test_the_append_is_an_in_place_update_for_autograd_and_inference_mode():
    """As torch's in-place ops: the caches' version counters move (a graph that saved a cache
    before the append refuses to run backward), and an inference tensor takes appends only under
    torch.inference_mode (outside it: refused before anything is written)."""
    q, k_new, v_new = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    k_cache, v_cache = torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 2, 4)
    weight = torch.randn(1, 8, 2, 4, requires_grad=True)
    saved = (weight * k_cache).sum()  # k_cache saved for the backward
    versions = k_cache._version, v_cache._version
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=3)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()
    with torch.inference_mode():
        k_inf, v_inf = torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 2, 4)
    with pytest.raises(RuntimeError, match="k_cache is an inference tensor"):
        flash_attn_with_kvcache(q, k_inf, v_inf, k_new, v_new, cache_seqlens=3)
    assert not k_inf.any() and not v_inf.any()
    with torch.inference_mode():
        flash_attn_with_kvcache(q, k_inf, v_inf, k_new, v_new, cache_seqlens=3)
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=4)  # a normal cache too
    assert torch.equal(k_inf[0, 3], k_new[0, 0]) and torch.equal(v_cache[0, 4], v_new[0, 0])


def test_forward_mode_ad_is_refused_and_vmap_runs_per_entry():
    """no_grad does not stop forward-mode AD: without a jvp its tangent would be dropped (None,
    or zeros under torch.func.jvp), so it is refused. vmap has torch run the call per entry."""
    import torch.autograd.forward_ad as fwAD
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 1, 1, 2, 8, generator=g)
    k_cache, v_cache = torch.randn(1, 8, 2, 8, generator=g), torch.randn(1, 8, 2, 8, generator=g)

    def call(x):
        return flash_attn_with_kvcache(x, k_cache, v_cache, cache_seqlens=5)

    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="q carries a forward-mode tangent"):
        call(fwAD.make_dual(q[0], q[1]))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(call, (q[0],), (q[1],))
    assert torch.equal(torch.vmap(call)(q), torch.stack([call(x) for x in q]))


STEP_CALLS = {  # common decode steps: (cache layout, call arguments beyond q and the caches)
    "attend": ("contiguous", dict(cache_seqlens="tensor")),
    "append_causal": ("contiguous", dict(new=1, causal=True, cache_seqlens="tensor")),
    "speculative_lse": ("contiguous", dict(new=3, causal=True, cache_seqlens="tensor",
                                           return_softmax_lse=True)),
    "int_seqlens_scale": ("contiguous", dict(new=1, cache_seqlens=9, softmax_scale=0.3)),
    "full_cache": ("contiguous", dict()),
    "batch_idx_leftpad": ("contiguous", dict(new=1, cache_seqlens="tensor", cache_batch_idx=[3, 0, 2],
                                             cache_leftpad=[2, 0, 5])),
    "paged": ("paged", dict(new=1, causal=True, cache_seqlens="tensor")),
    "paged_leftpad": ("paged", dict(new=2, cache_seqlens="tensor", cache_leftpad=[1, 0, 12])),
    "zero_new_rows": ("contiguous", dict(zero_new=True, cache_seqlens="tensor")),
    "window_softcap": ("contiguous", dict(new=1, causal=True, cache_seqlens="tensor", window_size=(6, -1),
                                          softcap=30.0)),
    "window_both_sides": ("paged", dict(new=2, cache_seqlens="tensor", window_size=(5, 1))),
    "window_as_long_as_the_cache": ("contiguous", dict(new=1, cache_seqlens="tensor", window_size=(40, 40))),
    "alibi_per_head": ("contiguous", dict(new=1, causal=True, cache_seqlens="tensor", alibi="per_head")),
    "alibi_per_entry": ("paged", dict(cache_seqlens="tensor", alibi="per_entry")),
    # rotary: q and the new keys rotated before the append (q row by row when causal or windowed)
    "rotary_interleaved_causal": ("contiguous", dict(new=1, causal=True, cache_seqlens="tensor", rotary=16)),
    "rotary_halves_part_of_d": ("contiguous", dict(new=2, cache_seqlens="tensor", rotary=8,
                                                   rotary_interleaved=False)),
    "rotary_paged_speculative": ("paged", dict(new=3, causal=True, cache_seqlens="tensor", rotary=16,
                                               rotary_dtype=torch.bfloat16, return_softmax_lse=True)),
    "rotary_window_int_seqlens": ("contiguous", dict(new=1, cache_seqlens=9, window_size=(4, 0), rotary=12,
                                                     rotary_dtype=torch.float64, rotary_interleaved=False)),
    "rotary_zero_new_rows": ("contiguous", dict(zero_new=True, cache_seqlens="tensor", rotary=16)),
}


def step_arguments(layout, spec, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = Cache(4, 40, 2, 16, dtype, 8 if layout == "paged" else None, g)
    k_cache, v_cache, extra = cache.tensors()
    if layout == "paged":
        extra["block_table"] = extra["block_table"][:3].clone()
    spec = dict(spec)
    new = spec.pop("new", 0)
    zero_new = spec.pop("zero_new", False)  # k and v given, with no rows
    kwargs = dict(extra, **spec)
    alibi = kwargs.pop("alibi", None)
    rotary_dim = kwargs.pop("rotary", None)
    rotary_dtype = kwargs.pop("rotary_dtype", torch.float32)
    if rotary_dim is not None:  # (seqlen_ro, rotary_dim / 2) tables of angles at 40 positions
        angles = torch.arange(40, dtype=torch.float64)[:, None] / 100 ** (torch.arange(rotary_dim // 2) / rotary_dim)
        kwargs["rotary_cos"], kwargs["rotary_sin"] = angles.cos().to(rotary_dtype), angles.sin().to(rotary_dtype)
    if alibi is not None:
        kwargs["alibi_slopes"] = torch.rand(*((8,) if alibi == "per_head" else (3, 8)), generator=g) * 0.3
    if kwargs.get("cache_seqlens") == "tensor":
        kwargs["cache_seqlens"] = torch.tensor([7, 0, 30], dtype=torch.int32)
    for key in ("cache_batch_idx", "cache_leftpad"):
        if key in kwargs:
            kwargs[key] = torch.tensor(kwargs[key], dtype=torch.int32)
    q = torch.randn(3, max(new, 1), 8, 16, generator=g).to(dtype)
    k_new = torch.randn(3, new, 2, 16, generator=g).to(dtype) if new else None
    v_new = torch.randn(3, new, 2, 16, generator=g).to(dtype) if new else None
    if zero_new:
        k_new, v_new = torch.zeros(3, 0, 2, 16, dtype=dtype), torch.zeros(3, 0, 2, 16, dtype=dtype)
    return q, k_cache, v_cache, k_new, v_new, kwargs


@pytest.mark.skipif(attention_ext._ops.KVCACHE_STEP is None, reason="the C++ decode step is in the prebuilt "
                    "extension only (a JIT build takes the Python path for every call)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(STEP_CALLS))
def test_a_common_step_takes_the_cxx_path_and_gives_the_python_path_s_bits(name, dtype, monkeypatch):
    """flash_attn_with_kvcache's common CPU steps run as one C++ call (csrc/kv_cache_step.h): the
    step answers for them, and the call's output, lse and caches are bitwise those of the Python
    path (the C++ step switched off), the caches' version counters moved alike."""
    layout, spec = STEP_CALLS[name]
    results, versions_moved = [], []
    for cxx in (True, False):
        q, k_cache, v_cache, k_new, v_new, kwargs = step_arguments(layout, spec, dtype)
        if cxx:
            step = attention_ext._ops.KVCACHE_STEP(
                q, k_cache.clone(), v_cache.clone(), k_new, v_new, kwargs.get("rotary_cos"), kwargs.get("rotary_sin"),
                kwargs.get("cache_seqlens"), kwargs.get("cache_batch_idx"), kwargs.get("cache_leftpad"),
                kwargs.get("block_table"), kwargs.get("softmax_scale"), kwargs.get("causal", False),
                kwargs.get("window_size", (-1, -1)), kwargs.get("softcap", 0.0), kwargs.get("rotary_interleaved", True),
                kwargs.get("alibi_slopes"), 0, kwargs.get("return_softmax_lse", False))
            assert step is not None, "the C++ step declined a common call"
        else:
            monkeypatch.setattr(attention_ext._ops, "KVCACHE_STEP", None)
        versions = k_cache._version, v_cache._version
        got = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
        results.append((got if isinstance(got, tuple) else (got,)) + (k_cache, v_cache))
        versions_moved.append((k_cache._version - versions[0], v_cache._version - versions[1]))
    assert versions_moved[0] == versions_moved[1]
    for cxx, python in zip(*results):
        assert cxx.shape == python.shape and cxx.stride() == python.stride()
        assert cxx._is_view() == python._is_view()  # (out and lse: views of the op's outputs)
        assert torch.equal(cxx, python)


STEP_DECLINES = {  # what the C++ step leaves to the Python path (which computes it, or raises)
    "a window side below -1": dict(window_size=(-3, 0)),
    "a window as a list": dict(window_size=[5, 2]),
    "a window side past 2**62": dict(window_size=(2 ** 62 + 1, -1)),
    "a window side past int64": dict(window_size=(2 ** 70, -1)),
    "an int softcap": dict(softcap=20),
    "a softcap beyond float32": dict(softcap=1e39),
    "a negative softcap": dict(softcap=-1.0),
    "a None softcap": dict(softcap=None),
    "float64 ALiBi slopes": dict(alibi_slopes=torch.ones(8, dtype=torch.float64)),
    "ALiBi slopes of the K/V heads' count": dict(alibi_slopes=torch.ones(2)),
    "an int scale": dict(softmax_scale=1),
    "a NaN scale": dict(softmax_scale=float("nan")),
    "k without v": dict(v_only_missing=True),
    "dtypes that differ": dict(k_double=True),
    "q requiring grad": dict(q_grad=True),
    "an overflowing append": dict(cache_seqlens=40),
    "a negative length": dict(cache_seqlens=-1),
    "a cache row out of range": dict(cache_batch_idx=[0, 1, 4]),
    "leftpad past the end": dict(cache_leftpad=[9, 0, 0]),
    "an int64 seqlens tensor": dict(seqlens_dtype=torch.int64),
    "an expanded cache": dict(expanded=True),
    "an inference-tensor cache outside inference mode": dict(inference_cache=True),
    "an empty batch": dict(empty=True),
    "a bad block id": dict(paged=True, bad_block=True),
    "rotary_cos alone": dict(rotary_cos=torch.ones(40, 8)),
    "rotary tables without new keys": dict(rotary_cos=torch.ones(40, 8), rotary_sin=torch.zeros(40, 8), no_new=True),
    "rotary tables that differ in shape": dict(rotary_cos=torch.ones(40, 8), rotary_sin=torch.zeros(40, 4)),
    "a rotary dim past the head dim": dict(rotary_cos=torch.ones(40, 9), rotary_sin=torch.zeros(40, 9)),
    "int rotary tables": dict(rotary_cos=torch.ones(40, 8, dtype=torch.int32),
                              rotary_sin=torch.zeros(40, 8, dtype=torch.int32)),
    "rotary tables short of the positions": dict(rotary_cos=torch.ones(8, 8), rotary_sin=torch.zeros(8, 8)),
    "rotary tables of one row": dict(rotary_cos=torch.ones(8), rotary_sin=torch.zeros(8)),
    "rotary tables that require grad": dict(rotary_cos=torch.ones(40, 8, requires_grad=True),
                                            rotary_sin=torch.zeros(40, 8)),
    "ALiBi slopes that require grad": dict(alibi_slopes=torch.ones(8, requires_grad=True)),
    "new rows that are a view of the cache": dict(new_from_cache=True),
    "caches that are one memory": dict(same_caches=True),
    "two entries appending to one slot": dict(cache_batch_idx=[0, 1, 1], cache_seqlens=[7, 30, 30]),
}
if hasattr(torch, "float8_e4m3fn"):  # (a float dtype the rotary op does not take: the Python path's torch ops)
    STEP_DECLINES["float8 rotary tables"] = dict(rotary_cos=torch.ones(40, 8).to(torch.float8_e4m3fn),
                                                 rotary_sin=torch.zeros(40, 8).to(torch.float8_e4m3fn))


@pytest.mark.skipif(attention_ext._ops.KVCACHE_STEP is None, reason="the C++ decode step is in the prebuilt "
                    "extension only")
@pytest.mark.parametrize("name", list(STEP_DECLINES))
def test_the_cxx_step_declines_what_it_does_not_take_and_writes_nothing(name):
    bad = STEP_DECLINES[name]
    q, k_cache, v_cache, k_new, v_new, kwargs = step_arguments("paged" if bad.get("paged") else "contiguous",
                                                                dict(new=1, cache_seqlens="tensor"))
    seqlens = bad.get("cache_seqlens", kwargs["cache_seqlens"])
    if isinstance(seqlens, list):
        seqlens = torch.tensor(seqlens, dtype=torch.int32)
    if bad.get("new_from_cache"):
        k_new, v_new = k_cache[:3, 1:2], v_cache[:3, 1:2]
    if bad.get("same_caches"):
        v_cache = k_cache
    if "seqlens_dtype" in bad:
        seqlens = seqlens.to(bad["seqlens_dtype"])
    if bad.get("v_only_missing"):
        v_new = None
    if bad.get("k_double"):
        k_new = k_new.double()
    if bad.get("q_grad"):
        q.requires_grad_()
    if bad.get("expanded"):
        k_cache, v_cache = (t[:1].expand_as(t) for t in (k_cache, v_cache))
    if bad.get("inference_cache"):
        with torch.inference_mode():
            k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if bad.get("empty"):
        q, k_new, v_new, seqlens = q[:0], k_new[:0], v_new[:0], seqlens[:0]
    if bad.get("no_new"):
        k_new = v_new = None
    table = kwargs.get("block_table")
    if bad.get("bad_block"):
        table[2, 3] = 99  # the block entry 2's new key goes to
    per_entry = {key: torch.tensor(bad[key], dtype=torch.int32) if key in bad else None
                 for key in ("cache_batch_idx", "cache_leftpad")}
    before = k_cache.clone(), v_cache.clone()
    step = attention_ext._ops.KVCACHE_STEP(
        q, k_cache, v_cache, k_new, v_new, bad.get("rotary_cos"), bad.get("rotary_sin"), seqlens,
        per_entry["cache_batch_idx"], per_entry["cache_leftpad"], table, bad.get("softmax_scale"), False,
        bad.get("window_size", (-1, -1)), bad.get("softcap", 0.0), True, bad.get("alibi_slopes"), 0, False)
    assert step is None
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.skipif(attention_ext._ops.KVCACHE_STEP is None, reason="the C++ decode step is in the prebuilt "
                    "extension only")
def test_the_cxx_step_declines_positions_past_int64_and_dispatch_modes():
    """Positions the Python path takes as unbounded ints: a paged cache's capacity (blocks ×
    block size) or an entry's end past int64, which the C++ step must not let wrap; and a torch
    dispatch mode, which sees the Python path's ops."""
    def step(q, k_cache, v_cache, k, v, seqlens, block_table):
        return attention_ext._ops.KVCACHE_STEP(q, k_cache, v_cache, k, v, None, None, seqlens, None, None,
                                               block_table, None, False, (-1, -1), 0.0, True, None, 0, False)

    q = torch.randn(1, 1, 1, 1)
    huge = torch.randn(1, 1, 1, 1).expand(1, 2 ** 61 + 1, 1, 1)  # 2**61 + 1 slots a block, one memory row
    eight_blocks = torch.zeros(1, 1, dtype=torch.int32).expand(1, 8)  # capacity 2**64 + 8: wraps to 8
    assert step(q, huge, huge, None, None, None, eight_blocks) is None
    widest = torch.randn(1, 1, 1, 1).expand(1, 2 ** 63 - 1, 1, 1)
    assert step(q, widest, widest, None, None, 5, torch.tensor([[99]], dtype=torch.int32)) is None
    k_cache, v_cache = torch.zeros(1, 8, 1, 1), torch.zeros(1, 8, 1, 1)
    new = torch.ones(1, 1, 1, 1)
    assert step(q, k_cache, v_cache, new, new, 2 ** 63 - 1, None) is None
    assert not k_cache.any() and not v_cache.any()

    class Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert step(q, k_cache, v_cache, new, new, 2, None) is None
        out = flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=2)  # the Python path
    assert torch.equal(k_cache[0, 2], new[0, 0]) and torch.equal(v_cache[0, 2], new[0, 0])
    weight = q.double().exp() / (2 + q.double().exp())  # keys 0, 0, 1 (scale 1 at d = 1); values 0, 0, 1
    torch.testing.assert_close(out.double(), weight, rtol=1e-6, atol=1e-6)


def test_a_window_side_as_long_as_the_cache_bounds_nothing():
    """FlashAttention's rule: a side >= the cache's capacity is -1. Here the right side of 4 on a
    cache of 4 slots would otherwise hide keys from the first rows of an 8-row call (their band
    ends at i + m - n + 4 < m)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 8, 2, 8, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(1, 4, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    plain = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, return_softmax_lse=True)
    for window in ((-1, 4), (4, -1), (9, 100), (2 ** 63 - 1, -1)):
        got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, window_size=window,
                                      return_softmax_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), window
    # One less is a bound: rows 0-2 then see no key (output 0, lse -inf).
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, window_size=(-1, 3),
                                       return_softmax_lse=True)
    assert torch.isneginf(lse[0, :, 0]).all() and torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


def test_table_slots_past_an_entry_s_blocks_may_hold_anything():
    """Only the blocks an entry reads or writes must be in the cache; the rest of its row of the
    table may be padding (-1, or any number), as block allocators leave it."""
    g = torch.Generator().manual_seed(8)
    cache = Cache(2, 40, 2, 8, torch.float32, 8, g)
    k_cache, v_cache, extra = cache.tensors()
    q = torch.randn(2, 1, 4, 8, generator=g)
    lengths = torch.tensor([9, 30], dtype=torch.int32)  # entry 0 uses blocks 0-1 of its row
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, **extra)
    padded = extra["block_table"].clone()
    padded[0, 2:] = -1
    padded[0, 4] = 10 ** 6
    got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=padded)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_rotary_reads_q_and_k_wherever_they_lie(dtype, interleaved):
    """q and the new k as slices of larger buffers at odd element offsets, and as transposed views,
    give the bits of contiguous copies (rotary on every head dim, and on half of it)."""
    g = torch.Generator().manual_seed(11)
    for rotary_dim in (8, 4):
        cos, sin = rotary_tables(16, rotary_dim)
        k_cache, v_cache = (torch.randn(1, 16, 2, 8, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(1 + 2 * 4 * 8, generator=g).to(dtype)[1:].view(1, 2, 4, 8)  # odd offset
        k = torch.randn(1, 2, 2, 9, generator=g).to(dtype)[..., 1:]  # odd offset, strided rows
        v = torch.randn(1, 2, 2, 8, generator=g).to(dtype)
        q_t = q.clone().transpose(1, 2).contiguous().transpose(1, 2)  # (heads, rows) stored the other way
        results = []
        for q_in, k_in in ((q, k), (q_t, k), (q.contiguous(), k.contiguous())):
            caches = (k_cache.clone(), v_cache.clone())
            out = flash_attn_with_kvcache(q_in, *caches, k_in, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=5, causal=True, rotary_interleaved=interleaved)
            results.append((out, *caches))
        for got in results[:2]:
            assert all(torch.equal(a, b) for a, b in zip(got, results[2])), rotary_dim


def test_bad_direct_append_calls_never_crash():
    """The append op checks shapes, rows, positions and block ids itself: in a subprocess that
    must survive, every bad call raises and leaves the caches as they were."""
    code = r"""
import torch, attention_ext
ops = torch.ops.attention_ext
i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
kc, vc = torch.zeros(2, 8, 2, 4), torch.zeros(2, 8, 2, 4)
pages = torch.zeros(4, 4, 2, 4)
three_heads = torch.zeros(2, 8, 3, 4)
k, v = torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4)
calls = [
    (three_heads[:, :, :2], three_heads[:, :, 1:], k, v, i32(3, 3), None, None),  # K and V share head 1
    (kc, torch.zeros(2, 8, 1, 4), k, v[:, :, :1], i32(3, 3), None, None),  # caches with different heads
    (kc, vc, k, v, i32(3, 8), None, None),                                   # a position past the cache
    (kc, vc, k, v, i32(-1, 0), None, None),                                  # a negative one
    (kc, vc, k, v, i32(3, 3), i32(0, 2), None),                              # a cache row past the cache
    (pages, pages.clone(), k, v, i32(3, 0), None, i32([0, 1], [7, 2])),      # a block id past the cache
    (kc, vc, k, torch.randn(2, 1, 2, 5), i32(3, 3), None, None),             # v of another head dim
    (kc, vc, k.double(), v.double(), i32(3, 3), None, None),                 # another dtype
    (kc, vc, k, v, i32(3), None, None),                                      # one start for two entries
    (kc, kc, k, v, i32(3, 3), None, None),                                   # K and V one memory
    (kc, vc, k, v, i32(3, 3), i32(1, 1), None),                              # two entries, one slot
    (pages, pages.clone(), k, v, i32(1, 1), None, i32([2, 0], [2, 1])),      # a block shared by new rows
    (kc[:1].expand(2, 8, 2, 4), vc, k, v, i32(3, 3), None, None),            # an expanded cache
    (kc, vc, k, v, i32(3, 3).to("meta"), None, None),                        # positions with no values
    (kc.clone().requires_grad_(), vc, k, v, i32(3, 3), None, None),          # a cache requiring grad
]
for args in calls:
    try:
        ops.attention_kvcache_append(*args)
    except (RuntimeError, ValueError) as e:
        assert "attention_ext" in str(e), e
    else:
        raise SystemExit(f"no error for {[getattr(a, 'shape', a) for a in args]}")
with torch.inference_mode():
    kc_inference = torch.zeros(2, 8, 2, 4)
try:
    ops.attention_kvcache_append(kc_inference, vc, k, v, i32(3, 3), None, None)
except RuntimeError as e:
    assert "inference tensor" in str(e), e
else:
    raise SystemExit("no error for an inference cache outside inference mode")
assert not kc.any() and not vc.any() and not pages.any() and not kc_inference.any() and not three_heads.any()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-2000:]


def test_the_append_op_called_directly_is_an_in_place_update_and_takes_rows_from_its_cache():
    """Called directly (as kernel developers do), the append op keeps torch's in-place rules itself:
    the caches' version counters move, so a graph that saved a cache before the write refuses to
    backpropagate through it; and new rows that are a view of the cache go in as they were passed."""
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    x = torch.randn(2, 6, 2, 4, requires_grad=True)
    k_cache, v_cache = torch.zeros(2, 6, 2, 4), torch.zeros(2, 6, 2, 4)
    y = (x * k_cache).sum()
    torch.ops.attention_ext.attention_kvcache_append(k_cache, v_cache, torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4),
                                                     i32(0, 0), None, None)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(1, 8, 1, 4, generator=g), torch.randn(1, 8, 1, 4, generator=g)
    want = k_cache[:, 0:3].clone()
    torch.ops.attention_ext.attention_kvcache_append(k_cache, v_cache, k_cache[:, 0:3], v_cache[:, 0:3], i32(1),
                                                     None, None)
    assert torch.equal(k_cache[:, 1:4], want)


def test_fake_kernels_refuse_tensors_on_another_device_as_the_ops_do():
    """A call with one argument on the meta device dispatches to the op's fake kernel: it must refuse
    what the real kernel would (an argument on another device) rather than return an uninitialised
    CPU tensor or do nothing."""
    ops = torch.ops.attention_ext
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    x, table = torch.randn(1, 4, 2, 8), torch.randn(16, 4)
    with pytest.raises(RuntimeError, match="rotary_cos must be on cpu, got meta"):
        ops.attention_rotary(x, table.to("meta"), table.to("meta"), i32(0), True, False)
    k_cache, v_cache = torch.zeros(2, 6, 2, 4), torch.zeros(2, 6, 2, 4)
    with pytest.raises(RuntimeError, match="cache_seqlens must be on cpu, got meta"):
        ops.attention_kvcache_append(k_cache, v_cache, torch.randn(2, 1, 2, 4), torch.randn(2, 1, 2, 4),
                                     i32(1, 0).to("meta"), None, None)
    q, k, v = (torch.randn(2, 10, 8) for _ in range(3))  # (heads, total tokens, d)
    cu = i32(0, 4, 10)
    out, lse = ops.attention_varlen_fwd(q, k, v, cu, cu, 6, 6, 8 ** -0.5, 0, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match="lse must be on cpu, got meta"):
        ops.attention_varlen_bwd(torch.ones_like(out), None, q, k, v, cu, cu, 6, 6, out, lse.to("meta"), 8 ** -0.5,
                                 0, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match="alibi_slopes must be on cpu, got meta"):
        ops.attention_varlen_fwd(q, k, v, cu, cu, 6, 6, 8 ** -0.5, 0, -1, -1, 0.0, torch.ones(2, device="meta"),
                                 None, 0.0, None)
    qm, km, vm = (t.to("meta").unsqueeze(0) for t in (q, k, v))
    outm, lsem = ops.attention_fwd(qm, km, vm, None, 0.35, 0, -1, -1, 0.0, None, None, 0.0, None)
    for mask in (None, torch.ones(1, 2, 10, 10, dtype=torch.bool, device="meta")):
        with pytest.raises(RuntimeError, match="a mask gradient needs a floating attn_mask"):
            ops.attention_bwd(torch.ones_like(outm), None, qm, km, vm, mask, outm, lsem, 0.35, 0, -1, -1, 0.0, None,
                              None, 0.0, None, True)


def test_vmap_over_entries_that_each_append_to_their_own_cache():
    """Under vmap each entry's call appends to its own cache (torch runs index_put_'s batching rule
    there): the same caches and outputs as the calls one by one."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 1, 1, 4, 8, generator=g) for _ in range(3))
    caches = [torch.randn(3, 1, 6, 4, 8, generator=g) for _ in range(2)]
    copies = [c.clone() for c in caches]
    call = lambda q, kc, vc, k, v: flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=2, causal=True)  # noqa: E731
    batched = torch.vmap(call)(q, *caches, k, v)
    one_by_one = torch.stack([call(q[i], copies[0][i], copies[1][i], k[i], v[i]) for i in range(3)])
    assert torch.equal(batched, one_by_one)
    assert torch.equal(caches[0], copies[0]) and torch.equal(caches[1], copies[1])


def test_per_entry_tensors_batched_by_vmap_are_refused_with_what_to_do():
    """cache_seqlens (and the other per-entry tensors) are read as values: batched by vmap they
    have none, so the call says to pass them unbatched, before anything is written."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 2, 1, 4, 8, generator=g) for _ in range(3))
    caches = [torch.zeros(3, 2, 6, 4, 8) for _ in range(2)]
    lengths = torch.tensor([[1, 3], [2, 5], [0, 4]], dtype=torch.int32)
    call = lambda q, kc, vc, k, v, l: flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=l)  # noqa: E731
    with pytest.raises(NotImplementedError, match="cache_seqlens is batched by torch.func.vmap: .* pass it unbatched"):
        torch.vmap(call)(q, *caches, k, v, lengths)
    assert not caches[0].any() and not caches[1].any()
    shared = torch.vmap(call, in_dims=(0, 0, 0, 0, 0, None))(q, *caches, k, v, lengths[0])
    assert shared.shape == (3, 2, 1, 4, 8) and caches[0][:, 0, 1].any() and caches[0][:, 1, 3].any()


def test_bad_direct_op_calls_never_crash():
    """The op checks lengths, rows and block ids against the cache itself: in a subprocess that
    must survive, every bad call raises."""
    code = r"""
import torch, attention_ext
ops = torch.ops.attention_ext
q = torch.randn(2, 2, 1, 8); kc = torch.randn(3, 2, 20, 8); pages = torch.randn(6, 2, 4, 8)
i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
calls = [
    (q, kc, kc, i32(5, 21), None, None, None),
    (q, kc, kc, i32(5, 5), i32(0, 3), None, None),
    (q, kc, kc, i32(5, 5), None, i32(6, 0), None),
    (q, pages, pages, i32(5, 9), None, None, i32([0, 1, 2], [3, 4, 60])),
    (q, pages, pages, i32(5, 13), None, None, i32([0, 1, 2], [3, 4, 5])),
    (q, kc, kc, i32(5), None, None, None),
]
for args in calls:
    try:
        ops.attention_kvcache_fwd(*args, 0.5, 0, -1, -1, 0.0, None)
    except RuntimeError as e:
        assert "attention_ext" in str(e), e
    else:
        raise SystemExit("accepted call " + str(calls.index(args)))
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-2000:]


def test_the_entries_are_checked_before_the_rotary_tables_and_an_empty_batch_returns_first():
    """The order of the refusals: the per-entry values (a cache overflow) before the rotary tables'
    shape; a batch of 0 entries returns empty outputs before the rotary tables are looked at."""
    kc, vc = torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8)
    q, k, v = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)
    cos, sin = torch.ones(16, 2), torch.zeros(16, 2)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 16 plus 1 new keys overflows"):
        flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos[:, :1], rotary_sin=sin,
                                cache_seqlens=torch.tensor([16, 0], dtype=torch.int32))
    out = flash_attn_with_kvcache(torch.randn(0, 1, 1, 8), kc, vc, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, 1, 1, 8)


def test_opcheck_and_signature():
    import inspect

    params = inspect.signature(flash_attn_with_kvcache).parameters
    assert list(params) == ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                            "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
                            "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
                            "return_softmax_lse"]
    assert attention_ext.flash_attn_with_kvcache is attention_ext.flash.flash_attn_with_kvcache
    q = torch.randn(2, 2, 2, 3, 8)
    kc = torch.randn(3, 2, 1, 20, 8)
    pages = torch.randn(6, 2, 1, 4, 8)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    torch.library.opcheck(ops.attention_kvcache_fwd, (q, kc, kc, i32(5, 9), i32(2, 0), i32(1, 0), None, 0.4, 2, 3,
                                                      -1, 5.0, torch.rand(2, 2, 1)))
    torch.library.opcheck(ops.attention_kvcache_fwd, (q, pages, pages, i32(5, 9), None, None,
                                                      i32([0, 1, 2], [3, 4, 5]), 0.4, 0, -1, -1, 0.0, None))
    # the append: (batch, new, kv_heads, d) rows into (rows | blocks, length | block_size, kv_heads, d)
    k_new, v_new = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
    torch.library.opcheck(ops.attention_kvcache_append, (torch.zeros(3, 20, 2, 8), torch.zeros(3, 20, 2, 8), k_new,
                                                         v_new, i32(5, 9), i32(2, 0), None))
    torch.library.opcheck(ops.attention_kvcache_append, (torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8), k_new,
                                                         v_new, i32(3, 0), None, i32([0, 1, 2], [3, 4, 5])))
    # the traced calls' checks (the eager call's rules, when the graph runs): each entry's key end
    ends = ops.kvcache_checked_ends(i32(5, 9), i32(2, 0), i32(1, 0), None, 2, 0, 3, 20, 3, 20, 12, 2, True)
    assert torch.equal(ends, i32(8, 12))
    torch.library.opcheck(ops.kvcache_checked_ends, (None, None, None, i32([0, 1, 2], [3, 4, 5]), 2, 7, 6, 4, 3, 12,
                                                     -1, 1, False))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 9 plus 3 new keys overflows the cache's 11 positions"):
        ops.kvcache_checked_ends(i32(5, 9), None, None, None, 2, 0, 3, 11, 3, 11, -1, 1, False)
    # the forward op checks the key ends itself
    with pytest.raises(RuntimeError, match=r"cache_seqlens\[1\] = -5 \(the keys the entry attends to, any appended "
                                           r"ones included\) must be in \[0, 20\]"):
        ops.attention_kvcache_fwd(q, kc, kc, i32(5, -5), None, None, None, 0.4, 0, -1, -1, 0.0, None)
    # the op checks every position itself before writing any (the Python function checks first)
    cache = torch.zeros(6, 4, 2, 8)
    for starts, table, message in ((i32(3, 10), i32([0, 1, 2], [3, 4, 5]), r"cache_seqlens\[1\] = 10 plus 3 new keys"),
                                   (i32(3, 0), i32([0, 1, 2], [9, 4, 5]), r"block_table\[1, 0\] = 9 is outside")):
        with pytest.raises(RuntimeError, match=message):
            ops.attention_kvcache_append(cache, cache.clone(), k_new, v_new, starts, None, table)
        assert not cache.any()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("table_dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_the_rotary_op_gives_the_bits_of_the_torch_formula(dtype, table_dtype, interleaved):
    """On CPU tensors the rotation is one op (csrc/rotary.cpp); under vmap and on other devices
    flash_attn_with_kvcache rotates with torch ops (kv_cache._rotate). Both round each product and
    the sum on their own, so they agree bit for bit: per row and shared positions, every rotary dim
    and part of them, strided rows; and both agree with the complex-multiplication reference."""
    from attention_ext import kv_cache

    g = torch.Generator().manual_seed(5)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    start = torch.tensor([3, 0, 9], dtype=torch.int32)
    x = torch.randn(3, 4, 2, 13, generator=g, dtype=torch.float64).to(dtype)[..., 1:]  # strided rows, d = 12
    for rotary_dim in (12, 8, 2, 0):
        cos, sin = (t.to(table_dtype) for t in rotary_tables(16, rotary_dim))
        for per_row in (True, False):
            got = ops.attention_rotary(x, cos, sin, start, per_row, interleaved)
            assert got.is_contiguous() and got.dtype == dtype
            positions = start.long().unsqueeze(-1) + (torch.arange(4) if per_row else torch.zeros(4, dtype=torch.long))
            rotation = kv_cache._rotation(cos, sin, positions, acc, interleaved)
            assert torch.equal(got, kv_cache._rotate(x, rotation, interleaved)), (rotary_dim, per_row)
            want = torch.stack([rotate_reference(x[b].double().clone(), cos, sin, positions[b], interleaved)
                                for b in range(3)])
            tolerance = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
            torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


def test_rotary_tables_in_other_float_dtypes_take_the_torch_formula():
    """Tables in a float dtype the op does not read (float8) take the torch formula: the result
    of the same tables converted exactly to float32."""
    cos, sin = (t.to(torch.float8_e4m3fn) for t in rotary_tables(10, 4))
    q, k, v = (torch.randn(1, 1, 2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    results = []
    for tables in ((cos, sin), (cos.float(), sin.float())):
        caches = (torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4))
        out = flash_attn_with_kvcache(q, *caches, k[:, :, :1], v[:, :, :1], rotary_cos=tables[0],
                                      rotary_sin=tables[1], cache_seqlens=2, causal=True)
        results.append((out, *caches))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_rotary_op_checks_its_arguments():
    """Direct calls with positions past the tables, a rotary dim past the head dim or misshapen
    arguments raise (in a subprocess that must survive); opcheck on its fake kernel."""
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    cos, sin = rotary_tables(10, 4)
    torch.library.opcheck(ops.attention_rotary, (torch.randn(2, 3, 2, 8), cos, sin, i32(1, 7), True, True))
    torch.library.opcheck(ops.attention_rotary, (torch.randn(2, 3, 2, 8).bfloat16(), cos.double(), sin.double(),
                                                 i32(4, 0), False, False))
    code = r"""
import torch, attention_ext
ops = torch.ops.attention_ext
i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
x, cos, sin = torch.randn(2, 3, 2, 8), torch.randn(10, 4), torch.randn(10, 4)
calls = [
    ((x, cos, sin, i32(1, 8), True, True), "positions 8..10 of entry 1 are outside the rotary tables' 10"),
    ((x, cos, sin, i32(-1, 0), False, True), "positions -1..-1 of entry 0"),
    ((x, torch.randn(10, 5), torch.randn(10, 5), i32(0, 0), True, True), "rotary_dim 10 .* exceeds the head dim 8"),
    ((x, cos, sin[:9], i32(0, 0), True, True), "must both be"),
    ((x, cos, sin, i32(0), True, True), "rotary start positions must have shape \(2,\)"),
    ((x, cos, sin, torch.tensor([0, 0]), True, True), "rotary start positions must be int32"),
    ((x[0], cos, sin, i32(0, 0), True, True), "\(batch, rows, heads, head_dim\)"),
    ((x.long(), cos, sin, i32(0, 0), True, True), "float64/float32/float16/bfloat16"),
    ((x, cos.long(), sin.long(), i32(0, 0), True, True), "rotary_cos must be float64"),
]
import re
for args, message in calls:
    try:
        ops.attention_rotary(*args)
    except RuntimeError as e:
        assert re.search(message, str(e)), (message, str(e))
    else:
        raise SystemExit(f"no error for {message}")
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-2000:]


@pytest.mark.cuda_kernels
@pytest.mark.skipif(CUDA_KERNELS_DEVICE is None, reason="needs a CUDA device or the CUDA emulation build")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
def test_cuda_kernels(dtype, block_size):
    result = run_case(dtype, "rotary", 4, 4, block_size, d=64, device=CUDA_KERNELS_DEVICE, leftpad=True)
    check(result, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_row_blocks_split_the_keys_as_the_contiguous_cache_does(cpu_variant, dtype):
    """A single decode row against 2000 keys is split into key ranges (merged by their lse); how
    many depends on the K/V layout: heads walked together or not. A paged cache of one-row blocks
    (its rows' dim of size 1) is laid out like the contiguous cache, so it gets the same ranges and
    the same bits, its blocks in any order."""
    g = torch.Generator().manual_seed(3)
    keys, kv_heads = 2000, 2
    q = torch.randn(1, 1, 4 * kv_heads, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, keys, kv_heads, 64, generator=g).to(dtype) for _ in range(2))
    order = torch.randperm(keys, generator=g)
    k_blocks, v_blocks = torch.empty(keys, 1, kv_heads, 64, dtype=dtype), torch.empty(keys, 1, kv_heads, 64, dtype=dtype)
    k_blocks[order], v_blocks[order] = k[0, :, None], v[0, :, None]
    table = order.to(torch.int32)[None]
    lengths = torch.tensor([keys], dtype=torch.int32)
    paged = flash_attn_with_kvcache(q, k_blocks, v_blocks, cache_seqlens=lengths, block_table=table,
                                    return_softmax_lse=True)
    contiguous = flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, return_softmax_lse=True)
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 7])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (4, 1), (16, 2)], ids=["mha", "gqa4", "one_kv_head", "gqa8"])
def test_a_paged_cache_gives_the_contiguous_cache_s_bits(cpu_variant, dtype, block_size, heads, kv_heads):
    """With one K/V head, blocks of 1, 5 or 7 rows cut every key tile into short runs, whose logits
    the kernel takes key by key; a contiguous cache's go through the path that reduces a vector's
    worth of keys' sums at once (hsum_lanes). Both add in the same order, so the outputs are the
    same bits. With several K/V heads both are read in storage order, the paged one run by run
    while copying each chunk of keys, in the same key ranges (one-row blocks too, whose rows'
    stride is the blocks'). (bf16 with two or more rows per K/V head in the avx512bf16 variant, and
    gqa8 in the amx variant: products on pairs of bf16, which group keys by their place in the key
    tile, whatever the runs.)"""
    g = torch.Generator().manual_seed(block_size + heads)
    cache = Cache(2, 300, kv_heads, 64, dtype, block_size=block_size, generator=g)
    q = torch.randn(2, 1, heads, 64, generator=g).to(dtype)
    lengths = torch.tensor([300, 211], dtype=torch.int32)
    k_paged, v_paged, extra = cache.tensors()
    paged = flash_attn_with_kvcache(q, k_paged, v_paged, cache_seqlens=lengths, return_softmax_lse=True, **extra)
    contiguous = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=lengths, return_softmax_lse=True)
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
