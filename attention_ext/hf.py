"""Hugging Face transformers integration: `attn_implementation="attention_ext"`.

    import attention_ext.hf
    attention_ext.hf.register()   # once; returns the name
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attention_ext")
    # or: model.set_attn_implementation("attention_ext")

register() adds an attention function to transformers' AttentionInterface and a mask function to
its AttentionMaskInterface under that name. Every attention layer then runs the fused kernels,
training and generate() alike:
  * causal / bidirectional layers: with no padding transformers' mask code hands over no mask and
    the kernel applies the causal rule itself (bottom-right aligned, so prefill, decode and
    chunked prefill with a cache all line up); a sliding-window layer passes its window the same
    way;
  * GQA without repeat_kv (the kernels broadcast K/V heads), Gemma 2's logit softcap, GPT-OSS's
    sinks (`s_aux`, with their gradient), dropout in training, output_attentions (the exact
    weights);
  * packed sequences (position_ids restarting, e.g. at 0, or cu_seq_lens_q/k from
    DataCollatorWithFlattening): recognised here even when transformers' mask code did not see
    the packing (a training forward with the default use_cache=True), so no sequence attends to
    another. Without a mask from transformers they run as packed variable-length batches
    (attention_ext.varlen): cost Σ n_b², no mask.
  * padding, and a static cache's slots past the newest token: a (batch, 1, 1, keys) mask over
    the keys, with the layer's rule applied by the kernels on top (mask_function), never a
    materialised (n x m) mask.
What keeps transformers' (batch, 1, n, m) mask: packed sequences when transformers' mask code saw
the packing (use_cache=False; a block-diagonal mask, applied as given) or the weights are asked
for, a bidirectional sliding window (ModernBERT's local layers), chunked attention, a compiled
static cache's traced positions, and any mask transformers builds from extra mask functions
(image tokens, prefix-LM): the mask function skips a mask only where transformers allows it to.

Under torch.compile (tracing) the data-dependent shortcuts step aside: transformers' own mask
is used where a CausalKeyMask would be (padding), packing is what transformers' mask code saw (as
for its sdpa path), and a layer with no window of its own takes its config's. Arguments that
change what is attended to and that the kernels do not take (_UNSUPPORTED_KWARGS) raise
NotImplementedError.

transformers is an optional dependency (`pip install 'transformers>=5.14'`, or the `hf` extra from a
checkout: `pip install --no-build-isolation '.[hf]'`), imported only here.
"""
from __future__ import annotations

import functools

import torch

from .api import attention, attention_weights, draw_rng_state, dropout_mask
from .varlen import varlen_attention

__all__ = ["register", "attention_forward", "mask_function", "CausalKeyMask", "calls"]

# Number of attention calls served by attention_forward since import, eagerly (tests read it to prove
# the kernels ran). Compiled calls do not count: torch.compile would guard on the global's value and
# recompile the model on every call.
calls = 0


# The oldest transformers the integration is tested with: 5.13's mask interface hands over
# calls that reach the kernels as (batch, 1, n, m) masks instead of masks over the keys.
MIN_TRANSFORMERS = "5.14"


