"""tools/finetune.py, with megazero/data/sft.py's records, response-only labels and packing, against a
plain transformers loop it does not share code with.

The model is a tiny transformers Llama saved with save_pretrained, its tokenizer a word-level one with
a chat template, built here (nothing downloaded). The other side tokenizes the records itself from the
vocabulary and the template's known layout, builds its labels (-100 on every prompt token), and
trains the same folder with the model's own loss, torch.optim.AdamW and clip_grad_norm_.

- 1 rank (the pool): {"prompt", "response"} and {"messages"} records, 2 micro batches of 2 a step,
  5 steps (an epoch is 3: the order is reshuffled): losses and final weights to rtol 1e-5.
- 2 ranks under torchrun, one launch: examples/deepspeed_loop.py, then tools/finetune.py --pack at
  ZeRO-3. The losses equal the plain loop's on the same records unpacked (each record its own padded
  row, the records a packed micro batch held together), so the packed rows kept the records apart;
  metrics.jsonl and the progress lines are pretrain_gpt.py's; the --export-hf folder, and the last
  checkpoint exported afterwards (--load), load with AutoModelForCausalLM and their logits equal the
  engine's within 1e-5.
- Bad input: one line each, before any process group.

Planted to see them fail: the loss on the prompt tokens too (sft.tokenize labelling every piece):
the 1-rank losses differ at step 1; packing without the record boundary (position ids running on
across a row): the torchrun losses differ at step 1; the forward without use_cache=False (Llama then
makes a cache, and transformers reads no packed records from the position ids): the same.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.driver import REPO
from tests.launching import run_torchrun
from tests.metrics_reading import metrics_records
from megazero.core.errors import UsageError

sys.path.insert(0, str(REPO))
from tools import finetune  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
VOCAB = ["<pad>", "<unk>", "<s>", "</s>", "user", "assistant", ":"] + WORDS
ID = {w: i for i, w in enumerate(VOCAB)}
TEMPLATE = (
    "{% for m in messages %}{{ m.role }} : {{ m.content }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
SEQ, LR, DECAY, CLIP, SEED = 32, 3e-3, 0.1, 0.5, 5


def save_model_folder(path: Path) -> Path:
    """A tiny Llama (dropout off, fp32) and a word-level tokenizer with a chat template."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", ID["<s>"])])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(VOCAB),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=SEQ,
            attention_dropout=0.0,
            bos_token_id=ID["<s>"],
            eos_token_id=ID["</s>"],
            pad_token_id=ID["<pad>"],
        )
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def records(n: int, seed: int = 1) -> list[dict]:
    """Prompt/response records, every third a two-turn conversation."""
    g = torch.Generator().manual_seed(seed)

    def text():
        return " ".join(
            WORDS[i]
            for i in torch.randint(0, len(WORDS), (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
        )

    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": text()},
                        {"role": "assistant", "content": text()},
                        {"role": "user", "content": text()},
                        {"role": "assistant", "content": text()},
                    ]
                }
            )
        else:
            out.append({"prompt": text(), "response": text()})
    return out


def reference_sample(record: dict) -> tuple[list[int], list[int]]:
    """(ids, labels) written from the vocabulary: BOS, prompt, response, EOS; a conversation as the
    template lays it out, labelled on each assistant reply and its </s>."""

    def ids(text):
        return [ID[w] for w in text.split()]

    if "prompt" in record:
        prompt, response = [ID["<s>"]] + ids(record["prompt"]), ids(record["response"]) + [ID["</s>"]]
        return prompt + response, [-100] * len(prompt) + response
    tokens, labels = [], []
    for m in record["messages"]:
        head, body = [ID[m["role"]], ID[":"]], ids(m["content"]) + [ID["</s>"]]
        tokens += head + body
        labels += [-100] * len(head) + (body if m["role"] == "assistant" else [-100] * len(body))
    return tokens[:SEQ], labels[:SEQ]


