"""Inference against a key/value cache: FlashAttention 2's `flash_attn_with_kvcache`, on CPU and CUDA,
in float64/float32/float16/bfloat16.

    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                  causal=True)

q (batch, seqlen_q, heads, head_dim); k_cache / v_cache (batch_cache, seqlen_cache, kv_heads, head_dim),
or paged (num_blocks, block_size, kv_heads, head_dim) with block_table (batch, max_blocks) int32 —
any block_size >= 1. heads is a multiple of kv_heads (GQA/MQA, no copies). Per batch entry b:
  1. with k / v (batch, seqlen_new, kv_heads, head_dim) given, they are written into the cache in
     place at positions cache_seqlens[b], cache_seqlens[b] + 1, ... (through block_table when paged),
     after rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2) rotated them at those positions —
     interleaved pairs (0, 1), (2, 3), ... or, with rotary_interleaved=False, the halves (GPT-NeoX);
     q is rotated at the same positions when causal or windowed (a window side shorter than the
     cache), else all its rows at cache_seqlens[b] (FlashAttention's rules). Positions are cache
     indices: they count from the cache's first slot, not from cache_leftpad[b], as FlashAttention's;
  2. q attends to the keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new) of cache row
     cache_batch_idx[b] (default b), causal and window aligned bottom-right, softcap and ALiBi as in
     flash_attn_func; a window side at least as long as the cache bounds nothing (FlashAttention's
     rule).
Returns out (batch, seqlen_q, heads, head_dim_v), and softmax_lse (batch, heads, seqlen_q) with
return_softmax_lse=True. Inference only: inputs that require grad (with grad mode on; rotary tables
and ALiBi slopes too), or that carry forward-mode tangents, are refused (vmap works: torch runs the
call once per entry, with cache_seqlens, cache_batch_idx, cache_leftpad and block_table unbatched).
Every write is checked first: a cache overflow (cache_seqlens + seqlen_new beyond the cache), a
block id outside the cache anywhere an entry reads or writes, two entries appending to one cache
slot (through cache_batch_idx or a block shared in block_table; reading one together is fine),
k_cache and v_cache in the same memory, or an expanded (stride-0) cache to append to raises before
anything is written. New k / v that are views of a cache are copied before the
writes, so they go in with the values they were passed with. A cache made under
torch.inference_mode() takes appends only under it as well (torch refuses in-place updates of
inference tensors outside it; FlashAttention writes through raw pointers and does not notice;
torch.compile cannot tell, so traced calls skip this check). Under
torch.compile the call traces whole (fullgraph=True): the checks of per-entry tensors run in an op
of their own when the graph runs, and the writes take their positions from its result.

The CPU decode kernel reads a paged cache through its block table (calls of up to 8 query rows);
longer calls, and the CUDA kernels, copy each entry's blocks into one contiguous tensor first.
num_splits is accepted for compatibility: the kernels choose their key split from the shape, so
results never depend on it.
"""
from __future__ import annotations

import numbers

import torch

from . import _arguments, _ops
from ._constants import FLOAT_DTYPES, lse_dtype
from ._ops import call_below_autograd, ops
from .api import _check_scale, _check_softcap
from .function import forward_ad_possible

__all__ = ["flash_attn_with_kvcache"]


@torch.library.register_fake("attention_ext::attention_kvcache_fwd")
def _kvcache_fwd_fake(query, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, scale,
                      causal, window_left, window_right, softcap, alibi_slopes):
    check = _arguments.check_traced
    _arguments.qkv_rules(check, query, k_cache, v_cache)
    for t, name in ((cache_seqlens, "cache_seqlens"), (cache_batch_idx, "cache_batch_idx"),
                    (cache_leftpad, "cache_leftpad"), (block_table, "block_table"), (alibi_slopes, "alibi_slopes")):
        if t is not None:
            _arguments.device_rule(check, t, name, query.device, cpu_ok=name != "alibi_slopes")
    _arguments.scale_rules(check, scale, query.dtype)
    _arguments.softcap_rules(check, softcap, query.dtype)
    heads = torch.broadcast_shapes(query.shape[1:-2], k_cache.shape[1:-2], v_cache.shape[1:-2])
    batch, n, dv = query.shape[0], query.shape[-2], v_cache.shape[-1]
    nd = len(heads)
    out = query.new_empty((batch, n, *heads, dv)).permute(0, *range(2, nd + 2), 1, nd + 2)
    return out, query.new_empty((batch, *heads, n), dtype=lse_dtype(query.dtype))


