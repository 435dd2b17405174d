"""Bad input raises a clear Python exception naming the tensor, what it got and what was expected."""
import math

import pytest
import torch

import attention_ext

sdpa = attention_ext.scaled_dot_product_attention


def t(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_floating_dtypes(dtype):
    with pytest.raises(TypeError, match=r"query must be float64, float32, float16 or bfloat16, got torch\."):
        sdpa(torch.zeros(2, 3, 4, dtype=dtype), t(2, 3, 4), t(2, 3, 4))


def test_mixed_dtypes():
    with pytest.raises(TypeError, match=r"same dtype, got query torch.float32, key torch.float64"):
        sdpa(t(2, 3, 4), t(2, 3, 4, dtype=torch.float64), t(2, 3, 4))


def test_mixed_devices():
    with pytest.raises(ValueError, match=r"same device, got query cpu, key meta"):
        sdpa(t(2, 3, 4), torch.empty(2, 3, 4, device="meta"), t(2, 3, 4))


def test_not_a_tensor():
    with pytest.raises(TypeError, match=r"key must be a torch.Tensor, got list"):
        sdpa(t(2, 3, 4), [[1.0]], t(2, 3, 4))


@pytest.mark.parametrize("shape", [(4,), ()])
def test_fewer_than_two_dims(shape):
    with pytest.raises(ValueError, match=r"value must have at least 2 dims .* got shape"):
        sdpa(t(3, 4), t(3, 4), t(*shape))


def test_head_dim_mismatch():
    with pytest.raises(ValueError, match=r"query and key must have the same head dim .* \(2, 3, 4\) and key \(2, 5, 6\)"):
        sdpa(t(2, 3, 4), t(2, 5, 6), t(2, 5, 6))


def test_key_value_length_mismatch():
    with pytest.raises(ValueError, match=r"key and value must have the same length .* key \(2, 5, 4\) and value \(2, 6, 4\)"):
        sdpa(t(2, 3, 4), t(2, 5, 4), t(2, 6, 4))


def test_batch_dims_that_do_not_broadcast():
    with pytest.raises(ValueError, match=r"batch dims of query \(2, 3, 4\), key \(3, 5, 4\) .* do not broadcast"):
        sdpa(t(2, 3, 4), t(3, 5, 4), t(3, 5, 4))


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan])
def test_non_finite_scale(scale):
    with pytest.raises(ValueError, match=r"scale must be finite, got"):
        sdpa(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), scale=scale)


@pytest.mark.parametrize("scale", ["0.5", True, [1.0], t(2)])
def test_non_numeric_scale(scale):
    with pytest.raises(TypeError, match=r"scale must be a"):
        sdpa(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), scale=scale)


@pytest.mark.parametrize("p", [-0.1, 1.5, math.nan])
def test_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\], got"):
        sdpa(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), dropout_p=p)


def test_dropout_not_a_number():
    with pytest.raises(TypeError, match=r"dropout_p must be a number"):
        sdpa(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), dropout_p="0.1")


def test_unknown_causal_kind():
    with pytest.raises(ValueError, match=r"causal must be None, 'top_left' or 'bottom_right', got 'lower'"):
        attention_ext.attention(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), causal="lower")


def test_ops_check_their_inputs_too():
    # The raw ops are public: they validate rather than crash.
    with pytest.raises(RuntimeError, match=r"query and key must have the same head dim"):
        torch.ops.attention_ext.attention_fwd(t(2, 3, 4), t(2, 3, 5), t(2, 3, 5), None, 1.0, 0, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"causal must be 0 \(none\), 1 \(top-left\) or 2 \(bottom-right\)"):
        torch.ops.attention_ext.attention_fwd(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), None, 1.0, 7, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"dropout_p > 0 needs an rng_state"):
        torch.ops.attention_ext.attention_fwd(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), None, 1.0, 0, -1, -1, 0.0, None, None, 0.5, None)
    with pytest.raises(RuntimeError, match=r"at most 8 batch dims"):
        torch.ops.attention_ext.attention_fwd(t(*[1] * 9, 3, 4), t(3, 4), t(3, 4), None, 1.0, 0, -1, -1, 0.0, None, None, 0.0, None)
    rng_state = torch.tensor([1, 0])
    for device in ("cpu", "meta"):  # (the kernel and its fake)
        with pytest.raises(RuntimeError, match=r"batch_shape's sizes.* must be >= 0, got \[-2, 3\]"):
            torch.ops.attention_ext.dropout_keep_mask(rng_state.to(device), [-2, 3], 5, 7, 0.5)


