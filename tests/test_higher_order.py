"""Beyond first-order reverse mode: double backward (gradgradcheck), forward-mode AD (torch.func.jvp
and forward_ad dual numbers), vmap, jacrev/jacfwd/hessian, and gradients through the lse output.
Everything is compared with the float64 reference differentiated by torch itself."""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from attention_ext import (
    attention,
    attention_reference,
    attention_weights,
    draw_rng_state,
    dropout_mask,
    scaled_dot_product_attention,
)

from conftest import rand


def assert_close(actual, expected, atol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.1e}"


def tiny(n=3, m=4, d=2, dv=2, batch=(1, 2), requires_grad=True):
    return (rand(*batch, n, d, requires_grad=requires_grad), rand(*batch, m, d, requires_grad=requires_grad),
            rand(*batch, m, dv, requires_grad=requires_grad))


def reseeded(fn, seed=0):
    """gradcheck calls the function many times: re-seed so each call draws the same dropout."""
    def wrapped(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return wrapped


def keep_mask(seed, shape, p):
    torch.manual_seed(seed)
    return dropout_mask(draw_rng_state(), shape, p)


# ----------------------------------------------------------------------------------------------
# Double backward.

@pytest.mark.parametrize("causal,n,m", [(None, 3, 4), ("top_left", 4, 3), ("bottom_right", 3, 5),
                                        ("bottom_right", 4, 2)])
def test_gradgradcheck_q_k_v(causal, n, m):
    q, k, v = tiny(n, m, batch=(1,) if causal is None else (1, 2))
    assert torch.autograd.gradgradcheck(lambda q, k, v: attention(q, k, v, causal=causal), (q, k, v),
                                        fast_mode=causal is not None)


def test_gradgradcheck_with_dropout_reseeded_each_call():
    q, k, v = tiny(batch=(2,))
    fn = reseeded(lambda q, k, v: scaled_dot_product_attention(q, k, v, dropout_p=0.3))
    assert torch.autograd.gradgradcheck(fn, (q, k, v), fast_mode=True)


def test_gradgradcheck_through_lse():
    q, k, v = tiny()
    assert torch.autograd.gradgradcheck(lambda q, k, v: attention(q, k, v, return_lse=True), (q, k, v),
                                        fast_mode=True)


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_double_backward_equals_reference_double_backward(causal):
    """d/d(q,k,v) of <grad(out), w> for a fixed cotangent and w, vs the reference's."""
    q, k, v = tiny(4, 5, 3, 3, batch=(2,))
    mask = rand(4, 5, requires_grad=True) if causal is None else None
    g_out = torch.randn(2, 4, 3, dtype=torch.float64)
    ws = [torch.randn_like(t) for t in (q, k, v)]

    def second(fn, leaves):
        out = fn(*leaves)
        g = torch.autograd.grad(out, leaves[:3], g_out, create_graph=True)
        s = sum((a * b).sum() for a, b in zip(g, ws))
        return torch.autograd.grad(s, [t for t in leaves if t is not None])

    ours = second(lambda q, k, v, mk: attention(q, k, v, attn_mask=mk, causal=causal), [q, k, v, mask])
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (q, k, v, mask)]
    expected = second(lambda q, k, v, mk: attention_reference(q, k, v, mk, causal=causal)[0], leaves)
    for i, (a, b) in enumerate(zip(ours, expected)):
        assert_close(a, b, 1e-10, f"second derivative {i}")


def _hessian_case():
    q, k, v = (t.detach() for t in tiny(2, 3, 2, 2, batch=()))
    mask = rand(2, 3)

    def ours(q):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask).pow(2).sum()

    def ref(q):
        return attention_reference(q, k, v, mask)[0].pow(2).sum()

    return q, ours, ref


