"""Forward: the fused kernels compute softmax(Q Kᵀ · scale) V like the float64 reference."""
import math
import os

import pytest
import torch

import attention_ext
from attention_ext.reference import attention_reference

from conftest import amx_tiles, assert_close_to_reference, assert_lse_close, cpuinfo, cpu_variants, rand

F = torch.nn.functional


def test_seed_worked_example():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    v = torch.tensor([[10.0, 0.0], [0.0, 10.0], [5.0, 5.0]])
    out = attention_ext.scaled_dot_product_attention(q, k, v)
    expected = torch.tensor([[6.15, 3.85], [3.85, 6.15], [5.0, 5.0]])
    assert torch.allclose(out, expected, atol=6e-3)
    # Exactly what the formula says, step by step, in float64.
    s = (q.double() @ k.double().T) / math.sqrt(2)
    w = torch.softmax(s, dim=-1)
    assert torch.allclose(out.double(), w @ v.double(), atol=1e-6)
    assert torch.allclose(attention_ext.attention_weights(q, k).double(), w, atol=1e-6)


SHAPES = [
    # (q batch, kv batch, n, m, dk, dv)
    ((), (), 3, 3, 2, 2),
    ((1,), (1,), 1, 1, 1, 1),
    ((2, 3), (2, 3), 17, 33, 5, 7),
    ((2, 3), (2, 3), 64, 64, 64, 64),
    ((1, 2), (1, 2), 130, 257, 64, 32),
    ((2,), (2,), 65, 1, 16, 16),
    ((1, 2), (1, 2), 113, 127, 257, 3),
    ((1, 1), (1, 1), 5, 9, 512, 512),
    ((2, 1, 3), (1, 4, 1), 9, 11, 8, 8),  # batch dims broadcast both ways
    ((2, 2, 2, 2), (2, 2, 2, 2), 6, 5, 4, 3),  # four leading dims
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_matches_reference(shape, dtype, causal, cpu_variant):
    qb, kb, n, m, dk, dv = shape
    q, k, v = rand(*qb, n, dk, dtype=dtype), rand(*kb, m, dk, dtype=dtype), rand(*kb, m, dv, dtype=dtype)
    out, lse = attention_ext.attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse, _ = attention_reference(q, k, v, causal=causal)
    assert out.shape == ref.shape and out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    budget = None
    if dtype in (torch.float16, torch.bfloat16):
        budget = (attention_reference(q, k, v, causal=causal, dtype=None)[0].double() - ref).abs().max().item()
    assert_close_to_reference(out, ref, dtype, budget)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("scale", [None, 0.0, 0.125, -0.7, 3.0, torch.tensor(0.5)])
def test_scale(scale):
    q, k, v = rand(2, 7, 6, dtype=torch.float32), rand(2, 9, 6, dtype=torch.float32), rand(2, 9, 4, dtype=torch.float32)
    ours = attention_ext.scaled_dot_product_attention(q, k, v, scale=scale)
    s = None if scale is None else float(scale)
    torch_out = F.scaled_dot_product_attention(q, k, v, scale=s)
    assert torch.allclose(ours, torch_out, atol=2e-6)


@pytest.mark.parametrize("is_causal", [False, True])
def test_drop_in_for_torch(is_causal):
    q, k, v = rand(2, 4, 33, 16, dtype=torch.float32), rand(2, 4, 40, 16, dtype=torch.float32), rand(2, 4, 40, 8, dtype=torch.float32)
    ours = attention_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert torch.allclose(ours, theirs, atol=3e-6)


def test_transposed_views_are_read_through_strides():
    # (B, N, H, D).transpose(1, 2): the common layout coming out of a projection.
    q = rand(2, 19, 3, 8, dtype=torch.float32).transpose(1, 2)
    k = rand(2, 23, 3, 8, dtype=torch.float32).transpose(1, 2)
    v = rand(2, 23, 3, 5, dtype=torch.float32).transpose(1, 2)
    assert not q.is_contiguous()
    out = attention_ext.scaled_dot_product_attention(q, k, v)
    ref = attention_reference(q, k, v)[0]
    assert_close_to_reference(out, ref, torch.float32)
    # Non-unit last-dim stride too.
    q2 = rand(2, 3, 8, 19, dtype=torch.float32).transpose(-1, -2)
    out2 = attention_ext.scaled_dot_product_attention(q2, k, v)
    assert_close_to_reference(out2, attention_reference(q2, k, v)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_out_and_gradients_follow_the_inputs_layout(dtype):
    """A query seen through a transpose of (B, N, H, D) memory gives an out laid out the same way,
    as torch's kernels do, so the model's transpose back and reshape to (B, N, H·D) copy nothing;
    each gradient comes in its input's order of dims. The values are those of contiguous inputs, bit for
    bit; a contiguous query gives a contiguous out."""
    qkv = rand(2, 19, 3, 4, 8, dtype=dtype)  # a fused projection's output: (B, N, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(1, 2).requires_grad_() for i in range(3))
    out = attention_ext.attention(q, k, v, causal="top_left")
    assert out.shape == (2, 4, 19, 8) and out.transpose(1, 2).is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)

    plain = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    plain_out = attention_ext.attention(*plain, causal="top_left")
    assert plain_out.is_contiguous() and torch.equal(plain_out, out)
    plain_grads = torch.autograd.grad(plain_out, plain, torch.ones_like(plain_out))
    for g, p in zip(grads, plain_grads):
        assert p.is_contiguous() and torch.equal(g, p)
    # one query row or one head: both layouts are the same memory order
    assert attention_ext.attention(q[:, :, :1], k, v).is_contiguous()
    assert attention_ext.attention(q[:, :1], k[:, :1], v[:, :1]).is_contiguous()
    # a contiguous query broadcast over the heads or the batch: a contiguous out
    assert attention_ext.attention(plain[0][:, :1], *plain[1:]).is_contiguous()
    assert attention_ext.attention(plain[0][0], *plain[1:]).is_contiguous()
    # GQA (its query heads split into (kv_heads, groups) inside): the same
    kv = rand(2, 19, 2, 2, 8, dtype=dtype)
    gqa_out = attention_ext.attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), enable_gqa=True)
    assert gqa_out.transpose(1, 2).is_contiguous()
    assert torch.equal(gqa_out, attention_ext.attention(q.contiguous(), kv[:, :, 0].transpose(1, 2).contiguous(),
                                                        kv[:, :, 1].transpose(1, 2).contiguous(), enable_gqa=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 500, 64, "top_left"), (1, 2, 2, 130, 1100, 512, None),
                                   (1, 1, 1, 1100, 300, 512, "bottom_right")],
                         ids=["gqa-causal", "key-tiles-past-the-kept-ones", "query-tiles-past-the-kept-ones"])
