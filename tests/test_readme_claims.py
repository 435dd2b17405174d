"""README.md's claims about torch, row by row, against the installed torch.

The comparison table at the top of README.md is written down in `ROWS` below: each row's cells as
README.md states them, the tests in this file that check its torch cell against the installed torch
(2.13, CPU), and the tests that back its attention_ext cell (mostly in other files; this file only
adds what no other test checks). The FlashAttention column comes from FlashAttention-2's public
interface (`flash_attn/flash_attn_interface.py` docstrings and its README); it needs a CUDA GPU,
so `flash_attention_source` says where each cell is documented instead of naming a test.

The first tests hold README.md and this file together: changing a cell, adding a row or moving to
another torch release fails until `ROWS` and the tests it names are brought up to date. The other
torch tests fail when torch stops behaving as README.md says, including the sentences of the
Semantics table and of "How it works" that describe torch.

In torch 2.13 on CPU, `scaled_dot_product_attention` picks the fused "flash" kernel
(`_scaled_dot_product_flash_attention_for_cpu`) when its conditions hold and the math fallback
otherwise; `sdpa_kernel` forces either, and a forced flash kernel that declines a call raises
"No available kernel".
"""
from __future__ import annotations

import ast
import functools
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import jacfwd, jacrev, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right, causal_upper_left
from torch.utils._python_dispatch import TorchDispatchMode

import attention_ext

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "README.md"

FLASH = SDPBackend.FLASH_ATTENTION
MATH = SDPBackend.MATH


@dataclass(frozen=True)
class Row:
    cells: tuple[str, str, str, str]  # feature, attention_ext, torch, FlashAttention: as in README.md
    torch_tests: tuple[str, ...]  # in this file
    ours_tests: tuple[str, ...]  # "file.py::test_name" in tests/
    flash_attention_source: str