def test_third_derivative_equals_reference():
    """create_graph=True three times: the composite backward is itself differentiable."""
    q, k, v = (t.detach() for t in tiny(3, 4, 2, 2, batch=(2,)))
    mask = rand(3, 4)

    def third(fn):
        leaf = q.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(leaf).pow(2).sum(), leaf, create_graph=True)
        (h,) = torch.autograd.grad((g * g).sum(), leaf, create_graph=True)
        return torch.autograd.grad(h.sin().sum(), leaf)[0]

    got = third(lambda x: attention(x, k, v, attn_mask=mask, causal="bottom_right"))
    expected = third(lambda x: attention_reference(x, k, v, mask, causal="bottom_right")[0])
    assert expected.abs().max() > 1e-3
    assert_close(got, expected, 1e-10, "third derivative")


@pytest.mark.parametrize("strategy", ["reverse-mode", "forward-mode"])
def test_autograd_functional_hessian_equals_reference(strategy):
    """forward-mode: torch.autograd.forward_ad over the differentiable backward (its jvp, which
    cannot open a second forward-AD level there, runs reverse mode twice), vectorized."""
    q, ours, ref = _hessian_case()
    got = torch.autograd.functional.hessian(ours, q, vectorize=strategy == "forward-mode",
                                            outer_jacobian_strategy=strategy)
    assert_close(got, torch.autograd.functional.hessian(ref, q), 1e-10, "hessian")


def test_func_hessian_wrt_query_equals_reference():
    q, ours, ref = _hessian_case()
    assert_close(hessian(ours)(q), hessian(ref)(q), 1e-10, "hessian")


HESSIAN_CASES = {
    "plain": {},
    "causal_bottom_right_window": {"causal": "bottom_right", "window": (1, None)},
    "softcap_alibi": {"softcap": 1.5, "alibi_slopes": torch.tensor([0.3, 0.7])},
    "sinks": {"sinks": True},
    "dropout": {"dropout_p": 0.4},
}


@pytest.mark.parametrize("case", HESSIAN_CASES)
def test_func_hessian_wrt_every_input_at_once_equals_reference(case):
    """torch.func.hessian (forward over reverse: the differentiable backward's jvp) of a loss of
    q, k, v, a float mask and the sinks together, against the reference's autograd Hessian."""
    kwargs = dict(HESSIAN_CASES[case])
    q, k, v = (t.detach() for t in tiny(3, 4, 2, 2, batch=(1, 2)))
    mask = rand(3, 4)
    sinks = rand(2) if kwargs.pop("sinks", False) else None
    p = kwargs.pop("dropout_p", 0.0)
    keep = keep_mask(3, (1, 2, 3, 4), p) if p else None
    weights = rand(1, 2, 3, 2)

    def ours(q, k, v, mask, *sinks_arg):
        torch.manual_seed(3)
        out = attention(q, k, v, attn_mask=mask, sinks=sinks_arg[0] if sinks_arg else None, dropout_p=p, **kwargs)
        return (out * out * weights).sum()

    def ref(q, k, v, mask, *sinks_arg):
        out = attention_reference(q, k, v, mask, sinks=sinks_arg[0] if sinks_arg else None, dropout_mask=keep,
                                  dropout_p=p, **kwargs)[0]
        return (out * out * weights).sum()

    args = (q, k, v, mask) + ((sinks,) if sinks is not None else ())
    argnums = tuple(range(len(args)))
    # (jacfwd(jacrev(f)) is torch.func.hessian; vmap inside jacfwd must be told how to draw dropout)
    got = jacfwd(jacrev(ours, argnums=argnums), argnums=argnums, randomness="same")(*args)
    expected = torch.autograd.functional.hessian(ref, args)
    for i in argnums:
        for j in argnums:
            assert_close(got[i][j], expected[i][j], 1e-10, f"{case}: d2/d{i}d{j}")


