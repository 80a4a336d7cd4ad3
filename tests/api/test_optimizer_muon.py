"""DeepSpeed's Muon block ({"type": "Muon"}) through megazero.initialize (megazero/api/optimizer.py's
muon_matrix, settings.py) against torch.optim.Muon and torch.optim.AdamW.

A tiny transformers Llama, one process, ZeRO-2 and ZeRO-3, 2 micro batches per step, 6 steps, no
clipping: the torch side steps torch.optim.Muon (DeepSpeed's choices, which are also torch's defaults:
Nesterov, momentum 0.95, the (3.4445, -4.775, 2.0315) iteration in bf16, lr scaled by
sqrt(max(1, rows / cols)) as adjust_lr_fn "original") on the parameters DeepSpeed tags use_muon (2-D,
the name holding neither "embed" nor "lm_head", written here from deepspeed.set_optimizer_flags) and
AdamW on the rest, both with the block's lr and weight decay. Losses agree to rtol 1e-5 at every
step and every parameter to 1e-5 (relative L2). Gradients are equal on both sides in one process;
across ranks their sums round differently and bf16's iteration turns a last-bit difference into a
0.4% one (tests/references/test_muon_against_torch.py), so the multi-rank layouts are that file's
and tests/zero/test_muon_distributed.py's.

Planted to see it fail: the block's Muon dropped (every parameter AdamW, as before this test: the
config was read, its note printed, and Adam ran); the embeddings given to Muon too.
"""

import pytest
import torch

import megazero
from megazero.utils import safe_get_full_fp32_param
from tests.api.hf_runs import MICRO, SEQ, VOCAB, tiny_model

LR, DECAY, STEPS, ACCUMULATION = 2e-3, 0.1, 3, 2


def batches():
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(ACCUMULATION)] for _ in range(STEPS)]


def uses_muon(name: str, p) -> bool:
    return p.ndim >= 2 and "embed" not in name.lower() and "lm_head" not in name.lower()


def torch_run() -> tuple[list[float], dict]:
    model = tiny_model("llama")
    muon = [p for n, p in model.named_parameters() if uses_muon(n, p)]
    rest = [p for n, p in model.named_parameters() if not uses_muon(n, p)]
    optimizers = [
        torch.optim.Muon(muon, lr=LR, weight_decay=DECAY, adjust_lr_fn="original"),
        torch.optim.AdamW(rest, lr=LR, weight_decay=DECAY),
    ]
    losses = []
    for micro in batches():
        total = 0.0
        for tokens in micro:
            loss = model(input_ids=tokens, labels=tokens).loss / ACCUMULATION
            loss.backward()
            total += loss.item()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_muon_block_steps_as_torch_muon(stage):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "Muon", "params": {"lr": LR, "weight_decay": DECAY}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16},
    }
    engine, *_ = megazero.initialize(model=tiny_model("llama"), config=config)
    losses = []
    for micro in batches():
        total = 0.0
        for tokens in micro:
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / ACCUMULATION
        losses.append(total)
    want_losses, want = torch_run()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    for name, p in engine.module.named_parameters():
        mine = safe_get_full_fp32_param(p)
        gap = ((mine - want[name]).norm() / want[name].norm()).item()
        assert gap <= 1e-5, f"stage {stage}: {name} off by {gap:.2e}"