ROWS = [
    Row(("float64 in the fused kernel (gradcheck on the real kernel)",
         "yes",
         "yes: the flash kernel runs float64 and passes gradcheck",
         "no: fp16/bf16 only"),
        torch_tests=("test_torch_flash_kernel_runs_float64_and_passes_gradcheck",),
        ours_tests=("test_backward.py::test_gradcheck_float64",
                    "test_masks.py::test_gradcheck_with_float_mask_requiring_grad"),
        flash_attention_source="README: 'Datatype fp16 and bf16'"),
    Row(("fully masked rows",
         "output 0, lse −inf, zero grads, never NaN",
         "output 0 and zero grads, flash kernel and math fallback",
         "output 0 (documented for causal rows that see no key)"),
        torch_tests=("test_torch_gives_zero_output_and_zero_grads_for_fully_masked_rows",),
        ours_tests=("test_masks.py::test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_grads",
                    "test_masks.py::test_fully_masked_rows_backprop_through_lse_without_nan",
                    "test_numerics.py::test_fully_masked_rows_stay_zero_with_zero_gradients_at_extreme_scales"),
        flash_attention_source="flash_attn_func docstring: 'If the row of the mask is all zero, the output "
                               "will be zero.'"),
    Row(("gradient into a float `attn_mask` (learned biases), reduced to its broadcast shape",
         "yes, fused, deterministic",
         "math fallback only: the flash kernel declines a mask that requires grad",
         "no: no mask input"),
        torch_tests=("test_torch_flash_kernel_declines_a_float_mask_that_requires_grad",
                     "test_torch_math_fallback_gives_a_float_masks_gradient_in_the_masks_shape",
                     "test_torch_cuda_memory_efficient_backward_has_a_mask_gradient_output"),
        ours_tests=("test_masks.py::test_masked_gradients_match_reference_and_mask_grad_has_the_masks_own_shape",
                    "test_readme_claims.py::test_ours_mask_gradient_comes_out_of_the_fused_backward_in_the_masks_shape",
                    "test_masks.py::test_mask_gradient_is_bitwise_deterministic_across_runs_and_thread_counts"),
        flash_attention_source="flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, "
                               "softcap, alibi_slopes, deterministic, return_attn_probs): no mask argument"),
    Row(("any head dim (1, 3, 257, 512 …), d_k ≠ d_v",
         "yes",
         "flash kernel: any d (1, 3, 257, 512 checked) with d_k = d_v; d_k ≠ d_v runs on the math fallback",
         "d ≤ 256, d_k = d_v"),
        torch_tests=("test_torch_flash_kernel_takes_any_head_dim",
                     "test_torch_flash_kernel_needs_equal_head_dims_and_unequal_ones_run_on_the_math_fallback"),
        ours_tests=("test_forward.py::test_matches_reference",
                    "test_backward.py::test_gradients_match_reference",
                    "test_decode.py::test_decode_any_head_dims_and_strided_inputs"),
        flash_attention_source="README: 'All head dimensions up to 256'; q, k, v docstring shapes share "
                               "headdim"),
    Row(("bottom-right causal, causal + mask together",
         "yes (`attention(causal=...)`; the drop-in's `is_causal=True` with an `attn_mask`)",
         "bottom-right via the `causal_lower_right` bias (flash kernel); together only top-left: the flash "
         "kernel takes `is_causal=True` with an `attn_mask`, the math fallback raises",
         "bottom-right only (since 2.1), no mask"),
        torch_tests=("test_torch_causal_lower_right_is_bottom_right_causal_on_the_flash_kernel",
                     "test_torch_causal_bias_objects_take_no_is_causal",
                     "test_torch_flash_kernel_applies_is_causal_top_left_and_an_attn_mask_together",
                     "test_torch_math_fallback_raises_for_is_causal_with_an_attn_mask"),
        ours_tests=("test_masks.py::test_causal_kinds_match_reference_forward_lse_and_grads",
                    "test_masks.py::test_attention_combines_causal_and_attn_mask_a_key_takes_part_only_if_both_allow",
                    "test_masks.py::test_attn_mask_with_is_causal_applies_both_as_torchs_cpu_kernel"),
        flash_attention_source="flash_attn_func docstring: 'the causal mask is aligned to the bottom right "
                               "corner'; README changelog 2.1"),
    Row(("double backward, `torch.func.jvp`/`vmap`/`jacrev`/`jacfwd`",
         "yes",
         "math fallback: all; flash kernel (the default pick): `vmap` (through torch's per-sample fallback) "
         "and `jacrev` only, double backward, `jvp` and `jacfwd` raise",
         "no: its `autograd.Function` has a first-order backward only and no `setup_context` (which "
         "`torch.func` needs)"),
        torch_tests=("test_torch_math_fallback_supports_double_backward_jvp_vmap_jacrev_and_jacfwd",
                     "test_torch_picks_the_flash_kernel_by_default",
                     "test_torch_flash_kernel_supports_vmap_and_jacrev",
                     "test_torch_flash_kernel_raises_for_double_backward_jvp_and_jacfwd"),
        ours_tests=("test_higher_order.py::test_double_backward_equals_reference_double_backward",
                    "test_higher_order.py::test_func_jvp_of_out_and_lse_equals_reference_jvp",
                    "test_higher_order.py::test_vmap_equals_a_loop",
                    "test_higher_order.py::test_jacobians_equal_reference"),
        flash_attention_source="FlashAttnFunc: a torch.autograd.Function with forward(ctx, ...) and "
                               "backward only; torch.func transforms need setup_context"),
    Row(("exact attention weights on request, lse out (and differentiable)",
         "yes",
         "no: returns the output only",
         "lse with `return_attn_probs=True` (no gradient through it); its probabilities are for testing only"),
        torch_tests=("test_torch_sdpa_returns_the_output_only",),
        ours_tests=("test_masks.py::test_attention_weights_rows_sum_to_one_or_zero_and_equal_the_reference",
                    "test_higher_order.py::test_lse_gradient_equals_reference",
                    "test_backward.py::test_gradcheck_through_lse"),
        flash_attention_source="flash_attn_func docstring on return_attn_probs ('for testing only ... not "
                               "guaranteed to be correct'); FlashAttnFunc.backward(ctx, dout, *args) drops "
                               "the lse gradient"),
    Row(("bitwise deterministic, independent of the thread count",
         "yes, no atomics",
         "flash kernel: not a documented guarantee; bf16 identical for 1–3 threads in our tests, float32 dQ "
         "differed between 1 and 2–3 threads on an Intel Xeon (identical on AMD Zen 3/4); math fallback: no, its "
         "float32 backward changed with the thread count",
         "forward yes; backward opt-in (`deterministic=True`)"),
        torch_tests=("test_torch_flash_kernel_is_bitwise_identical_for_one_to_three_threads",
                     "test_torch_math_fallback_float32_backward_changes_with_the_thread_count"),
        ours_tests=("test_determinism.py::test_bitwise_identical_across_runs_and_thread_counts",
                    "test_decode.py::test_decode_is_bitwise_independent_of_thread_count"),
        flash_attention_source="flash_attn_func docstring on deterministic: 'The forward pass is always "
                               "deterministic'"),
    Row(("dropout mask reproducible from (seed, offset), same on CPU and GPU",
         "yes (on the GPU checked under the host emulation of CUDA so far)",
         "no: dropout runs on the math fallback only (the flash kernel declines `dropout_p > 0`); "
         "`torch.manual_seed` replays it, the mask is not returned",
         "CUDA only; the pattern only through the testing-only `return_attn_probs`"),
        torch_tests=("test_torch_flash_kernel_declines_dropout_which_runs_on_the_math_fallback",
                     "test_torch_dropout_replays_under_manual_seed",
                     "test_torch_sdpa_returns_the_output_only"),
        ours_tests=("test_dropout.py::test_dropout_mask_is_a_pure_function_of_rng_state_and_position",
                    "test_dropout.py::test_replay_is_bitwise_across_thread_counts",
                    "test_cuda.py::test_dropout_mask_is_the_philox_stream"),  # on a CUDA device or the emulation
        flash_attention_source="flash_attn_func docstring: S_dmask 'also encodes the dropout pattern', "
                               "returned with return_attn_probs (testing only)"),
]