def test_backward_jvp_with_tangents_only_for_out_gives_zeros():
    """out and lse enter the differentiable backward only through q, k and v (the composite
    recomputes them): tangents of out alone move no gradient."""
    from attention_ext.function import AttentionBackward
    q, k, v, go = (rand(1, 3, 4) for _ in range(4))
    out, lse = torch.ops.attention_ext.attention_fwd(q, k, v, None, 0.5, 0, -1, -1, 0.0, None, None, 0.0, None)

    def grads(o):
        return AttentionBackward.apply(go, None, q, k, v, None, o, lse, 0.5, 0, -1, -1, 0.0, None, None, 0.0, None,
                                       False, False)[:3]

    for tangent in jvp(grads, (out,), (torch.ones_like(out),))[1]:
        assert tangent.shape == q.shape and torch.equal(tangent, torch.zeros_like(tangent))


@pytest.mark.parametrize("how", ["grad_of_grad", "jacrev_of_jacrev"])
def test_func_reverse_over_reverse_equals_reference(how):
    q, ours, ref = _hessian_case()
    if how == "grad_of_grad":
        got = grad(lambda x: grad(ours)(x).sum())(q)
        expected = grad(lambda x: grad(ref)(x).sum())(q)
    else:
        got, expected = jacrev(jacrev(ours))(q), jacrev(jacrev(ref))(q)
    assert_close(got, expected, 1e-10, how)


@pytest.mark.parametrize("how", ["jacfwd_of_jacfwd", "jvp_of_jvp", "jvp_of_jvp_weights"])
def test_forward_over_forward_raises_rather_than_dropping_the_second_order_term(how):
    """torch gives a custom Function's jvp its saved tensors without the outer level's tangent:
    forward over forward would silently miss a term, so it is refused (the other three orders of
    composition above are exact)."""
    q, ours, _ = _hessian_case()
    t = torch.randn_like(q)
    with pytest.raises(NotImplementedError, match="nested forward-mode AD"):
        if how == "jacfwd_of_jacfwd":
            jacfwd(jacfwd(ours))(q)
        elif how == "jvp_of_jvp":
            jvp(lambda y: jvp(ours, (y,), (t,))[1], (q,), (t,))
        else:
            k = torch.randn_like(q)
            jvp(lambda y: jvp(lambda x: attention_weights(x, k).sum(), (y,), (t,))[1], (q,), (t,))


# ----------------------------------------------------------------------------------------------
# Forward mode.

JVP_CASES = ["plain", "bool_mask", "float_mask", "top_left", "bottom_right", "dropout"]


def _jvp_setup(case):
    q, k, v = (t.detach() for t in tiny(4, 5, 3, 2, batch=(2, 2)))
    mask, causal, p, keep = None, None, 0.0, None
    if case == "bool_mask":
        mask = torch.rand(1, 2, 4, 5) < 0.7
        mask[..., 0] = True
    elif case == "float_mask":
        mask = rand(2, 1, 4, 5)
    elif case in ("top_left", "bottom_right"):
        causal = case
    elif case == "dropout":
        p = 0.4
        keep = keep_mask(0, (2, 2, 4, 5), p)
    return q, k, v, mask, causal, p, keep


@pytest.mark.parametrize("case", JVP_CASES)
def test_func_jvp_of_out_and_lse_equals_reference_jvp(case):
    q, k, v, mask, causal, p, keep = _jvp_setup(case)
    float_mask = mask is not None and mask.is_floating_point()
    primals = (q, k, v) + ((mask,) if float_mask else ())
    tangents = tuple(torch.randn_like(t) for t in primals)

    def ours(q, k, v, mk=mask):
        torch.manual_seed(0)
        return attention(q, k, v, attn_mask=mk, causal=causal, dropout_p=p, return_lse=True)

    def ref(q, k, v, mk=mask):
        out, lse, _ = attention_reference(q, k, v, mk, causal=causal, dropout_mask=keep, dropout_p=p)
        return out, lse

    (out, lse), (out_t, lse_t) = jvp(ours, primals, tangents)
    (r_out, r_lse), (r_out_t, r_lse_t) = jvp(ref, primals, tangents)
    assert_close(out, r_out, 1e-10, "out")
    assert_close(out_t, r_out_t, 1e-10, "out tangent")
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close(lse_t[finite], r_lse_t[finite], 1e-10, "lse tangent")


