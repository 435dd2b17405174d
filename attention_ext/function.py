"""Autograd for the attention ops.

First order runs the fused kernels both ways: `AttentionFunction.forward` calls `attention_fwd`
and its backward calls `attention_bwd` (the softmax-Jacobian backward, no atomics). The same
setup_context/backward pair is registered on the op with `torch.library.register_autograd`, so
`torch.ops.attention_ext.attention_fwd` is differentiable on its own (opcheck, torch.compile).

Beyond first order the library composes torch ops, at O(batch · n · m) memory:
  * double backward (`AttentionBackward.backward`) differentiates `attention_backward_composite`,
    the same Jacobian formula written in torch ops; cost ≈ a naive attention forward + backward.
  * forward-mode AD (`AttentionFunction.jvp`) uses the exact weights from `attention_probs`
    (through `AttentionWeightsFunction`, whose backward makes reverse over forward work):
    out_t = (P_t ∘ Z) V + (P ∘ Z) V_t with P_t = P ∘ (S_t − rowsum(P ∘ S_t)); forward over
    forward is refused (refuse_nested_forward_ad).
  * forward over reverse (torch.func.hessian) is AttentionBackward.jvp: torch.func.jvp of the
    composite backward.
  * vmap rules fold the vmapped dim into the ops' broadcast batch dims: no Python loop.
"""
from __future__ import annotations

import inspect

import torch

try:
    from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers
except ImportError:  # pragma: no cover - torch without it has no dead wrappers to unwrap
    def _unwrap_dead_wrappers(args):
        return args

from ._constants import CAUSAL_NAMES, lse_dtype
from ._ops import call_below_autograd, ops
from .reference import masked_scores, softmax_lse


class _PositionalApply:
    """torch.autograd.Function.apply binds the arguments against inspect.signature(forward) on
    every call when setup_context is defined (to fill in defaults); with every argument given
    positionally and no functorch transform active that binding returns them unchanged, so this
    apply goes straight to the C++ autograd.Function machinery (as torch's apply then does)."""

    @classmethod
    def apply(cls, *args, **kwargs):
        # (torch.compile traces torch's own apply; older releases' dynamo cannot trace the
        # functorch query, so it is asked only in eager mode.)
        if kwargs or len(args) != cls._arity or torch.compiler.is_compiling() \
                or torch._C._are_functorch_transforms_active():
            return super().apply(*args, **kwargs)
        args = _unwrap_dead_wrappers(args)
        return super(torch.autograd.Function, cls).apply(*args)


def forward_ad_possible() -> bool:
    """Whether jvp may run for the call being recorded: a forward-mode AD level is open or a
    functorch transform (jvp among them) is active. jvp runs within the call, never later."""
    if torch.autograd.forward_ad._current_level >= 0:
        return True
    # Under torch.compile the functorch state is the tracer's business (and older releases'
    # dynamo cannot trace this query, e.g. torch 2.4's).
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


