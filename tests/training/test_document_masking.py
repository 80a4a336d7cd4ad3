"""Document masking (--reset-position-ids, --reset-attention-mask, --eod-mask-loss, all three on) in
every parallel layout against one process: 10 steps of the small GPT on packed samples (documents of
1 to 6 tokens, DocumentTokens), gradient accumulation and clipping on; the loss curve, gradient norms
and final parameters to rtol 1e-5. One 2-rank pool serves the grid: tp 2 with sequence
parallelism (learned positions: the sequence-parallel embedding scatters per-sample positions), cp 2
ring (p2p), all-to-all (with selective recomputation) and allgather (RoPE at the documents'
positions read through the context-parallel index), pp 2 interleaved (every stage builds the
microbatch's documents from its tokens), ZeRO-3 with full recomputation, ep 2 (MoE).

That the single process itself computes document masking right is tests/models/test_documents.py's
(packed equals separate documents, the tensors equal megatron-core's GPTDataset's).

Mutations planted and seen failing (each by hand, then reverted):
- the ring's blocks after step 0 not masked by document (`_same_document` returning None for
  step > 0) -> cp 2 ring fails; the other layouts pass.
- the loss normaliser counted on this rank's tokens only (no all-reduce over dp x cp) -> ZeRO-3
  dp 2, cp 2 and ep 2 fail.
- the sequence-parallel embedding scattering per-sample positions along dim 0 (the batch) -> tp 2
  SP fails with a shape error.
- positions left at the local chunk's under CP (Documents.token_positions ignoring the index) ->
  cp 2 ring and a2a fail.
"""

from megazero.data.synthetic import DocumentTokens
from megazero.parallel.process_groups import ProcessGroups
from tests.layouts import (
    VOCAB,
    assemble_params,
    assert_close,
    assert_params_match,
    last_stage_result,
    layout_worker,
    run_training,
    small_config,
    strip_padding,
)
from tests.parallel.test_expert_parallel import MOE, assemble as assemble_experts

EOD = VOCAB - 1
ROPE = {"position_embedding": "rope", "num_query_groups": 2}


def packed_config(**config):
    """small_config with the three flags on: 4 layers (pp 2 x 2 virtual stages), 8 samples a step."""
    config = {"model_extra": ROPE, **config}
    cfg = small_config(steps=10, layers=4, global_batch=8, **config)
    cfg.data.reset_position_ids = cfg.data.reset_attention_mask = cfg.data.eod_mask_loss = True
    return cfg


def packed_data():
    return DocumentTokens(VOCAB, 16, EOD, seed=3, max_document=6)


_REFERENCES = {}


def reference(name: str, **config):
    """(result, full parameters) of the one-process run, once per session per name."""
    if name not in _REFERENCES:
        result = run_training(packed_config(**config), ProcessGroups.single(), dataset=packed_data(), eod=EOD)
        params = assemble_experts([result]) if "moe" in name else assemble_params([result])
        _REFERENCES[name] = result, strip_padding(params, VOCAB)
    return _REFERENCES[name]


LAYOUTS = [  # (what, reference name, dp, config)
    ("tp 2 sequence parallel", "learned", 1, dict(tp=2, sequence_parallel=True, model_extra={})),
    ("cp 2 ring", "rope", 1, dict(cp=2, cp_comm_type="p2p")),
    (
        "cp 2 a2a, selective recompute",
        "rope",
        1,
        dict(cp=2, cp_comm_type="a2a", model_extra={**ROPE, "recompute_granularity": "selective"}),
    ),
    ("cp 2 allgather", "rope", 1, dict(cp=2, cp_comm_type="allgather")),
    ("pp 2 interleaved", "rope", 1, dict(pp=2, virtual=2, schedule="interleaved")),
    (
        "ZeRO-3 dp 2, full recompute",
        "rope",
        2,
        dict(
            stage=3,
            model_extra={
                **ROPE,
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 2,
            },
        ),
    ),
    ("ep 2 (MoE)", "moe", 2, dict(ep=2, stage=1, model_extra={**ROPE, **MOE})),
]
REFERENCE_CONFIGS = {"learned": dict(model_extra={}), "rope": {}, "moe": dict(model_extra={**ROPE, **MOE})}


def _grid(ctx):
    """Pool entry: every layout in turn on the pool's 2 ranks."""
    return [
        layout_worker(ctx, packed_config(**config), dp, dataset=packed_data(), eod=EOD) for _, _, dp, config in LAYOUTS
    ]


def test_document_masking_grid_matches_one_process(dist_pool):
    per_rank = dist_pool(2).run(_grid)
    for index, (what, name, dp, config) in enumerate(LAYOUTS):
        results = [rank_results[index] for rank_results in per_rank]
        ref, ref_params = reference(name, **REFERENCE_CONFIGS[name])
        got = last_stage_result(results)
        assert_close(got["losses"], ref["losses"], f"{what}: loss curve")
        assert_close(got["norms"], ref["norms"], f"{what}: grad norms")
        params = assemble_experts(results) if name == "moe" else assemble_params(results)
        assert_params_match(strip_padding(params, VOCAB), ref_params, what)
