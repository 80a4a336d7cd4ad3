"""The precision-aware optimizer's flags (megazero/config/optimizer_state_flags.py): Megatron-LM's
--use-precision-aware-optimizer with --exp-avg-dtype / --exp-avg-sq-dtype / --main-grads-dtype /
--main-params-dtype, and DeepSpeed's bf16.bf16_optimizer_states, reach the precision record; each
combination refused is one line naming the fix. Planted: the flags parsed but not passed on (the
record's moments stay fp32) fails the first two tests."""

from __future__ import annotations

import json

import pytest

from megazero.config.flags import parse_args
from megazero.config.train_flags import config_from_args
from megazero.core.errors import UsageError

AWARE = "--use-precision-aware-optimizer"


def _config(line: str, ds: dict | None = None, tmp_path=None):
    if ds is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        line += f" --deepspeed_config {path}"
    return config_from_args(parse_args((line + " --mock-data").split()), world_size=2, cuda_available=False)


def test_megatron_flags_reach_the_precision_record(tmp_path):
    p = _config(f"--bf16 {AWARE} --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16").precision
    assert (p.exp_avg_dtype, p.exp_avg_sq_dtype, p.grad_accum_dtype, p.reduce_dtype) == ("bf16",) * 4
    p = _config(
        f"--bf16 {AWARE} --exp-avg-dtype bf16 --main-grads-dtype bf16",  # a reduce dtype given stays
        {"communication_data_type": "fp32"},
        tmp_path,
    ).precision
    assert (p.exp_avg_dtype, p.exp_avg_sq_dtype, p.grad_accum_dtype, p.reduce_dtype) == ("bf16", "fp32", "bf16", "fp32")
    p = _config(f"{AWARE} --main-params-dtype fp32").precision  # fp32 run: nothing lowered
    assert (p.exp_avg_dtype, p.exp_avg_sq_dtype, p.grad_accum_dtype) == ("fp32",) * 3


def test_deepspeed_bf16_optimizer_states_means_both_moments_in_bf16(tmp_path):
    p = _config("", {"bf16": {"enabled": True, "bf16_optimizer_states": True}}, tmp_path).precision
    assert (p.exp_avg_dtype, p.exp_avg_sq_dtype) == ("bf16", "bf16")
    same = _config(
        f"{AWARE} --exp-avg-dtype bf16", {"bf16": {"enabled": True, "bf16_optimizer_states": True}}, tmp_path
    ).precision
    assert (same.exp_avg_dtype, same.exp_avg_sq_dtype) == ("bf16", "bf16")


@pytest.mark.parametrize(
    "line, ds, words",
    [
        ("--exp-avg-dtype bf16", None, "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
        (f"{AWARE} --exp-avg-sq-dtype fp8", None, "--exp-avg-sq-dtype fp8 is not supported yet"),
        (f"{AWARE} --exp-avg-dtype fp16", None, "--exp-avg-dtype fp16 is not supported yet"),
        (f"{AWARE} --main-params-dtype fp16", None, "--main-params-dtype fp16 is not supported yet"),
        (f"{AWARE} --main-grads-dtype bf16", None, "--main-grads-dtype bf16 needs --bf16"),
        (
            f"--bf16 {AWARE} --exp-avg-dtype fp32",
            {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
            "--exp-avg-dtype fp32 contradicts bf16.bf16_optimizer_states",
        ),
        (
            f"--bf16 {AWARE} --main-grads-dtype bf16",
            {"data_types": {"grad_accum_dtype": "fp32"}},
            "--main-grads-dtype bf16 contradicts",
        ),
        (
            "",
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "bf16.bf16_master_weights_and_grads is not supported yet",
        ),
        (
            "",
            {
                "bf16": {"enabled": True, "bf16_optimizer_states": True},
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu"},
                    "zenflow": {"topk_ratio": 0.1},
                },
            },
            "bf16 Adam moments with zero_optimization.zenflow are not supported yet",
        ),
    ],
)
def test_refused_combinations_are_one_line(line, ds, words, tmp_path):
    with pytest.raises(UsageError) as err:
        _config(line, ds, tmp_path)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