def register(name: str = "attention_ext") -> str:
    """Registers the attention and mask functions with transformers under `name` and returns it."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"attention_ext.hf needs transformers: pip install 'transformers>={MIN_TRANSFORMERS}'") from e
    from packaging.version import Version  # (a dependency of transformers)
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"attention_ext.hf needs transformers >= {MIN_TRANSFORMERS}, found {transformers.__version__}: "
                          f"pip install -U 'transformers>={MIN_TRANSFORMERS}'")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    if not isinstance(name, str) or not name:
        raise TypeError(f"attention_ext.hf.register: name must be a non-empty string, got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_function)
    return name


class CausalKeyMask(torch.Tensor):
    """The mask mask_function gives a causal layer with padding or a static cache: (batch, 1, 1,
    visible) booleans over the first `visible` keys, the ones up to the newest query (a static
    cache's slots past it are not), True for a real token. attention_forward applies the layer's
    causal rule and window to those keys, bottom-right aligned. A tensor subclass, so that what
    transformers and accelerate do to masks on the way (.contiguous(), .to(device)) keeps it one;
    a narrower mask than the keys is no mask transformers or eager attention would accept.

    A sliding-window layer's mask says its window in its class (`window`: transformers' local_size,
    for the layers that do not pass sliding_window themselves, as PhiMoE's), and `all_real` marks
    one made only to carry it (no key is padding).

    Only those moves keep the class (_KEY_MASK_MOVES, and indexing); any other op on it gives a
    plain tensor. So a compiled forward handed one from outside (generate() with a static cache
    builds its masks eagerly) traces: with torch's default, every op would return the subclass,
    and torch.compile carried it into the layer's output and the next layers' queries, where it
    cannot trace the class."""
    window = None
    all_real = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _KEY_MASK_MOVES and isinstance(out, torch.Tensor) and out.dtype == torch.bool:
            return out.as_subclass(cls)
        return out


# The ops that move or copy a mask on its way to the attention function (transformers' and
# accelerate's .contiguous(), .to(device)), which keep a CausalKeyMask one.
_KEY_MASK_MOVES = frozenset({torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.detach,
                             torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.__getitem__})


@functools.lru_cache(maxsize=None)
def _windowed_key_mask(window: int, all_real: bool) -> type:
    return type(f"CausalKeyMask_window{window}{'_all_real' if all_real else ''}", (CausalKeyMask,),
                {"window": window, "all_real": all_real, "__module__": __name__})


def mask_function(*args, **kwargs):
    """transformers' mask interface. What attention_forward receives:

    * None where the layer's own rule is the whole structure: causal (bottom-right aligned, the
      queries being the last positions of the keys) or bidirectional, plus a causal sliding window,
      which attention_forward passes to the kernels as transformers' FlashAttention path does;
    * with the same structure but padding, or a static cache whose newest token is not its last
      slot: a boolean mask over the keys. A causal layer's is a CausalKeyMask (batch, 1, 1,
      visible): attention_forward drops the slots past the newest token and applies the causal rule
      and window to the rest. A bidirectional layer's is broadcast over the rows (a stride-0 view of
      (batch, 1, 1, m)). No (n x m) mask is materialised either way;
    * transformers' sdpa mask (batch, 1, n, m) otherwise: extra mask functions (image tokens,
      prefix-LM), packing transformers saw, chunked attention, a bidirectional window, a one-row
      step on a compileable (static) cache.
    """
    from transformers.masking_utils import sdpa_mask
    call = dict(zip(_sdpa_mask_parameters(), args))
    call.update(kwargs)
    n, m, kv_offset = call["q_length"], call["kv_length"], call.get("kv_offset", 0)
    # transformers allows a skip only where the mask is pure structure (no extra mask functions, no
    # packing it saw, not a one-row step on a compileable cache). Chunked attention is no window:
    # it has no structure in the kernels.
    causal = (call.setdefault("allow_is_causal_skip", True)
              and getattr(call.get("config"), "attention_chunk_size", None) is None)
    visible = _keys_up_to_the_newest_query(call.get("q_offset", 0), n, kv_offset, m) if causal else None
    local = call.get("local_size")
    if causal and visible is not None:
        padding = _key_padding(call.get("attention_mask"), kv_offset, m, visible)
        if padding is None and visible == m and (local is None or _tracing()):
            return None  # (tracing: attention_forward finds the window without the mask, _traced_window)
        if _tracing():  # (dynamo does not trace as_subclass): transformers' own mask, the structure in it
            return sdpa_mask(**call)
        keys = (padding[:, :visible].contiguous() if padding is not None
                else torch.ones(call["batch_size"], visible, dtype=torch.bool, device=call.get("device", "cpu")))
        kind = CausalKeyMask if local is None else _windowed_key_mask(int(local), padding is None)
        return keys[:, None, None, :].as_subclass(kind)
    # Anything else keeps transformers' own mask, with its skips only where None means the same
    # to the kernels (bottom-right alignment) as to torch's SDPA.
    call["allow_is_causal_skip"] = False
    bidirectional = call.get("allow_is_bidirectional_skip", False) and call.get("local_size") is None
    if bidirectional and n > 1 and not causal:
        padding = _key_padding(call.get("attention_mask"), kv_offset, m, m)
        if padding is None:
            return None
        return padding[:, None, None, :].expand(-1, -1, n, -1)
    return sdpa_mask(**call)


_SDPA_MASK_PARAMETERS = {}  # (a plain dict, which torch.compile reads as constants; not an lru_cache)


def _sdpa_mask_parameters():
    from transformers.masking_utils import sdpa_mask
    names = _SDPA_MASK_PARAMETERS.get(sdpa_mask)
    if names is None:
        import inspect
        names = _SDPA_MASK_PARAMETERS[sdpa_mask] = tuple(inspect.signature(sdpa_mask).parameters)
    return names


def _tracing():
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _keys_up_to_the_newest_query(q_offset, n, kv_offset, m):
    """How many of the keys (positions kv_offset..kv_offset+m-1) a causal layer's queries (positions
    q_offset..q_offset+n-1) can see: those up to the newest query. None when the queries reach past
    the keys, or when the offset is traced (a compiled static cache) and cannot be read."""
    offsets = []
    for offset in (q_offset, kv_offset):
        if isinstance(offset, torch.Tensor):
            if _tracing():
                return None
            offset = int(offset)
        offsets.append(offset)
    visible = offsets[0] + n - offsets[1]
    return visible if 0 < visible <= m else None


def _key_padding(attention_mask, kv_offset, m, visible):
    """The (batch, m) boolean mask of keys kv_offset..kv_offset+m-1 that are neither padding nor
    past `visible` (positions past the 2D mask are not yet written), or None when all `visible`
    keys are real tokens (unknown while tracing: then the mask is returned)."""
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    if mask.dim() != 2:
        raise ValueError(f"attention_ext.hf: expected transformers' 2D padding mask (batch, tokens), got shape "
                         f"{tuple(attention_mask.shape)}")
    short = kv_offset + m - mask.shape[-1]
    if short > 0:
        mask = torch.nn.functional.pad(mask, (0, short), value=False)
    mask = mask[:, kv_offset:kv_offset + m]
    if not _tracing() and bool(mask[:, :visible].all()):
        return None
    return mask


def _packed_segments(position_ids, cu_seq_lens, batch, n):
    """(batch, n) segment ids of packed sequences, or None when the rows are not packed."""
    if cu_seq_lens is not None:
        if batch != 1:
            raise NotImplementedError("attention_ext.hf: cu_seq_lens with a batch of more than one row")
        bounds = cu_seq_lens.to(torch.int64)
        if bounds.dim() != 1 or bounds.numel() < 2 or int(bounds[0]) != 0 or bool((bounds.diff() < 0).any()):
            raise ValueError(f"attention_ext.hf: cu_seq_lens must be non-decreasing sequence bounds from 0, got "
                             f"{bounds.tolist()}")
        if int(bounds[-1]) != n:
            raise ValueError(f"attention_ext.hf: cu_seq_lens ends at {int(bounds[-1])} but the batch has {n} tokens")
        inner = bounds[1:-1]
        inner = inner[inner < n]  # (empty sequences at the end repeat the last bound)
        if inner.numel() == 0:
            return None
        starts = torch.zeros(n, dtype=torch.int64, device=bounds.device)
        starts[inner] = 1  # (an empty sequence inside repeats a bound: the same start)
        return starts.cumsum(0).unsqueeze(0)
    segments = _position_segments(position_ids, batch, n)
    if segments is None or not bool(segments[:, -1].any()):  # (no row restarts its positions)
        return None
    return segments


def _traced_window(module):
    """While tracing, a sliding-window layer that neither passes its window nor has one gets no key
    mask from mask_function (it would need as_subclass): its window is the one transformers' mask
    code used, the config's sliding_window, for a model whose layers do not alternate."""
    config = getattr(module, "config", None)
    if config is None or getattr(config, "layer_types", None) is not None:
        return None
    return getattr(config, "sliding_window", None)


