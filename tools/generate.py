"""Sample text from a megazero checkpoint of any layout.

    python tools/generate.py --load runs/ckpt --prompt "def main(" --max-new-tokens 64
    python tools/generate.py --load runs/ckpt --prompt "def main(" --temperature 0.8 --top-k 50 --top-p 0.95
    python tools/generate.py --load runs/ckpt --prompt "def main(" --json    # {"prompt_ids", "ids", "text"}

The checkpoint (a --save directory, its `latest`, or an iter_* directory, written at any TP x PP x
ZeRO layout) is loaded into one process one parameter at a time, as consolidate reads it; the prompt
is encoded with the tokenizer the checkpoint keeps (or given as ids with --prompt-ids). Decoding runs
the model once over the prompt and then one position per token against a key/value cache
(megazero/models/generation.py). --temperature 0 (the default) is greedy: the ids equal transformers'
greedy `generate` on the folder `convert_checkpoint.py export-hf` writes. Generation stops at the
tokenizer's end-of-document id (included in `ids`) or after --max-new-tokens, or, with learned
positions, where the position table ends (a line on stderr and `note` in the JSON say so); `ids` and
`text` are the continuation only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from megazero.checkpoint import CheckpointReader
from megazero.checkpoint.files import TOKENIZER_DIR
from megazero.core.errors import UsageError
from megazero.data.tokenizer import tokenizer_from_saved
from megazero.models.config import GPTConfig
from megazero.models.generation import generate
from megazero.models.gpt import GPT


def load_model(reader: CheckpointReader, device: torch.device) -> GPT:
    """The checkpoint's model, read one full parameter at a time (a tied head is the embedding's)."""
    config = dataclasses.replace(
        GPTConfig(**reader.metadata["model"]), hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity="none"
    )
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    if config.tie_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.output_head.weight = model.embedding.word.weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(reader.full_tensor(name, "fp32"))
            reader.close()  # files are memory-mapped: keep only what was read
        for name, buffer in model.named_buffers():  # the routers' expert biases (to_empty left them unset)
            buffer.copy_(reader.buffer(name) if name in reader.buffers else torch.zeros_like(buffer))
    return model.eval()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="a --save directory (its `latest`) or an iter_* directory")
    p.add_argument("--prompt", help="text to continue, encoded with the checkpoint's tokenizer")
    p.add_argument("--prompt-ids", type=int, nargs="+", help="token ids to continue (instead of --prompt)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, all)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the most likely tokens up to this probability (default: 1.0, all)",
    )
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampler (default: 1234)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help='print {"prompt_ids": [...], "ids": [...], "text": "..."}')
    return p.parse_args(argv)


def _check(args) -> None:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UsageError("give the prompt once: --prompt TEXT or --prompt-ids ID [ID ...]")
    for flag, value, ok in (
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1),
        ("--temperature", args.temperature, 0 <= args.temperature < float("inf")),
        ("--top-k", args.top_k, args.top_k >= 0),
        ("--top-p", args.top_p, 0 < args.top_p <= 1),
    ):
        if not ok:
            raise UsageError(
                f"{flag} {value} is out of range (--max-new-tokens >= 1, --temperature >= 0 and "
                f"finite, --top-k >= 0, 0 < --top-p <= 1)"
            )


def run(args) -> dict:
    _check(args)
    reader = CheckpointReader(args.load)
    record = reader.metadata.get("tokenizer")
    tokenizer = tokenizer_from_saved(reader.path / TOKENIZER_DIR, record) if record else None
    if args.prompt is not None and tokenizer is None:
        raise UsageError(
            f"--load {args.load}: the checkpoint keeps no tokenizer to encode --prompt with; give --prompt-ids instead"
        )
    prompt = tokenizer.encode(args.prompt) if args.prompt is not None else args.prompt_ids
    vocab = reader.metadata["model"]["vocab_size"]
    if not prompt or not all(0 <= i < vocab for i in prompt):
        raise UsageError(f"the prompt must be 1 or more token ids below the model's vocabulary ({vocab}); got {prompt}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(reader, device)
    positions = model.config.max_position_embeddings
    if model.embedding.position is not None and len(prompt) > positions:
        raise UsageError(f"the prompt has {len(prompt)} tokens; the model has {positions} positions")
    generator = torch.Generator().manual_seed(args.seed)
    ids = generate(
        model,
        prompt,
        args.max_new_tokens,
        stop=tokenizer.eod if tokenizer else None,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=generator,
    )
    ended = tokenizer is not None and ids and ids[-1] == tokenizer.eod
    shown = ids[:-1] if ended else ids
    text = tokenizer.decode(shown) if tokenizer is not None else None
    note = None
    if not ended and len(ids) < args.max_new_tokens:  # generate() stops only at the table's end
        note = (
            f"stopped at the model's position limit: {len(ids)} of --max-new-tokens {args.max_new_tokens} "
            f"new tokens (the prompt's {len(prompt)} tokens and the continuation use all {positions} "
            f"learned positions)"
        )
    return {"prompt_ids": list(prompt), "ids": ids, "text": text, "note": note}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = run(args)
    except (UsageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if out["note"]:
        print(f"note: {out['note']}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    else:
        print((args.prompt or "") + (out["text"] if out["text"] is not None else " ".join(map(str, out["ids"]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
