"""The model's kernels on a GPU, where they take the paths the CPU tests cannot reach: every
--attention-backend's SDPA kernels (flash, cuDNN / memory-efficient) in bf16 with grouped-query
attention against the written-out math, the fused output layer + loss against the full logits,
and the layers compiled by inductor (triton) against eager."""

import pytest
import torch
import torch.nn.functional as F

from megazero.training.model_builder import compile_layers
from megazero.models.attention import attention_reference, core_attention
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT, initial_value
from megazero.models.loss import linear_cross_entropy

DEVICE = "cuda"


@pytest.mark.parametrize("backend", ["auto", "flash", "fused", "unfused", "local"])
@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2)])
def test_attention_backends_in_bf16(backend, heads, groups):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (
        torch.randn(2, 256, n, 64, device=DEVICE, generator=g, dtype=torch.bfloat16) for n in (heads, groups, groups)
    )
    out = core_attention(q, k, v, 0.0, backend).float()
    ref = attention_reference(q.double(), k.double(), v.double()).float()
    assert float((out - ref).abs().max()) <= 3e-2 * float(ref.abs().max()), backend


def test_chunked_loss_matches_full_logits():
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(4, 512, 256, device=DEVICE, generator=g, requires_grad=True)
    w = (torch.randn(8192, 256, device=DEVICE, generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, 8000, (4, 512), device=DEVICE, generator=g)
    loss = linear_cross_entropy(x, w, labels, 8000, chunk_tokens=300)
    loss.sum().backward()
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = F.cross_entropy(F.linear(x, w)[..., :8000].flatten(0, 1), labels.flatten(), reduction="none")
    ref.sum().backward()
    for name, got, want in (("loss", loss.flatten(), ref), ("dx", dx, x.grad), ("dW", dw, w.grad)):
        gap = float((got - want).abs().max())
        assert gap <= 1e-5 * float(want.abs().max()), f"{name}: {gap:.2e}"


def test_inductor_layers_match_eager_on_the_gpu():
    cfg = GPTConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding="rope",
        activation="swiglu",
    )
    eager = GPT(cfg)
    for name, p in eager.named_parameters():
        p.data = initial_value(cfg, name, p.shape, 3)
    eager = eager.to(DEVICE)
    compiled = compile_layers(GPT(cfg).to(DEVICE), "inductor")
    compiled.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 512, (2, 129), device=DEVICE)
    losses = [m(tokens[:, :-1], tokens[:, 1:]).sum() for m in (eager, compiled)]
    assert abs(float(losses[1]) - float(losses[0])) <= 1e-5 * abs(float(losses[0]))
