"""Where a rank's rows sit in the full sequence, and which (query rows, key rows) calls of the fused
kernel cover one block of the ring.

A shard is a list of chunks, each a run of consecutive global positions stored consecutively in
the shard, in increasing global order (so a shard's global positions are monotone in its local
index under both layouts):

* contiguous: rank r holds rows [r·L/P, (r+1)·L/P) — one chunk;
* zigzag: the sequence is cut into 2P equal chunks and rank r holds chunks r and 2P−1−r — two chunks,
  which balances causal work (every rank gets one early and one late chunk).

Causal attention on global positions makes every (query chunk, key chunk) pair one of: fully
visible, not visible at all (skipped, never computed), or cut by one diagonal j ≤ i + d. plan_calls
turns a block's pairs into as few kernel calls as it can, each a rectangle of local rows and keys
whose visibility is "key j ≤ query i + R" — the kernel's bottom-right window (−1, right), or no mask.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

LAYOUTS = ("contiguous", "zigzag")


class Chunk(NamedTuple):
    global_start: int
    local_start: int
    size: int


class KernelCall(NamedTuple):
    """Local query rows [q_lo, q_hi) against local key rows [k_lo, k_hi); window_right −1: every key
    visible, else key j visible to query i iff j ≤ i + (k_hi − k_lo) − (q_hi − q_lo) + window_right
    (the kernel's bottom-right aligned window with an unbounded left side)."""
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    window_right: int


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"attention_ext: layout must be 'contiguous' or 'zigzag', got {layout!r}")
    return layout


def parts(layout: str, world: int) -> int:
    """How many equal pieces the full sequence is cut into."""
    return world if layout == "contiguous" else 2 * world


def check_divisible(length: int, layout: str, world: int, what: str) -> None:
    pieces = parts(layout, world)
    if length % pieces != 0:
        raise ValueError(f"attention_ext: {what} has {length} rows, which the {layout} layout over {world} ranks "
                         f"cannot split: it needs a multiple of {pieces}")


def chunks(layout: str, rank: int, world: int, local_length: int) -> list[Chunk]:
    """The chunks of rank's shard, given the shard's length (the full length is world·local_length)."""
    if layout == "contiguous":
        return [Chunk(rank * local_length, 0, local_length)]
    size = local_length // 2
    return [Chunk(rank * size, 0, size), Chunk((2 * world - 1 - rank) * size, size, size)]


# Visibility of one (query chunk, key chunk) pair.
_FULL, _NONE, _PARTIAL = "full", "none", "partial"


def _classify(qc: Chunk, kc: Chunk, offset: Optional[int]):
    """offset None: no causal mask; else global key j is visible to global query i iff j ≤ i + offset.
    Returns (kind, d) with d the pair-local diagonal (key j ≤ query i + d) for a partial pair."""
    if qc.size == 0 or kc.size == 0:
        return _NONE, 0
    if offset is None:
        return _FULL, 0
    d = qc.global_start + offset - kc.global_start
    if kc.size - 1 <= d:
        return _FULL, d
    if d + qc.size - 1 < 0:
        return _NONE, d
    return _PARTIAL, d


def _single_call(q_chunks, k_chunks, offset) -> Optional[list[KernelCall]]:
    """One rectangle over the given (locally adjacent) chunks if one bound R in "local key j ≤ local
    query i + R" reproduces every pair's visibility; [] if nothing is visible; None if no R does."""
    kinds = [(qc, kc, *_classify(qc, kc, offset)) for qc in q_chunks for kc in k_chunks]
    q_lo, q_hi = q_chunks[0].local_start, q_chunks[-1].local_start + q_chunks[-1].size
    k_lo, k_hi = k_chunks[0].local_start, k_chunks[-1].local_start + k_chunks[-1].size
    if all(kind == _NONE for *_, kind, _ in kinds):
        return []
    if all(kind == _FULL for *_, kind, _ in kinds):
        return [KernelCall(q_lo, q_hi, k_lo, k_hi, -1)]
    low, high, exact = -float("inf"), float("inf"), set()
    for qc, kc, kind, d in kinds:
        shift = kc.local_start - qc.local_start
        if kind == _FULL:
            low = max(low, shift + kc.size - 1)
        elif kind == _NONE:
            high = min(high, shift - qc.size)
        else:
            exact.add(d + shift)
    if len(exact) > 1:
        return None
    bound = exact.pop() if exact else low
    if not (low <= bound <= high):
        return None
    # Trim the rows that see no key and the keys no row sees; what is left needs right >= 0.
    q_lo = max(q_lo, k_lo - bound)
    k_hi = min(k_hi, q_hi + bound)
    if q_lo >= q_hi or k_lo >= k_hi:
        return []
    n, m = q_hi - q_lo, k_hi - k_lo
    local_bound = q_lo + bound - k_lo  # key j' <= query i' + local_bound, in the rectangle's indices
    right = local_bound - (m - n)
    return [KernelCall(q_lo, q_hi, k_lo, k_hi, -1 if local_bound >= m - 1 else right)]


def plan_calls(q_chunks: list[Chunk], k_chunks: list[Chunk], offset: Optional[int]) -> list[KernelCall]:
    """Kernel calls covering exactly the visible (query, key) pairs of one block, fewest first: one
    rectangle over everything that is visible, else one per query chunk, else one per pair. Chunks
    with nothing visible are dropped, so masked work is skipped, never computed."""
    k_live = [kc for kc in k_chunks if any(_classify(qc, kc, offset)[0] != _NONE for qc in q_chunks)]
    q_live = [qc for qc in q_chunks if any(_classify(qc, kc, offset)[0] != _NONE for kc in k_live)]
    if not q_live or not k_live:
        return []
    if _adjacent(q_live) and _adjacent(k_live):
        calls = _single_call(q_live, k_live, offset)
        if calls is not None:
            return calls
    if len(q_live) > 1:
        return [call for qc in q_live for call in plan_calls([qc], k_live, offset)]
    if len(k_live) > 1:
        return [call for kc in k_live for call in plan_calls(q_live, [kc], offset)]
    return _single_call(q_live, k_live, offset)  # one pair: always one rectangle


def _adjacent(chunk_list: list[Chunk]) -> bool:
    return all(a.local_start + a.size == b.local_start for a, b in zip(chunk_list, chunk_list[1:]))