@torch.library.register_fake("attention_ext::attention_rotary")
def _rotary_fake(x, cos, sin, start, per_row, interleaved):
    """The op's shape and dtype rules (the positions are values: checked when it runs); the
    rotated rows come back contiguous, in x's dtype."""
    check = _arguments.check_traced
    check(x.dim() == 4 and x.dtype in FLOAT_DTYPES, ValueError,
          lambda: f"rotary rotates float (batch, rows, heads, head_dim) tensors, got {x.dtype} of shape "
                  f"{tuple(x.shape)}")
    check(cos.dim() == 2 and cos.shape == sin.shape and cos.dtype in FLOAT_DTYPES and sin.dtype in FLOAT_DTYPES,
          ValueError, lambda: f"rotary_cos / rotary_sin must both be float (seqlen_ro, rotary_dim / 2), got "
                              f"{cos.dtype} {tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    check(2 * cos.shape[1] <= x.shape[3], ValueError,
          lambda: f"rotary_dim {2 * cos.shape[1]} exceeds the head dim {x.shape[3]}")
    check(start.dtype == torch.int32 and tuple(start.shape) == (x.shape[0],), TypeError,
          lambda: f"the rotary start positions must be int32 of shape ({x.shape[0]},), got {start.dtype} of shape "
                  f"{tuple(start.shape)}")
    for t, name in ((cos, "rotary_cos"), (sin, "rotary_sin"), (start, "the rotary start positions")):
        _arguments.device_rule(check, t, name, x.device, cpu_ok=t is start)
    return x.new_empty(x.shape)