def _position_segments(position_ids, batch, n):
    """(batch, n) segment ids from position_ids restarting (every row one segment if none does). A
    restart is a position not after the one before it (DataCollatorWithFlattening's 0 after each
    sequence); positions that jump forward stay one sequence, as transformers' sdpa and eager
    attention treat them with a cache (its mask code splits at jumps too, but only without one,
    and then its block-diagonal mask holds that split)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != n or n < 2:
        return None
    restarts = torch.diff(position_ids, dim=-1) <= 0
    first = torch.zeros_like(position_ids[:, :1], dtype=torch.int64)
    return torch.cat([first, restarts.to(torch.int64).cumsum(-1)], dim=-1).expand(batch, n)


def _packed_attention(query, key, value, segments, dropout, scaling, causal, window, softcap, sinks):
    """Packed rows as a variable-length batch: each (batch row, segment) is a sequence of its own.
    query (batch, heads, n, d) -> (batch·n, heads, d) rows; returns (batch, n, heads, d_v)."""
    batch, n = segments.shape
    ids = (segments + torch.arange(batch, device=segments.device).unsqueeze(-1) * (n + 1)).reshape(-1)
    lengths = torch.unique_consecutive(ids, return_counts=True)[1]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    rows = [t.transpose(1, 2).reshape(batch * n, t.shape[1], t.shape[-1]) for t in (query, key, value)]
    out = varlen_attention(*rows, cu, cu, longest, longest, scale=scaling, causal=causal,
                           window=window or (-1, -1), softcap=softcap or 0.0, sinks=sinks, dropout_p=dropout)
    return out.view(batch, n, *out.shape[1:])


# Arguments some models pass that change what is attended to and that the kernels do not take:
# refused, never dropped.
_UNSUPPORTED_KWARGS = {
    "position_bias": "T5-style relative biases",
    "indices": "a sparse top-k selection of keys per query (DeepSeek-V3.2's indexer)",
    "block_indices": "a block-sparse selection of keys",
    "sinks": "attention sinks computed per token",
}


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function signature: query (batch, heads, n, d), key/value
    (batch, kv_heads, m, d), attention_mask from mask_function (or None). Returns the output
    (batch, n, heads, d_v) and the attention weights when output_attentions is set (else None)."""
    global calls
    if not _tracing():
        calls += 1
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attention_ext.hf: {name} ({what}) is not supported yet; use "
                                      "attn_implementation='eager' for this model")
    batch, heads, n = query.shape[0], query.shape[1], query.shape[2]
    m = all_keys = key.shape[2]
    causal_layer = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = attention_mask
    # mask_function's key mask for a causal layer: the layer's rule applies on top of it, to the
    # keys up to the newest query. One made only to say the window, over all the keys, is none.
    key_padding = isinstance(mask, CausalKeyMask)
    mask_window = None
    if key_padding:
        mask_window = type(mask).window
        if type(mask).all_real and mask.shape[-1] == m:
            mask, key_padding = None, False
        else:
            m = mask.shape[-1]
            # (a view is a plain tensor: CausalKeyMask.__torch_function__; dynamo, which meets the
            # mask in a compiled forward, does not trace as_subclass)
            mask = None if type(mask).all_real else mask.view(mask.shape)
            key, value = key[:, :, :m], value[:, :, :m]
    elif mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    structure_only = mask is None and not key_padding  # the layer's own rule is the whole structure
    structure = structure_only or key_padding
    # Packed rows: only without cached keys (m == n), and not beside padding, which explains the
    # restarts in position_ids (generate() gives padding position 1: [1, 1, 0, 1, 2, ...]), as in
    # transformers' own packing detection. A full mask transformers gives also hides the padding
    # keys, so the segment mask below changes nothing there.
    segments = None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu_q and not _tracing() and \
            (cu_q is None or not torch.equal(cu_k.to(cu_q.device, torch.int64), cu_q.to(torch.int64))):
        raise NotImplementedError("attention_ext.hf: cu_seq_lens_k differing from cu_seq_lens_q (packed keys other "
                                  "than the packed queries) is not supported yet")
    if m == n and not key_padding and not _tracing():  # (compiled: transformers' mask code decides packing, as for sdpa)
        segments = _packed_segments(kwargs.get("position_ids"), cu_q, batch, n)
    elif cu_q is not None and cu_q.numel() > 2:
        raise NotImplementedError("attention_ext.hf: packed sequences (cu_seq_lens_q) with cached keys or padding are "
                                  "not supported yet")
    sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if mask_window is not None:  # transformers' mask code says the layer's window
        sliding = mask_window
    elif sliding is None and mask is None and _tracing() and "sliding_window" not in kwargs \
            and not hasattr(module, "sliding_window"):
        sliding = _traced_window(module)
    # transformers' sliding window: attend iff 0 <= q_pos - k_pos < sliding_window.
    window = (int(sliding) - 1, None) if sliding is not None and causal_layer else None
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if segments is not None and structure_only and not kwargs.get("output_attentions", False) and not _tracing():
        return _packed_attention(query, key, value, segments.to(query.device), dropout, scaling, bool(causal_layer),
                                 window and (window[0], -1), softcap, sinks), None
    if segments is not None:
        segments = segments.to(query.device)
        same = (segments.unsqueeze(-1) == segments.unsqueeze(-2)).unsqueeze(1)  # (batch, 1, n, n)
        # A mask transformers built without seeing the packing (causal, a window over the flat
        # positions, which within a sequence are its own) still holds within each sequence.
        if mask is None:
            mask = same
        elif mask.dtype == torch.bool:
            mask = mask & same
        else:
            mask = mask.masked_fill(~same, float("-inf"))
    causal = "bottom_right" if structure and causal_layer else None
    if not structure:
        window = None  # transformers' mask holds the window already
    options = dict(attn_mask=mask, causal=causal, window=window, softcap=softcap or None, scale=scaling,
                   enable_gqa=heads != key.shape[1])
    want_weights = kwargs.get("output_attentions", False)
    dropped = None
    if want_weights and dropout > 0.0:  # the state the call draws, to return the weights it applied (as eager)
        with torch.random.fork_rng(devices=[query.device] if query.device.type == "cuda" else []):
            dropped = draw_rng_state(query.device)
    out = attention(query, key, value, sinks=sinks, dropout_p=dropout, **options)
    weights = None
    if want_weights:
        weights = attention_weights(query, key, sinks=sinks, **options)
        if dropped is not None:  # (dropout 1: every weight dropped, zeros as eager's)
            weights = weights * dropout_mask(dropped, weights.shape, dropout) / (1.0 - dropout) if dropout < 1.0 \
                else weights * 0
        if m < all_keys:  # a static cache's slots past the newest token: weight 0, as eager gives them
            weights = torch.nn.functional.pad(weights, (0, all_keys - m))
    # (free for the usual query, a transposed view of (batch, n, heads, d): out follows its layout)
    return out.transpose(1, 2).contiguous(), weights