@pytest.mark.parametrize("which", [0, 1, 2])
def test_jvp_with_a_single_tangent_input_equals_reference(which):
    q, k, v = (t.detach() for t in tiny(3, 4, 2, 3))
    args = [q, k, v]

    def ours(x):
        a = list(args)
        a[which] = x
        return scaled_dot_product_attention(*a)

    def ref(x):
        a = list(args)
        a[which] = x
        return attention_reference(*a)[0]

    t = torch.randn_like(args[which])
    assert_close(jvp(ours, (args[which],), (t,))[1], jvp(ref, (args[which],), (t,))[1], 1e-10, "tangent")


@pytest.mark.parametrize("case", ["plain", "float_mask", "bottom_right"])
def test_forward_ad_dual_numbers_equal_reference_jvp(case):
    q, k, v, mask, causal, _, _ = _jvp_setup(case)
    float_mask = mask is not None and mask.is_floating_point()
    primals = (q, k, v) + ((mask,) if float_mask else ())
    tangents = tuple(torch.randn_like(t) for t in primals)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p_, t_) for p_, t_ in zip(primals, tangents)]
        mk = duals[3] if float_mask else mask
        out, lse = attention(duals[0], duals[1], duals[2], attn_mask=mk, causal=causal, return_lse=True)
        out_t = fwAD.unpack_dual(out).tangent
        lse_t = fwAD.unpack_dual(lse).tangent
        out_p = fwAD.unpack_dual(out).primal

    def ref(q, k, v, mk=mask):
        out, lse, _ = attention_reference(q, k, v, mk, causal=causal)
        return out, lse

    (r_out, r_lse), (r_out_t, r_lse_t) = jvp(ref, primals, tangents)
    assert_close(out_p, r_out, 1e-10, "primal")
    assert_close(out_t, r_out_t, 1e-10, "out tangent")
    finite = torch.isfinite(r_lse)
    assert_close(lse_t[finite], r_lse_t[finite], 1e-10, "lse tangent")


def test_forward_ad_with_gqa_equals_reference():
    q = rand(1, 4, 3, 2)
    k, v = rand(1, 2, 4, 2), rand(1, 2, 4, 3)
    tangents = [torch.randn_like(t) for t in (q, k, v)]
    _, ours = jvp(lambda q, k, v: scaled_dot_product_attention(q, k, v, enable_gqa=True), (q, k, v), tuple(tangents))
    _, ref = jvp(lambda q, k, v: attention_reference(q, k, v, enable_gqa=True)[0], (q, k, v), tuple(tangents))
    assert_close(ours, ref, 1e-10, "tangent")


_PROBS_NO_FORWARD_AD = ("attention_weights (op attention_probs) has only a backward formula registered: under "
                        "forward-mode AD its output silently carries no tangent (torch.func.jvp gives zeros, "
                        "forward_ad.unpack_dual(...).tangent is None) instead of the softmax's jvp or an error")


def test_func_jvp_of_attention_weights_equals_reference():
    q, k, _ = (t.detach() for t in tiny(3, 4))
    mask = rand(3, 4)
    tangents = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(mask))
    _, got = jvp(lambda q, k, mk: attention_weights(q, k, attn_mask=mk), (q, k, mask), tangents)
    v_dummy = torch.zeros(*k.shape[:-1], 1, dtype=k.dtype)
    _, expected = jvp(lambda q, k, mk: attention_reference(q, k, v_dummy, mk)[2], (q, k, mask), tangents)
    assert_close(got, expected, 1e-10, "weights tangent")


