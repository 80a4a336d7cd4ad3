"""The planner's count of what a waiting weight-gradient pass (W) of a zero-bubble schedule holds
(config/activation_memory.py `weight_grad_bytes`) against what the deferred GEMMs' W really keeps:
the tensors its closures hold after a real split backward's B (models/split_backward.py)."""
import pytest
import torch

from megazero.config.activation_memory import weight_grad_bytes, zero_bubble_peaks
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from megazero.models.split_backward import WeightGradWork, deferring


def _held_by(work: WeightGradWork) -> int:
    """Bytes of the distinct storages the work's deferred computations hold (their closures)."""
    storages, stack = {}, [c for item in work._items for c in item if c is not None]
    seen = set()
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for cell in getattr(f, "__closure__", None) or ():
            value = cell.cell_contents
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
            elif callable(value):
                stack.append(value)
    return sum(storages.values())


@pytest.mark.parametrize("swiglu,groups", [(True, 2), (False, 8)])
def test_waiting_weight_grad_holds_its_gemms_inputs_and_output_gradients(swiglu, groups):
    """bf16, 2 layers, 512 tokens, GQA or not, SwiGLU or GELU: the planner's bytes for one waiting W
    equal what its closures hold (the norms' parameter-sized sums aside, under 1%). Planted (the
    count before: a whole microbatch of the stage's activations per waiting W): 1.19x what the
    SwiGLU layers' W holds (GELU's happens to equal Korthikanti's count at these widths)."""
    h, tokens = 256, 512
    cfg = GPTConfig(vocab_size=1000, hidden_size=h, num_layers=2, num_attention_heads=8, num_query_groups=groups,
                    ffn_hidden_size=704, seq_length=tokens, position_embedding="rope",
                    activation="swiglu" if swiglu else "gelu", normalization="rmsnorm", add_bias_linear=False,
                    hidden_dropout=0.0, attention_dropout=0.0, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg).to(torch.bfloat16)
    model.embedding = model.output_head = model.final_norm = None
    x = torch.randn(1, tokens, h, dtype=torch.bfloat16, requires_grad=True)
    work = WeightGradWork()
    with deferring(work):
        out = model(x)
        out.backward(torch.randn_like(out))
    held = _held_by(work)
    inputs, grads = weight_grad_bytes(tokens, cfg, 2, 1, 2)
    assert inputs + grads == pytest.approx(held, rel=0.01), (inputs, grads, held)
    work.run()


def test_a_zero_bubble_peak_weighs_waiting_ws_apart_from_activations():
    """ZB-H1 at pp 4 with 8 microbatches: the last stage's list holds at most 1 forward and 3
    waiting Ws, then 4 waiting Ws, and its B makes one W's gradients beside them (parallel/pipeline
    zero_bubble.py's list); with W free the peak is 1F1B's one microbatch plus a B's gradients."""
    a, w_in, w_grad = 10.0, 3.0, 5.0
    peaks = zero_bubble_peaks("zb-h1", 4, 1, 8, a, w_in, w_grad)
    assert peaks[3] == max(a + 3 * (w_in + w_grad) + w_grad, 4 * (w_in + w_grad))
    assert zero_bubble_peaks("zb-h1", 4, 1, 8, a, 0.0, 0.0) == [4 * a, 3 * a, 2 * a, a]