@pytest.mark.parametrize("backward", ["fused", "split"])
def test_packed_tiles_kept_across_tiles_give_the_bits_of_contiguous_inputs(cpu_variant, dtype, shape, backward,
                                                                           monkeypatch):
    """Rows a model's (B, n, H, d) layout spaces apart are packed, and each packed tile is kept for
    the next tiles that read it (the forward's K/V tiles across a head's query tiles and the heads
    of a GQA group, the fused backward's Q/dO tiles across its key tiles) as far as a budget goes,
    later ones packed on every visit (d = 512: past the budget at ~1000 keys or queries), with
    either backward (the split one keeps none). The results are those of contiguous inputs, bit
    for bit."""
    monkeypatch.setenv("ATTENTION_EXT_CPU_BACKWARD", backward)
    batch, heads, kv_heads, n, m, d, causal = shape
    qkv = [rand(batch, length, h, d, dtype=dtype) for length, h in ((n, heads), (m, kv_heads), (m, kv_heads))]
    model = [t.transpose(1, 2).requires_grad_() for t in qkv]
    dense = [t.detach().contiguous().requires_grad_() for t in model]
    go = rand(batch, heads, n, d, dtype=dtype)
    results = []
    for q, k, v in (model, dense):
        out = attention_ext.attention(q, k, v, causal=causal, enable_gqa=heads != kv_heads)
        results.append([out, *torch.autograd.grad(out, (q, k, v), go)])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    reference = attention_reference(*model, causal=causal, enable_gqa=heads != kv_heads)[0]
    assert_close_to_reference(results[0][0], reference, dtype)


