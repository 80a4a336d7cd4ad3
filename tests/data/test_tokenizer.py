"""megazero/data/tokenizer.py: the sentencepiece tokenizer round-trips text exactly (whitespace,
unicode, the end-of-document text), and training's inputs and errors."""

import pytest

from megazero.core.errors import UsageError
from megazero.data.tokenizer import load_tokenizer, train_tokenizer
from tests.data.tiny_data import ROUND_TRIP_TEXT, generated_python, tiny_tokenizer  # noqa: F401 (a fixture)


def test_tokenizer_round_trip_exact(tiny_tokenizer):
    tok = load_tokenizer(tiny_tokenizer[0])
    assert tok.vocab_size == 400 and tok.id_to_piece(tok.eod) == "<|endoftext|>"
    ids = tok.encode(ROUND_TRIP_TEXT)
    assert tok.eod not in ids and max(ids) < tok.vocab_size
    assert tok.decode(ids) == ROUND_TRIP_TEXT
    assert tok.decode(ids + [tok.eod]) == ROUND_TRIP_TEXT
    for text in ["", " ", "\n", "\t", "    x", generated_python(99, 3)]:
        assert tok.decode(tok.encode(text)) == text
    # Indentation is learned as whole-run pieces rather than one token per space.
    assert len(tok.encode("        return")) < 4


def test_train_tokenizer_inputs_and_errors(tmp_path, tiny_tokenizer):
    text_file = tmp_path / "plain.txt"
    text_file.write_text(generated_python(5, 20))
    model = train_tokenizer([text_file], tmp_path / "t", 350, progress=False)
    assert load_tokenizer(model).vocab_size == 350 and not list(tmp_path.glob("*.tmp-*"))
    with pytest.raises(UsageError, match="not found"):
        train_tokenizer([tmp_path / "missing.txt"], tmp_path / "t2", 350, progress=False)
    with pytest.raises(UsageError, match="smaller --vocab-size"):
        train_tokenizer([text_file], tmp_path / "t3", 5000, progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n{"body": "y"}\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:2: no string field 'text'"):
        train_tokenizer([bad], tmp_path / "t4", 350, progress=False)
    with pytest.raises(UsageError, match="not a sentencepiece model"):
        load_tokenizer(bad)
    with pytest.raises(UsageError, match="not found"):
        load_tokenizer(tmp_path / "none.model")
