"""Ring attention on torch.distributed point-to-point, forward and backward.

Forward, on rank r of P: the queries stay; at step s the rank holds the K/V block of rank r−s and
sends it on to r+1 while it computes (the transfer of the next block overlaps this block's compute).
Each step's partial (out, lse) is merged into the running result by its log-sum-exp, in step order,
so the result is bitwise the same on every run for a fixed P. Memory beyond the rank's own shard:
the block being computed and the one arriving — two K/V blocks, never an all-gather.

Backward: the K/V blocks go around once more. With the final out and lse every block's softmax
weights are the global ones, so each step's kernel backward gives exact partial dQ (summed here in
step order) and partial dK/dV for the block it holds. Those partials ride along the ring with their
block, each rank adding its own, and after P steps arrive at the block's owner — again in a fixed
order. Traffic per rank and pass: P−1 K/V blocks (backward adds P dK/dV blocks, in the accumulation
dtype); the dK/dV hop of step s overlaps step s+1's compute, so backward holds up to three dK/dV
blocks: the one this step sums, the one arriving and the one still leaving.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from .._constants import lse_dtype
from .._ops import below_autograd, ops
from ._layout import Chunk, plan_calls

# Message tags, so K, V and the travelling gradients never match each other's receives.
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14

# A list while record_ring_steps() is active: one dict per ring step.
_step_log: Optional[list] = None


class Ring:
    """The group's ranks in ring order; shift() posts this rank's sends to the next rank and the
    matching receives from the previous one, returning the requests and the receive buffers."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world

    def shift(self, tensors, tags):
        received = [torch.empty_like(t) for t in tensors]
        ops_ = []
        for t, r, tag in zip(tensors, received, tags):
            ops_.append(dist.P2POp(dist.isend, t, self.next, self.group, tag))
            ops_.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag))
        return dist.batch_isend_irecv(ops_), received


def _wait(requests) -> float:
    start = time.perf_counter()
    for request in requests or ():
        request.wait()
    return time.perf_counter() - start


def _log(pass_name, step, compute_s, wait_s, bytes_sent):
    if _step_log is not None:
        _step_log.append({"pass": pass_name, "step": step, "compute_s": compute_s, "wait_s": wait_s,
                          "bytes_sent": bytes_sent})


class RingGeometry:
    """What every step needs to know: this rank's query chunks, any rank's key chunks, and the causal
    offset on global positions (None: no causal mask)."""

    def __init__(self, q_chunks: list[Chunk], key_chunks_of, offset: Optional[int]):
        self.q_chunks, self.key_chunks_of, self.offset = q_chunks, key_chunks_of, offset

    def calls(self, source_rank: int):
        return plan_calls(self.q_chunks, self.key_chunks_of(source_rank), self.offset)


def _rows(t, lo, hi):
    return t.narrow(-2, lo, hi - lo)


def _merge(out_acc, lse_acc, out_part, lse_part):
    """(out_acc, lse_acc) ← the softmax over both key sets: weights e^(lse − lse_new), an empty side
    (lse −inf) weighing 0 — no NaN for rows that have seen no key yet."""
    lse_new = torch.logaddexp(lse_acc, lse_part)
    finite = torch.where(torch.isneginf(lse_new), torch.zeros_like(lse_new), lse_new)
    out_acc.mul_(torch.exp(lse_acc - finite).unsqueeze(-1).to(out_acc.dtype))
    out_acc.add_(out_part * torch.exp(lse_part - finite).unsqueeze(-1).to(out_acc.dtype))
    lse_acc.copy_(lse_new)


def ring_forward(ring: Ring, geometry: RingGeometry, query, key, value, scale):
    """(out, lse) of this rank's queries against every rank's keys; key/value contiguous."""
    acc_dtype = lse_dtype(query.dtype)
    batch = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
    out = query.new_zeros((*batch, query.shape[-2], value.shape[-1]), dtype=acc_dtype)
    lse = query.new_full((*batch, query.shape[-2]), -float("inf"), dtype=acc_dtype)
    k_cur, v_cur = key, value
    for step in range(ring.world):
        requests = None
        if step < ring.world - 1:
            requests, (k_next, v_next) = ring.shift((k_cur, v_cur), (_TAG_K, _TAG_V))
        start = time.perf_counter()
        with below_autograd():
            for call in geometry.calls((ring.rank - step) % ring.world):
                part_out, part_lse = ops.attention_fwd(
                    _rows(query, call.q_lo, call.q_hi), _rows(k_cur, call.k_lo, call.k_hi),
                    _rows(v_cur, call.k_lo, call.k_hi), None, scale, 0, -1, call.window_right, 0.0, None, None,
                    0.0, None)
                _merge(_rows(out, call.q_lo, call.q_hi), lse[..., call.q_lo:call.q_hi], part_out, part_lse)
        compute_s = time.perf_counter() - start
        wait_s = _wait(requests)
        sent = 0 if requests is None else k_cur.nbytes + v_cur.nbytes
        _log("forward", step, compute_s, wait_s, sent)
        if requests is not None:
            k_cur, v_cur = k_next, v_next
    return out.to(query.dtype), lse