def test_stride_zero_expanded_inputs():
    k = rand(1, 1, 31, 8, dtype=torch.float32).expand(2, 4, 31, 8)
    v = rand(1, 1, 31, 8, dtype=torch.float32).expand(2, 4, 31, 8)
    q = rand(2, 4, 13, 8, dtype=torch.float32)
    out = attention_ext.scaled_dot_product_attention(q, k, v)
    assert_close_to_reference(out, attention_reference(q, k, v)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [3, 70], ids=["decode", "tiled"])
def test_empty_sizes(cpu_variant, dtype, rows):
    """Every variant's kernels, decode and tiled, in every dtype: a zero size anywhere gives the
    defined result (an empty tensor's data pointer may be null: no kernel may hand it to memcpy)."""
    t = dict(dtype=dtype)
    # n = 0: empty output
    out = attention_ext.scaled_dot_product_attention(rand(2, 0, 4, **t), rand(2, 5, 4, **t), rand(2, 5, 3, **t))
    assert out.shape == (2, 0, 3)
    # m = 0: zeros, lse -inf
    out, lse = attention_ext.attention(rand(2, rows, 4, **t), rand(2, 0, 4, **t), rand(2, 0, 3, **t), return_lse=True)
    assert out.shape == (2, rows, 3) and torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    # zero batch
    out = attention_ext.scaled_dot_product_attention(rand(0, 2, rows, 4, **t), rand(0, 2, 5, 4, **t),
                                                     rand(0, 2, 5, 3, **t))
    assert out.shape == (0, 2, rows, 3)
    # d_v = 0
    assert attention_ext.scaled_dot_product_attention(rand(rows, 4, **t), rand(5, 4, **t), rand(5, 0, **t)).shape == (rows, 0)
    # d_k = 0: every score is 0, so each row is the mean of the values
    v = rand(5, 2, **t)
    out = attention_ext.scaled_dot_product_attention(rand(rows, 0, **t), rand(5, 0, **t), v)
    assert_close_to_reference(out, v.double().mean(0, keepdim=True).expand(rows, 2), dtype)


def test_large_magnitudes_do_not_overflow():
    q = rand(1, 8, 16, dtype=torch.float32, scale=1e3)
    k = rand(1, 8, 16, dtype=torch.float32, scale=1e3)
    v = rand(1, 8, 16, dtype=torch.float32)
    out = attention_ext.scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(out).all()
    ref = attention_reference(q, k, v)[0]
    assert_close_to_reference(out, ref, torch.float32)  # (scores ~1e6: each row one-hot, to float32)