def test_forward_ad_dual_of_attention_weights_has_the_reference_tangent():
    q, k, _ = (t.detach() for t in tiny(3, 4))
    tq = torch.randn_like(q)
    with fwAD.dual_level():
        w = attention_weights(fwAD.make_dual(q, tq), k)
        tangent = fwAD.unpack_dual(w).tangent
    v_dummy = torch.zeros(*k.shape[:-1], 1, dtype=k.dtype)
    _, expected = jvp(lambda q: attention_reference(q, k, v_dummy)[2], (q,), (tq,))
    assert tangent is not None, "no tangent"
    assert_close(tangent, expected, 1e-10, "weights tangent")


def test_jvp_on_fully_masked_rows_is_zero_and_finite():
    q, k, v = (t.detach() for t in tiny(3, 4))
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    _, (out_t, lse_t) = jvp(lambda q, k, v: attention(q, k, v, attn_mask=mask, return_lse=True), (q, k, v), tangents)
    assert torch.equal(out_t[..., 1, :], torch.zeros_like(out_t[..., 1, :]))
    assert not torch.isnan(out_t).any() and not torch.isnan(lse_t).any()


# ----------------------------------------------------------------------------------------------
# vmap.

VB = 3  # the vmapped size


def _loop(fn, in_dims, args, out_dim=0):
    results = []
    for i in range(VB):
        sliced = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]
        results.append(fn(*sliced))
    return torch.stack(results, out_dim)


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, None), (None, 0, 0), (None, 0, None), (1, 2, 0),
                                     (2, None, 1), (-1, 0, None)], ids=str)
def test_vmap_equals_a_loop(in_dims):
    n, m, d, dv = 4, 5, 3, 2
    shapes = [(2, n, d), (2, m, d), (2, m, dv)]
    args = []
    for shape, dim in zip(shapes, in_dims):
        if dim is None:
            args.append(rand(*shape))
        else:
            dim = dim % (len(shape) + 1)
            args.append(rand(*shape[:dim], VB, *shape[dim:]))
    fn = scaled_dot_product_attention
    assert_close(vmap(fn, in_dims=in_dims)(*args), _loop(fn, in_dims, args), 1e-12, "vmap")


@pytest.mark.parametrize("mask_dim", [0, None, 1])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_vmap_with_a_mask_equals_a_loop(kind, mask_dim):
    q, k, v = rand(VB, 2, 4, 3), rand(2, 5, 3), rand(VB, 2, 5, 2)
    mshape = (4, 5)
    if mask_dim is not None:
        mshape = (*mshape[:mask_dim], VB, *mshape[mask_dim:])
    mask = torch.rand(mshape) < 0.7 if kind == "bool" else rand(*mshape)
    in_dims = (0, None, 0, mask_dim)
    fn = lambda q, k, v, mk: attention(q, k, v, attn_mask=mk, causal=None)  # noqa: E731
    assert_close(vmap(fn, in_dims=in_dims)(q, k, v, mask), _loop(fn, in_dims, (q, k, v, mask)), 1e-12, "vmap")


def test_vmap_with_out_dims_and_lse_equals_a_loop():
    q, k, v = rand(2, VB, 4, 3), rand(2, 5, 3), rand(2, 5, 2)
    fn = lambda q, k, v: attention(q, k, v, causal="bottom_right", return_lse=True)  # noqa: E731
    out, lse = vmap(fn, in_dims=(1, None, None), out_dims=(2, 1))(q, k, v)
    assert_close(out, _loop(lambda *a: fn(*a)[0], (1, None, None), (q, k, v), out_dim=2), 1e-12, "out")
    assert_close(lse, _loop(lambda *a: fn(*a)[1], (1, None, None), (q, k, v), out_dim=1), 1e-12, "lse")


def test_nested_vmap_equals_a_loop():
    q, k, v = rand(VB, 2, 4, 3), rand(2, VB, 5, 3), rand(5, 2)
    inner = vmap(scaled_dot_product_attention, in_dims=(0, 0, None))
    out = vmap(inner, in_dims=(0, 1, None))(q, k, v.expand(5, 2).contiguous().unsqueeze(0).expand(2, 5, 2)[0])
    for i in range(VB):
        for j in range(2):
            assert_close(out[i, j], scaled_dot_product_attention(q[i, j], k[j, i], v), 1e-12, f"[{i},{j}]")