def test_unknown_cpu_variant():
    with pytest.raises(RuntimeError, match=r"unknown CPU kernel variant 'sse9'"):
        attention_ext.set_cpu_variant("sse9")


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("switch, typo", [("ATTENTION_EXT_CPU_FORWARD", "tile"), ("ATTENTION_EXT_CPU_BACKWARD", "fuse")])
def test_unknown_path_switch_value_is_an_error_not_the_default(monkeypatch, switch, typo):
    # A mistyped switch must not silently run the default path (a test forcing a path would then
    # test the other one).
    monkeypatch.setenv(switch, typo)
    q = t(2, 5, 4).requires_grad_()
    with pytest.raises(RuntimeError, match=rf"{switch}={typo} is not a known value; expected one of: "):
        attention_ext.scaled_dot_product_attention(q, q, q).sum().backward()


def test_a_scale_tensor_that_requires_grad_is_refused_not_dropped():
    """torch takes scale as a float; a tensor the caller expects a gradient for must not lose it."""
    with pytest.raises(TypeError, match=r"scale is a tensor that requires grad"):
        sdpa(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), scale=torch.tensor(0.5, requires_grad=True))


def test_a_scale_or_dropout_tensor_asked_for_a_derivative_is_refused_not_read_as_a_constant():
    """A tensor scale (or dropout_p) with a forward-mode tangent, or traced by a torch.func
    transform, would be read as a constant: its derivative would be silently 0. Refused, as a
    scale that requires grad is; a plain tensor scale inside such a transform is still taken."""
    q, k, v = t(2, 3, 4), t(2, 3, 4), t(2, 3, 4)
    s, one = torch.tensor(0.7), torch.tensor(1.0)
    says = r"scale is a tensor with a forward-mode tangent or traced by a torch\.func transform"
    with pytest.raises(TypeError, match=says):
        torch.func.jvp(lambda sc: attention_ext.attention(q, k, v, scale=sc), (s,), (one,))
    with pytest.raises(TypeError, match=r"scale is a tensor that requires grad"):  # (grad's tensors require it)
        torch.func.grad(lambda sc: attention_ext.attention_weights(q, k, scale=sc).sum())(s)
    with pytest.raises(TypeError, match=says):
        torch.func.vmap(lambda sc: sdpa(q, k, v, scale=sc))(torch.tensor([0.5, 0.7]))
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        with pytest.raises(TypeError, match=says):
            sdpa(q, k, v, scale=fwAD.make_dual(s, one))
        with pytest.raises(TypeError, match=r"dropout_p is a tensor with a forward-mode tangent"):
            sdpa(q, k, v, dropout_p=fwAD.make_dual(torch.tensor(0.1), one))
    # q under the transform, the scale a plain tensor: taken as its value.
    out, tangent = torch.func.jvp(lambda x: sdpa(x, k, v, scale=s), (q,), (torch.ones_like(q),))
    want, want_tangent = torch.func.jvp(lambda x: sdpa(x, k, v, scale=0.7), (q,), (torch.ones_like(q),))
    assert torch.equal(out, want) and torch.equal(tangent, want_tangent)


def test_a_one_element_dropout_tensor_is_taken_as_its_value():
    q = t(2, 3, 4)
    torch.manual_seed(0)
    a = sdpa(q, q, q, dropout_p=torch.tensor(0.25))
    torch.manual_seed(0)
    assert torch.equal(a, sdpa(q, q, q, dropout_p=0.25))


@pytest.mark.parametrize("dtype,softcap", [(torch.float32, 1e39), (torch.float32, 1e38), (torch.float32, 1e-46),
                                           (torch.float64, 1e-320)])  # (1e38: its reciprocal would be subnormal)
def test_a_softcap_outside_the_accumulation_range_is_refused(dtype, softcap):
    """softcap·log2(e) is held in the accumulation dtype: beyond it NaN, below its normal range 0."""
    q = t(2, 3, 4).to(dtype)
    with pytest.raises(ValueError, match=r"softcap must be within the"):
        attention_ext.attention(q, q, q, softcap=softcap)
    with pytest.raises(RuntimeError, match=r"softcap .* is outside the"):  # the op's own check
        torch.ops.attention_ext.attention_fwd(q, q, q, None, 0.5, 0, -1, -1, softcap, None, None, 0.0, None)


