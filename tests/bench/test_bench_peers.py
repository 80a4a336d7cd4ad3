"""The benches' peers run their own code and compute our function: transformers' models and the plain
PyTorch GPT (bench/peer_models.py, bench/plain_gpt.py) built from megazero's initial weights give
megazero's GPT's losses, and the GPU bench's peer runs every GEMM of its forward and backward in
the autocast dtype (checked on the CPU's bf16 autocast)."""

import collections
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import bench_gpu_step  # noqa: E402
import peer_models  # noqa: E402
from plain_gpt import PlainGPT  # noqa: E402

from megazero.models.config import GPTConfig  # noqa: E402
from megazero.models.loss import linear_cross_entropy  # noqa: E402

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul"}
BASE = dict(
    vocab_size=96,
    hidden_size=48,
    num_layers=2,
    num_attention_heads=4,
    seq_length=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA = dict(
    position_embedding="rope",
    activation="swiglu",
    normalization="rmsnorm",
    tie_embeddings=False,
    num_query_groups=2,
    add_bias_linear=False,
)


class GemmDtypes(TorchDispatchMode):
    """Records the input dtypes of every GEMM, split into forward and backward (an op run while
    autograd evaluates a node is backward)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in GEMMS:
            phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
            dtypes = tuple(str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor))
            self.seen[phase][dtypes] += 1
        return func(*args, **(kwargs or {}))


def test_gpu_bench_peer_runs_every_gemm_under_autocast():
    args = bench_gpu_step.parse_args(["--tiny", "--device", "cpu"])
    cfg = bench_gpu_step.model_config(args)
    step, _ = bench_gpu_step.peer_step(args, cfg, torch.device("cpu"))
    with GemmDtypes() as recorder:
        step(0)
    linears = 4 * cfg.num_layers + 1  # qkv, proj, fc1, fc2 per layer; the tied head
    assert sum(recorder.seen["forward"].values()) == linears, recorder.seen
    assert sum(recorder.seen["backward"].values()) == 2 * linears, recorder.seen
    for phase, dtypes in recorder.seen.items():
        assert set(dtypes) <= {("bfloat16",) * 2, ("bfloat16",) * 3}, (phase, dict(dtypes))


def test_the_recorder_sees_a_custom_functions_backward_outside_autocast():
    """The check above can fail: megazero's fused loss (a custom autograd Function without
    custom_bwd) runs its backward GEMMs on the fp32 weights it was given."""
    x = torch.randn(8, 16, requires_grad=True)
    weight = torch.randn(32, 16, requires_grad=True)
    with GemmDtypes() as recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(x, weight, torch.randint(0, 32, (8,)), 32).sum()
        loss.backward()
    assert ("bfloat16", "bfloat16") in recorder.seen["forward"]
    assert any("float32" in d for d in recorder.seen["backward"]), dict(recorder.seen["backward"])


@pytest.mark.parametrize("options", [{}, LLAMA], ids=["gpt2", "llama"])
def test_transformers_peer_computes_our_loss_and_gradients(options):
    cfg = GPTConfig(**BASE, **options)
    ours = peer_models.initialised_gpt(cfg, 7).train()
    theirs = peer_models.hf_model(cfg, 7)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    our_loss = ours(tokens[:, :-1], tokens[:, 1:]).sum() / tokens[:, 1:].numel()
    their_loss = peer_models.hf_loss(theirs, tokens, tokens[:, 1:].numel())
    torch.testing.assert_close(their_loss, our_loss, rtol=1e-5, atol=0)
    our_loss.backward()
    their_loss.backward()
    # the word embedding: the same tensor on both sides (rows of real words)
    torch.testing.assert_close(
        theirs.get_input_embeddings().weight.grad, ours.embedding.word.weight.grad, rtol=1e-4, atol=1e-7
    )


def test_plain_gpt_computes_our_loss():
    cfg = GPTConfig(**BASE)
    ours = peer_models.initialised_gpt(cfg, 7).train()
    plain = PlainGPT(cfg)
    plain.load_gpt2_state(peer_models.initial_hf_state(cfg, 7, "gpt2"))
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        plain(tokens[:, :-1], tokens[:, 1:]), ours(tokens[:, :-1], tokens[:, 1:]), rtol=1e-5, atol=1e-6
    )
