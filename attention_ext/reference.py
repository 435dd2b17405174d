"""The formula in plain torch: softmax(Q Kᵀ · scale + mask) V, computed in float64.

This is the yardstick for tests and `python -m attention_ext check`, and the differentiable
composition behind double backward and forward-mode AD (see function.py). It follows the
library's decided semantics: a row with no visible key gives output 0 and lse -inf (never NaN),
and a floating mask entry at or below the dtype's lowest finite value counts as masked out.
"""
from __future__ import annotations

import math
from typing import Optional

import torch



def _bound(b) -> Optional[int]:
    """A window bound: None or a negative number (-1, FlashAttention's) means unbounded."""
    return None if b is None or b < 0 else int(b)


def band_visibility(n: int, m: int, causal: Optional[str], device=None, window=None) -> Optional[torch.Tensor]:
    """Bool (n, m): True where key j is visible to query i under the causal alignment and the
    sliding window (left, right): i + m - n - left <= j <= i + m - n + right (bottom-right
    aligned, as FlashAttention; top-left causal aligns at j <= i). None where all are visible."""
    left, right = (None, None) if window is None else (_bound(window[0]), _bound(window[1]))
    if causal is None and left is None and right is None:
        return None
    diag = torch.arange(n, device=device).unsqueeze(-1) + (0 if causal == "top_left" else m - n)
    j = torch.arange(m, device=device)
    visible = torch.ones(n, m, dtype=torch.bool, device=device)
    if causal is not None:
        visible &= j <= diag
    if right is not None:
        visible &= j <= diag + right
    if left is not None:
        visible &= j >= diag - left
    return visible


def alibi_bias(slopes: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """ALiBi: -slope·|i + m - n - j| for every (batch position, query i, key j); slopes broadcast
    against the batch dims (one per head)."""
    i = torch.arange(n, device=slopes.device).unsqueeze(-1)
    j = torch.arange(m, device=slopes.device)
    distance = (i + (m - n) - j).abs().to(torch.float64)
    return -slopes.to(torch.float64)[..., None, None] * distance


def masked_scores(query, key, attn_mask=None, *, causal=None, window=None, softcap=0.0, alibi_slopes=None,
                  scale=None) -> torch.Tensor:
    """Scaled scores t = scale·q·k, modified (softcap > 0: softcap·tanh(t / softcap); then ALiBi's
    -slope·|i + m - n - j|) and masked: -inf where a key does not take part."""
    if scale is None:  # d_k = 0: every score is 0 whatever the scale
        scale = 1.0 / math.sqrt(key.shape[-1]) if key.shape[-1] > 0 else 1.0
    s = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, s.shape[-2], s.shape[-1]).to(s.dtype)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            lowest = torch.finfo(attn_mask.dtype).min
            s = s + attn_mask.to(s.dtype)
            s = s.masked_fill(attn_mask <= lowest, float("-inf"))
    vis = band_visibility(s.shape[-2], s.shape[-1], causal, s.device, window)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return s


def softmax_lse(s: torch.Tensor, sinks: Optional[torch.Tensor] = None):
    """Row softmax (max-subtracted, exact for scores of any magnitude) and logsumexp, with fully
    masked rows giving weights 0 and lse -inf. sinks (one logit per batch position) join each
    row's denominator as one more key, whose weight is left out of the result."""
    if sinks is not None:
        batch = torch.broadcast_shapes(s.shape[:-2], sinks.shape)
        s = s.expand(*batch, *s.shape[-2:])
        column = sinks.to(s.dtype)[..., None, None].expand(*batch, s.shape[-2], 1)
        p, lse = softmax_lse(torch.cat([s, column], dim=-1))
        return p[..., :-1], lse
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    empty = torch.isneginf(lse)
    p = torch.where(empty, torch.zeros_like(s), torch.softmax(torch.where(empty, torch.zeros_like(s), s), dim=-1))
    return p, lse.squeeze(-1)


def expand_gqa(query, key, value):
    """torch's enable_gqa: each key head serves query_heads / key_heads query heads, each value
    head query_heads / value_heads (key and value repeated each by its own factor)."""
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if hq != hk:
        key = key.repeat_interleave(hq // hk, dim=-3)
    if hq != hv:
        value = value.repeat_interleave(hq // hv, dim=-3)
    return key, value


def attention_reference(
    query,
    key,
    value,
    attn_mask=None,
    *,
    causal: Optional[str] = None,
    window=None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dropout_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    dtype: Optional[torch.dtype] = torch.float64,
):
    """Returns (out, lse, weights). `dtype=None` computes in the inputs' own dtype (used to
    measure the error of plain low-precision torch); `dropout_mask` is the bool keep mask."""
    if dtype is not None:
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            # "Masked out" is decided in the mask's own dtype (its finfo.min), before widening.
            lowest = attn_mask <= torch.finfo(attn_mask.dtype).min
            attn_mask = attn_mask.to(dtype).masked_fill(lowest, float("-inf"))
    if enable_gqa:
        key, value = expand_gqa(query, key, value)
    if sinks is not None and dtype is not None:
        sinks = sinks.to(dtype)
    s = masked_scores(query, key, attn_mask, causal=causal, window=window, softcap=softcap,
                      alibi_slopes=alibi_slopes, scale=scale)
    p, lse = softmax_lse(s, sinks)
    weights = p
    if dropout_p >= 1:  # every weight dropped (torch's zeros)
        p = p * 0
    elif dropout_mask is not None and dropout_p > 0:
        p = p * dropout_mask.to(p.dtype) / (1.0 - dropout_p)
    return torch.matmul(p, value), lse, weights