def test_numpy_bools_are_bools_and_other_types_are_named():
    np = pytest.importorskip("numpy")
    q = t(2, 3, 4)
    assert torch.equal(sdpa(q, q, q, is_causal=np.True_), sdpa(q, q, q, is_causal=True))
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got numpy.int64"):
        sdpa(q, q, q, is_causal=np.int64(1))
    for value in (0, 1):  # torch refuses ints here too, 0 as well as 1
        with pytest.raises(TypeError, match=r"is_causal must be a bool, got int"):
            sdpa(q, q, q, is_causal=value)


def test_gqa_slopes_must_name_every_query_head():
    """With 4 query heads on 2 K/V heads a (2,) vector would broadcast over the groups (slope of
    head h = s[h % 2]), not the K/V heads: refused, as FlashAttention refuses it."""
    q, kv = t(1, 4, 3, 8), t(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"one value per query head \(4\)"):
        attention_ext.attention(q, kv, kv, enable_gqa=True, alibi_slopes=torch.ones(2))
    with pytest.raises(TypeError, match=r"alibi_slopes must be float32 of shape \(4,\) or \(1, 4\)"):
        attention_ext.flash_attn_func(q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2),
                                      alibi_slopes=torch.ones(2))


@pytest.mark.parametrize("layout", ["jagged", "strided"])
def test_nested_tensors_are_refused_with_a_pointer_to_the_variable_length_api(layout):
    # (batch, ragged length, heads, dim) transposed to (batch, heads, length, dim), as torch's docs build them
    nested = torch.nested.nested_tensor([t(3, 2, 8), t(5, 2, 8)], layout=getattr(torch, layout)).transpose(1, 2)
    for call in (sdpa, attention_ext.attention):
        with pytest.raises(NotImplementedError, match=r"query is a nested tensor.*varlen_attention"):
            call(nested, nested, nested)


@pytest.mark.parametrize("bound", [2 ** 62 + 1, 2 ** 70])
def test_a_window_bound_beyond_2_to_the_62_is_a_value_error(bound):
    q = t(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"window bounds must be at most 2\*\*62"):
        attention_ext.attention(q, q, q, window=(bound, None))
    assert attention_ext.attention(q, q, q, window=(2 ** 62, None)).shape == q.shape


def test_leading_dims_past_the_kernels_limit_are_merged_and_the_op_refuses_them():
    """The kernels take kMaxBatchDims (8) batch dims: the API merges the leading ones of a call
    with more (tests/test_forward.py checks the results); the op called directly refuses them."""
    from attention_ext.api import _MAX_BATCH_DIMS
    for dims in (_MAX_BATCH_DIMS, _MAX_BATCH_DIMS + 1):
        q = t(*[1] * dims, 3, 8)
        assert sdpa(q, q, q).shape == q.shape
    with pytest.raises(RuntimeError, match=rf"at most {_MAX_BATCH_DIMS} batch dims"):
        torch.ops.attention_ext.attention_fwd(q, q, q, None, 0.5, 0, -1, -1, 0.0, None, None, 0.0, None)


def test_kvcache_with_no_entries_returns_empty_results_and_a_paged_cache_needs_a_slot():
    out, lse = attention_ext.flash_attn_with_kvcache(t(0, 1, 4, 8), t(2, 5, 2, 8), t(2, 5, 2, 8), cache_seqlens=2,
                                                     return_softmax_lse=True)
    assert out.shape == (0, 1, 4, 8) and lse.shape == (0, 4, 1) and lse.dtype == torch.float32
    rotated = attention_ext.flash_attn_with_kvcache(t(0, 1, 4, 8), t(2, 5, 2, 8), t(2, 5, 2, 8), t(0, 1, 2, 8),
                                                   t(0, 1, 2, 8), torch.ones(6, 4), torch.zeros(6, 4), cache_seqlens=2)
    assert rotated.shape == (0, 1, 4, 8)
    with pytest.raises(ValueError, match=r"a paged k_cache needs at least one block of at least one slot"):
        attention_ext.flash_attn_with_kvcache(t(3, 1, 4, 8), t(3, 0, 2, 8), t(3, 0, 2, 8), cache_seqlens=0,
                                              block_table=torch.zeros(3, 1, dtype=torch.int32))