def test_output_is_convex_combination_of_values():
    q, k, v = rand(3, 50, 8, dtype=torch.float32), rand(3, 70, 8, dtype=torch.float32), rand(3, 70, 6, dtype=torch.float32)
    out = attention_ext.scaled_dot_product_attention(q, k, v)
    lo = v.min(dim=-2, keepdim=True).values
    hi = v.max(dim=-2, keepdim=True).values
    assert (out >= lo - 1e-5).all() and (out <= hi + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dk,dv", [(64, 64), (33, 96), (128, 40)])
def test_low_precision_with_masks_dropout_and_strided_storage(dtype, dk, dv, cpu_variant):
    # The bf16 forward of the avx512bf16 variant packs Kᵀ and V as bf16 pairs and rounds P to
    # bf16: every packing path (odd head dim, unit and non-unit column strides, odd key count)
    # and every score modifier must still match the reference within the dtype's budget.
    n, m, p = 70, 131, 0.2
    q = rand(2, 3, n, dk, dtype=dtype)
    k = rand(2, 3, dk, m, dtype=dtype).transpose(-1, -2)  # column stride != 1
    v = rand(2, 3, m, dv, dtype=dtype)
    v_strided = rand(2, 3, dv, m, dtype=dtype).transpose(-1, -2)
    mask = (torch.randn(1, 3, n, m, dtype=torch.float64) * 2).to(dtype)
    for value in (v, v_strided):
        torch.manual_seed(3)
        keep = attention_ext.dropout_mask(attention_ext.draw_rng_state(), (2, 3, n, m), p)
        torch.manual_seed(3)
        out = attention_ext.attention(q, k, value, attn_mask=mask, causal="bottom_right", dropout_p=p)
        ref = attention_reference(q, k, value, mask, causal="bottom_right", dropout_mask=keep, dropout_p=p)[0]
        budget = (attention_reference(q, k, value, mask, causal="bottom_right", dropout_mask=keep, dropout_p=p,
                                      dtype=None)[0].double() - ref).abs().max().item()
        assert_close_to_reference(out, ref, dtype, budget)


@pytest.mark.cpu_kernels
@pytest.mark.skipif("avx512bf16" not in cpu_variants(), reason="this CPU has no AVX512-BF16")
def test_avx512bf16_variant_runs_its_own_bf16_forward():
    # It rounds P to bf16 for the P V product, so its bf16 output differs from the avx512
    # variant's (which keeps P in fp32) while both stay within the bf16 budget; for every other
    # dtype the two variants run the same code and agree bitwise.
    q, k, v = (rand(2, 4, 100, 64, dtype=torch.bfloat16) for _ in range(3))
    previous = attention_ext.cpu_variant()
    try:
        results = {}
        for variant in ("avx512bf16", "avx512"):
            attention_ext.set_cpu_variant(variant)
            results[variant] = attention_ext.scaled_dot_product_attention(q, k, v)
            results[variant + "_fp32"] = attention_ext.scaled_dot_product_attention(q.float(), k.float(), v.float())
    finally:
        attention_ext.set_cpu_variant(previous)
    assert not torch.equal(results["avx512bf16"], results["avx512"])
    assert torch.equal(results["avx512bf16_fp32"], results["avx512_fp32"])
    ref = attention_reference(q, k, v)[0]
    budget = (attention_reference(q, k, v, dtype=None)[0].double() - ref).abs().max().item()
    for variant in ("avx512bf16", "avx512"):
        assert_close_to_reference(results[variant], ref, torch.bfloat16, budget)


@pytest.mark.cpu_kernels
def test_auto_takes_amx_where_granted_else_the_bf16_dot_variant_only_on_amd():
    # AMX tiles are the fastest bf16 products wherever the CPU has them and Linux grants the tile
    # state. Without AMX: AVX512-BF16 dot products gave half the fp32 FMAs' flop rate on the Intel
    # core measured and more than it on AMD's, so 'auto' follows the vendor (never a timing).
    info = attention_ext.build_info()
    supported = info["cpu_variants_supported"].split(",")
    assert info["cpu_variant_auto"] in supported
    vendor = cpuinfo().get("vendor_id")
    if "amx" in supported:
        expected = "amx"
    elif "avx512bf16" in supported and vendor in ("GenuineIntel", "AuthenticAMD"):
        expected = "avx512bf16" if vendor == "AuthenticAMD" else "avx512"
    else:
        pytest.skip(f"needs a CPU with AMX or AVX512-BF16 from Intel or AMD (vendor {vendor!r}, supported {supported})")
    assert info["cpu_variant_auto"] == expected
    previous = attention_ext.cpu_variant()
    try:
        assert attention_ext.set_cpu_variant("auto") == expected
    finally:
        attention_ext.set_cpu_variant(previous)


@pytest.mark.cpu_kernels
def test_build_info_reports_the_active_variants_vector_width(cpu_variant):
    # 64-byte vectors for the AVX-512 variants, 32 for AVX2, 16 for the portable one (SSE2 on
    # x86-64, NEON on arm64): the width some summation orders follow (test_decode's fp32 rows four
    # at a time), so it follows set_cpu_variant.
    expected = {"amx": "64", "avx512bf16": "64", "avx512": "64", "avx2": "32", "generic": "16"}
    assert attention_ext.build_info()["cpu_vector_bytes"] == expected[cpu_variant]


@pytest.mark.cpu_kernels
def test_build_info_says_whether_avx512_runs_as_two_256_bit_halves():
    # AMD's family 25 cores with AVX-512 (Zen 4) run 512-bit operations as two halves, and bf16
    # decode with four rows per K/V head takes dot products there (decode_bf16_dot.inc); read
    # from CPUID, so /proc/cpuinfo's family and flags say the same.
    info = cpuinfo()
    if "vendor_id" not in info:
        pytest.skip("no /proc/cpuinfo vendor to compare with")
    split = (info["vendor_id"] == "AuthenticAMD" and info.get("cpu family") == "25"
             and "avx512f" in info.get("flags", "").split())
    assert attention_ext.build_info()["cpu_avx512_double_pumped"] == ("1" if split else "0")


@pytest.mark.cpu_kernels
def test_amx_is_supported_exactly_where_the_cpu_has_amx_bf16():
    # The variant needs AMX-TILE and AMX-BF16 (and the kernel's grant of the tile state, which a
    # Linux with AMX support gives): a CPU listing both flags gets it, one without never does.
    info = attention_ext.build_info()
    if "amx" not in info["cpu_variants_compiled"].split(","):
        pytest.skip("the amx variant is not compiled here (needs x86-64 Linux and GCC >= 11)")
    flags = cpuinfo().get("flags", "").split()
    has_amx = "amx_tile" in flags and "amx_bf16" in flags and "avx512_bf16" in flags
    assert ("amx" in info["cpu_variants_supported"].split(",")) == has_amx


TILE_STATE_RUN = r"""
import ctypes, sys, torch
import attention_ext

libc = ctypes.CDLL(None, use_errno=True)
def tiles_permitted():  # arch_prctl(ARCH_GET_XCOMP_PERM): the xfeatures this process may use
    features = ctypes.c_ulong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(features)) == 0
    return bool(features.value >> 18 & 1)  # XFEATURE_XTILEDATA

def call(n):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, m, 64).bfloat16() for m in (n, 80, 80))
    return attention_ext.scaled_dot_product_attention(q, k, v)

assert attention_ext.build_info()["cpu_variant"] == "amx"
torch.manual_seed(0)
attention_ext.scaled_dot_product_attention(*torch.randn(3, 1, 2, 40, 64).unbind())  # float32
call(4)  # a bf16 decode call: not on tiles
assert attention_ext.build_info()["amx_tile_state"] == "not requested" and not tiles_permitted()
if sys.argv[1] == "small_signal_stack":
    # A signal stack too small for the tile state: Linux refuses the request then.
    class StackT(ctypes.Structure):
        _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]
    stack = ctypes.create_string_buffer(8192)
    assert libc.sigaltstack(ctypes.byref(StackT(ctypes.addressof(stack), 0, 8192)), None) == 0
out = call(100)
state = attention_ext.build_info()["amx_tile_state"]
print(state, tiles_permitted())
attention_ext.set_cpu_variant("avx512")
print(torch.equal(out, call(100)))
"""


@pytest.mark.cpu_kernels
@pytest.mark.skipif(not amx_tiles(), reason="this CPU has no AMX (or Linux refused this process its tile state)")
@pytest.mark.parametrize("causal", [False, True])
def test_amx_bf16_forward_past_its_packed_key_budget_packs_tiles_in_turn(causal):
    # A head's packed K and V are kept between query tiles up to 1 MiB; past that (4200 keys at
    # d = 128: 2.1 MiB) every key tile is packed for each use, into two slots taken in turn, since
    # the forward packs the next key tile while the current one's V is still read (the tile
    # products of the next tile run between the softmax blocks of this one). 70 query rows: a last
    # block of 6 rows and 10 of padding. Were the next tile packed over the current one, P V would
    # read the wrong values.
    torch.manual_seed(0)
    q = rand(1, 2, 70, 128, dtype=torch.bfloat16)
    k, v = rand(1, 2, 4200, 128, dtype=torch.bfloat16), rand(1, 2, 4200, 128, dtype=torch.bfloat16)
    previous = attention_ext.cpu_variant()
    try:
        attention_ext.set_cpu_variant("amx")
        out, lse = attention_ext.attention(q, k, v, causal="bottom_right" if causal else None, return_lse=True)
    finally:
        attention_ext.set_cpu_variant(previous)
    mode = "bottom_right" if causal else None
    ref, ref_lse, _ = attention_reference(q, k, v, causal=mode)
    budget = (attention_reference(q, k, v, causal=mode, dtype=None)[0].double() - ref).abs().max().item()
    assert_close_to_reference(out, ref, torch.bfloat16, budget)
    assert_lse_close(lse, ref_lse, torch.bfloat16)


@pytest.mark.cpu_kernels
@pytest.mark.skipif("amx" not in cpu_variants(), reason="this CPU has no AMX (or Linux does not offer its tile state)")
@pytest.mark.parametrize("signal_stack", ["none", "small_signal_stack"])
def test_amx_tile_state_is_requested_on_the_first_tile_call_and_a_refusal_falls_back(signal_stack):
    # Listing or choosing the amx variant, float32 calls and bf16 decode calls leave the process
    # without AMX's tile state (Linux would then refuse every smaller signal stack); the first bf16
    # call that runs on tiles requests it. Where Linux refuses (here: a signal stack too small for
    # the tiles), the amx variant's bf16 kernels run the avx512 variant's code, bit for bit.
    import subprocess
    import sys
    env = {key: value for key, value in os.environ.items() if not key.startswith("ATTENTION_EXT_CPU_")}
    result = subprocess.run([sys.executable, "-c", TILE_STATE_RUN, signal_stack], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    state, permitted, same_as_avx512 = result.stdout.split()
    if signal_stack == "none":
        assert (state, permitted, same_as_avx512) == ("granted", "True", "False")
    else:
        assert (state, permitted, same_as_avx512) == ("refused", "False", "True")


@pytest.mark.cpu_kernels
@pytest.mark.skipif(not amx_tiles(), reason="this CPU has no AMX (or Linux refused this process its tile state)")
@pytest.mark.parametrize("n,m,dk,dv", [(100, 200, 64, 64), (64, 64, 128, 128), (48, 131, 96, 48), (17, 70, 80, 16),
                                       (130, 190, 32, 72)])
def test_amx_variant_runs_its_own_bf16_forward_and_backward(n, m, dk, dv):
    # Its bf16 tile products run on AMX tiles: Kᵀ (and in the backward Vᵀ, Qᵀ, dOᵀ) transposed in
    # 16 x 16 blocks where rows are dense and the head dim a multiple of 32 (else packed pair by
    # pair), head dims padded to whole tiles, row blocks of 32 and 16, column blocks of 32 and 16.
    # P (and in the backward dS) is rounded to bf16 for the products that take it, so its bf16
    # results differ from the avx512 variant's (fp32 P and dS) while both stay within the bf16
    # budget; for every other dtype it runs the avx512 variant's code, bit for bit.
    torch.manual_seed(0)
    q, k = rand(2, 3, n, dk, dtype=torch.bfloat16), rand(2, 3, m, dk, dtype=torch.bfloat16)
    v = rand(2, 3, m, dv, dtype=torch.bfloat16)
    grad_out = rand(2, 3, n, dv, dtype=torch.bfloat16)
    previous = attention_ext.cpu_variant()
    results, grads = {}, {}
    try:
        for variant in ("amx", "avx512"):
            attention_ext.set_cpu_variant(variant)
            for causal in (False, True):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out = attention_ext.scaled_dot_product_attention(*leaves, is_causal=causal)
                results[variant, causal] = out.detach()
                grads[variant, causal] = torch.autograd.grad(out, leaves, grad_out)
            leaves32 = [t.float().requires_grad_() for t in (q, k, v)]
            out32 = attention_ext.scaled_dot_product_attention(*leaves32)
            results[variant, "fp32"] = [out32.detach(), *torch.autograd.grad(out32, leaves32, grad_out.float())]
    finally:
        attention_ext.set_cpu_variant(previous)
    assert all(torch.equal(a, b) for a, b in zip(results["amx", "fp32"], results["avx512", "fp32"]))
    assert not torch.equal(results["amx", False], results["avx512", False])
    assert not torch.equal(grads["amx", False][0], grads["avx512", False][0])
    for causal in (False, True):
        mode = "top_left" if causal else None
        ref = attention_reference(q, k, v, causal=mode)[0]
        budget = (attention_reference(q, k, v, causal=mode, dtype=None)[0].double() - ref).abs().max().item()
        leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref_grads = torch.autograd.grad(attention_reference(*leaves64, causal=mode)[0], leaves64, grad_out.double())
        for variant in ("amx", "avx512"):
            assert_close_to_reference(results[variant, causal], ref, torch.bfloat16, budget)
            for name, got, want in zip("qkv", grads[variant, causal], ref_grads):
                # bf16 inputs and gradients: a few ulp (2^-8) of the largest entry
                err = (got.double() - want).abs().max().item()
                assert err <= 2e-2 * want.abs().max().item(), (variant, causal, name, err)


@pytest.mark.cpu_kernels
@pytest.mark.skipif("amx" not in cpu_variants(), reason="this CPU has no AMX (or Linux does not offer its tile state)")
@pytest.mark.parametrize("n", [7, 8])
def test_amx_variant_keeps_decode_shaped_calls_on_the_avx512_code(n):
    # At most 8 query rows: the decode forward, and a backward whose tiles would be mostly padding,
    # run the avx512 variant's code in bf16 too, bit for bit (gradients included); except that the
    # decode forward takes 8 or more rows per K/V head on AMX tiles (where Linux grants the tile
    # state): then the output differs and the gradients (avx512 backward) stay within rounding.
    torch.manual_seed(0)
    q, k, v = rand(2, 4, n, 64, dtype=torch.bfloat16), rand(2, 4, 300, 64, dtype=torch.bfloat16), rand(2, 4, 300, 64, dtype=torch.bfloat16)
    previous = attention_ext.cpu_variant()
    results = {}
    try:
        for variant in ("amx", "avx512"):
            attention_ext.set_cpu_variant(variant)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = attention_ext.scaled_dot_product_attention(*leaves)
            results[variant] = [out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))]
    finally:
        attention_ext.set_cpu_variant(previous)
    if n < 8 or not amx_tiles():
        assert all(torch.equal(a, b) for a, b in zip(results["amx"], results["avx512"]))
        return
    assert not torch.equal(results["amx"][0], results["avx512"][0])
    for a, b in zip(results["amx"], results["avx512"]):
        assert (a.double() - b.double()).abs().max().item() < 0.05 * b.double().abs().max().item()


