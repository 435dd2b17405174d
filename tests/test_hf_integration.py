"""attention_ext.hf.register(): attn_implementation="attention_ext" in Hugging Face transformers.

Tiny randomly initialised models (no download) of every family the kernels' features serve:
Llama (GQA), Mistral (sliding window shorter than the sequence), Qwen 2, Gemma 2 (softcap and
alternating sliding / full layers), GPT-OSS (sinks, sliding layers), BERT (bidirectional, padding).
Each gives the logits and every parameter gradient of attn_implementation="eager", generate()
gives eager's logits at every step with dynamic and static caches, padded or not (padding reaching
the kernels as a mask over the keys, never a rows x keys one), packed sequences equal the same
sequences run one by one, and a counter proves our attention function ran while torch's SDPA is
booby-trapped (nothing may fall back to it).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attention_ext.hf as hf  # noqa: E402

NAME = hf.register()
VOCAB = 64


def _decoder(family):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=5, **common))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if family == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            sliding_window=5, head_dim=8, attn_logit_softcapping=1.5, query_pre_attn_scalar=8, **common))
    if family == "gpt_oss":
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            sliding_window=5, head_dim=8, num_local_experts=4, num_experts_per_tok=2, **common))
    raise ValueError(family)


DECODERS = ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"]


def build(family):
    torch.manual_seed(0)
    model = _decoder(family).float().eval()
    if family == "gpt_oss":  # random sinks (zeros at init would not test them)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    return model


@pytest.fixture
def no_sdpa(monkeypatch):
    """torch's SDPA raises while our implementation runs: nothing may fall back to it."""
    def trap(*args, **kwargs):
        raise AssertionError("torch.nn.functional.scaled_dot_product_attention was called")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", trap)


def forward_backward(model, impl, **inputs):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    before = hf.calls
    out = model(**inputs)
    loss = out.logits.float().square().mean() if out.loss is None else out.loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().clone(), grads, hf.calls - before


def assert_same(a, b, what, tol=2e-5):
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"{what}: max abs difference {err:.3e}"


@pytest.mark.parametrize("family", DECODERS)
def test_logits_and_every_parameter_gradient_equal_eager(family, no_sdpa):
    model = build(family)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    want_logits, want_grads, _ = forward_backward(model, "eager", input_ids=ids, labels=ids)
    logits, grads, calls = forward_backward(model, NAME, input_ids=ids, labels=ids)
    assert calls == model.config.num_hidden_layers
    assert_same(logits, want_logits, "logits")
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        assert_same(grads[name], want_grads[name], f"grad of {name}")


@pytest.mark.parametrize("family", DECODERS)
def test_left_padded_batches_equal_eager_on_the_real_tokens(family, no_sdpa):
    model = build(family)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second row is 8 tokens, left-padded
    want, _, _ = forward_backward(model, "eager", input_ids=ids, attention_mask=mask)
    got, _, calls = forward_backward(model, NAME, input_ids=ids, attention_mask=mask)
    assert calls == model.config.num_hidden_layers
    real = mask.bool()
    assert_same(got[real], want[real], "logits")


def prompt_of(length, padding, seed=3):
    """Two prompts of `length` tokens, the second left-padded by `padding`, and their 2D mask."""
    prompt = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(prompt)
    mask[1, :padding] = 0
    return prompt, mask