def ring_backward(ring: Ring, geometry: RingGeometry, grad_out, grad_lse, query, key, value, out, lse, scale):
    """(dq, dk, dv) for this rank's shards: dq summed over the steps, dk/dv accumulated along the
    ring and received back from the last rank that added to them."""
    acc_dtype = lse_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=acc_dtype, device=query.device)
    k_cur, v_cur = key, value
    kv_requests = grad_requests = None
    dk_acc = dv_acc = None
    for step in range(ring.world):
        if step < ring.world - 1:
            kv_requests, (k_next, v_next) = ring.shift((k_cur, v_cur), (_TAG_K, _TAG_V))
        start = time.perf_counter()
        dk_part = dv_part = None
        with below_autograd():
            for call in geometry.calls((ring.rank - step) % ring.world):
                rows = slice(call.q_lo, call.q_hi)
                call_dq, call_dk, call_dv, _ = ops.attention_bwd(
                    _rows(grad_out, call.q_lo, call.q_hi), None if grad_lse is None else grad_lse[..., rows],
                    _rows(query, call.q_lo, call.q_hi), _rows(k_cur, call.k_lo, call.k_hi),
                    _rows(v_cur, call.k_lo, call.k_hi), None, _rows(out, call.q_lo, call.q_hi), lse[..., rows],
                    scale, 0, -1, call.window_right, 0.0, None, None, 0.0, None, False, True)
                _rows(dq, call.q_lo, call.q_hi).add_(call_dq)
                whole = call.k_lo == 0 and call.k_hi == k_cur.shape[-2] and call_dk.dtype == acc_dtype
                if dk_part is None and whole:  # the one call of the block: its gradients are the partials
                    dk_part, dv_part = call_dk, call_dv
                    continue
                if dk_part is None:
                    dk_part = torch.zeros(k_cur.shape, dtype=acc_dtype, device=k_cur.device)
                    dv_part = torch.zeros(v_cur.shape, dtype=acc_dtype, device=v_cur.device)
                _rows(dk_part, call.k_lo, call.k_hi).add_(call_dk)
                _rows(dv_part, call.k_lo, call.k_hi).add_(call_dv)
                del call_dk, call_dv
        if dk_part is None:  # nothing of this block is visible to this rank's queries
            dk_part = torch.zeros(k_cur.shape, dtype=acc_dtype, device=k_cur.device)
            dv_part = torch.zeros(v_cur.shape, dtype=acc_dtype, device=v_cur.device)
        compute_s = time.perf_counter() - start
        # The partial sums for this block arrive from the previous rank (posted last step).
        wait_s = _wait(grad_requests)
        if dk_acc is not None:
            dk_part.add_(dk_acc)  # fixed order: the ranks before, then this one (rounded alike each run)
            dv_part.add_(dv_acc)
        if ring.world == 1:
            return dq.to(query.dtype), dk_part.to(key.dtype), dv_part.to(value.dtype)
        # After the last step the block is the next rank's own; what arrives is ours, complete.
        grad_requests, (dk_acc, dv_acc) = ring.shift((dk_part, dv_part), (_TAG_DK, _TAG_DV))
        wait_s += _wait(kv_requests)
        sent = dk_part.nbytes + dv_part.nbytes + (k_cur.nbytes + v_cur.nbytes if kv_requests is not None else 0)
        _log("backward", step, compute_s, wait_s, sent)
        if kv_requests is not None:
            k_cur, v_cur = k_next, v_next
            kv_requests = None
    _wait(grad_requests)
    return dq.to(query.dtype), dk_acc.to(key.dtype), dv_acc.to(value.dtype)