@pytest.mark.cpu_kernels
@pytest.mark.skipif("amx" not in cpu_variants(), reason="this CPU has no AMX (or Linux does not offer its tile state)")
@pytest.mark.parametrize("m", [300, 4200])  # a head's packed K/V kept between query tiles (1 MiB), or repacked
def test_amx_packed_key_values_are_reused_per_head_with_the_same_bits(m):
    # Query tiles of one head reuse its packed key tiles, also across the query heads of a GQA
    # group (one K/V head, broadcast); how a thread's chunk of items falls (1 or 2 threads) changes
    # which tiles are reused, never the result.
    torch.manual_seed(0)
    q = rand(1, 2, 3, 150, 64, dtype=torch.bfloat16)
    k, v = (rand(1, 2, 1, m, 64, dtype=torch.bfloat16).expand(1, 2, 3, m, 64) for _ in range(2))
    previous, threads = attention_ext.cpu_variant(), torch.get_num_threads()
    try:
        attention_ext.set_cpu_variant("amx")
        outs = []
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            outs.append(attention_ext.scaled_dot_product_attention(q, k, v))
        attention_ext.set_cpu_variant("avx512")
        fp32_p = attention_ext.scaled_dot_product_attention(q, k, v)
    finally:
        attention_ext.set_cpu_variant(previous)
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    ref = attention_reference(q, k, v)[0]
    budget = (attention_reference(q, k, v, dtype=None)[0].double() - ref).abs().max().item()
    assert_close_to_reference(outs[0], ref, torch.bfloat16, budget)
    assert_close_to_reference(fp32_p, ref, torch.bfloat16, budget)