def generate_with(model, impl, prompt, **kwargs):
    """(generate() with `impl`, the same with eager attention)."""
    model.set_attn_implementation("eager")
    want = model.generate(prompt, **kwargs)
    model.set_attn_implementation(impl)
    return model.generate(prompt, **kwargs), want


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_greedy_generation_gives_eager_logits_at_every_step(family, cache, padded, no_sdpa):
    """Every step's logits, not only the tokens: a static cache holds slots past the newest token
    (a prefill into it and each decode step must not see them), and a left-padded prompt's padding
    keys stay hidden throughout."""
    model = build(family)
    prompt, mask = prompt_of(9, 4 if padded else 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    before = hf.calls
    got, want = generate_with(model, NAME, prompt, **kwargs)
    assert hf.calls - before >= 6 * model.config.num_hidden_layers
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert_same(a, b, f"logits of step {step}")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_key_mask_survives_copies_on_the_way(family, no_sdpa):
    """transformers' generate() makes masks contiguous, accelerate moves them between devices: a
    copy of the key mask must still say it is one (else the causal rule would be lost)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def copying_attention(module, query, key, value, attention_mask, *args, **kwargs):
        copied = None if attention_mask is None else attention_mask.clone()
        return hf.attention_forward(module, query, key, value, copied, *args, **kwargs)
    AttentionInterface.register("attention_ext_copying", copying_attention)
    AttentionMaskInterface.register("attention_ext_copying", hf.mask_function)
    prompt, mask = prompt_of(9, 4)
    got, want = generate_with(build(family), "attention_ext_copying", prompt, attention_mask=mask, max_new_tokens=4,
                              do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              cache_implementation="static")
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert_same(a, b, f"logits of step {step}")


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_static_cache_generation_with_a_fullgraph_compiled_forward(padded, no_sdpa):
    """transformers' recipe: model.forward compiled with fullgraph=True, generate() with a static
    cache, which builds the masks eagerly and hands the compiled forward a key mask: it traces (the
    mask's class stays on it, not on what is computed from it), eager's tokens and logits."""
    model = build("llama")
    prompt, mask = prompt_of(9, 4 if padded else 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True, cache_implementation="static")
    model.set_attn_implementation("eager")
    want = model.generate(prompt, **kwargs)
    model.set_attn_implementation(NAME)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, fullgraph=True, backend="eager")
    masks = []
    make_mask = hf.mask_function

    def spy(*args, **kwargs):
        masks.append(make_mask(*args, **kwargs))
        return masks[-1]
    from transformers.masking_utils import AttentionMaskInterface
    AttentionMaskInterface.register(NAME, spy)
    try:
        got = model.generate(prompt, **kwargs)
    finally:
        model.forward = eager_forward
        AttentionMaskInterface.register(NAME, make_mask)
    assert any(isinstance(m, hf.CausalKeyMask) for m in masks), "no key mask reached the compiled forward"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert_same(a, b, f"logits of step {step}")


@pytest.fixture
def masks_seen(monkeypatch):
    """The attention masks our kernels receive, and a trap on transformers' sdpa_mask for more
    than one query row: padding must reach the kernels as a mask over the keys, not a rows x keys one."""
    from transformers import masking_utils
    full = masking_utils.sdpa_mask

    def no_row_by_key_mask(*args, **kwargs):
        if kwargs.get("q_length", args[1] if len(args) > 1 else 1) > 1:
            raise AssertionError("transformers' sdpa_mask built a (batch, 1, n, m) mask")
        return full(*args, **kwargs)
    monkeypatch.setattr(masking_utils, "sdpa_mask", no_row_by_key_mask)
    seen = []
    kernel = hf.attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        seen.append(None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.stride()))
        return kernel(query, key, value, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(hf, "attention", spy)
    return seen


@pytest.mark.parametrize("family", DECODERS)
def test_padding_and_a_static_cache_reach_the_kernels_as_a_mask_over_keys(family, masks_seen, no_sdpa):
    model = build(family)
    prompt, mask = prompt_of(9, 4)
    model.set_attn_implementation(NAME)
    model.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
    model(input_ids=prompt, attention_mask=mask).logits.sum().backward()
    assert masks_seen
    for seen in masks_seen:
        if seen is not None:
            shape, stride = seen
            assert shape[-2] == 1 or stride[-2] == 0, f"a mask of shape {shape} with strides {stride}"


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens", "use_cache=False"])
def test_packed_sequences_equal_the_sequences_run_one_by_one(family, how, no_sdpa, monkeypatch):
    """Three sequences packed in one row (as DataCollatorWithFlattening makes them). With the
    default use_cache=True transformers' mask code does not see the packing and gives no mask: the
    rows run as a packed variable-length batch (no dense call, no mask). With use_cache=False it
    builds the block-diagonal mask itself, which is applied as given. Logits and gradients equal
    those of the sequences run one by one."""
    model = build(family)
    model.set_attn_implementation(NAME)
    lengths = [5, 9, 3]
    seqs = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(10 + n)) for n in lengths]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    inputs = dict(input_ids=packed, position_ids=position_ids)
    if how == "cu_seq_lens":
        cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    if how == "use_cache=False":
        inputs.update(use_cache=False)
    else:
        def no_dense_call(*args, **kwargs):
            raise AssertionError("packed rows without a mask went to the dense kernels")
        monkeypatch.setattr(hf, "attention", no_dense_call)
    model.zero_grad(set_to_none=True)
    got = model(**inputs).logits
    got.square().mean().backward()
    got_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    monkeypatch.undo()
    model.zero_grad(set_to_none=True)
    want = torch.cat([model(input_ids=s).logits for s in seqs], dim=1)
    want.square().mean().backward()
    assert_same(got.detach(), want.detach(), "packed logits")
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_same(got_grads[name], p.grad, f"gradient of {name}", tol=1e-4)


def test_position_ids_that_jump_forward_are_one_sequence():
    """Only a restart (a position not after the one before) starts a packed sequence: positions
    that jump forward (0..3 then 10..13) are one sequence with the default cache, as eager and sdpa
    attention take them; without a cache transformers' mask code splits there itself (its mask is
    applied as given), so all three agree both ways."""
    model = build("llama")
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    position_ids = torch.tensor([[0, 1, 2, 3, 10, 11, 12, 13]])
    for use_cache in (True, False):
        logits = {}
        for implementation in ("eager", NAME):
            model.set_attn_implementation(implementation)
            with torch.no_grad():
                logits[implementation] = model(input_ids=ids, position_ids=position_ids, use_cache=use_cache).logits
        assert_same(logits[NAME], logits["eager"], f"use_cache={use_cache}")


def test_packed_bounds_ending_in_empty_sequences_equal_the_bounds_without_them(no_sdpa):
    """Batches padded to a fixed number of sequences repeat the last bound (empty sequences)."""
    model = build("llama")
    model.set_attn_implementation(NAME)
    ids = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(5))
    position_ids = torch.cat([torch.arange(n) for n in (5, 9, 3)]).unsqueeze(0)
    logits = []
    for bounds in ([0, 5, 14, 17], [0, 5, 14, 17, 17, 17]):
        cu = torch.tensor(bounds, dtype=torch.int32)
        logits.append(model(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                            max_length_q=9, max_length_k=9).logits)
    assert torch.equal(logits[0], logits[1])


def test_arguments_the_kernels_do_not_take_are_refused_not_dropped():
    """Sparse key selections (DeepSeek-V3.2's indices, block_indices), per-token sinks, relative
    position biases, packed keys other than the packed queries, packing beside cached keys."""
    module = torch.nn.Module()
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    for name in ("indices", "block_indices", "sinks", "position_bias"):
        with pytest.raises(NotImplementedError, match=name):
            hf.attention_forward(module, q, kv, kv, None, **{name: torch.zeros(1, 4, 6, 1)})
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="cu_seq_lens_k differing"):
        hf.attention_forward(module, q, kv, kv, None, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 6]))
    with pytest.raises(NotImplementedError, match="with cached keys"):
        hf.attention_forward(module, q[:, :, :2], kv, kv, None, cu_seq_lens_q=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        hf.attention_forward(module, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 4, 2, 6]))


def test_a_window_only_transformers_mask_code_knows_is_applied(no_sdpa):
    """PhiMoE's layers pass no sliding_window and have no such attribute: the window reaches the
    kernels through the mask function (transformers' local_size), padded or not."""
    torch.manual_seed(0)
    config = transformers.PhimoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                       num_experts_per_tok=1, sliding_window=4)
    model = transformers.PhimoeForCausalLM(config).float().eval()
    assert not hasattr(model.model.layers[0].self_attn, "sliding_window")
    ids, mask = prompt_of(11, 3)
    for inputs in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)):
        got = forward_backward(model, NAME, **inputs)
        want = forward_backward(model, "eager", **inputs)
        real = inputs.get("attention_mask", torch.ones_like(ids)).bool()
        assert_same(got[0][real], want[0][real], "logits")
        assert got[2] > 0
    got, want = generate_with(model, NAME, ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    # compiled: no key mask to carry the window (as_subclass does not trace); the config's is taken
    model.set_attn_implementation("eager")
    want = model(input_ids=ids).logits
    model.set_attn_implementation(NAME)
    torch._dynamo.reset()
    assert_same(torch.compile(model.forward, fullgraph=True, backend="eager")(input_ids=ids).logits.detach(),
                want.detach(), "compiled logits")


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("how", ["padding", "no_mask", "packed"])
def test_a_compiled_fullgraph_forward_equals_eager(family, how, no_sdpa):
    """torch.compile(model.forward, fullgraph=True), as transformers documents it: the mask code's
    data-dependent shortcuts step aside while tracing (transformers' own mask where there is
    padding or packing it saw); without them the layer's structure still reaches the kernels, no
    rows x keys mask."""
    model = build(family)
    ids, mask = prompt_of(9, 3)
    inputs = dict(input_ids=ids)
    if how == "padding":
        inputs["attention_mask"] = mask
    if how == "packed":
        inputs.update(position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]]).expand(2, -1), use_cache=False)
    model.set_attn_implementation("eager")
    want = model(**inputs).logits
    model.set_attn_implementation(NAME)
    torch._dynamo.reset()
    before = hf.calls
    seen = []
    kernel = hf.attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        seen.append(attn_mask is None)
        return kernel(query, key, value, attn_mask=attn_mask, **kwargs)
    hf.attention = spy
    try:
        got = torch.compile(model.forward, fullgraph=True, backend="eager")(**inputs).logits
    finally:
        hf.attention = kernel
    assert seen and hf.calls == before  # (compiled calls are not counted: the count would be a guard)
    if how == "no_mask":
        assert seen and all(seen), "a mask reached the kernels of a compiled call without padding or packing"
    real = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    assert_same(got.detach()[real], want.detach()[real], "logits")