@torch.library.register_fake("attention_ext::attention_kvcache_append")
def _kvcache_append_fake(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    """The op's shape, dtype and device rules (the positions are values: checked when it runs);
    it writes into the caches in place, so nothing to allocate."""
    check = _arguments.check_traced
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"), (v, "v")):
        check(t.dim() == 4, ValueError, lambda t=t, name=name: f"{name} must be 4-D, got shape {tuple(t.shape)}")
        check(t.dtype == k_cache.dtype, TypeError, lambda t=t, name=name: f"{name} must have k_cache's dtype "
              f"{k_cache.dtype}, got {t.dtype}")
        _arguments.device_rule(check, t, name, k_cache.device)
    check(k_cache.shape[:3] == v_cache.shape[:3] and k.shape[:3] == v.shape[:3] and k.shape[2:] == k_cache.shape[2:]
          and v.shape[2:] == v_cache.shape[2:], ValueError,
          lambda: f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit k_cache {tuple(k_cache.shape)} / v_cache "
          f"{tuple(v_cache.shape)}")
    for t, name in ((cache_seqlens, "cache_seqlens"), (cache_batch_idx, "cache_batch_idx")):
        if t is not None:
            check(t.dtype == torch.int32 and tuple(t.shape) == (k.shape[0],), TypeError,
                  lambda t=t, name=name: f"{name} must be int32 of shape ({k.shape[0]},), got {t.dtype} "
                  f"{tuple(t.shape)}")
    for t, name in ((cache_seqlens, "cache_seqlens"), (cache_batch_idx, "cache_batch_idx"),
                    (block_table, "block_table")):
        if t is not None:  # (on a device of their own, a real call would read no values from them)
            _arguments.device_rule(check, t, name, k_cache.device, cpu_ok=True)
    if block_table is not None:
        check(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == k.shape[0],
              TypeError, lambda: f"block_table must be int32 of shape ({k.shape[0]}, max_blocks), got "
              f"{block_table.dtype} {tuple(block_table.shape)}")
    return None


_PREFIX = "attention_ext.flash_attn_with_kvcache: "


def _fail(error, message):
    raise error(_PREFIX + message)


def _enforce(holds, error, message):
    """_arguments' check with this function's prefix: the shared rules raise under its name."""
    if not holds:
        _fail(error, message())


def _check_per_entry(t, name, batch, device):
    """An optional int32 (batch,) argument: its dtype, shape and device (what tracing can check)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (batch,):
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        _fail(TypeError, f"{name} must be an int32 tensor of shape ({batch},), got {got}")
    _arguments.device_rule(_enforce, t, name, device, cpu_ok=True)
    if t.device.type == "meta":  # (the checks and the writes read its values)
        _fail(ValueError, f"{name} is on the meta device and holds no values: give it on the CPU (or q's device)")


def _entry_values(cache_seqlens, cache_batch_idx, cache_leftpad, batch, capacity):
    """The per-entry arguments as host lists: (lengths, cache rows, leftpad). cache_seqlens may be a
    tensor, an int, or None (every entry's cache full)."""
    if cache_seqlens is None:
        lengths = [capacity] * batch
    elif isinstance(cache_seqlens, torch.Tensor):
        lengths = cache_seqlens.tolist()
    else:
        lengths = [int(cache_seqlens)] * batch
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(batch))
    leftpad = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
    return lengths, rows, leftpad


def _check_entries(lengths, rows, leftpad, block_table, cache_rows, block_size, new, capacity, batch_idx_given):
    """Every position an entry writes or reads, from the per-entry values (_entry_values) before
    anything is written: the cache's capacity, int32 ends, leftpad, cache rows and, paged
    (block_table given; cache_rows are then its blocks of block_size slots), the block ids; and
    that no two entries write one slot (_check_one_writer)."""
    paged = block_table is not None
    for b in range(len(lengths)):
        if lengths[b] < 0:
            _fail(ValueError, f"cache_seqlens[{b}] = {lengths[b]} must be >= 0")
        if lengths[b] + new > capacity:
            _fail(ValueError, f"cache_seqlens[{b}] = {lengths[b]} plus {new} new keys overflows the cache's {capacity} "
                              "positions")
        if lengths[b] + new >= 2 ** 31:  # (the kernels take the ends as int32, as FlashAttention)
            _fail(ValueError, f"cache_seqlens[{b}] = {lengths[b]} plus {new} new keys is beyond the int32 positions "
                              "the kernels take")
        if not 0 <= leftpad[b] <= lengths[b] + new:
            _fail(ValueError, f"cache_leftpad[{b}] = {leftpad[b]} must be in [0, {lengths[b] + new}]")
        if not paged and not 0 <= rows[b] < cache_rows:
            if not batch_idx_given:
                _fail(IndexError, f"q's batch of {len(lengths)} entries is larger than the cache's {cache_rows} rows: "
                                  "pass cache_batch_idx to say which cache row each entry uses")
            _fail(IndexError, f"cache_batch_idx[{b}] = {rows[b]} is outside the cache's {cache_rows} rows")

    lowest, highest = torch.aminmax(block_table) if paged and block_table.numel() else (0, 0)
    if paged and lengths and not (0 <= int(lowest) and int(highest) < cache_rows):
        # Every block an entry reads or writes, [min(leftpad, length), length + new), must be in
        # the cache: checked before anything is written (the op checks the ones it reads again).
        # (Only when some entry of the table is out of range: the slots past an entry's blocks may
        # hold anything, e.g. -1 as padding.)
        on = block_table.device
        first = torch.tensor([min(pad, length) // block_size for pad, length in zip(leftpad, lengths)], device=on)
        stop = torch.tensor([-(-(length + new) // block_size) for length in lengths], device=on)
        column = torch.arange(block_table.shape[1], device=on)
        used = (column >= first[:, None]) & (column < stop[:, None])
        bad = used & ((block_table < 0) | (block_table >= cache_rows))
        if bool(bad.any()):
            b, j = (int(i) for i in bad.nonzero()[0])
            _fail(IndexError, f"block_table[{b}, {j}] = {int(block_table[b, j])} is outside the cache's {cache_rows} "
                              f"blocks (entry {b} uses its blocks {int(first[b])}..{int(stop[b]) - 1})")
    if new > 0:
        _check_one_writer(lengths, rows, block_table, block_size, new)


def _check_one_writer(lengths, rows, block_table, block_size, new):
    """Two entries writing one cache slot (a cache row named twice in cache_batch_idx, or a block
    shared in block_table, where both append) would leave whichever was written last: refused.
    Reading a shared row or block is fine. (Pieces: each entry's new positions cut at its blocks.)"""
    paged = block_table is not None
    if not paged and len(set(rows)) == len(rows):
        return
    pieces = []  # (block or cache row, first slot, end slot, entry)
    table = block_table.tolist() if paged else None
    for b, length in enumerate(lengths):
        if not paged:
            pieces.append((rows[b], length, length + new, b))
            continue
        for j in range(length // block_size, (length + new - 1) // block_size + 1):
            lo, hi = max(length, j * block_size), min(length + new, (j + 1) * block_size)
            pieces.append((table[b][j], lo - j * block_size, hi - j * block_size, b))
    pieces.sort()
    for before, piece in zip(pieces, pieces[1:]):
        if before[0] == piece[0] and piece[1] < before[2]:
            where = f"block {piece[0]}, slot {piece[1]}" if paged else f"cache row {piece[0]}, position {piece[1]}"
            who = (f"entry {piece[3]} appends twice to {where} (its block_table row lists the block twice)"
                   if before[3] == piece[3] else f"entries {before[3]} and {piece[3]} both append to {where} "
                   f"(through {'block_table' if paged else 'cache_batch_idx'})")
            _fail(ValueError, f"{who}: each cache slot takes one new key per call")


def _check_rotary_reach(lengths, new, seqlen_q, local, table_rows):
    """The last position rotary rotates (new keys at lengths[b], ...; q's rows there too when local,
    else at lengths[b]) must be in the tables."""
    if not lengths:
        return
    last = max([max(lengths) + new - 1 if new else -1] +
               [max(lengths) + (seqlen_q - 1 if local else 0) if seqlen_q else -1])
    if last >= table_rows:
        _fail(ValueError, f"position {last} is beyond the rotary tables' {table_rows} positions")


torch.library.define(
    "attention_ext::kvcache_checked_ends",
    "(Tensor? cache_seqlens, Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, SymInt batch, "
    "SymInt fixed_length, SymInt cache_rows, SymInt block_size, SymInt new, SymInt capacity, SymInt rotary_rows, "
    "SymInt seqlen_q, bool local) -> Tensor")


@torch.library.impl("attention_ext::kvcache_checked_ends", "CompositeExplicitAutograd")
def _checked_ends(cache_seqlens, cache_batch_idx, cache_leftpad, block_table, batch, fixed_length, cache_rows,
                  block_size, new, capacity, rotary_rows, seqlen_q, local):
    """Under torch.compile, the per-entry checks of an eager call (_check_entries, and
    _check_rotary_reach for rotary_rows >= 0) run in this op, when the graph runs: the values are
    data, unknown while tracing. Returns each entry's key end, lengths[b] + new, as int32 on the
    CPU. fixed_length: every entry's length when cache_seqlens is not a tensor."""
    seqlens = cache_seqlens if cache_seqlens is not None else fixed_length
    lengths, rows, leftpad = _entry_values(seqlens, cache_batch_idx, cache_leftpad, batch, capacity)
    _check_entries(lengths, rows, leftpad, block_table, cache_rows, block_size, new, capacity,
                   cache_batch_idx is not None)
    if rotary_rows >= 0:
        _check_rotary_reach(lengths, new, seqlen_q, local, rotary_rows)
    return _key_ends(lengths, new)


@torch.library.register_fake("attention_ext::kvcache_checked_ends")
def _checked_ends_fake(cache_seqlens, cache_batch_idx, cache_leftpad, block_table, batch, fixed_length, cache_rows,
                       block_size, new, capacity, rotary_rows, seqlen_q, local):
    return torch.empty(batch, dtype=torch.int32, device="cpu")


def _starts(cache_seqlens, lengths):
    """Where each entry's new keys go, as the CPU ops take it: cache_seqlens' int32 (batch,) tensor
    as given, or one built from the int."""
    return cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else torch.tensor(lengths, dtype=torch.int32)


def _start_column(cache_seqlens, lengths, device):
    """_starts as an int64 (batch, 1) tensor on device (for index tensors)."""
    return _starts(cache_seqlens, lengths).to(device=device, dtype=torch.int64).unsqueeze(-1)


def _key_ends(lengths, new):
    """Each entry's key end, lengths[b] + new, as the int32 tensor the attention op takes."""
    return torch.tensor([length + new for length in lengths], dtype=torch.int32)


def _rotation(cos, sin, positions, acc, interleaved):
    """The rotary tables at positions (batch, rows), only those rows converted to the float dtype
    acc, laid out like the dims they rotate: (cos, signed sin), each (batch, rows, 1, rotary_dim),
    with each pair's cos on both its members and its sin negated on the first."""
    c, s = cos[positions].to(acc), sin[positions].to(acc)
    if interleaved:
        both, signed = torch.stack((c, c), dim=-1).flatten(-2), torch.stack((-s, s), dim=-1).flatten(-2)
    else:
        both, signed = torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)
    return both.unsqueeze(2), signed.unsqueeze(2)


def _rotate(x, rotation, interleaved):
    """Rotary embedding of the first rotary_dim dims of x (batch, rows, heads, d) by rotation
    (_rotation): each pair (x1, x2), neighbours (interleaved) or the two halves of the rotated
    dims, becomes (x1·c − x2·s, x2·c + x1·s), in rotation's precision (float32; float64 for
    float64 x), stored in x's dtype. As x·cos + partner·signed sin: two products and a sum per
    element, so the bits are those of the formula's own and do not depend on where x lies (a few
    torch ops for the whole rotation)."""
    both, signed = rotation
    dims = both.shape[-1]
    part = x[..., :dims].to(both.dtype)
    if interleaved:
        partner = part.unflatten(-1, (dims // 2, 2)).flip(-1).flatten(-2)
    else:
        partner = part.roll(dims // 2, dims=-1)
    rotated = (part * both + partner * signed).to(x.dtype)
    return rotated if dims == x.shape[-1] else torch.cat((rotated, x[..., dims:]), dim=-1)


_FLASH_RULES = None


def _flash_rules():
    """flash_attn_func's window, ALiBi and softcap rules (flash imports this module: looked up on
    first use; one assignment, so threads racing through the first call all get the same three)."""
    global _FLASH_RULES
    if _FLASH_RULES is None:
        from .flash import _band_from, _check_alibi, _check_softcap
        _FLASH_RULES = (_band_from, _check_alibi, _check_softcap)
    return _FLASH_RULES


def _byte_span(t):
    """The bytes a strided tensor's elements lie in: [first, end) (empty for no elements)."""
    if t.numel() == 0:
        return 0, 0
    first = t.data_ptr()
    return first, first + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _dense(t):
    """Whether t's elements fill numel() consecutive slots, in some order of its dims (no gaps, no
    overlap): as ATen's is_non_overlapping_and_dense."""
    size = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if st != size:
            return False
        size *= n
    return True


def _may_share_memory(a, b):
    """Whether a and b lie in overlapping bytes (some element of each may be the same memory)."""
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def _same_memory(a, b):
    """Whether a and b certainly share elements: the same first element, two dense tensors in
    overlapping bytes (ATen's full and partial overlap), or views with the same strides that meet
    (_strided_views_meet). Interleaved views, as a packed KV cache's two halves, are not.
    (csrc/kv_cache.cpp's same_memory is the C++ twin.)"""
    if a.numel() == 0 or b.numel() == 0 or not _may_share_memory(a, b):
        return False
    return a.data_ptr() == b.data_ptr() or (_dense(a) and _dense(b)) or _strided_views_meet(a, b)


_MEET_SEARCH_BUDGET = 4096


def _strided_views_meet(a, b):
    """Whether views a and b with the same strides (and element size) have an element in common:
    index x of a and y of b with sum_i stride_i·(x_i − y_i) = b's first element − a's. The
    differences are found dim by dim, largest stride first, each among the values that leave a
    remainder the smaller strides can still make (one or two where the strides nest, as slices of
    one tensor's do). Other strides, or a search past its budget: False (not decided)."""
    size = a.element_size()
    distance = b.data_ptr() - a.data_ptr()
    # (the strides of dims of size 1 in both say nothing: a view may carry any there)
    moving = [i for i in range(a.dim()) if a.shape[i] > 1 or b.shape[i] > 1]
    if size != b.element_size() or a.dim() != b.dim() or distance % size != 0 \
            or any(a.stride(i) != b.stride(i) for i in moving):
        return False
    # (stride, largest x − y, smallest x − y) per dim that can differ
    dims = sorted(((a.stride(i), a.shape[i] - 1, 1 - b.shape[i]) for i in moving if a.stride(i) != 0),
                  reverse=True)
    reach_high = [0] * (len(dims) + 1)  # the sums dims[i:] can reach: [reach_low[i], reach_high[i]]
    reach_low = [0] * (len(dims) + 1)
    for i in range(len(dims) - 1, -1, -1):
        st, high, low = dims[i]
        reach_high[i] = reach_high[i + 1] + st * high
        reach_low[i] = reach_low[i + 1] + st * low
    budget = [_MEET_SEARCH_BUDGET]

    def meet(i, rest):
        if i == len(dims):
            return rest == 0
        st, high, low = dims[i]
        first = max(low, -((reach_high[i + 1] - rest) // st))  # st·d >= rest − reach_high[i + 1]
        last = min(high, (rest - reach_low[i + 1]) // st)  # st·d <= rest − reach_low[i + 1]
        for d in range(first, last + 1):
            budget[0] -= 1
            if budget[0] < 0:  # (the whole search stops here)
                return False
            if meet(i + 1, rest - st * d):
                return True
        return False

    return meet(0, distance // size)


def _heads_first(cache):
    """A (rows or blocks, length, kv_heads, d) cache as the view (rows, kv_heads, 1, length, d)."""
    rows, length, kv_heads, d = cache.shape
    st = cache.stride()
    return cache.as_strided((rows, kv_heads, 1, length, d), (st[0], st[2], 0, st[1], st[3]))


def _refuse_vmapped_entries(named):
    """The per-entry tensors are read as values (which rows and slots each entry reads and writes):
    batched by torch.func.vmap they have none to read, so each is refused with what to do instead."""
    if torch.compiler.is_compiling():
        return
    for t, name in named:
        if isinstance(t, torch.Tensor) and torch._C._functorch.is_batchedtensor(t):
            _fail(NotImplementedError, f"{name} is batched by torch.func.vmap: its values say where each entry "
                                       "reads and writes, so it must be the same for every call vmap makes; pass it "
                                       "unbatched (in_dims None) or loop over the calls")


def _refuse_forward_ad(named):
    """no_grad does not stop forward-mode AD, and the op has no jvp: its tangents would be dropped
    (vmap is fine: torch runs the op once per batch entry)."""
    for t, name in named:
        if isinstance(t, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            _fail(NotImplementedError, f"{name} carries a forward-mode tangent: this inference function has no "
                                       "forward-mode AD")
    stack = getattr(torch._C._functorch, "get_interpreter_stack", lambda: None)()
    if stack and any(level.key() == torch._C._functorch.TransformType.Jvp for level in stack):
        _fail(NotImplementedError, "called under torch.func.jvp / jacfwd: this inference function has no forward-mode "
                                   "AD")


def _step_op(op, *args):
    """One of the step's ops (none has autograd, and no input requiring grad gets here with grad
    mode on): through its direct entry below the autograd keys, or as a plain call when traced."""
    return op(*args) if torch.compiler.is_compiling() else call_below_autograd(op, *args)


def _check_tensors(q, k_cache, v_cache, k, v, paged):
    if (k is None) != (v is None):
        _fail(ValueError, "k and v must be given together (the new keys and values to append)")
    for t, name in ((k, "k"), (v, "v")):  # (their shapes are checked against the cache's below)
        if t is not None and not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a torch.Tensor (batch, seqlen_new, kv_heads, head_dim) or None, got "
                             f"{type(t).__name__}")
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"), (v, "v")):
        if isinstance(t, torch.Tensor) and (t.layout != torch.strided or t.is_nested):  # (sparse, mkldnn, nested)
            got = "a nested tensor" if t.is_nested else f"layout {t.layout}"
            _fail(TypeError, f"{name} must be a dense (strided) tensor, got {got}")
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            layout = "(num_blocks, block_size" if paged and name != "q" else "(batch, seqlen"
            _fail(ValueError, f"{name} must be a 4-D tensor {layout}, heads, head_dim), got {got}")
    tensors = [(q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")] + ([(k, "k"), (v, "v")] if k is not None else [])
    dtype, device, grad_enabled = q.dtype, q.device, torch.is_grad_enabled()
    for t, name in tensors:
        if t.dtype != dtype or t.device != device:
            _fail(TypeError, f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, "
                             f"{t.device}")
        if grad_enabled and t.requires_grad:
            _fail(RuntimeError, f"{name} requires grad: this is an inference function (no backward); call it under "
                                "torch.no_grad() or pass detached tensors")
    if q.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        _fail(TypeError, f"q must be float64, float32, float16 or bfloat16, got {q.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        _fail(ValueError, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share their first "
                          "three dims")
    if k_cache.shape[-1] != q.shape[-1]:
        _fail(ValueError, f"k_cache must have q's head dim {q.shape[-1]}, got k_cache {tuple(k_cache.shape)}")
    heads, kv_heads = q.shape[2], k_cache.shape[2]
    _arguments.head_groups_rule(_arguments.enforce, heads, kv_heads, "the cache")
    if k is not None:
        want_k = (q.shape[0], k.shape[1], kv_heads, k_cache.shape[-1])
        want_v = (q.shape[0], k.shape[1], kv_heads, v_cache.shape[-1])
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            _fail(ValueError, f"k and v must be (batch, seqlen_new, kv_heads, head_dim) = {want_k} / {want_v}, got "
                              f"{tuple(k.shape)} and {tuple(v.shape)}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """FlashAttention 2's flash_attn_with_kvcache (see the module docstring)."""
    # An eager CPU step in one C++ call, which checks what this function checks below and answers
    # None for anything else, or anything these checks would refuse, before writing: then this
    # function runs and decides (csrc/kv_cache_step.h).
    if _ops.KVCACHE_STEP is not None and not torch.compiler.is_compiling() and not forward_ad_possible():
        result = _ops.KVCACHE_STEP(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                   cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                                   softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
        if result is not None:
            return result
    paged = block_table is not None
    _check_tensors(q, k_cache, v_cache, k, v, paged)
    if k is not None:  # (torch's own in-place ops refuse such a tensor too)
        for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            strides = cache.stride()
            shared = [dim for dim in range(4) if strides[dim] == 0 and cache.shape[dim] > 1] if 0 in strides else ()
            if shared:
                _fail(ValueError, f"{name} is an expanded view (stride 0 in dim {shared[0]}, shape "
                                  f"{tuple(cache.shape)}): appending k / v would write one memory row for several "
                                  "entries; give the cache its own memory (e.g. .clone())")
        if k_cache.device.type != "meta" and not torch.compiler.is_compiling() and \
                not torch._C._are_functorch_transforms_active():
            # Caches that are one memory would each take the other's new rows.
            if _same_memory(k_cache, v_cache):
                _fail(ValueError, "k_cache and v_cache are the same memory: appending k / v would write each "
                                  "over the other; give them memory of their own")
            # New rows that are a view of a cache would be overwritten while they are copied in:
            # copied first (rows as the caller passed them).
            if any(_may_share_memory(new_rows, cache) for new_rows in (k, v) for cache in (k_cache, v_cache)):
                k, v = k.clone(), v.clone()
    _refuse_vmapped_entries(((cache_seqlens, "cache_seqlens"), (cache_batch_idx, "cache_batch_idx"),
                             (cache_leftpad, "cache_leftpad"), (block_table, "block_table")))
    if forward_ad_possible():
        _refuse_forward_ad(((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"), (v, "v"),
                            (rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")))
    batch, seqlen_q, heads, _ = q.shape
    if paged and (k_cache.shape[0] == 0 or k_cache.shape[1] == 0):
        _fail(ValueError, f"a paged k_cache needs at least one block of at least one slot, got shape "
                          f"{tuple(k_cache.shape)} (num_blocks, block_size, kv_heads, head_dim)")
    kv_heads, device = k_cache.shape[2], q.device
    _band_from, _check_alibi, _flash_softcap = _flash_rules()
    _, (window_left, window_right) = _band_from(causal, window_size, _PREFIX)
    if causal:
        window_right = 0
    scale = _check_scale(softmax_scale, q)
    softcap = _check_softcap(_flash_softcap(softcap, _PREFIX))
    if type(num_splits) is not int and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)):
        _fail(TypeError, f"num_splits must be an int (FlashAttention's: < 1 chooses), got {num_splits!r}")
    rotary_interleaved = _arguments.flag(rotary_interleaved, "rotary_interleaved", _PREFIX, integers=True)
    return_softmax_lse = _arguments.flag(return_softmax_lse, "return_softmax_lse", _PREFIX, integers=True)

    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != batch:
            got = (f"{block_table.dtype} of shape {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor)
                   else type(block_table).__name__)
            _fail(TypeError, f"block_table must be an int32 tensor of shape ({batch}, max_blocks), got {got}")
        _arguments.device_rule(_enforce, block_table, "block_table", device, cpu_ok=True)
        if cache_batch_idx is not None:
            _fail(ValueError, "cache_batch_idx cannot be combined with block_table (the table names each "
                              "entry's blocks)")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    # FlashAttention's rule: a window side at least as long as the cache bounds nothing (-1), for
    # the mask as for rotary's choice of positions below.
    window_left = -1 if window_left >= capacity else window_left
    window_right = -1 if window_right >= capacity else window_right
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        if k is not None:
            _fail(ValueError, "appending k / v needs cache_seqlens (where each entry's new keys go)")
    elif isinstance(cache_seqlens, torch.Tensor) or not isinstance(cache_seqlens, numbers.Integral) \
            or isinstance(cache_seqlens, bool):
        _check_per_entry(cache_seqlens, "cache_seqlens", batch, device)
    _check_per_entry(cache_batch_idx, "cache_batch_idx", batch, device)
    _check_per_entry(cache_leftpad, "cache_leftpad", batch, device)
    seqlens_given = isinstance(cache_seqlens, torch.Tensor)
    rotary = rotary_cos is not None or rotary_sin is not None
    # FlashAttention rotates q row by row only for a causal or windowed call.
    local = causal or window_left >= 0 or window_right >= 0
    # Every position an entry writes or reads (and, below, the rotary tables' reach), before
    # anything is written: from the per-entry values on the host in an eager call; under
    # torch.compile, where those values are data, by an op that runs the same checks when the graph
    # runs and returns the key ends (then lengths stay unknown when cache_seqlens is a tensor).
    traced = torch.compiler.is_compiling() and (seqlens_given or cache_batch_idx is not None or
                                                cache_leftpad is not None or paged)
    ends = None
    if not traced:
        lengths, rows, leftpad = _entry_values(cache_seqlens, cache_batch_idx, cache_leftpad, batch, capacity)
        _check_entries(lengths, rows, leftpad, block_table, k_cache.shape[0], k_cache.shape[1], new, capacity,
                       cache_batch_idx is not None)
    # Every rule that can refuse the call, before anything is written (the op checks them again).
    _arguments.band_rules(_arguments.enforce, 2 if causal else 0, window_left, window_right, seqlen_q, capacity)
    if softcap != 0.0:  # (0.0, none, passes every rule)
        _arguments.softcap_rules(_arguments.enforce, softcap, q.dtype)
    groups = heads // kv_heads
    slopes = alibi_slopes
    if slopes is not None:
        _check_alibi(slopes, batch, heads, _PREFIX)
        if slopes.device != device:
            _fail(ValueError, f"alibi_slopes must be on q's device {device}, got {slopes.device}")
        if torch.is_grad_enabled() and slopes.requires_grad:
            _fail(RuntimeError, "alibi_slopes requires grad: this is an inference function (no backward); call it "
                                "under torch.no_grad() or pass detached slopes")
        slopes = slopes.unflatten(-1, (kv_heads, groups))

    if batch == 0:  # nothing to write or attend to
        out = q.new_empty((0, seqlen_q, heads, v_cache.shape[-1]))
        return (out, q.new_empty((0, heads, seqlen_q), dtype=lse_dtype(q.dtype))) if return_softmax_lse else out

    if rotary:
        if rotary_cos is None or rotary_sin is None or k is None:
            _fail(ValueError, "rotary_cos and rotary_sin go together and only with new k / v to rotate")
        for table, name in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
            if not isinstance(table, torch.Tensor) or not table.is_floating_point() or table.device != device:
                got = f"{table.dtype} on {table.device}" if isinstance(table, torch.Tensor) else type(table).__name__
                _fail(TypeError, f"{name} must be a floating tensor on {device}, got {got}")
            if torch.is_grad_enabled() and table.requires_grad:
                _fail(RuntimeError, f"{name} requires grad: this is an inference function (no backward); call it "
                                    "under torch.no_grad() or pass detached tensors")
        # (tables may still require grad under no_grad: detached, the rotation records nothing)
        rotary_cos, rotary_sin = rotary_cos.detach(), rotary_sin.detach()
        if rotary_cos.shape != rotary_sin.shape or rotary_cos.dim() != 2 or 2 * rotary_cos.shape[1] > q.shape[-1]:
            _fail(ValueError, f"rotary_cos / rotary_sin must both be (seqlen_ro, rotary_dim / 2) with rotary_dim <= "
                              f"head_dim ({q.shape[-1]}), got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if not traced:
            _check_rotary_reach(lengths, new, seqlen_q, local, rotary_cos.shape[0])
    if traced:
        fixed_length = 0 if seqlens_given else capacity if cache_seqlens is None else int(cache_seqlens)
        ends = ops.kvcache_checked_ends(cache_seqlens if seqlens_given else None, cache_batch_idx, cache_leftpad,
                                        block_table, batch, fixed_length, k_cache.shape[0], k_cache.shape[1], new,
                                        capacity, rotary_cos.shape[0] if rotary else -1, seqlen_q, local)
        # The writes take their positions from the checks' result, so that a compiler cannot
        # order them before the checks (a tensor from here on: no host list, whose length would
        # make the batch size a constant).
        cache_seqlens = ends - new
        lengths = None

    # On CPU tensors the rotary and the append are ops of their own; under vmap and the other
    # functorch transforms (the ops have no batching rules) and on other devices, torch ops.
    cpu_ops = device.type == "cpu" and not torch._C._are_functorch_transforms_active()
    starts = positions = None  # (computed once for the rotary and the append that need them)
    if rotary:
        if cpu_ops and rotary_cos.dtype in FLOAT_DTYPES and rotary_sin.dtype in FLOAT_DTYPES:
            # One op per tensor (rotary.h), the formula's bits; tables in other float dtypes
            # (float8) take the torch ops below.
            starts = _starts(cache_seqlens, lengths)
            k = _step_op(ops.attention_rotary, k, rotary_cos, rotary_sin, starts, True, rotary_interleaved)
            q = _step_op(ops.attention_rotary, q, rotary_cos, rotary_sin, starts, local, rotary_interleaved)
        else:
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32
            # (batch, new) cache indices where each entry's new keys go, so (FlashAttention's rule)
            # the positions rotary rotates them and q at
            start = _start_column(cache_seqlens, lengths, device)
            positions = start + torch.arange(new, device=device)
            rotation = _rotation(rotary_cos, rotary_sin, positions, acc, rotary_interleaved)
            if not (local and seqlen_q == new):  # (else q's positions are the new keys')
                q_positions = start + (torch.arange(seqlen_q, device=device) if local
                                       else torch.zeros(seqlen_q, dtype=torch.int64, device=device))
                q_rotation = _rotation(rotary_cos, rotary_sin, q_positions, acc, rotary_interleaved)
            else:
                q_rotation = rotation
            k = _rotate(k, rotation, rotary_interleaved)
            q = _rotate(q, q_rotation, rotary_interleaved)

    if k is not None and new > 0:  # the append, in place (every position was checked above)
        # (torch.compile cannot ask whether a tensor is an inference tensor: traced calls skip this)
        inference = torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
        for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if not inference and cache.is_inference():
                _fail(RuntimeError, f"{name} is an inference tensor (made under torch.inference_mode()): appending to "
                                    "it in place works only under inference_mode too, as torch's in-place updates "
                                    "(or pass a clone)")
        # Row copies on CPU caches, no index tensors to build; elsewhere index_put_ (which has the
        # functorch transforms' batching rules).
        if cpu_ops:
            if starts is None:
                starts = _starts(cache_seqlens, lengths)
            # (an in-place op: it bumps the caches' version counters, so autograd notices a saved
            # cache written since)
            _step_op(ops.attention_kvcache_append, k_cache, v_cache, k, v, starts, cache_batch_idx, block_table)
        else:
            if positions is None:
                positions = _start_column(cache_seqlens, lengths, device) + torch.arange(new, device=device)
            if paged:
                table = block_table.to(device=device, dtype=torch.int64)
                index = (table.gather(1, positions // k_cache.shape[1]), positions % k_cache.shape[1])
            else:
                entry_rows = (cache_batch_idx.to(device=device, dtype=torch.int64) if cache_batch_idx is not None
                              else torch.arange(batch, device=device))
                index = (entry_rows.unsqueeze(-1).expand(batch, new), positions)
            k_cache.index_put_(index, k)
            v_cache.index_put_(index, v)

    # (batch, kv_heads, groups, seqlen_q, d) against K/V (batch, kv_heads, 1, seqlen, d): the CPU
    # decode kernel runs the groups sharing a KV head as the rows of one item, reading each K/V row
    # once for all of them. The CUDA kernels do not group heads; for them one query row per entry
    # with nothing that depends on the row's position (no window, no ALiBi; causal is then no rule
    # at all, as a right bound never hides a key from the last position's row) is folded: the
    # groups become the rows of one call. (Views by as_strided: one dispatch per tensor, where a
    # decode step's few microseconds of Python and dispatch run with caches the call just swept.)
    fold = q.device.type == "cuda" and seqlen_q == 1 and window_left < 0 and slopes is None and groups > 1
    qs, d = q.stride(), q.shape[-1]
    if fold:  # (batch, kv_heads, groups as rows, d); CUDA only
        qh = q.reshape(batch, kv_heads, groups, d)
        kh, vh = (t.permute(0, 2, 1, 3) for t in (k_cache, v_cache))
    else:
        qh = q.as_strided((batch, kv_heads, groups, seqlen_q, d), (qs[0], qs[2] * groups, qs[2], qs[1], qs[3]))
        kh, vh = _heads_first(k_cache), _heads_first(v_cache)
    # The per-entry tensors as given where they already are what the op takes (it reads them to
    # the host itself): the key ends are cache_seqlens unless new keys were appended.
    if ends is None:  # (else the traced checks' op gave them)
        if new == 0 and seqlens_given:
            ends = cache_seqlens
        else:
            ends = _key_ends(lengths, new)
    if slopes is not None:
        slopes = slopes.detach()  # (the op has no backward; nothing else it takes can require grad here)
    out, lse = _step_op(ops.attention_kvcache_fwd, qh, kh, vh, ends, cache_batch_idx, cache_leftpad, block_table,
                         scale, 0 if fold else 2 if causal else 0, -1 if fold else window_left,
                         -1 if fold else window_right, softcap, slopes)
    dv = out.shape[-1]
    if fold:  # (batch, kv_heads, groups, d_v) -> (batch, 1, heads, d_v): a copy of one row per head
        out = out.reshape(batch, 1, heads, dv)
        return (out, lse.reshape(batch, heads, 1)) if return_softmax_lse else out
    out = out.permute(0, 3, 1, 2, 4).flatten(2, 3)  # (batch, seqlen_q, heads, d_v), as the kernels laid it out
    return (out, lse.flatten(1, 2)) if return_softmax_lse else out