def reference_losses(
    folder: Path, recs: list[dict], steps: int, micro: int, accumulation: int, dp: int, pack: bool
) -> tuple[list[float], dict]:
    """The plain loop. A row is a record, or (pack) the records packed greedily in file order into
    SEQ tokens; a micro batch is its rows' records, each its own right-padded row."""
    import transformers

    samples = [reference_sample(r) for r in recs]
    rows = [[i] for i in range(len(samples))]
    if pack:
        rows, used = [], SEQ + 1
        for i, (ids, _) in enumerate(samples):
            if used + len(ids) > SEQ:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += len(ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    per_step = micro * accumulation * dp
    losses = []
    for step in range(steps):
        epoch, within = divmod(step, len(rows) // per_step)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        total = 0.0
        for m in range(accumulation):
            for r in range(dp):
                first = within * per_step + (m * dp + r) * micro
                docs = [samples[i] for row in order[first : first + micro] for i in rows[row]]
                width = max(len(ids) for ids, _ in docs)
                ids = torch.tensor([d + [0] * (width - len(d)) for d, _ in docs])
                labels = torch.tensor([l + [-100] * (width - len(l)) for _, l in docs])
                mask = torch.tensor([[1] * len(d) + [0] * (width - len(d)) for d, _ in docs])
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss / (accumulation * dp)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def ds_config(path: Path, micro: int, accumulation: int, stage: int) -> Path:
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": accumulation,
                "gradient_clipping": CLIP,
                "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}},
                "zero_optimization": {"stage": stage},
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    folder = save_model_folder(root / "model")
    recs = records(16)
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return root, folder, recs


def finetune_on_pool(ctx, argv: list[str]):
    """Pool entry: tools/finetune.py's job on the first rank alone; its losses and full weights."""
    from megazero.parallel.topology import Topology
    from megazero.utils import safe_get_full_fp32_param

    groups = ctx.groups(Topology(world_size=1))
    if groups is None:
        return None
    done = finetune.run(finetune.parse_args(argv), process_groups=groups)
    return [r["loss"] for r in done.history], {
        n: safe_get_full_fp32_param(p) for n, p in done.engine.module.named_parameters()
    }


def assert_close(ours: list[float], theirs: list[float], what: str) -> None:
    assert len(ours) == len(theirs), (ours, theirs)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {step + 1}: {a} against the plain loop's {b}"


def test_response_only_loss_matches_a_plain_transformers_loop(dist_pool, job):
    root, folder, recs = job
    recs = recs[:12]
    (root / "twelve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    argv = [
        "--hf-model",
        str(folder),
        "--data",
        str(root / "twelve.jsonl"),
        "--seq-length",
        str(SEQ),
        "--deepspeed_config",
        str(ds_config(root / "ds1.json", 2, 2, 2)),
        "--train-iters",
        "5",
        "--seed",
        str(SEED),
        "--run-dir",
        str(root / "run1"),
    ]
    losses, params = dist_pool(2).run(finetune_on_pool, argv)[0]
    ref_losses, ref_params = reference_losses(folder, recs, 5, 2, 2, 1, pack=False)
    assert_close(losses, ref_losses, "1 rank")
    for name, ref in ref_params.items():
        err = float((params[name] - ref).norm() / ref.norm())
        assert err <= 1e-5, f"{name}: {err:.2e} relative from the plain loop's"


def test_two_ranks_under_torchrun_pack_and_export(job, tmp_path):
    """examples/deepspeed_loop.py and tools/finetune.py --pack in one torchrun launch of 2 ranks."""
    from transformers import AutoModelForCausalLM

    root, folder, recs = job
    probe = torch.randint(0, len(VOCAB), (2, 12), generator=torch.Generator().manual_seed(9))
    torch.save(probe, tmp_path / "probe.pt")
    argv = [
        "--hf-model",
        str(folder),
        "--data",
        str(root / "sft.jsonl"),
        "--pack",
        "--train-iters",
        "4",
        "--deepspeed_config",
        str(ds_config(tmp_path / "ds3.json", 1, 2, 3)),
        "--seed",
        str(SEED),
        "--run-dir",
        str(tmp_path / "run"),
        "--save",
        str(tmp_path / "ck"),
        "--save-interval",
        "2",
        "--ckpt-keep-last",
        "1",
        "--export-hf",
        str(tmp_path / "hf"),
    ]
    proc = run_torchrun(
        2, [str(REPO / "tests" / "tools" / "finetune_torchrun.py"), str(tmp_path), *argv], tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    example = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(example) == 4 and example[-1] < 0.9 * example[0], proc.stdout
    assert " iteration      4/4 | loss " in proc.stdout, proc.stdout
    logged = metrics_records(tmp_path / "run")
    assert [r["iteration"] for r in logged] == [1, 2, 3, 4] and all(r["split"] == "train" for r in logged)
    ref_losses, _ = reference_losses(folder, recs, 4, 1, 2, 2, pack=True)
    assert_close([r["loss"] for r in logged], ref_losses, "2 ranks, packed")
    assert sorted(p.name for p in (tmp_path / "ck").glob("iter_*")) == ["iter_0000004"]  # keep-last 1
    ours = torch.load(tmp_path / "ours.pt")
    # the export at the end, and the last checkpoint exported afterwards in this one process
    assert (
        finetune.main(
            ["--hf-model", str(folder), "--load", str(tmp_path / "ck"), "--export-hf", str(tmp_path / "from_ck")]
        )
        == 0
    )
    for out in ("hf", "from_ck"):
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        with torch.no_grad():
            theirs = exported(input_ids=probe).logits
        assert torch.allclose(theirs, ours, rtol=0, atol=1e-5), (out, float((theirs - ours).abs().max()))


def _argv(root: Path, folder: Path, data: Path, *extra: str) -> list[str]:
    return [
        "--hf-model",
        str(folder),
        "--data",
        str(data),
        "--deepspeed_config",
        str(ds_config(root / "ds_bad.json", 1, 1, 2)),
        *extra,
    ]


@pytest.mark.parametrize(
    "lines, extra, expected",
    [
        (
            ['{"prompt": "w1 w2", "response": "w3"}', '{"prompt": "w1"}'],
            [],
            r"sft\.jsonl:2: the record has no \"response\"",
        ),
        (
            ['{"prompt": "w1 w2 w3 w4", "response": "w3"}'],
            ["--seq-length", "5"],
            r"sft\.jsonl:1: the response is empty after truncation to --seq-length 5 \(the prompt takes 5 tokens\)",
        ),
        (['{"prompt": "w1", "response": "w3"}'], ["--seq-length", "33"], r"--seq-length 33 is above the model's 32"),
        (["not json"], [], r"sft\.jsonl:1: not a JSON object"),
        (['{"messages": [{"role": "user", "content": "w1"}]}'], [], r"sft\.jsonl:1: no \"assistant\" message"),
        (['{"prompt": "w1", "response": "w3"}'], ["--save", "{tmp}"], r"--save .* holds checkpoints of another run"),
    ],
)
def test_bad_records_and_flags_say_one_line(job, tmp_path, lines, extra, expected):
    root, folder, _ = job
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(lines) + "\n")
    (tmp_path / "latest").write_text("iter_0000004\n")
    extra = [str(tmp_path) if e == "{tmp}" else e for e in extra]
    with pytest.raises(UsageError, match=expected):
        finetune.prepare(finetune.parse_args(_argv(tmp_path, folder, data, *extra)), dp=1)


def test_no_chat_template_no_causal_lm_and_packing_a_recurrent_model_are_refused(job, tmp_path, capsys):
    import transformers

    root, folder, _ = job
    data = tmp_path / "sft.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n')
    plain = tmp_path / "plain"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    for name in ("config.json", "model.safetensors"):
        (plain / name).write_bytes((folder / name).read_bytes())
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(
        UsageError, match=r"sft\.jsonl:1: a \"messages\" record, but the tokenizer has no chat template"
    ):
        finetune.prepare(finetune.parse_args(_argv(tmp_path, plain, data)), dp=1)
    encoder = tmp_path / "encoder"
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=1, architectures=["GPT2Model"]).save_pretrained(encoder)
    assert finetune.main(_argv(tmp_path, encoder, data)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --hf-model") and "a GPT2Model model, not a causal language model" in err, err
    assert len(err.splitlines()) == 1
    mamba = tmp_path / "mamba"
    transformers.MambaConfig(
        vocab_size=8, hidden_size=8, num_hidden_layers=1, architectures=["MambaForCausalLM"]
    ).save_pretrained(mamba)
    with pytest.raises(
        UsageError, match=r"--pack: MambaForCausalLM does not build its masks with transformers' masking_utils"
    ):
        finetune.prepare(finetune.parse_args(_argv(tmp_path, mamba, data, "--pack", "--seq-length", "8")), dp=1)
    import torch.distributed as dist

    assert not dist.is_initialized()