def test_a_compiled_model_called_again_runs_its_graph_without_recompiling():
    """Calls of the same shape reuse the compiled graph: nothing the attention function does per
    call (its eager call counter) becomes a guard. Ten calls under fullgraph pass the recompile
    limit (8) that such a guard would hit."""
    model = build("llama")
    ids, _ = prompt_of(9, 3)
    model.set_attn_implementation(NAME)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for _ in range(10):
            assert_same(compiled(input_ids=ids).logits, want, "compiled logits")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_output_attentions_in_training_with_dropout_are_the_weights_applied():
    """As eager returns them: after dropout (rows no longer sum to 1), the ones that made the output."""
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    torch.manual_seed(7)
    out, weights = hf.attention_forward(module, q, k, v, None, dropout=0.5, output_attentions=True)
    assert not torch.allclose(weights.sum(-1), torch.ones(2, 4, 5))
    applied = weights @ v.repeat_interleave(2, dim=1)  # (batch, heads, n, d)
    torch.testing.assert_close(out, applied.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.manual_seed(7)
    alone, _ = hf.attention_forward(module, q, k, v, None, dropout=0.5)
    assert torch.equal(out, alone)  # asking for the weights draws nothing more
    # dropout 1 drops every weight: zeros, as eager's F.dropout gives (not 0 / 0)
    out, weights = hf.attention_forward(module, q, k, v, None, dropout=1.0, output_attentions=True)
    assert torch.equal(weights, torch.zeros_like(weights)) and torch.equal(out, torch.zeros_like(out))


def test_output_attentions_are_the_exact_weights(no_sdpa):
    model = build("gpt_oss")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    model.set_attn_implementation("eager")
    want = model(input_ids=ids, output_attentions=True).attentions
    model.set_attn_implementation(NAME)
    got = model(input_ids=ids, output_attentions=True).attentions
    assert len(got) == len(want) == model.config.num_hidden_layers
    for a, b in zip(got, want):  # (the sink's column dropped in both)
        assert a.shape == b.shape
        assert_same(a, b, "attention weights")


def test_output_attentions_with_a_static_cache_cover_every_slot(no_sdpa):
    """The weights of a static cache's unfilled slots are 0 and still there, as eager gives them."""
    ids, mask = prompt_of(7, 2, seed=4)
    got, want = generate_with(build("llama"), NAME, ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                              pad_token_id=0, output_attentions=True, return_dict_in_generate=True,
                              cache_implementation="static")
    for step_got, step_want in zip(got.attentions, want.attentions):
        for a, b in zip(step_got, step_want):
            assert a.shape == b.shape
            real_rows = mask.bool()[:, -a.shape[2]:]  # (a padded query row's weights are not defined alike)
            assert_same(a.transpose(1, 2)[real_rows], b.transpose(1, 2)[real_rows], "attention weights")


def test_bert_with_padding_equals_eager(no_sdpa):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    outputs = {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        before = hf.calls
        outputs[impl] = model(input_ids=ids, attention_mask=mask).last_hidden_state
        if impl == NAME:
            assert hf.calls - before == 2
    real = mask.bool()
    assert_same(outputs[NAME][real], outputs["eager"][real], "hidden states")


def test_bert_padding_reaches_the_kernels_as_a_mask_over_keys(masks_seen, no_sdpa):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    model.set_attn_implementation(NAME)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 7:] = 0
    model(input_ids=torch.randint(0, VOCAB, (2, 10)), attention_mask=mask)
    assert len(masks_seen) == 2
    for shape, stride in masks_seen:
        assert shape == (2, 1, 10, 10) and stride[-2] == 0  # the keys' padding, broadcast over the rows


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "padding"])
def test_modernbert_bidirectional_sliding_window_equals_eager(padded, no_sdpa):
    """ModernBERT's local layers: a bidirectional window of 4 keys over 17 tokens. Only a causal
    window reaches the kernels as structure; this one must keep its mask, padded or not."""
    config = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, local_attention=4,
                                           global_attn_every_n_layers=2, max_position_embeddings=64, pad_token_id=0,
                                           cls_token_id=1, sep_token_id=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.ModernBertModel(config).eval()
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 12:] = 0
    outputs = {}
    with torch.no_grad():
        for impl in ("eager", NAME):
            model.set_attn_implementation(impl)
            before = hf.calls
            inputs = dict(input_ids=ids, attention_mask=mask) if padded else dict(input_ids=ids)
            outputs[impl] = model(**inputs).last_hidden_state
            if impl == NAME:
                assert hf.calls - before == 2
    real = mask.bool()
    assert_same(outputs[NAME][real], outputs["eager"][real], "hidden states")


def test_register_returns_the_name_and_checks_it():
    assert hf.register("attention_ext_again") == "attention_ext_again"
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        hf.register("")


def test_an_older_transformers_is_named_with_the_version_it_needs(monkeypatch):
    """Below the oldest release the suite passes with, register() says which version it needs
    (installing the extra alone would not upgrade an older transformers already there)."""
    import sys
    # (the module register() imports: transformers replaces its own sys.modules entry on the way)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.13.1")
    with pytest.raises(ImportError, match=rf"needs transformers >= {hf.MIN_TRANSFORMERS}, found 5.13.1"):
        hf.register("attention_ext_old")
