"""Supervised fine-tuning data for tools/finetune.py: a JSON-lines file of records, tokenized with a
Hugging Face tokenizer into samples whose labels are -100 everywhere but the response tokens, and
the micro batches a data-parallel rank trains on.

    {"prompt": "...", "response": "..."}            the prompt (with the tokenizer's special tokens,
                                                     e.g. BOS) then the response and the EOS token
    {"messages": [{"role": ..., "content": ...}]}   rendered by the tokenizer's chat template; every
                                                     assistant turn is a response (as the template
                                                     renders it, its end-of-turn tokens included)

A sample is truncated to the sequence length. Its first token is never a label (nothing in its own
document predicts it; packed, the previous document would). Each record must keep at least one
label after truncation.

Batches: unpacked, a row is one sample, a micro batch's rows padded to its longest with an
attention mask; packed (`pack=True`), samples are laid one after another into rows of at most the
sequence length, with position ids that restart at 0 at each sample and no attention mask, which is
how transformers' masking (masking_utils.find_packed_sequence_indices) tells documents apart and
keeps each attending to itself only. The row order is reshuffled every epoch from the seed; step
`it`'s global batch is cut into micro batches exactly as DeepSpeed's loop consumes them: micro batch
`m` of data-parallel rank `r` is rows (m x dp + r) x micro ... + micro of the global batch.

Owns reading, the one-line checks of the records (with their line numbers), tokenizing and
batching; no model and no process group.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from megazero.core.errors import UsageError

IGNORE = -100  # the label transformers' loss skips


@dataclasses.dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]


def read_records(path) -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line of the JSON-lines file `path`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(
            f'--data {path}: no such file; give a JSON-lines file of {{"prompt", "response"}} or {{"messages"}} records'
        )
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise UsageError(f"--data {path}:{number}: not a JSON object ({err})") from None
            if not isinstance(record, dict):
                raise UsageError(f"--data {path}:{number}: not a JSON object")
            records.append((number, record))
    if not records:
        raise UsageError(f"--data {path}: no records in it")
    return records


def _text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise UsageError(
            f'{where}: the record has no "{key}" string (a record is {{"prompt", "response"}} '
            f'or {{"messages": [{{"role", "content"}}, ...]}})'
        )
    return value


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def prompt_response_pieces(tokenizer, record: dict, where: str) -> list[tuple[list[int], bool]]:
    prompt, response = _text(record, "prompt", where), _text(record, "response", where)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [(_ids(tokenizer, prompt, True), False), (_ids(tokenizer, response, False) + eos, True)]


def message_pieces(tokenizer, record: dict, where: str) -> list[tuple[list[int], bool]]:
    """The chat template's rendering cut at each assistant turn: (token ids, is a response) pieces.
    A turn's text is what rendering up to it adds to rendering up to the prompt of it."""
    messages = record["messages"]
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            f'{where}: a "messages" record, but the tokenizer has no chat template; add '
            f'"chat_template" to the model folder\'s tokenizer_config.json, or give '
            f'{{"prompt", "response"}} records'
        )
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise UsageError(f'{where}: "messages" must be a list of {{"role", "content"}} objects with strings')
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise UsageError(f'{where}: no "assistant" message: nothing to learn from this record')

    def render(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)

    pieces, done = [], ""
    for i in turns:
        before, after = render(i, True), render(i + 1, False)
        if not before.startswith(done) or not after.startswith(before):
            raise UsageError(
                f"{where}: the chat template does not render the conversation turn by turn "
                f"(a later rendering does not start with an earlier one), so its response "
                f'tokens cannot be told apart; give {{"prompt", "response"}} records'
            )
        pieces += [
            (_ids(tokenizer, before[len(done) :], False), False),
            (_ids(tokenizer, after[len(before) :], False), True),
        ]
        done = after
    return pieces


def tokenize(tokenizer, record: dict, where: str, seq_length: int) -> Sample:
    """One record as a sample of at most `seq_length` tokens, labelled on its response tokens only."""
    if "messages" in record:
        pieces = message_pieces(tokenizer, record, where)
    else:
        pieces = prompt_response_pieces(tokenizer, record, where)
    ids, labels = [], []
    for piece, is_response in pieces:
        ids += piece
        labels += piece if is_response else [IGNORE] * len(piece)
    prompt = next((i for i, label in enumerate(labels) if label != IGNORE), len(labels))
    ids, labels = ids[:seq_length], labels[:seq_length]
    if labels:
        labels[0] = IGNORE
    if all(label == IGNORE for label in labels):
        raise UsageError(
            f"{where}: the response is empty after truncation to --seq-length {seq_length} "
            f"(the prompt takes {prompt} tokens); raise --seq-length or shorten the prompt"
        )
    return Sample(ids, labels)


def load_samples(path, tokenizer, seq_length: int) -> list[Sample]:
    return [tokenize(tokenizer, record, f"--data {path}:{number}", seq_length) for number, record in read_records(path)]


@dataclasses.dataclass
class Row:
    """A training row: one sample, or several packed (`starts`: where each begins)."""

    input_ids: list[int]
    labels: list[int]
    starts: list[int]


def make_rows(samples: list[Sample], seq_length: int, pack: bool) -> list[Row]:
    if not pack:
        return [Row(s.input_ids, s.labels, [0]) for s in samples]
    rows, current = [], None
    for sample in samples:
        if current is None or len(current.input_ids) + len(sample.input_ids) > seq_length:
            current = Row([], [], [])
            rows.append(current)
        current.starts.append(len(current.input_ids))
        current.input_ids += sample.input_ids
        current.labels += sample.labels
    return rows


def collate(rows: list[Row], pad_id: int, pack: bool) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for these rows (CPU tensors: the caller moves them). Padding is
    right; packed, it is one more document (position ids from 0), never attended by the others."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    second = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        ids[i, :n] = torch.tensor(row.input_ids)
        labels[i, :n] = torch.tensor(row.labels)
        if pack:
            for start, end in zip(row.starts, row.starts[1:] + [n]):
                second[i, start:end] = torch.arange(end - start)
            second[i, n:] = torch.arange(width - n)
        else:
            second[i, :n] = 1
    if pack:
        return {"input_ids": ids, "labels": labels, "position_ids": second}
    return {"input_ids": ids, "labels": labels, "attention_mask": second}


class SFTBatches:
    """The micro batches of every step, for every data-parallel rank (see the module docstring)."""

    def __init__(self, rows: list[Row], micro: int, accumulation: int, dp: int, seed: int, pad_id: int, pack: bool):
        self.rows, self.micro, self.accumulation, self.dp = rows, micro, accumulation, dp
        self.seed, self.pad_id, self.pack = seed, pad_id, pack
        self.global_batch = micro * accumulation * dp
        self.steps_per_epoch = len(rows) // self.global_batch
        self._order: tuple[int, torch.Tensor] | None = None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(len(self.rows), generator=g))
        return self._order[1]

    def micro_batch(self, step: int, micro: int, dp_rank: int) -> dict[str, torch.Tensor]:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._epoch_order(epoch)
        first = within * self.global_batch + (micro * self.dp + dp_rank) * self.micro
        return collate([self.rows[i] for i in order[first : first + self.micro].tolist()], self.pad_id, self.pack)