def test_vmap_with_gqa_equals_a_loop():
    q, k, v = rand(VB, 1, 4, 3, 2), rand(1, 2, 5, 2), rand(VB, 1, 2, 5, 2)
    fn = lambda q, k, v: scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    assert_close(vmap(fn, in_dims=(0, None, 0))(q, k, v), _loop(fn, (0, None, 0), (q, k, v)), 1e-12, "vmap")


def test_vmap_of_grad_gives_per_sample_gradients():
    q, k, v = rand(VB, 2, 3, 2), rand(VB, 2, 4, 2), rand(2, 4, 2)
    mask = rand(VB, 3, 4)

    def loss(q, k, v, mk):
        return attention(q, k, v, attn_mask=mk).pow(2).sum()

    g = vmap(grad(loss, argnums=(0, 1, 3)), in_dims=(0, 0, None, 0))(q, k, v, mask)
    for i in range(VB):
        leaves = [q[i].clone().requires_grad_(), k[i].clone().requires_grad_(), mask[i].clone().requires_grad_()]
        expected = torch.autograd.grad(attention_reference(leaves[0], leaves[1], v, leaves[2])[0].pow(2).sum(), leaves)
        for name, a, b in zip("qkm", g, expected):
            assert_close(a[i], b, 1e-10, f"d{name}[{i}]")


def test_vmap_of_jvp_equals_a_loop():
    q, k, v = (t.detach() for t in tiny(3, 4))
    tq = torch.randn(VB, *q.shape, dtype=torch.float64)
    f = lambda q: scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    batched = vmap(lambda t: jvp(f, (q,), (t,))[1])(tq)
    for i in range(VB):
        assert_close(batched[i], jvp(f, (q,), (tq[i],))[1], 1e-12, f"tangent {i}")


def _dropout_vmap_inputs():
    return rand(VB, 2, 4, 3), rand(VB, 2, 5, 3), rand(VB, 2, 5, 2)


def _sdpa_dropout(q, k, v):
    return scaled_dot_product_attention(q, k, v, dropout_p=0.5)


def test_vmap_with_dropout_and_default_randomness_raises_like_torch():
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(_sdpa_dropout)(*_dropout_vmap_inputs())


def test_vmap_with_dropout_and_randomness_same_gives_every_element_the_unbatched_calls_pattern():
    """randomness="same": one drawn state, so each element is the unbatched call on it under the
    same seed (one dropout pattern for all; as torch's), replayable under manual_seed."""
    q, k, v = _dropout_vmap_inputs()
    torch.manual_seed(1)
    batched = vmap(_sdpa_dropout, randomness="same")(q, k, v)
    for i in range(VB):
        torch.manual_seed(1)
        assert torch.equal(batched[i], _sdpa_dropout(q[i], k[i], v[i])), i
    same = vmap(_sdpa_dropout, randomness="same")(*(t[:1].expand(VB, *t.shape[1:]) for t in (q, k, v)))
    assert all(torch.equal(same[i], same[0]) for i in range(VB))


def test_vmap_with_dropout_and_randomness_different_gives_each_element_its_own_pattern_and_replays():
    q, k, v = (t[:1].expand(VB, *t.shape[1:]) for t in _dropout_vmap_inputs())  # equal inputs
    torch.manual_seed(1)
    a = vmap(_sdpa_dropout, randomness="different")(q, k, v)
    torch.manual_seed(1)
    b = vmap(_sdpa_dropout, randomness="different")(q, k, v)
    assert torch.equal(a, b)
    assert not all(torch.equal(a[i], a[0]) for i in range(1, VB))
    grads = torch.func.grad(lambda q: vmap(_sdpa_dropout, randomness="different")(q, k, v).sum())(q.contiguous())
    assert grads.shape == q.shape and torch.isfinite(grads).all()


# ----------------------------------------------------------------------------------------------
# jacrev / jacfwd.

