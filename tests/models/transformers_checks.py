"""What an exported model must do in transformers: the same logits (fp32, 1e-5) and the same greedy
continuation as megazero's own decoding (models/generation.py, with its KV cache)."""

from __future__ import annotations

import torch

from megazero.models.generation import generate


def assert_same_logits_and_greedy_tokens(model, theirs, tokens: torch.Tensor, new_tokens: int = 8) -> None:
    with torch.no_grad():
        ours, reference = model(tokens), theirs(tokens).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    prompt = tokens[:1, :5]
    mine = generate(model, prompt[0].tolist(), max_new_tokens=new_tokens)
    # the mask given: transformers would take the prompt's id 0 (its pad id here) for padding
    expected = theirs.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )[0, 5:].tolist()
    assert mine[-new_tokens:] == expected