def test_a_stray_meta_tensor_beside_real_ones_is_refused_not_answered_with_garbage():
    """Any meta argument sends the op to its fake kernel, which returns uninitialised tensors on q's
    device: the index tensors and the backward's extra inputs are checked for their device too."""
    q, k, v = t(6, 2, 8), t(7, 2, 8), t(7, 2, 8)
    cu_q, cu_k = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be on cpu, got meta"):
        attention_ext.flash_attn_varlen_func(q, k, v, cu_q.to("meta"), cu_k, 6, 7)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k must be on cpu, got meta"):  # the op itself
        torch.ops.attention_ext.attention_varlen_fwd(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu_q,
                                                     cu_k.to("meta"), 6, 7, 0.3, 0, -1, -1, 0.0, None, None, 0.0, None)
    out, lse = torch.ops.attention_ext.attention_fwd(q, q, q, None, 0.3, 0, -1, -1, 0.0, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"grad_lse must be on cpu, got meta"):
        torch.ops.attention_ext.attention_bwd(out, lse.to("meta"), q, q, q, None, out, lse, 0.3, 0, -1, -1, 0.0, None,
                                              None, 0.0, None, False)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"block_table must be on cpu, got meta"):
        torch.ops.attention_ext.attention_kvcache_fwd(t(1, 2, 1, 1, 8), t(2, 2, 1, 4, 8), t(2, 2, 1, 4, 8),
                                                      torch.tensor([5], dtype=torch.int32), None, None,
                                                      table.to("meta"), 0.3, 0, -1, -1, 0.0, None)
    # All on meta is shape inference, and works.
    assert attention_ext.flash_attn_varlen_func(*(x.to("meta") for x in (q, k, v, cu_q, cu_k)), 6, 7).is_meta


@pytest.mark.parametrize("call", [
    lambda q: attention_ext.attention(q, q, q, return_lse="no"),
    lambda q: attention_ext.attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), return_lse=torch.tensor(False)),
    lambda q: attention_ext.flash_attn_func(q, q, q, return_attn_probs="False"),
    lambda q: attention_ext.varlen_attention(q[0], q[0], q[0], *[torch.tensor([0, 3], dtype=torch.int32)] * 2, 3, 3,
                                             return_lse="no"),
], ids=["attention", "attention full path", "flash_attn_func", "varlen_attention"])
def test_return_flags_must_be_bools(call):
    """A truthy string is not True: it would silently change the return type."""
    with pytest.raises(TypeError, match=r"must be a bool, got (str|torch\.Tensor)"):
        call(t(1, 3, 2, 4))


@pytest.mark.parametrize("window_size", ["20", (1.9, 0), (float("inf"), 0), (torch.tensor(2), 0), 5])
def test_flash_window_size_must_be_a_pair_of_ints(window_size):
    q = t(1, 5, 2, 8)
    with pytest.raises(TypeError, match=r"window_size must be a pair of ints \(left, right\)"):
        attention_ext.flash_attn_func(q, q, q, window_size=window_size)


def test_messages_name_what_the_caller_passed():
    # FlashAttention's layout is what the message shows, not the transposed view the kernels get.
    with pytest.raises(ValueError, match=r"q and k must have the same head_dim, got q \(2, 5, 4, 8\) and k \(2, 6, 2, 4\)"):
        attention_ext.flash_attn_func(t(2, 5, 4, 8), t(2, 6, 2, 4), t(2, 6, 2, 4))
    with pytest.raises(ValueError, match=r"causal must be None, 'top_left' or 'bottom_right', got \['top_left'\]"):
        attention_ext.attention(t(2, 3, 4), t(2, 3, 4), t(2, 3, 4), causal=["top_left"])
    q = t(1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"query must be a dense \(strided\) tensor, got layout torch.sparse_coo"):
        attention_ext.attention(q.to_sparse(), q, q)
    with pytest.raises(TypeError, match=r"dropout_mask shape must be a tuple of ints >= 0"):
        attention_ext.dropout_mask(torch.tensor([1, 2]), (2.7, 3.9), 0.1)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int in \[0, 2\*\*63\)"):
        attention_ext.flash_attn_varlen_func(t(4, 2, 8), t(4, 2, 8), t(4, 2, 8), cu, cu, 2 ** 63, 4)