# Sentences outside the table that describe torch: the Semantics table and "How it works".
SENTENCES = {
    "`is_causal` / `causal=\"top_left\"` | key j visible to query i iff j ≤ i (torch)":
        ("test_torch_is_causal_is_top_left",),
    "key j visible iff j ≤ i + (m − n) (FlashAttention, torch's `causal_lower_right`)":
        ("test_torch_causal_lower_right_is_bottom_right_causal_on_the_flash_kernel",),
    "torch 2.13 raises for a `causal_lower_right` of other sizes but ignores the sizes of a "
    "`causal_upper_left`":
        ("test_torch_causal_lower_right_of_other_sizes_raises",
         "test_torch_ignores_the_sizes_of_a_causal_upper_left",
         "test_ours_causal_upper_left_of_other_sizes_raises_value_error"),
    "gradients exactly 0 (torch 2.13 on CPU also gives output and gradients 0)":
        ("test_torch_gives_zero_output_and_zero_grads_for_fully_masked_rows",),
    "torch's semantics: query heads a multiple of key/value heads":
        ("test_torch_enable_gqa_needs_query_heads_a_multiple_of_key_value_heads",),
    "P rounded to bf16 before the P V product, as torch 2.13's CPU flash kernel does in bf16":
        ("test_torch_flash_kernel_rounds_p_to_bf16_before_the_pv_product",),
}


# ----------------------------------------------------------------------------------------------
# README.md and this file say the same thing.

def _readme_text():
    return README.read_text(encoding="utf-8")


def _comparison_table():
    """(header cells, body rows as cell tuples) of the table whose header starts '| | attention_ext |'."""
    lines = _readme_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| | attention_ext |"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(tuple(cell.strip() for cell in line.strip().strip("|").split(" | ")))
    return table[0], table[2:]


