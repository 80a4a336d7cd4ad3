"""Which parameters of the GPT Muon steps, and how each is a matrix: what the ZeRO engine's Muon
(megazero.zero.muon) is told about the model, as data (it knows no layer).

Muon steps the hidden weight matrices: attention's QKV and output projections, the MLP's two layers,
the shared expert's, and every expert's two matrices of a grouped-experts layer (each expert's own
matrix). AdamW steps the rest, as Megatron-LM and torch.optim.Muon's documentation say: the word and
position embeddings and the output layer (Megatron's is_embedding_or_output_parameter), norms and
biases (not 2-D), and two gates megazero also leaves to AdamW: the MoE router (a few rows of
routing logits, whose scale the top-k reads) and the shared expert's 1 x hidden gate (a vector).
Megatron-LM runs Muon on the router; megazero does not.

Decided from the parameter's name and the shape its storage records (never `param.shape`, which a
ZeRO-3 parameter between gathers reports as empty), with tensor parallelism's split of it (its
`tp_shard`) turned into the join and split the engine calls. With split QKV (Megatron-LM's default)
the QKV weight's rows of each query group are its queries, key and value: three matrices.
"""

from __future__ import annotations

import dataclasses

from megazero.models.config import GPTConfig
from megazero.models.param_info import param_info
from megazero.ops.muon_config import MuonConfig
from megazero.parallel.layers import TPShard
from megazero.zero.muon import MuonMatrix

ADAMW_NAMES = ("embedding.word.weight", "embedding.position.weight", "output_head.weight")
ADAMW_SUFFIXES = ("router.weight", "shared_experts.gate_weight")


def muon_matrix_of(model: GPTConfig, muon: MuonConfig):
    """`matrix(name, param, shape) -> MuonMatrix | None`, the engine's `muon_matrix`."""
    qkv_rows = tuple(r * model.head_dim for r in (model.num_attention_heads // model.num_query_groups, 1, 1))

    def matrix(name: str, param, shape: tuple) -> MuonMatrix | None:
        info = param_info(param)
        if name in ADAMW_NAMES or name.endswith(ADAMW_SUFFIXES):
            return None
        expert = info.expert_parallel and len(shape) == 3
        if len(shape) != 2 and not expert:
            return None
        if info.tile_shard is not None:
            raise ValueError(f"Muon needs {name} whole, but it is a tile of a TiledLinear; untile it or use Adam")
        # A grouped-experts weight holds this expert-parallel rank's experts, split over TP as its
        # ExpertShard's TPShard says; each expert's matrix is orthogonalised apart.
        shard = getattr(info.tp_shard, "tp", info.tp_shard) if expert else info.tp_shard
        split = shard if info.tensor_parallel and isinstance(shard, TPShard) and shard.size > 1 else None
        blocks = qkv_rows if muon.split_qkv and name.endswith("attention.qkv.weight") else ()
        return MuonMatrix(
            full_shape=split.full_shape(shape) if split is not None else tuple(shape),
            join=split.full_from_locals if split is not None else None,
            split=_splitter(split) if split is not None else None,
            row_blocks=blocks,
            batched=expert,
            transposed=expert,
        )

    return matrix


def _splitter(shard: TPShard):
    ranks = [dataclasses.replace(shard, rank=r) for r in range(shard.size)]
    return lambda full: [r.local_from_full(full) for r in ranks]
