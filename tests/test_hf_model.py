"""A tiny randomly initialised Hugging Face Llama (grouped-query attention, causal) gives the same
logits and parameter gradients with torch's SDPA and with attention_ext's drop-in patched in.

transformers' sdpa integration looks up `torch.nn.functional.scaled_dot_product_attention` at call
time (transformers/integrations/sdpa_attention.py), so patching that attribute reroutes it.
No download: the model is built from a config.
"""
from __future__ import annotations

import pytest
import torch

import attention_ext

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 11, 2


def build_model():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def run(model, input_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().clone(), out.loss.detach().clone(), grads


@pytest.fixture
def counted_sdpa():
    calls = []

    def ours(*args, **kwargs):
        calls.append(kwargs)
        return attention_ext.scaled_dot_product_attention(*args, **kwargs)

    ours.calls = calls
    return ours


def test_tiny_llama_gives_same_logits_and_parameter_grads_with_attention_ext(monkeypatch, counted_sdpa):
    model = build_model()
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    torch_logits, torch_loss, torch_grads = run(model, input_ids)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
    ours_logits, ours_loss, ours_grads = run(model, input_ids)
    monkeypatch.undo()

    # Our function did the attention: once per layer.
    assert len(counted_sdpa.calls) == model.config.num_hidden_layers
    torch.testing.assert_close(ours_logits, torch_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_loss, torch_loss, atol=1e-6, rtol=1e-6)
    assert ours_grads.keys() == torch_grads.keys() and len(ours_grads) == len(list(model.parameters()))
    for name in torch_grads:
        torch.testing.assert_close(ours_grads[name], torch_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_tiny_llama_causality_holds_with_attention_ext(monkeypatch, counted_sdpa):
    """Changing the last token must not change the logits of the earlier positions."""
    model = build_model()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % VOCAB
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = model(input_ids=changed).logits
    assert counted_sdpa.calls
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
def test_tiny_llama_incremental_decoding_matches_full_forward_with_attention_ext(monkeypatch, counted_sdpa):
    """Prefill then one-token decode steps (n = 1 query against a growing cache) reproduce the
    full-sequence logits."""
    model = build_model()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        prefix = 6
        out = model(input_ids=ids[:, :prefix], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(prefix, SEQ):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    assert len(counted_sdpa.calls) == model.config.num_hidden_layers * (2 + SEQ - prefix)  # full + prefill + decode steps
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