@functools.lru_cache(maxsize=None)
def _test_names(file):
    tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_readme_comparison_table_is_the_table_these_tests_check():
    _, body = _comparison_table()
    documented = [row.cells for row in ROWS]
    assert body == documented, (
        "README.md's comparison table and ROWS in tests/test_readme_claims.py differ: update ROWS and "
        "the tests each row names to what README.md now claims")


def _release(version):
    return ".".join(version.split("+")[0].split(".")[:2])


def _readme_torch_release():
    """The torch release README.md's torch column describes ('torch 2.13 SDPA on CPU ...')."""
    header, _ = _comparison_table()
    return re.match(r"torch (\d+\.\d+) SDPA on CPU", header[2]).group(1)


@pytest.fixture(autouse=True)
def _torch_claims_need_the_readme_torch(request):
    """The tests of torch's behaviour check the release README.md describes: under another torch
    (the package supports 2.4 on) they are skipped, not failed. CI installs README's torch."""
    if request.node.name.startswith("test_torch_") and _release(torch.__version__) != _readme_torch_release():
        pytest.skip(f"README.md's torch column describes torch {_readme_torch_release()}; "
                    f"torch {torch.__version__} is installed")


def test_readme_torch_column_names_the_torch_readme_installs():
    # The torch cells were checked against the release README's commands install (and CI runs);
    # moving to another one needs them checked again.
    pins = set(re.findall(r"pip install torch==(\d+\.\d+)\.\d+", _readme_text()))
    assert pins == {_readme_torch_release()}, (pins, _readme_torch_release())


def test_readme_sentences_about_torch_are_the_ones_these_tests_check():
    text = re.sub(r"\s+", " ", _readme_text())  # prose wraps anywhere
    for sentence in SENTENCES:
        assert sentence in text, f"README.md no longer says: {sentence!r}"


def test_every_test_named_for_a_claim_exists():
    here = set(globals())
    for row in ROWS:
        assert row.torch_tests and row.ours_tests and row.flash_attention_source, row.cells[0]
        for name in row.torch_tests:
            assert name.startswith("test_torch_") and name in here, name
        for ref in row.ours_tests:
            file, name = ref.split("::")
            assert name in _test_names(file), ref
    for names in SENTENCES.values():
        for name in names:
            assert name in here, name


# ----------------------------------------------------------------------------------------------
# Helpers.

def sdpa(backend, *args, **kwargs):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(*args, **kwargs)