@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("jac", [jacrev, jacfwd], ids=["jacrev", "jacfwd"])
def test_jacobians_equal_reference(jac, causal):
    q, k, v = rand(3, 2), rand(4, 2), rand(4, 2)
    mask = rand(3, 4) if causal is None else None
    argnums = (0, 1, 2, 3) if mask is not None else (0, 1, 2)

    def ours(q, k, v, mk=None):
        return attention(q, k, v, attn_mask=mk, causal=causal)

    def ref(q, k, v, mk=None):
        return attention_reference(q, k, v, mk, causal=causal)[0]

    args = (q, k, v) + ((mask,) if mask is not None else ())
    got = jac(ours, argnums=argnums)(*args)
    expected = jacrev(ref, argnums=argnums)(*args)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_close(a, b, 1e-10, f"jacobian wrt arg {i}")


@pytest.mark.parametrize("jac", [jacrev, jacfwd], ids=["jacrev", "jacfwd"])
def test_jacobian_of_lse_equals_reference(jac):
    q, k, v = rand(1, 3, 2), rand(1, 4, 2), rand(1, 4, 2)
    got = jac(lambda q, k: attention(q, k, v, return_lse=True)[1], argnums=(0, 1))(q, k)
    expected = jacrev(lambda q, k: attention_reference(q, k, v)[1], argnums=(0, 1))(q, k)
    for a, b in zip(got, expected):
        assert_close(a, b, 1e-10, "lse jacobian")


# ----------------------------------------------------------------------------------------------
# Gradients through lse.

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("use_out", [False, True], ids=["lse_only", "out_and_lse"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_lse_gradient_equals_reference(causal, use_out, dtype):
    q = rand(2, 3, 5, 4, dtype=dtype, requires_grad=True)
    k = rand(2, 3, 6, 4, dtype=dtype, requires_grad=True)
    v = rand(2, 3, 6, 3, dtype=dtype, requires_grad=True)
    mask = rand(3, 5, 6, dtype=dtype, requires_grad=True) if causal is None else None
    leaves = [t for t in (q, k, v, mask) if t is not None]
    out, lse = attention(q, k, v, attn_mask=mask, causal=causal, return_lse=True)
    expected_lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.dtype == expected_lse_dtype and lse.shape == (2, 3, 5)
    g_lse = torch.randn(lse.shape, dtype=torch.float64)
    g_out = torch.randn(out.shape, dtype=torch.float64)
    loss = (lse * g_lse.to(lse.dtype)).sum() + ((out * g_out.to(dtype)).sum() if use_out else 0)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)

    r_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    r_mask = r_leaves[3] if mask is not None else None
    r_out, r_lse, _ = attention_reference(*r_leaves[:3], r_mask, causal=causal)
    r_loss = (r_lse * g_lse).sum() + ((r_out * g_out).sum() if use_out else 0)
    expected = torch.autograd.grad(r_loss, r_leaves, allow_unused=True)
    atol = 1e-10 if dtype == torch.float64 else 1e-4
    for name, a, b in zip("qkvm", grads, expected):
        if b is None:  # v does not reach lse
            assert a is None or torch.equal(a, torch.zeros_like(a)), f"d{name} should be zero"
        else:
            assert_close(a, b, atol, f"d{name}")


def test_lse_gradient_wrt_query_is_the_weighted_mean_of_keys_times_scale():
    """d lse_i / d q_i = scale * sum_j P_ij k_j: a closed form, independent of the reference."""
    q = rand(1, 4, 3, requires_grad=True)
    k = rand(1, 6, 3)
    v = rand(1, 6, 2)
    scale = 0.7
    _, lse = attention(q, k, v, scale=scale, return_lse=True)
    (dq,) = torch.autograd.grad(lse.sum(), [q])
    w = torch.softmax(q.detach() @ k.transpose(-1, -2) * scale, -1)
    assert_close(dq, scale * (w @ k), 1e-12, "dq")