class _SecondDerivativeRefused(torch.autograd.Function):
    """The identity on a first-order backward's results, recorded against everything they depend
    on (the incoming gradients and the saved inputs): differentiating through it raises. (Its vmap
    rule is generated: torch.func.jacrev runs the first-order backward under vmap, and under
    torch.func's grad transforms the results are recorded against this node as well.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(what, count, *tensors):
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.what = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(f"attention_ext: {ctx.what} has a first-order backward only: a second derivative "
                                  f"through it (create_graph=True, a Hessian, double backward) is not supported; "
                                  f"attention_ext.attention() has one")


def first_order_backward(what):
    """Decorates a backward(ctx, *grads) that is not itself differentiable. The backward runs
    without recording; when autograd keeps a graph of it (create_graph=True) its results are tied
    to the incoming gradients and the saved inputs through a node that raises if differentiated.
    (torch's once_differentiable ties them to detached copies instead, so torch.autograd.grad of a
    result with respect to an input finds no path and silently returns zeros or None.)"""
    def decorate(backward):
        def run(ctx, *grads):
            keep_graph = torch.is_grad_enabled()
            with torch.no_grad():
                results = backward(ctx, *grads)
            if not keep_graph:
                return results
            sources = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not sources:
                return results
            return _SecondDerivativeRefused.apply(what, len(results), *results, *sources)
        run.__name__, run.__doc__ = backward.__name__, backward.__doc__
        return run
    return decorate


def refuse_nested_forward_ad():
    """Forward over forward (torch.func.jvp of jvp, jacfwd of jacfwd) is refused: torch hands a
    custom Function's jvp its saved tensors without the outer level's tangent, so the second-order
    term would be silently dropped. Reverse over forward and forward over reverse are exact."""
    if torch.compiler.is_compiling():
        return
    stack = torch._C._functorch.get_interpreter_stack() or ()
    if sum(1 for level in stack if level.key() == torch._C._functorch.TransformType.Jvp) > 1:
        raise NotImplementedError(
            "attention_ext: nested forward-mode AD (jvp of jvp, jacfwd of jacfwd) is not supported: torch does not "
            "pass the outer level's tangent into a custom Function's jvp, so the result would miss the second-order "
            "term; use torch.func.hessian (forward over reverse), jacrev(jacfwd(f)) or "
            "torch.autograd.functional.hessian")


def keep_scale(rng_state, batch_shape, n, m, dropout_p, dtype):
    """Z = keep / (1 - p): the dropout mask the kernels use, as a tensor."""
    keep = ops.dropout_keep_mask(rng_state, list(batch_shape), n, m, dropout_p)
    return keep.to(dtype) / (1.0 - dropout_p)


def _batch_shape(query, key, value):
    return torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])


# ----------------------------------------------------------------------------------------------
# First order: the fused kernels.

def _setup_context(ctx, inputs, output):
    (query, key, value, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes, sinks,
     dropout_p, rng_state) = inputs
    out, lse = output
    ctx.scale, ctx.dropout_p = scale, dropout_p
    ctx.logit = (causal, window_left, window_right, softcap)  # the ops' logit options but the tensors
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, rng_state, alibi_slopes, sinks)
    ctx.set_materialize_grads(False)


def sink_gradient(sinks, lse, out, grad_out, grad_lse):
    """d loss / d sinks: each row's sink weight exp(sink − lse) times (0 − delta), delta =
    rowsum(dO ∘ O) − dlse (the sink's key has value 0), summed to the sinks' shape. O(n·d_v) in
    torch ops, differentiable (double backward)."""
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1) if grad_out is not None else torch.zeros_like(lse)
    if grad_lse is not None:
        delta = delta - grad_lse
    # exp(sink − lse) <= 1 exactly; capped at 1 because a sink that dominates its row can sit an
    # lse's rounding above it, and at |lse| ~ 1e11 (float) that ulp is past exp's range (inf).
    sink = sinks[..., None]
    weight = torch.exp((sink - lse).clamp(max=0.0))
    weight = torch.where(sink == lse, torch.ones_like(weight), weight)  # (a sink of +inf: lse +inf, weight 1)
    weight = torch.where(torch.isneginf(lse), torch.zeros_like(weight), weight)  # (sinks of −inf)
    return (-(weight * delta)).sum(-1).sum_to_size(sinks.shape)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, attn_mask, out, lse, rng_state, alibi_slopes, sinks = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return (None,) * 13
    # (needs_input_grad builds a tuple per access: asked only where there is a mask or sinks)
    dsinks = sink_gradient(sinks, lse, out, grad_out, grad_lse) \
        if sinks is not None and ctx.needs_input_grad[10] else None
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    mask_grad = attn_mask is not None and bool(ctx.needs_input_grad[3])
    args = (grad_out, grad_lse, query, key, value, attn_mask, out, lse, ctx.scale, *ctx.logit, alibi_slopes, sinks,
            ctx.dropout_p, rng_state, mask_grad, False)
    if torch.is_grad_enabled():  # create_graph=True: keep the graph for double backward
        dq, dk, dv, dmask = AttentionBackward.apply(*args)
    else:
        dq, dk, dv, dmask = call_below_autograd(ops.attention_bwd, *args)
    return dq, dk, dv, (dmask if mask_grad else None), None, None, None, None, None, None, dsinks, None, None


class AttentionFunction(_PositionalApply, torch.autograd.Function):
    """(query, key, value, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
    sinks, dropout_p, rng_state) -> (out, lse)."""

    @staticmethod
    def forward(query, key, value, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
                sinks, dropout_p, rng_state):
        return call_below_autograd(ops.attention_fwd, query, key, value, attn_mask, scale, causal, window_left,
                                   window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        if forward_ad_possible():  # only jvp reads these (~5 µs a call to save)
            query, key, value, attn_mask, *_, alibi_slopes, sinks, _, rng_state = inputs
            ctx.save_for_forward(query, key, value, attn_mask, rng_state, alibi_slopes, sinks)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _backward(ctx, grad_out, grad_lse)

    @staticmethod
    def jvp(ctx, query_t, key_t, value_t, mask_t, _scale_t, _causal_t, _left_t, _right_t, _softcap_t, alibi_t,
            sinks_t, *unused):
        if not ctx.saved_tensors:
            raise RuntimeError(
                "attention_ext: forward-mode AD needs its dual level opened through torch.autograd.forward_ad "
                "(dual_level() or enter_dual_level()); a level entered through torch._C is not seen")
        refuse_nested_forward_ad()
        query, key, value, attn_mask, rng_state, alibi_slopes, sinks = ctx.saved_tensors
        _no_tangent(alibi_t, "alibi_slopes")
        scale = ctx.scale
        s_t = _score_tangent(query, key, query_t, key_t, mask_t, scale, ctx.logit[3])
        # Through the weights' own Function, whose backward lets reverse over forward (jacrev of
        # jacfwd) differentiate this jvp.
        probs = AttentionWeightsFunction.apply(query, key, attn_mask, scale, *ctx.logit, alibi_slopes, sinks)
        batch = probs.shape[:-2]
        z = None
        weights = probs
        if ctx.dropout_p > 0:
            z = keep_scale(rng_state, batch, probs.shape[-2], probs.shape[-1], ctx.dropout_p, probs.dtype)
            weights = probs * z
        out_t = None
        lse_t = None
        ps, row = _row_tangent(probs, s_t, sinks_t)
        if row is not None:
            p_t = -probs * row if ps is None else ps - probs * row
            if z is not None:
                p_t = p_t * z
            out_t = torch.matmul(p_t, value)
            lse_t = row.squeeze(-1).to(lse_dtype(query.dtype))
        if value_t is not None:
            term = torch.matmul(weights, value_t)
            out_t = term if out_t is None else out_t + term
        if out_t is None:
            out_t = torch.zeros((*batch, probs.shape[-2], value.shape[-1]), dtype=query.dtype, device=query.device)
        else:
            out_t = out_t.expand(*batch, probs.shape[-2], value.shape[-1])
        if lse_t is None:
            lse_t = torch.zeros(probs.shape[:-1], dtype=lse_dtype(query.dtype), device=query.device)
        return out_t.contiguous(), lse_t.contiguous()

    @staticmethod
    def vmap(info, in_dims, query, key, value, attn_mask, scale, causal, window_left, window_right, softcap,
             alibi_slopes, sinks, dropout_p, rng_state):
        _no_vmap_over(in_dims[9], "alibi_slopes")
        _no_vmap_over(in_dims[10], "sinks")
        if dropout_p > 0.0:
            # The dropout pattern is keyed by the batch index, so folding the vmapped dim into the
            # batch dims would give each element its own pattern. vmap's randomness decides: "same"
            # (one drawn state) gives every element the pattern of the unbatched call, "different"
            # (a state per element) each its own. One call per element.
            dims = (*in_dims[:4], in_dims[12])
            results = []
            for i in range(info.batch_size):
                q_i, k_i, v_i, mask_i, state_i = (t if d is None else t.select(d, i)
                                                  for t, d in zip((query, key, value, attn_mask, rng_state), dims))
                results.append(AttentionFunction.apply(q_i, k_i, v_i, mask_i, scale, causal, window_left, window_right,
                                                       softcap, alibi_slopes, sinks, dropout_p, state_i))
            return (torch.stack([r[0] for r in results]), torch.stack([r[1] for r in results])), (0, 0)
        _no_vmap_over(in_dims[12], "rng_state")
        # (Slopes broadcast against the batch dims from the right: the folded dim leaves them be.)
        query, key, value, attn_mask = fold_vmap_dim(info.batch_size, in_dims[:4],
                                                     (query, key, value, attn_mask))
        out, lse = AttentionFunction.apply(query, key, value, attn_mask, scale, causal, window_left, window_right,
                                           softcap, alibi_slopes, sinks, dropout_p, rng_state)
        return (out, lse), (0, 0)


def _no_tangent(tangent, name):
    if tangent is not None:
        raise NotImplementedError(f"attention_ext: forward-mode AD through {name} is not supported")


def _row_tangent(probs, s_t, sinks_t):
    """(P ∘ S_t, the tangent of each row's normaliser: rowsum(P ∘ S_t) + P_sink·sink_t), with
    P_sink = 1 − rowsum(P) the sink's weight; (None, None) without tangents."""
    ps = row = None
    if s_t is not None:
        ps = probs * s_t
        row = ps.sum(-1, keepdim=True)
    if sinks_t is not None:
        term = (1 - probs.sum(-1, keepdim=True)) * sinks_t.to(probs.dtype)[..., None, None]
        row = term if row is None else row + term
    return ps, row


def _no_vmap_over(dim, name):
    if dim is not None:
        raise NotImplementedError(f"attention_ext: vmap over {name} is not supported")


def softcap_derivative(query, key, scale, softcap):
    """d(softcap·tanh(t / softcap))/dt at t = scale·q·k: 1 − tanh²(t / softcap), (..., n, m)."""
    return 1 - torch.tanh(torch.matmul(query, key.transpose(-1, -2)) * (scale / softcap)) ** 2


def _score_tangent(query, key, query_t, key_t, mask_t, scale, softcap=0.0):
    """S_t = (Q_t Kᵀ + Q K_tᵀ)·scale (times the softcap's derivative) + M_t for the tangents given
    (None if none are)."""
    s_t = None
    if query_t is not None:
        s_t = torch.matmul(query_t, key.transpose(-1, -2)) * scale
    if key_t is not None:
        term = torch.matmul(query, key_t.transpose(-1, -2)) * scale
        s_t = term if s_t is None else s_t + term
    if s_t is not None and softcap > 0:
        s_t = s_t * softcap_derivative(query, key, scale, softcap)
    if mask_t is not None:
        s_t = mask_t if s_t is None else s_t + mask_t
    return s_t


def fold_vmap_dim(size, dims, tensors):
    """Moves each tensor's vmapped dim to the front (expanding unbatched ones, without a copy) and
    pads the batch dims so all tensors align; the ops then treat it as one more batch dim."""
    prepared = []
    for t, d in zip(tensors, dims):
        if t is None:
            prepared.append(None)
            continue
        if d is None:
            t = t.unsqueeze(0).expand(size, *t.shape)
        else:
            t = t.movedim(d, 0)
        while t.dim() < 3:  # (V, rows, cols) at least: a 1-D mask is (m,)
            t = t.unsqueeze(1)
        prepared.append(t)
    nbatch = max(t.dim() - 3 for t in prepared if t is not None)
    out = []
    for t in prepared:
        if t is not None:
            while t.dim() - 3 < nbatch:
                t = t.unsqueeze(1)
        out.append(t)
    return out


torch.library.register_autograd("attention_ext::attention_fwd", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Second order: a composition of torch ops.

def attention_backward_composite(grad_out, grad_lse, query, key, value, attn_mask, scale, logit, alibi_slopes,
                                 sinks, dropout_p, rng_state):
    """The backward of the kernels in differentiable torch ops: (dq, dk, dv, dmask), reduced to
    the inputs' shapes; logit = (causal code, window_left, window_right, softcap). Memory
    O(batch · n · m)."""
    causal, window_left, window_right, softcap = logit
    s = masked_scores(query, key, attn_mask, causal=CAUSAL_NAMES[causal], window=(window_left, window_right),
                      softcap=softcap, alibi_slopes=alibi_slopes, scale=scale)
    p, _ = softmax_lse(s, sinks)
    pz = p
    z = None
    if dropout_p > 0:
        z = keep_scale(rng_state, s.shape[:-2], s.shape[-2], s.shape[-1], dropout_p, p.dtype)
        pz = p * z
    out = torch.matmul(pz, value)
    dv = torch.matmul(pz.transpose(-1, -2), grad_out)
    dp = torch.matmul(grad_out, value.transpose(-1, -2))
    if z is not None:
        dp = dp * z
    delta = (grad_out * out).sum(-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.unsqueeze(-1).to(delta.dtype)
    ds = p * (dp - delta)
    dmask = ds.sum_to_size(attn_mask.shape) if attn_mask is not None and attn_mask.is_floating_point() else None
    if softcap > 0:
        ds = ds * softcap_derivative(query, key, scale, softcap)
    dq = torch.matmul(ds, key) * scale
    dk = torch.matmul(ds.transpose(-1, -2), query) * scale
    return dq.sum_to_size(query.shape), dk.sum_to_size(key.shape), dv.sum_to_size(value.shape), dmask


# AttentionBackward's differentiable inputs (grad_out, grad_lse, query, key, value, attn_mask, sinks):
# their positions among its forward's arguments.
_BACKWARD_LEAF_ARGS = (0, 1, 2, 3, 4, 5, 14)


def _composite_in(ctx, leaves, wants, rng_state, alibi_slopes, outputs):
    """attention_backward_composite as a function of the wanted leaves alone (the others fixed),
    returning the results listed in outputs (indices into (dq, dk, dv, dmask))."""
    def composite(*chosen):
        it = iter(chosen)
        args = [next(it) if w else t for t, w in zip(leaves, wants)]
        results = attention_backward_composite(*args[:6], ctx.scale, ctx.logit, alibi_slopes, args[6], ctx.dropout_p,
                                               rng_state)
        return tuple(results[i] for i in outputs)
    return composite


def _jvp_by_double_vjp(f, primals, tangents):
    """J·t of f at primals through reverse mode twice: g(u) = Jᵀu is linear in u, so the vjp of g
    with cotangent t is J·t. For a jvp rule running inside torch.autograd.forward_ad's level,
    where torch.func.jvp would open a second level."""
    with torch.no_grad():  # (a copy, not detach(): under autograd.functional's vectorized jacobian the
        xs = [p.clone() for p in primals]  # primals are batched tensors, whose detach is not batched)
    with torch.enable_grad():
        xs = [x.requires_grad_() for x in xs]
        outs = f(*xs)
        us = [torch.zeros_like(o, requires_grad=True) for o in outs]
        gs = torch.autograd.grad(outs, xs, us, create_graph=True, allow_unused=True)
        pairs = [(g, t) for g, t in zip(gs, tangents) if g is not None and g.requires_grad]
        results = (torch.autograd.grad([g for g, _ in pairs], us, [t for _, t in pairs], allow_unused=True)
                   if pairs else [None] * len(us))
    return tuple(torch.zeros_like(o) if r is None else r for r, o in zip(results, outs))


class AttentionBackward(_PositionalApply, torch.autograd.Function):
    """The fused backward as a differentiable function (its own backward is the composition)."""

    @staticmethod
    def forward(grad_out, grad_lse, query, key, value, attn_mask, out, lse, scale, causal, window_left,
                window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state, mask_grad, merged_lse):
        return call_below_autograd(ops.attention_bwd, grad_out, grad_lse, query, key, value, attn_mask, out, lse,
                                   scale, causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                                   rng_state, mask_grad, merged_lse)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (grad_out, grad_lse, query, key, value, attn_mask, _, _, scale, causal, window_left, window_right, softcap,
         alibi_slopes, sinks, dropout_p, rng_state, mask_grad, _) = inputs
        ctx.scale, ctx.dropout_p, ctx.mask_grad = scale, dropout_p, mask_grad
        ctx.logit = (causal, window_left, window_right, softcap)
        ctx.save_for_backward(grad_out, grad_lse, query, key, value, attn_mask, rng_state, alibi_slopes, sinks)
        if forward_ad_possible():  # only jvp reads these
            ctx.save_for_forward(grad_out, grad_lse, query, key, value, attn_mask, rng_state, alibi_slopes, sinks)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, g_dq, g_dk, g_dv, g_dmask):
        grad_out, grad_lse, query, key, value, attn_mask, rng_state, alibi_slopes, sinks = ctx.saved_tensors
        leaves = (grad_out, grad_lse, query, key, value, attn_mask, sinks)
        wants = [bool(ctx.needs_input_grad[i]) and t is not None for i, t in zip(_BACKWARD_LEAF_ARGS, leaves)]
        wants[5] = wants[5] and attn_mask.is_floating_point()
        cotangents = (g_dq, g_dk, g_dv, g_dmask if ctx.mask_grad else None)
        chosen = [i for i, g in enumerate(cotangents) if g is not None]
        grads = [None] * len(leaves)
        if chosen and any(wants):
            # torch.func.vjp rather than autograd.grad: it needs no requires_grad_() on the saved
            # tensors, which torch.func's transforms forbid (grad of grad), and it keeps the graph
            # for a further derivative when one is being recorded.
            f = _composite_in(ctx, leaves, wants, rng_state, alibi_slopes, chosen)
            _, vjp = torch.func.vjp(f, *(t for t, w in zip(leaves, wants) if w))
            it = iter(vjp(tuple(cotangents[i] for i in chosen)))
            grads = [next(it) if w else None for w in wants]
        return (*grads[:6],) + (None,) * 8 + (grads[6], None, None, None, None)

    @staticmethod
    def jvp(ctx, grad_out_t, grad_lse_t, query_t, key_t, value_t, mask_t, _out_t, _lse_t, _scale_t, _causal_t,
            _left_t, _right_t, _softcap_t, alibi_t, sinks_t, *unused):
        # out and lse are functions of query, key and value that the composite recomputes, so their
        # tangents are already in the composite's; the ones passed are not used twice.
        refuse_nested_forward_ad()
        _no_tangent(alibi_t, "alibi_slopes")
        grad_out, grad_lse, query, key, value, attn_mask, rng_state, alibi_slopes, sinks = ctx.saved_tensors
        leaves = (grad_out, grad_lse, query, key, value, attn_mask, sinks)
        tangents = (grad_out_t, grad_lse_t, query_t, key_t, value_t, mask_t, sinks_t)
        wants = [t is not None and t_t is not None for t, t_t in zip(leaves, tangents)]
        wants[5] = wants[5] and attn_mask.is_floating_point()
        outputs = [0, 1, 2, 3] if ctx.mask_grad else [0, 1, 2]
        if any(wants):
            f = _composite_in(ctx, leaves, wants, rng_state, alibi_slopes, outputs)
            primals = tuple(t for t, w in zip(leaves, wants) if w)
            chosen_tangents = tuple(t for t, w in zip(tangents, wants) if w)
            if torch._C._are_functorch_transforms_active():
                _, results = torch.func.jvp(f, primals, chosen_tangents)
            else:  # torch.autograd.forward_ad's level is open, and it does not nest
                results = _jvp_by_double_vjp(f, primals, chosen_tangents)
        else:  # (tangents of inputs the results do not depend on: grad_lse's alone without a loss on it)
            results = [torch.zeros_like(t) for t in (query, key, value, attn_mask)[:len(outputs)]]
        dmask_t = results[3] if ctx.mask_grad else query.new_zeros((0,))
        return results[0], results[1], results[2], dmask_t

    @staticmethod
    def vmap(info, in_dims, grad_out, grad_lse, query, key, value, attn_mask, out, lse, scale, causal,
             window_left, window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state, mask_grad, merged_lse):
        _no_vmap_over(in_dims[13], "alibi_slopes")
        _no_vmap_over(in_dims[14], "sinks")
        _no_vmap_over(in_dims[16], "rng_state")
        q, k, v, m, go, o = fold_vmap_dim(
            info.batch_size, (in_dims[2], in_dims[3], in_dims[4], in_dims[5], in_dims[0], in_dims[6]),
            (query, key, value, attn_mask, grad_out, out))
        # lse and grad_lse are (batch..., n): fold them with a dummy trailing dim.
        ls, gl = fold_vmap_dim(info.batch_size, (in_dims[7], in_dims[1]),
                               (lse.unsqueeze(-1), grad_lse.unsqueeze(-1) if grad_lse is not None else None))
        nb = q.dim() - 2
        ls = _align(ls.squeeze(-1), nb + 1)
        gl = _align(gl.squeeze(-1), nb + 1) if gl is not None else None
        go, o = _align(go, nb + 2), _align(o, nb + 2)
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        go = go.expand(*batch, *go.shape[-2:])
        o = o.expand(*batch, *o.shape[-2:])
        ls = ls.expand(*batch, ls.shape[-1])
        if gl is not None:
            gl = gl.expand(*batch, gl.shape[-1])
        dq, dk, dv, dmask = AttentionBackward.apply(go, gl, q, k, v, m, o, ls, scale, causal, window_left,
                                                    window_right, softcap, alibi_slopes, sinks, dropout_p,
                                                    rng_state, mask_grad, merged_lse)
        return (dq, dk, dv, dmask), (0, 0, 0, 0 if mask_grad else None)


def _align(t, ndim):
    while t.dim() < ndim:
        t = t.unsqueeze(1)
    return t


torch.library.register_autograd("attention_ext::attention_bwd", AttentionBackward.backward,
                                setup_context=AttentionBackward.setup_context)


# ----------------------------------------------------------------------------------------------
# Exact attention weights.

def _probs_setup_context(ctx, inputs, output):
    query, key, attn_mask, scale = inputs[:4]
    ctx.scale, ctx.softcap = scale, inputs[7]
    ctx.save_for_backward(query, key, attn_mask, output, inputs[9])
    ctx.set_materialize_grads(False)  # (inputs without a tangent: None, not zeros)


def _probs_backward(ctx, grad_w):
    """W = softmax(S): dS = W ∘ (dW − rowsum(dW ∘ W)) (times the softcap's derivative for Q and
    K), and for a sink, whose weight is 1 − rowsum(W), dsink = −(1 − rowsum(W))·rowsum(dW ∘ W);
    composed in torch ops."""
    if grad_w is None:
        return (None,) * 10
    query, key, attn_mask, w, sinks = ctx.saved_tensors
    row = (grad_w * w).sum(-1, keepdim=True)
    ds = w * (grad_w - row)
    dsinks = None
    if ctx.needs_input_grad[9] and sinks is not None:
        dsinks = (-(1 - w.sum(-1, keepdim=True)) * row).squeeze(-1).sum(-1).sum_to_size(sinks.shape)
    dmask = None
    if ctx.needs_input_grad[2] and attn_mask is not None and attn_mask.is_floating_point():
        dmask = ds.sum_to_size(attn_mask.shape)
    if ctx.softcap > 0 and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        ds = ds * softcap_derivative(query, key, ctx.scale, ctx.softcap)
    dq = torch.matmul(ds, key) * ctx.scale if ctx.needs_input_grad[0] else None
    dk = torch.matmul(ds.transpose(-1, -2), query) * ctx.scale if ctx.needs_input_grad[1] else None
    return (dq.sum_to_size(query.shape) if dq is not None else None,
            dk.sum_to_size(key.shape) if dk is not None else None, dmask) + (None,) * 6 + (dsinks,)


def _weights_tangent(query, key, w, query_t, key_t, mask_t, sinks_t, scale, softcap):
    """W = softmax(S) (with the sink in the denominator): W_t = W ∘ (S_t − rowsum(W ∘ S_t) −
    W_sink·sink_t)."""
    s_t = _score_tangent(query, key, query_t, key_t, mask_t, scale, softcap)
    ws, row = _row_tangent(w, s_t, sinks_t)
    if row is None:
        return torch.zeros_like(w)
    return ((-w * row if ws is None else ws - w * row)).expand_as(w).contiguous()


class AttentionWeightsFunction(_PositionalApply, torch.autograd.Function):
    """(query, key, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes, sinks)
    -> exact attention probabilities W."""

    @staticmethod
    def forward(query, key, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes, sinks):
        return call_below_autograd(ops.attention_probs, query, key, attn_mask, scale, causal, window_left,
                                   window_right, softcap, alibi_slopes, sinks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _probs_setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[0], inputs[1], output)

    @staticmethod
    def backward(ctx, grad_w):
        return _probs_backward(ctx, grad_w)

    @staticmethod
    def jvp(ctx, query_t, key_t, mask_t, _scale_t, _causal_t, _left_t, _right_t, _softcap_t, alibi_t, sinks_t):
        refuse_nested_forward_ad()
        _no_tangent(alibi_t, "alibi_slopes")
        query, key, w = ctx.saved_tensors
        return _weights_tangent(query, key, w, query_t, key_t, mask_t, sinks_t, ctx.scale, ctx.softcap)

    @staticmethod
    def vmap(info, in_dims, query, key, attn_mask, scale, causal, window_left, window_right, softcap, alibi_slopes,
             sinks):
        _no_vmap_over(in_dims[8], "alibi_slopes")
        _no_vmap_over(in_dims[9], "sinks")
        query, key, attn_mask = fold_vmap_dim(info.batch_size, in_dims[:3], (query, key, attn_mask))
        return AttentionWeightsFunction.apply(query, key, attn_mask, scale, causal, window_left, window_right, softcap,
                                              alibi_slopes, sinks), 0


torch.library.register_autograd("attention_ext::attention_probs", _probs_backward,
                                setup_context=_probs_setup_context)

# torch's apply (the fallback of _PositionalApply: keywords, missing arguments, functorch) binds
# the arguments against inspect.signature(forward); a function's __signature__ is what that
# returns, so compute each once.
for _fn in (AttentionFunction, AttentionBackward, AttentionWeightsFunction):
    _fn.forward.__signature__ = inspect.signature(_fn.forward)
    _fn._arity = len(_fn.forward.__signature__.parameters)
del _fn

# AttentionFunction's apply without _PositionalApply's checks and unwrapping, for api._lean_forward,
# which has ruled out what they look for (its 13 arguments positional, no compiler, no functorch
# transform; the compiled entry declines functorch wrappers, which torch's apply would unwrap):
# ~4 µs of a small call's 12 with autograd.
attention_function_apply = super(torch.autograd.Function, AttentionFunction).apply