def declined_by_flash(*args, **kwargs):
    """True iff torch's CPU flash kernel, forced, refuses the call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns why before it raises
        try:
            sdpa(FLASH, *args, **kwargs)
        except RuntimeError as error:
            assert "No available kernel" in str(error), error
            return True
    return False


def ran_on_flash(out):
    return type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"


def qkv(b=1, h=2, n=4, m=6, dk=8, dv=None, dtype=torch.float64, requires_grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
    return make(b, h, n, dk), make(b, h, m, dk), make(b, h, m, dv or dk)


def explicit_attention(q, k, v, bias):
    """softmax(Q Kᵀ/sqrt(d) + bias) V by plain autograd ops (bias: a float tensor)."""
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1)
    return weights @ v


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------
# float64.

def test_torch_flash_kernel_runs_float64_and_passes_gradcheck():
    q, k, v = qkv(h=1, n=2, m=3, dk=2)  # gradcheck costs a kernel call per input element
    out = sdpa(FLASH, q, k, v)
    assert out.dtype == torch.float64 and ran_on_flash(out)
    assert torch.autograd.gradcheck(lambda q, k, v: sdpa(FLASH, q, k, v), (q, k, v))


# ----------------------------------------------------------------------------------------------
# Fully masked rows.

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float_-inf"])
@pytest.mark.parametrize("backend", [FLASH, MATH], ids=["flash", "math"])
def test_torch_gives_zero_output_and_zero_grads_for_fully_masked_rows(backend, kind, dtype):
    q, k, v = qkv(dtype=dtype)
    keep = torch.rand(4, 6, generator=torch.Generator().manual_seed(1)) < 0.6
    keep[:, 0] = True
    keep[1] = False  # query row 1 sees no key
    mask = keep if kind == "bool" else torch.zeros(4, 6, dtype=dtype).masked_fill(~keep, float("-inf"))
    out = sdpa(backend, q, k, v, attn_mask=mask)
    assert ran_on_flash(out) == (backend == FLASH)
    assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
    assert not out.isnan().any()
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    assert torch.equal(dq[..., 1, :], torch.zeros_like(dq[..., 1, :]))
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad).all()
    # The masked row sends nothing into dK and dV either: zeroing its output gradient changes nothing.
    grad_out[..., 1, :] = 0
    _, dk_without, dv_without = torch.autograd.grad(out, (q, k, v), grad_out)
    assert torch.equal(dk, dk_without) and torch.equal(dv, dv_without)


# ----------------------------------------------------------------------------------------------
# Gradient of a float mask.

def test_torch_flash_kernel_declines_a_float_mask_that_requires_grad():
    q, k, v = qkv()
    bias = torch.randn(4, 6, dtype=torch.float64)
    assert not declined_by_flash(q, k, v, attn_mask=bias)
    assert declined_by_flash(q, k, v, attn_mask=bias.requires_grad_())


def test_torch_math_fallback_gives_a_float_masks_gradient_in_the_masks_shape():
    q, k, v = qkv()
    bias = torch.randn(2, 1, 6, dtype=torch.float64, requires_grad=True)  # broadcast over batch and rows
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert not ran_on_flash(out)  # the default dispatch fell back to math
    grad_out = torch.randn_like(out)
    (dbias,) = torch.autograd.grad(out, bias, grad_out)
    (expected,) = torch.autograd.grad(explicit_attention(q, k, v, bias), bias, grad_out)
    assert dbias.shape == bias.shape
    torch.testing.assert_close(dbias, expected, rtol=1e-10, atol=1e-12)


def test_torch_cuda_memory_efficient_backward_has_a_mask_gradient_output():
    # Not runnable without a GPU: the README's CUDA note rests on the op's schema, which the CPU
    # build registers too: the backward takes the bias and a grad_input_mask for (q, k, v, bias).
    schema = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default._schema
    arguments = {a.name: str(a.type) for a in schema.arguments}
    assert "attn_bias" in arguments
    assert arguments["grad_input_mask"] in ("bool[4]", "List[bool]")
    assert len(schema.returns) == 4


def test_ours_mask_gradient_comes_out_of_the_fused_backward_in_the_masks_shape():
    # The one attention_ext op of the backward returns the mask gradient already reduced to the
    # broadcast shape: no (B, H, n, m) gradient is materialised and summed afterwards.
    q, k, v = qkv(b=2, h=3, n=5, m=6, dk=4, dtype=torch.float32)
    bias = torch.randn(3, 1, 6, requires_grad=True)
    out = attention_ext.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    class RecordOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            self.calls.append((func, result))
            return result

    with RecordOps() as recorded:
        out.backward(torch.randn_like(out))
    kernels = [(func, result) for func, result in recorded.calls if func.namespace == "attention_ext"]
    assert [func for func, _ in kernels] == [torch.ops.attention_ext.attention_bwd.default]
    assert kernels[0][1][3].shape == bias.shape
    assert not [func for func, _ in recorded.calls if func in (torch.ops.aten.sum.dim_IntList,
                                                               torch.ops.aten.sum.default)]
    assert torch.equal(bias.grad, kernels[0][1][3])


# ----------------------------------------------------------------------------------------------
# Head dims.

@pytest.mark.parametrize("d", [1, 3, 257, 512])
def test_torch_flash_kernel_takes_any_head_dim(d):
    q, k, v = qkv(n=5, m=7, dk=d)
    out = sdpa(FLASH, q, k, v)
    assert ran_on_flash(out) and out.shape[-1] == d
    torch.testing.assert_close(out, sdpa(MATH, q, k, v), rtol=1e-12, atol=1e-12)


def test_torch_flash_kernel_needs_equal_head_dims_and_unequal_ones_run_on_the_math_fallback():
    q, k, v = qkv(dk=8, dv=16)
    assert declined_by_flash(q, k, v)
    out = F.scaled_dot_product_attention(q, k, v)
    assert not ran_on_flash(out) and out.shape[-1] == 16


# ----------------------------------------------------------------------------------------------
# Causal kinds.

def _visible(n, m, offset):
    """Key j visible to query i iff j <= i + offset."""
    return torch.arange(m)[None, :] <= torch.arange(n)[:, None] + offset


# torch warns of NaNs for n > m; its rows that see no key come out 0 (assert_close rejects NaN).
@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("n,m", [(3, 7), (7, 3), (5, 5)])
def test_torch_causal_lower_right_is_bottom_right_causal_on_the_flash_kernel(n, m):
    q, k, v = qkv(n=n, m=m)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, m))
    assert ran_on_flash(out)
    expected = sdpa(MATH, q, k, v, attn_mask=_visible(n, m, m - n))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_torch_causal_bias_objects_take_no_is_causal():
    # A CausalBias is the whole attn_mask, so bottom-right causal cannot be combined with a mask.
    q, k, v = qkv()
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 6), is_causal=True)


def _some_keys_masked(n, m):
    keep = torch.rand(n, m, generator=torch.Generator().manual_seed(3)) < 0.7
    keep[:, 0] = True
    return keep


@pytest.mark.parametrize("n,m", [(4, 6), (6, 4), (5, 5)])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_torch_flash_kernel_applies_is_causal_top_left_and_an_attn_mask_together(n, m, mask_kind):
    q, k, v = qkv(n=n, m=m)
    keep = _some_keys_masked(n, m)
    mask = keep if mask_kind == "bool" else torch.randn(n, m, dtype=torch.float64).masked_fill(~keep, -math.inf)
    out = sdpa(FLASH, q, k, v, attn_mask=mask, is_causal=True)
    assert ran_on_flash(out)
    both = mask & _visible(n, m, 0) if mask_kind == "bool" else mask.masked_fill(~_visible(n, m, 0), -math.inf)
    torch.testing.assert_close(out, sdpa(MATH, q, k, v, attn_mask=both), rtol=1e-12, atol=1e-12)


def test_torch_math_fallback_raises_for_is_causal_with_an_attn_mask():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal=True"):
        sdpa(MATH, q, k, v, attn_mask=_some_keys_masked(4, 6), is_causal=True)


@pytest.mark.parametrize("n,m", [(4, 6), (6, 4)])
def test_torch_is_causal_is_top_left(n, m):
    q, k, v = qkv(n=n, m=m)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, sdpa(MATH, q, k, v, attn_mask=_visible(n, m, 0)), rtol=1e-12, atol=1e-12)


def test_torch_causal_lower_right_of_other_sizes_raises():
    q, k, v = qkv(n=4, m=6)
    with pytest.raises(RuntimeError, match="must match"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 5))


def test_torch_ignores_the_sizes_of_a_causal_upper_left():
    q, k, v = qkv(n=4, m=6)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(3, 10))
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_ours_causal_upper_left_of_other_sizes_raises_value_error():
    # causal_lower_right: tests/test_fuzz.py::test_causal_bias_of_other_sizes_than_the_problem_raises_value_error
    q, k, v = qkv(n=4, m=6)
    with pytest.raises(ValueError, match="CausalBias attn_mask is for 3 queries and 10 keys"):
        attention_ext.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(3, 10))


# ----------------------------------------------------------------------------------------------
# Higher-order derivatives and function transforms.

def _attend(backend):
    def f(q, k, v):
        return sdpa(backend, q, k, v)
    return f


def test_torch_picks_the_flash_kernel_by_default():
    q, k, v = qkv()
    assert ran_on_flash(F.scaled_dot_product_attention(q, k, v))


def test_torch_math_fallback_supports_double_backward_jvp_vmap_jacrev_and_jacfwd():
    q, k, v = qkv(h=1, n=3, m=4, dk=2)
    f = _attend(MATH)
    assert torch.autograd.gradgradcheck(f, (q, k, v), fast_mode=True)
    primals = tuple(t.detach() for t in (q, k, v))
    tangents = tuple(torch.randn_like(t) for t in primals)
    out, tangent_out = jvp(f, primals, tangents)
    jacobians = jacrev(f, argnums=(0, 1, 2))(*primals)
    expected = sum((j * t).sum(dim=tuple(range(-t.dim(), 0))) for j, t in zip(jacobians, tangents))
    torch.testing.assert_close(tangent_out, expected, rtol=1e-10, atol=1e-12)
    for a, b in zip(jacfwd(f, argnums=(0, 1, 2))(*primals), jacobians):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    stacked = tuple(torch.stack([t, 2 * t]) for t in primals)
    batched = vmap(f)(*stacked)
    torch.testing.assert_close(batched, torch.stack([f(*primals), f(*(2 * t for t in primals))]))


def test_torch_flash_kernel_supports_vmap_and_jacrev():
    q, k, v = (t.detach() for t in qkv(n=3, m=4, dk=2))
    flash, math_ = _attend(FLASH), _attend(MATH)
    stacked = tuple(torch.stack([t, 2 * t]) for t in (q, k, v))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batched = vmap(flash)(*stacked)
    # The flash op has no batching rule: vmap runs it once per sample (and says so).
    assert any("not yet implemented the batching rule for aten::_scaled_dot_product_flash_attention_for_cpu"
               in str(w.message) for w in caught)
    torch.testing.assert_close(batched, vmap(math_)(*stacked), rtol=1e-12, atol=1e-12)
    for a, b in zip(jacrev(flash, argnums=(0, 1, 2))(q, k, v), jacrev(math_, argnums=(0, 1, 2))(q, k, v)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _double_backward(f, q, k, v):
    (dq,) = torch.autograd.grad(f(q, k, v).sum(), q, create_graph=True)
    dq.sum().backward()


def _jvp(f, q, k, v):
    jvp(f, (q.detach(), k.detach(), v.detach()), tuple(torch.ones_like(t) for t in (q, k, v)))


def _jacfwd(f, q, k, v):
    jacfwd(f)(q.detach(), k.detach(), v.detach())


@pytest.mark.parametrize("transform,message", [
    (_double_backward, "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not "
                       "implemented"),
    (_jvp, "forward AD with _scaled_dot_product_flash_attention_for_cpu"),
    (_jacfwd, "forward AD with _scaled_dot_product_flash_attention_for_cpu"),
], ids=["double_backward", "jvp", "jacfwd"])
@pytest.mark.parametrize("forced", [True, False], ids=["forced", "default_dispatch"])
def test_torch_flash_kernel_raises_for_double_backward_jvp_and_jacfwd(transform, message, forced):
    q, k, v = qkv(n=3, m=4, dk=2)
    f = _attend(FLASH) if forced else F.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match=re.escape(message)):
        transform(f, q, k, v)


# ----------------------------------------------------------------------------------------------
# Outputs.

def test_torch_sdpa_returns_the_output_only():
    # The documented signature: no option returns weights, lse or a dropout mask.
    signature = F.scaled_dot_product_attention.__doc__.strip().split(":\n")[0]
    assert re.sub(r"\s+", " ", signature) == (
        "scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, "
        "scale=None, enable_gqa=False) -> Tensor")
    q, k, v = qkv()
    assert type(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)) is torch.Tensor
    with pytest.raises(TypeError, match=r"need_weights"):
        F.scaled_dot_product_attention(q, k, v, need_weights=True)


# ----------------------------------------------------------------------------------------------
# Thread counts.

def _forward_and_grads(backend, threads, q, k, v, **kwargs):
    torch.set_num_threads(threads)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = sdpa(backend, q, k, v, **kwargs)
    grad_out = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    return (out.detach(),) + torch.autograd.grad(out, (q, k, v), grad_out)


FLASH_DETERMINISM_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "gqa_float_mask": {"enable_gqa": True, "attn_mask": "float"},
}


# float32 is not asserted: its dQ differed between 1 and 2-3 threads on an Intel Xeon (family 6,
# model 207) and was identical on AMD Zen 3 and Zen 4, so the README states both observations.
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", FLASH_DETERMINISM_CASES)
def test_torch_flash_kernel_is_bitwise_identical_for_one_to_three_threads(case, dtype, restore_threads):
    kwargs = dict(FLASH_DETERMINISM_CASES[case])
    # 100 query rows make several query blocks per head, so threads split the forward differently.
    q, k, v = qkv(b=2, h=4, n=100, m=120, dk=40, dtype=dtype, requires_grad=False)
    if kwargs.get("enable_gqa"):
        k, v = k[:, :2], v[:, :2]
    if kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(2, 1, 100, 120, generator=torch.Generator().manual_seed(2)).to(dtype)
    results = [_forward_and_grads(FLASH, threads, q, k, v, **kwargs) for threads in (1, 2, 3)]
    for threads, result in zip((2, 3), results[1:]):
        for name, a, b in zip(["out", "dq", "dk", "dv"], results[0], result):
            assert torch.equal(a, b), f"{name} differs between 1 and {threads} threads"


def test_torch_math_fallback_float32_backward_changes_with_the_thread_count(restore_threads):
    # Seen on x86 with torch's MKL build: the backward's matrix products are blocked by thread count.
    def changes(b, h, n, d):
        q, k, v = qkv(b=b, h=h, n=n, m=n, dk=d, dtype=torch.float32, requires_grad=False)
        one, two = (_forward_and_grads(MATH, threads, q, k, v) for threads in (1, 2))
        return not all(torch.equal(a, b) for a, b in zip(one, two))

    assert changes(1, 2, 100, 64) or changes(1, 1, 300, 64), (
        "torch's math fallback gave identical results for 1 and 2 threads: update README.md")


# ----------------------------------------------------------------------------------------------
# Dropout.

def test_torch_flash_kernel_declines_dropout_which_runs_on_the_math_fallback():
    q, k, v = qkv()
    assert declined_by_flash(q, k, v, dropout_p=0.3)
    assert not ran_on_flash(F.scaled_dot_product_attention(q, k, v, dropout_p=0.3))


def test_torch_dropout_replays_under_manual_seed():
    q, k, v = qkv(requires_grad=False)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        first = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        torch.manual_seed(7)
        assert torch.equal(first, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
        assert not torch.equal(first, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))


# ----------------------------------------------------------------------------------------------
# Grouped-query attention and bf16 rounding (sentences outside the table).

def test_torch_enable_gqa_needs_query_heads_a_multiple_of_key_value_heads():
    q, k, v = qkv(h=4)
    out = F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True)
    assert out.shape == q.shape
    with pytest.raises(RuntimeError, match="must divide the number of heads"):
        F.scaled_dot_product_attention(q[:, :3], k[:, :2], v[:, :2], enable_gqa=True)


def test_torch_flash_kernel_rounds_p_to_bf16_before_the_pv_product():
    # One query, scale 1, scores (0, -0.5, -0.50390625): exp gives p = (1, 0.60653, 0.60417), whose
    # last two both round to the bf16 value 0.60546875. With V = (0, 1, -1) the output is their
    # difference over the row sum: exactly 0 when P is rounded first, 0.00107 when it is not.
    bf16 = torch.bfloat16
    q = torch.ones(1, 1, 1, 1, dtype=bf16)
    k = torch.tensor([0.0, -0.5, -0.50390625], dtype=bf16).view(1, 1, 3, 1)
    v = torch.tensor([0.0, 1.0, -1.0], dtype=bf16).view(1, 1, 3, 1)
    unrounded = (math.exp(-0.5) - math.exp(-0.50390625)) / (1 + math.exp(-0.5) + math.exp(-0.50390625))
    assert sdpa(FLASH, q, k, v, scale=1.0).item() == 0.0
    # The math fallback keeps P in float32, which shows the inputs do separate the two cases.
    assert sdpa(MATH, q, k, v, scale=1.0).item() == pytest.approx(unrounded, rel=1e-2)