def test_under_autocast_the_call_runs_in_the_autocast_dtype_as_torchs_does():
    scaled_dot_product_attention = attention_ext.scaled_dot_product_attention
    """torch's SDPA is on autocast's lower-precision list: q, k, v and a float mask are cast to the
    autocast dtype (a bf16 query beside fp32 K/V included), gradients return in the inputs' dtypes."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 8, generator=g, requires_grad=True)
    k, v, mask = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(3, 5, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        mixed = scaled_dot_product_attention(q.bfloat16(), k, v, attn_mask=mask)
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        lean = scaled_dot_product_attention(q, k, v)  # (the no-mask fast path too)
    assert out.dtype == mixed.dtype == lean.dtype == torch_out.dtype == torch.bfloat16
    want = scaled_dot_product_attention(*(t.detach().bfloat16() for t in (q, k, v, mask)))
    assert torch.equal(out, want) and torch.equal(mixed, want)
    assert torch.equal(lean, scaled_dot_product_attention(*(t.detach().bfloat16() for t in (q, k, v))))
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32
    # float64 is left be (as torch's autocast), and a CausalBias stays one
    from torch.nn.attention.bias import causal_lower_right
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert scaled_dot_product_attention(*(x.detach().double() for x in (q, k, v))).dtype == torch.float64
        assert torch.equal(scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 5)),
                           attention_ext.attention(q, k, v, causal="bottom_right"))


def test_autocast_holds_in_a_compiled_call_too():
    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    mask = torch.randn(3, 3)
    masked = torch.compile(lambda q, k, v, m: attention_ext.scaled_dot_product_attention(q, k, v, attn_mask=m),
                           fullgraph=True, backend="eager")
    lean = torch.compile(lambda q, k, v: attention_ext.scaled_dot_product_attention(q, k, v, is_causal=True),
                         fullgraph=True, backend="eager")
    assert masked(q, k, v, mask).dtype == lean(q, k, v).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert masked(q, k, v, mask).dtype == lean(q, k, v).dtype == torch.bfloat16


def test_more_batch_dims_than_the_kernels_take_are_merged():
    """torch takes any number of batch dims; the kernels take 8. Ten of them (key and value
    broadcast along a leading one; one float mask that varies along the merged dims and one
    that broadcasts over them; sinks that vary along them) give the reference's output and lse,
    the weights, gradients into every input, mask and the sinks (gradcheck), and dropout's keep
    mask indexed over all ten dims in row-major order."""
    from attention_ext import attention_weights, draw_rng_state, dropout_mask

    lead = (2, 1, 1, 1, 1, 1, 1, 1, 2, 1)
    q = rand(*lead, 3, 4, requires_grad=True)
    k = rand(1, *lead[1:], 5, 4, requires_grad=True)
    v = rand(1, *lead[1:], 5, 2, requires_grad=True)
    sinks = rand(2, *[1] * 9, requires_grad=True)  # one per (first dim, head)
    for mask in (rand(2, 1, 3, 5, requires_grad=True),  # (broadcast over the first eight batch dims)
                 rand(2, *[1] * 9, 3, 5, requires_grad=True)):  # (varies along the merged ones)
        out, lse = attention_ext.attention(q, k, v, attn_mask=mask, causal="bottom_right", sinks=sinks,
                                           return_lse=True)
        ref_out, ref_lse, _ = attention_reference(q, k, v, mask, causal="bottom_right", sinks=sinks)
        assert out.shape == (*lead, 3, 2) and lse.shape == (*lead, 3)
        assert (out - ref_out).abs().max().item() <= 1e-12 and (lse - ref_lse).abs().max().item() <= 1e-12
        weights = attention_weights(q, k, attn_mask=mask, causal="bottom_right", sinks=sinks)
        assert weights.shape == (*lead, 3, 5)
        assert torch.allclose(weights @ v.expand(*lead, 5, 2), out, atol=1e-12, rtol=0)
        assert torch.autograd.gradcheck(
            lambda *t: attention_ext.attention(*t[:3], attn_mask=t[3], sinks=t[4]), (q, k, v, mask, sinks))
    torch.manual_seed(7)
    keep = dropout_mask(draw_rng_state("cpu"), (*lead, 3, 5), 0.4)
    torch.manual_seed(7)
    dropped = attention_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.4)
    want = attention_reference(q, k, v, mask, dropout_mask=keep, dropout_p=0.4)[0]
    assert (dropped - want).abs().max().item() <= 1e-12
