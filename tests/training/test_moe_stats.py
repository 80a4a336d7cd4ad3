"""megazero/training/moe_stats.py: the line naming MoE layers that sent every token to one expert while
nothing balances them, from the step's loads, once per layer; and pretrain_gpt.py saying it (a router
made to prefer expert 0)."""

import torch

from megazero.models.config import GPTConfig
from megazero.models.moe import Router
from megazero.training.moe_stats import collapse_line
from tests.driver import TINY, run_main

MOE = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=64,
    num_experts=4,
    moe_router_topk=2,
    moe_layer_freq=1,
)


def test_the_line_names_collapsed_layers_once_and_only_without_balancing():
    """4 experts, top-2: layer 1 gave its 8 tokens' 16 choices as 8 to one expert (every token) and 8
    spread; layer 3 as 6 at most (not every token). (Planted: comparing the largest load with all
    choices (k x tokens) instead of the tokens misses layer 1.)"""
    record = {"load": {1: (8.0, 4.0), 3: (6.0, 4.0)}}
    said = set()
    line = collapse_line(record, GPTConfig(**MOE), 5, said)
    assert line.startswith("iteration 5: MoE layer 1 routed every token to one expert") and "\n" not in line
    assert "--moe-aux-loss-coeff 0," in line and "set --moe-aux-loss-coeff" in line, line
    assert collapse_line(record, GPTConfig(**MOE), 6, said) is None  # said once
    for balanced in (
        dict(moe_aux_loss_coeff=0.01),
        dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
    ):
        assert collapse_line(record, GPTConfig(**MOE, **balanced), 5, set()) is None
    assert collapse_line(record, GPTConfig(**dict(MOE, num_experts=2)), 5, set()) is None  # top-2 of 2


def test_a_run_whose_router_sends_every_token_to_one_expert_says_so(capsys, tmp_path, monkeypatch):
    """(Planted: the loop not calling collapse_line, as before, fails: the run is silent.)"""
    plain = Router.logits
    monkeypatch.setattr(
        Router,
        "logits",
        lambda self, x: plain(self, x) + torch.tensor([100.0] + [0.0] * (self.num_experts - 1), device=x.device),
    )
    monkeypatch.chdir(tmp_path)
    code, out = run_main(
        [
            *TINY,
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "64",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "1",
            "--train-iters",
            "3",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--num-workers",
            "0",
        ],
        capsys,
    )
    text = out.out + out.err
    assert code == 0, text[-3000:]
    lines = [x for x in text.splitlines() if "routed every token to one expert" in x]
    assert len(lines) == 1 and "iteration 1: MoE layers 0, 1 routed" in lines[0], text[-3000:]
