"""Context parallelism: attention over sequences split along their length across the ranks of a
torch.distributed process group (gloo on CPU, NCCL on CUDA).

    import attention_ext.distributed as cp
    q, k, v = (cp.shard(t, layout="zigzag") for t in (q_full, k_full, v_full))   # this rank's rows
    out = cp.context_parallel_attention(q, k, v, layout="zigzag", causal="top_left")
    out_full = cp.unshard(out, layout="zigzag")

Each rank keeps its queries; K/V blocks travel around a ring of point-to-point transfers, the next
block's transfer overlapping the current block's compute, and the partial results are merged by
their log-sum-exp (_ring.py). Causal blocks that see nothing are skipped (_layout.py).
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from ..api import _MAX_BATCH_DIMS, _check_causal, _prepare
from ..function import first_order_backward
from . import _ring
from ._layout import LAYOUTS, check_divisible, check_layout, chunks
from ._ring import Ring, RingGeometry, ring_backward, ring_forward

__all__ = ["context_parallel_attention", "shard", "unshard", "record_ring_steps", "LAYOUTS"]


def _group_rank_world(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("attention_ext: context parallelism needs torch.distributed initialised "
                           "(torch.distributed.init_process_group) in every process")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("attention_ext: this process is not a member of the group passed as group=")
    return rank, world


def _fingerprint(message: Optional[str], facts) -> int:
    """A 63-bit digest of (error, facts), the same on every rank for the same values."""
    digest = hashlib.blake2b(repr((message, facts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _agree(group, world, error: Optional[BaseException], facts: Optional[tuple], what: str):
    """Every rank learns whether every rank's arguments were good and the same, before any rank
    starts a transfer — so a bad argument on one rank is an exception on all, not a hang. One
    all-reduce of a digest when all agree (the common case); only when they do not, the details
    are gathered to say which rank. A rank whose own check failed re-raises its exception; the
    others raise naming the failed ranks."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    mark = _fingerprint(message, facts)
    extremes = torch.tensor([mark, -mark], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if error is None and int(extremes[0]) == mark and int(extremes[1]) == -mark:
        return  # every rank has the same digest: the same facts, no error
    everyone = [None] * world
    dist.all_gather_object(everyone, (message, facts), group=group)
    if error is not None:
        raise error
    failed = [f"rank {r}: {m}" for r, (m, _) in enumerate(everyone) if m is not None]
    if failed:
        raise RuntimeError(f"attention_ext: {what} failed on another rank of the group, so every rank stops: "
                           + "; ".join(failed))
    differing = [r for r, (_, f) in enumerate(everyone) if f != everyone[0][1]]
    listing = "; ".join(f"rank {r}: {f}" for r, (_, f) in enumerate(everyone))
    raise ValueError(f"attention_ext: {what} needs the same arguments (shard shapes, dtype, flags, whether "
                     f"autograd records the call) on every rank, but ranks {differing} differ from rank 0: {listing}")


@contextlib.contextmanager
def record_ring_steps():
    """Records every ring step run inside the block, on this rank: a list of dicts with pass
    ('forward' / 'backward'), step, compute_s (the kernels and merges), wait_s (waiting for the
    transfers after computing: 0 when the transfer was hidden), bytes_sent. Host-side times: on
    CUDA they measure kernel launches and waits are asynchronous, so synchronise to time steps."""
    previous, _ring._step_log = _ring._step_log, []
    try:
        yield _ring._step_log
    finally:
        _ring._step_log = previous


def _dim_index(x: torch.Tensor, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"attention_ext: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"attention_ext: dim {dim} is out of range for {name} of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x: torch.Tensor, layout: str = "contiguous", group=None, *, dim: int = -2) -> torch.Tensor:
    """This rank's rows of the full tensor x (the same x on every rank) along dim: contiguous,
    rows [r·L/P, (r+1)·L/P); zigzag, chunks r and 2P−1−r of 2P. Differentiable (slicing)."""
    check_layout(layout)
    rank, world = _group_rank_world(group)
    dim = _dim_index(x, dim, "x")
    check_divisible(x.shape[dim], layout, world, "x")
    pieces = [x.narrow(dim, c.global_start, c.size) for c in chunks(layout, rank, world, x.shape[dim] // world)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, layout, group, dim, world):
        ctx.layout, ctx.group, ctx.dim = layout, group, dim
        gathered = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(gathered, x_local.contiguous(), group=group)
        local = x_local.shape[dim]
        full = x_local.new_empty((*x_local.shape[:dim], local * world, *x_local.shape[dim + 1:]))
        for rank, part in enumerate(gathered):
            for c in chunks(layout, rank, world, local):
                full.narrow(dim, c.global_start, c.size).copy_(part.narrow(dim, c.local_start, c.size))
        return full

    @staticmethod
    def backward(ctx, grad_full):
        # torch.distributed.nn's all_gather convention: every rank's copy of the full tensor
        # feeds a loss of its own, so this rank's rows get the sum of all ranks' gradients.
        grad_full = grad_full.contiguous()
        dist.all_reduce(grad_full, group=ctx.group)
        return shard(grad_full, ctx.layout, ctx.group, dim=ctx.dim), None, None, None, None


def unshard(x_local: torch.Tensor, layout: str = "contiguous", group=None, *, dim: int = -2) -> torch.Tensor:
    """The full tensor from every rank's shard (an all-gather; the inverse of shard). Differentiable:
    the gradient of this rank's shard is the sum over the ranks of their full tensors' gradients
    at its rows (torch.distributed.nn's all_gather convention). Use dim=-1 for an lse shard."""
    rank, world = _group_rank_world(group)
    error, facts, d = None, None, None
    try:
        check_layout(layout)
        d = _dim_index(x_local, dim, "x_local")
        if layout == "zigzag" and x_local.shape[d] % 2:
            raise ValueError(f"attention_ext: a zigzag shard has two equal chunks, but x_local has "
                             f"{x_local.shape[d]} rows along dim {dim}")
        facts = (tuple(x_local.shape), str(x_local.dtype), d, layout)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, whatever it is
        error = e
    _agree(group, world, error, facts, "unshard")
    return _Unshard.apply(x_local, layout, group, d, world)


class _ContextParallelAttention(torch.autograd.Function):
    """(query, key, value) shards -> (out, lse) shards; the ring runs in forward and in backward.
    Backward is not itself differentiable (no double backward through the ring)."""

    @staticmethod
    def forward(ctx, query, key, value, ring, geometry, scale):
        key, value = key.contiguous(), value.contiguous()  # sent as they are
        out, lse = ring_forward(ring, geometry, query, key, value, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.ring, ctx.geometry, ctx.scale = ring, geometry, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @first_order_backward("context_parallel_attention")
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = ring_backward(ctx.ring, ctx.geometry, grad_out, grad_lse, query, key, value, out, lse,
                                   ctx.scale)
        return dq, dk, dv, None, None, None


def context_parallel_attention(query, key, value, *, group=None, layout: str = "contiguous",
                               causal: Optional[str] = None, scale=None, enable_gqa: bool = False,
                               return_lse: bool = False):
    """This rank's shard of attention(q_full, k_full, v_full, causal=..., scale=..., enable_gqa=...),
    where every rank of group (default: the world) holds its shard (see shard()) along dim -2 of
    query (N rows in all), key and value (M rows); leading dims alike on every rank. causal: None,
    "top_left" or "bottom_right", on global positions. Returns out (and the lse shard with
    return_lse=True), differentiable into the local shards: dK/dV are summed around the ring back to
    their owner. Every rank must make the same call (checked: shapes, dtype, flags, whether autograd
    records it) and run backward through it when one does. A failure inside the ring on one rank
    (an error during backward, running out of memory) or a rank that skips the backward the others
    run leaves the others waiting until the process group's timeout (init_process_group(timeout=)).

    Bitwise deterministic for a fixed group size. Memory per rank: its shards plus two K/V blocks
    in flight (backward: also up to three dK/dV blocks in the accumulation dtype: the one being
    summed, the one arriving and the one leaving), never an all-gather. fp16/bf16: each block's
    partial output and gradients come from the kernel rounded to the input dtype, then merge and sum
    in float32."""
    rank, world = _group_rank_world(group)
    error, facts = None, None
    try:
        check_layout(layout)
        _check_causal(causal)
        if not isinstance(return_lse, bool):
            raise TypeError(f"attention_ext: return_lse must be a bool, got {type(return_lse).__name__}")
        call = _prepare(query, key, value, None, scale, 0.0, enable_gqa)
        query_p, key_p, value_p, scale_p, heads = call.query, call.key, call.value, call.scale, call.heads
        if len(call.batch) > _MAX_BATCH_DIMS:  # (attention() merges them; the ring's blocks do not)
            split = " (enable_gqa's split of the heads into (kv heads, groups) counts as one more)" \
                if heads is not None else ""
            raise ValueError(f"attention_ext: context_parallel_attention takes at most {_MAX_BATCH_DIMS} leading "
                             f"dims, got {len(call.batch)}{split}: query {tuple(query.shape)}; reshape the leading "
                             "dims together")
        if key_p.shape[:-2] != value_p.shape[:-2]:
            raise ValueError(f"attention_ext: context_parallel_attention needs key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} to have the same leading dims")
        n_local, m_local = query.shape[-2], key.shape[-2]
        if layout == "zigzag" and (n_local % 2 or m_local % 2):
            raise ValueError(f"attention_ext: a zigzag shard has two equal chunks, but query has {n_local} rows "
                             f"and key {m_local}: both must be even")
        # Whether autograd records the call: a rank that records it runs the ring again in backward,
        # so every rank must (else the others wait for it there).
        records = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        facts = (tuple(query.shape), tuple(key.shape), tuple(value.shape), str(query.dtype), query.device.type,
                 layout, causal, scale_p, enable_gqa, return_lse, records)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, whatever it is
        error = e
    _agree(group, world, error, facts, "context_parallel_attention")

    n_full, m_full = n_local * world, m_local * world
    offset = {None: None, "top_left": 0, "bottom_right": m_full - n_full}[causal]
    geometry = RingGeometry(chunks(layout, rank, world, n_local),
                            lambda source: chunks(layout, source, world, m_local), offset)
    out, lse = _ContextParallelAttention.apply(query_p, key_p, value_p, Ring(group, rank, world), geometry,
                                               scale_p)
    if heads is not None:
        out, lse = out.flatten(-4, -3), lse.flatten(-3, -2)
    return (out, lse) if return_lse else out
