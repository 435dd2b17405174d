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


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, math.nan])
def test_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got"):
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
