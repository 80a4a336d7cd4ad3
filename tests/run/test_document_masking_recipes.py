"""Megatron-LM's Llama-3 8B and GPT-3 175B recipes (tests/config/test_run_flags.py's LLAMA3 and
GPT3, scaled down) with --reset-position-ids --reset-attention-mask --eod-mask-loss added, on mock
data (GPT-3's --data-path replaced by --mock-data, its GPT-2 BPE files kept), run unedited in one
process: every flag accepted, the mock samples are documents ending with the tokenizer's
end-of-document id (the NullTokenizer's vocab-size - 1, the GPT-2 BPE's <|endoftext|>), and the
losses are finite."""

import math

from megazero.run import launch
from megazero.data.tokenizer import build_tokenizer
from tests.config.test_run_flags import GPT3, LLAMA3, gpt2_data, recipe_argv  # noqa: F401 (a fixture)
from tests.metrics_reading import split_records

DOCUMENT_FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def test_recipes_with_document_masking_train_on_mock_data(tmp_path, gpt2_data, capsys):  # noqa: F811
    llama = recipe_argv(LLAMA3, tp=1, dir=tmp_path / "llama") + DOCUMENT_FLAGS + ["--run-dir", str(tmp_path / "llama")]
    assert launch.main(llama) == 0, capsys.readouterr().err
    assert "each ending with the end-of-document id 511" in capsys.readouterr().out
    train = split_records(tmp_path / "llama")
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in train)

    text = GPT3.replace("--data-path {data}", "--mock-data")
    gpt3 = recipe_argv(text, pp=1, dir=tmp_path / "gpt3", **gpt2_data) + DOCUMENT_FLAGS
    gpt3 += ["--run-dir", str(tmp_path / "gpt3")]
    assert launch.main(gpt3) == 0, capsys.readouterr().err
    eod = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_data["vocab"], merge_file=gpt2_data["merges"]).eod
    assert f"each ending with the end-of-document id {eod})" in capsys.readouterr().out
    train = split_records(tmp_path / "gpt3")
    assert train[0]["iteration"] == 1 and all(math.isfinite(r["loss"]) for r in train)
