"""Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh as Megatron-LM ships it scaled
down (2 layers, hidden 256, 2 experts, ep 2 on 2 ranks, 7 iterations), its flags unedited but for
the tokenizer and data path (--mock-data and the default tokenizer in their place), under torchrun:
it trains, logs the MoE lines, and its losses are finite."""

import math

from tests.run.test_cli import _torchrun
from tests.metrics_reading import metrics_records

MODEL = """--use-mcore-models --disable-bias-linear --seq-length 256 --max-position-embeddings 2048 --num-layers 2
--hidden-size 256 --ffn-hidden-size 896 --num-attention-heads 2 --init-method-std 0.01 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000"""
MOE = """--num-experts 2 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
--moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce"""
DATA = "--mock-data --split 99990,8,2"
TRAINING = "--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 7 --min-lr 1.0e-5 --weight-decay 0.1 --clip-grad 1.0"
PARALLEL = """--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
--use-distributed-optimizer --sequence-parallel"""
LOGGING = "--eval-iters 10 --no-load-optim --no-load-rng"


def test_megatron_mixtral_recipe_runs_under_torchrun(tmp_path):
    argv = " ".join([MODEL, MOE, DATA, TRAINING, PARALLEL, LOGGING]).split() + ["--run-dir", "r", "--log-interval", "1"]
    proc = _torchrun(2, argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "expert load (max/mean tokens): layer 0" in proc.stdout
    records = metrics_records(tmp_path / "r" / "metrics.jsonl")
    train = [r for r in records if r.get("split") == "train"]
    assert len(train) == 7 and all(math.isfinite(r["loss"]) and r["moe_aux_loss"] > 0 for r in train)
