"""Reading a checkpoint written by any layout, one whole parameter at a time.

`CheckpointReader(dir)` checks what can be checked without reading tensors (metadata present and of
this format, its iteration that of the directory's name and of the optimizer's step counts, every
rank file present with the size its index records, indexes of the same run) and
then assembles any parameter's full fp32 value of a kind ("fp32", "exp_avg", "exp_avg_sq") from the
pieces the saving ranks wrote: each TP rank's flat (TP-local) value from its ZeRO pieces, then the
full tensor from the TP ranks (`TPShard.full_from_locals`). Only the files holding pieces of that
parameter are opened, and only those tensors read; each piece's CRC is checked as it is read. No
rank ever holds more than one parameter of the checkpoint. Nothing here runs pickle.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from megazero.parallel.layers import TPShard
from .files import FORMAT_VERSION, METADATA, TOKENIZER_DIR, CheckpointError, latest_iteration_dir, read_json
from .saver import crc32


# GPTConfig fields that decide parameter names and shapes or the function the weights compute
# (dropout, recompute, seq_length for rope models and the like may change between save and load).
def tokenizer_flags(record: dict, folder: Path) -> str:
    """The pretrain_gpt.py flags that rebuild the tokenizer a checkpoint keeps in `folder`."""
    kind = record["type"]
    if kind == "SentencePieceTokenizer":
        return f"--tokenizer-type {kind} --tokenizer-model {folder / 'tokenizer.model'}"
    if kind == "GPT2BPETokenizer":
        return f"--tokenizer-type {kind} --vocab-file {folder / 'vocab.json'} --merge-file {folder / 'merges.txt'}"
    if kind == "HuggingFaceTokenizer":
        return f"--tokenizer-type {kind} --tokenizer-model {folder}"
    return f"--tokenizer-type {kind} --vocab-size {record['vocab_size']}"


ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "position_embedding",
    "activation",
    "gelu_approximate",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "rotary_base",
    "rotary_percent",
    "tie_embeddings",
    "add_bias_linear",
    "add_qkv_bias",
)
# The learned position table's rows (max_position_embeddings, by default --seq-length): compared when
# both models learn positions (rotary ones have no table), and only ever grown on purpose.
POSITION_TABLE = "embedding.position.weight"
EXTEND_RULE = "position p starts from the checkpoint's row p mod {rows}"


def resolve(path: str | Path) -> Path:
    """A checkpoint directory: an iter_* directory itself, or a save directory's `latest`."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    target = latest_iteration_dir(path)
    if target is None:
        raise CheckpointError(f"{path}: no `latest` file and no {METADATA}; not a checkpoint directory")
    return target


class CheckpointReader:
    def __init__(self, path: str | Path):
        self.path = resolve(path)
        self.metadata = read_json(self.path / METADATA)
        version = self.metadata.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path / METADATA}: format version {version!r}, this megazero reads {FORMAT_VERSION}"
            )
        self.run_id = self.metadata["run_id"]
        self._check_iteration()
        self.indexes = self.metadata["ranks"]
        self._open: dict[int, object] = {}  # rank -> open safetensors file
        for rank, data_name in enumerate(self.metadata["rank_files"]):
            self._check_rank_file(rank, data_name)
        self.where: dict[str, list[tuple[int, dict]]] = {}
        self.buffers: dict[str, tuple[int, dict]] = {}  # name -> (a rank that saved it, its entry)
        for index in self.indexes:
            for name, entry in index["pieces"].items():
                self.where.setdefault(name, []).append((index["rank"], entry))
            for name, entry in index.get("buffers", {}).items():
                self.buffers.setdefault(name, (index["rank"], entry))

    def _check_iteration(self) -> None:
        """The iteration metadata.json records is its directory's (iter_N) and the one the optimizer's
        step counts give (steps applied and skipped since the iteration its state began at): an
        edited iteration would resume the lr schedule and the data elsewhere than the weights are."""
        where, iteration = self.path / METADATA, self.metadata.get("iteration")
        named = re.fullmatch(r"iter_(\d+)", self.path.name)
        if named and int(named.group(1)) != iteration:
            raise CheckpointError(
                f"{where}: iteration {iteration}, but its directory is {self.path.name}; "
                f"the metadata was edited or the directory renamed: restore it"
            )
        engine = self.metadata.get("engine") or {}
        steps, skipped = engine.get("step_count", 0), engine.get("skipped_steps", 0)
        first = engine.get("first_iteration")
        if not isinstance(iteration, int) or (
            first + steps + skipped != iteration if first is not None else steps + skipped > iteration
        ):
            since = f" since iteration {first}" if first is not None else ""
            raise CheckpointError(
                f"{where}: iteration {iteration} does not match the optimizer's {steps} "
                f"steps and {skipped} skipped{since}; the metadata was edited: restore it"
            )

    def _check_rank_file(self, rank: int, data_name: str) -> None:
        """Present, of the recorded size, and (its own header says) of this run and rank."""
        data = self.path / data_name
        if not data.is_file():
            raise CheckpointError(f"{data}: missing; the checkpoint is incomplete")
        header = self._file(rank).metadata() or {}
        run, owner = header.get("megazero_run_id"), header.get("rank")
        if run != self.run_id or owner != str(rank):
            raise CheckpointError(
                f"{data}: a shard of run {run} rank {owner}, not of this checkpoint "
                f"(run {self.run_id} rank {rank}); the directory mixes runs"
            )
        expected = self.indexes[rank]["file"]["bytes"]
        if data.stat().st_size != expected:
            raise CheckpointError(
                f"{data}: {data.stat().st_size} bytes, {METADATA} records {expected}; "
                f"the file is truncated or was replaced"
            )

    def _file(self, rank: int):
        if rank not in self._open:
            path = self.path / self.metadata["rank_files"][rank]
            try:
                self._open[rank] = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types for bad files
                raise CheckpointError(f"{path}: cannot be read ({err}); the file is corrupted or truncated") from None
        return self._open[rank]

    @property
    def names(self) -> list[str]:
        return sorted(self.where)

    def full_shape(self, name: str) -> tuple[int, ...]:
        entry = self.where[name][0][1]
        tp, ep = entry["tp"], entry.get("ep")
        shape = list(entry["shape"])
        if tp is not None:
            shape[tp[0]] *= tp[2]
        if ep is not None:  # experts: each expert-parallel rank saved its own, along dim 0
            shape[0] *= ep[1]
        return tuple(shape)

    def full_tensor(self, name: str, kind: str = "fp32") -> torch.Tensor:
        """The whole parameter `name` of tensor `kind`, fp32, assembled from every saving rank."""
        if name not in self.where:
            raise CheckpointError(f"{self.path}: has no parameter {name!r}; it was saved from another model")
        entries = self.where[name]
        tp, ep = entries[0][1]["tp"], entries[0][1].get("ep")
        tp_size, ep_size = 1 if tp is None else tp[2], 1 if ep is None else ep[1]
        local_shape = entries[0][1]["shape"]
        numel = math.prod(local_shape)
        locals_ = [torch.zeros(numel) for _ in range(tp_size * ep_size)]
        filled = [0] * (tp_size * ep_size)
        for rank, entry in entries:
            t = (0 if entry["tp"] is None else entry["tp"][1]) + tp_size * (0 if ep is None else entry["ep"][0])
            piece = self._read(rank, f"{name}/{kind}", entry["crc"][kind])
            locals_[t][entry["offset"] : entry["offset"] + entry["length"]] = piece
            filled[t] += entry["length"]
        if filled != [numel] * (tp_size * ep_size):
            raise CheckpointError(
                f"{self.path}: parameter {name!r} is incomplete ({filled} of {numel} "
                f"elements per TP (and expert-parallel) rank); a rank file is missing pieces"
            )
        locals_ = [t.view(local_shape) for t in locals_]
        per_ep = [locals_[e * tp_size : (e + 1) * tp_size] for e in range(ep_size)]
        if tp is not None:
            per_ep = [[TPShard(tp[0], 0, tp_size, tp[3]).full_from_locals(pieces)] for pieces in per_ep]
        return torch.cat([pieces[0] for pieces in per_ep]) if ep is not None else per_ep[0][0]

    def buffer(self, name: str) -> torch.Tensor:
        """The saved model buffer `name` (an expert bias), fp32."""
        if name not in self.buffers:
            raise CheckpointError(f"{self.path}: has no buffer {name!r}; it was saved from another model")
        rank, entry = self.buffers[name]
        return self._read(rank, f"buffer/{name}", entry["crc"]).view(entry["shape"])

    def _read(self, rank: int, key: str, crc: int) -> torch.Tensor:
        path = self.path / self.metadata["rank_files"][rank]
        try:
            tensor = self._file(rank).get_tensor(key)
        except Exception as err:  # safetensors raises its own error types for bad files
            raise CheckpointError(f"{path}: cannot read {key!r} ({err}); the file is corrupted") from None
        if crc32(tensor) != crc:
            raise CheckpointError(f"{path}: tensor {key!r} fails its checksum; the file is corrupted")
        return tensor

    def close(self) -> None:
        """Drops the open (memory-mapped) files: what was read stops counting in this process."""
        self._open.clear()

    def rng_state(self, rank: int, key: str) -> torch.Tensor:
        """RNG state `key` ("cpu", "cuda", "tracker/<stream>") of the saving rank `rank`."""
        return self._read(rank, f"rng/{key}", self.indexes[rank]["rng"][key])

    def check_model(self, model_config, where: str = "--load", extend_positions: bool = False) -> None:
        """Refuses a checkpoint of another model shape, naming every differing setting at once by the
        flags that give it (the checkpoint's and this run's), and the flags to pass for it; a learned
        position table of another size too, unless `extend_positions` grows a smaller one
        (--extend-position-embeddings, by EXTEND_RULE)."""
        saved = self.metadata["model"]
        ours = {f: getattr(model_config, f, None) for f in saved}
        # a width both models derive from the others (no flag gave it) follows once those are passed
        differing = [
            f
            for f in ARCHITECTURE_FIELDS
            if f in saved
            and saved[f] != ours[f]
            and not (saved[f] == _derived(f, saved) and ours[f] == _derived(f, ours))
        ]
        if not differing:
            self._check_positions(model_config, where, extend_positions)  # the table's rows, last
            return
        record = self.metadata.get("tokenizer")
        shown, wanted = [], []
        for field in differing:
            theirs, mine = model_flag(field, saved[field], saved), model_flag(field, ours[field], ours)
            if field == "vocab_size" and record:  # most often: the tokenizer flags left out
                theirs = (
                    f"the checkpoint keeps the tokenizer it was trained with ({record['type']}, "
                    f"vocab {record['vocab_size']})"
                )
                mine = f"vocab {ours[field]}"
                wanted.append(tokenizer_flags(record, self.path / TOKENIZER_DIR))
            else:
                wanted.append(theirs)
            shown.append(f"{theirs} (this run: {mine})")
        count = f"{len(differing)} settings" if len(differing) > 1 else "a setting"
        add = " ".join(w for w in wanted if not w.startswith("no "))
        drop = " ".join(w[3:] for w in wanted if w.startswith("no "))
        fix = " and ".join(([f"pass {add}"] if add else []) + ([f"leave out {drop}"] if drop else []))
        raise CheckpointError(
            f"{where} {self.path}: the saved model differs from this run's in {count}: "
            f"{'; '.join(shown)}; {fix} (or load a checkpoint of this model)"
        )

    def _check_positions(self, model_config, where: str, extend: bool) -> None:
        saved = self.metadata["model"]
        rows, mine = saved.get("max_position_embeddings"), model_config.max_position_embeddings
        learned = saved.get("position_embedding") == model_config.position_embedding == "learned"
        if not learned or rows in (None, mine) or (extend and mine > rows):
            return
        head = (
            f"{where} {self.path}: the checkpoint's learned position table has {rows} rows, this run's "
            f"{mine} (--max-position-embeddings, else --seq-length)"
        )
        if mine < rows:
            raise CheckpointError(
                f"{head}; pass --max-position-embeddings {rows} (a --seq-length up to {rows} uses its first rows)"
            )
        raise CheckpointError(
            f"{head}; pass --max-position-embeddings {rows} with a --seq-length up to {rows}, "
            f"or --extend-position-embeddings to grow the table ({EXTEND_RULE.format(rows=rows)})"
        )


def _derived(field: str, model: dict):
    """What a model's other fields make of `field` when no flag gives it (models.config.GPTConfig's
    defaults: Megatron's head width and MLP width), None for a field without such a default."""
    hidden, heads = model.get("hidden_size"), model.get("num_attention_heads")
    if field == "kv_channels" and hidden and heads:
        return hidden // heads
    if field == "ffn_hidden_size" and hidden:
        return 64 * ((8 * hidden // 3 + 63) // 64) if model.get("activation") == "swiglu" else 4 * hidden
    return None


def model_flag(field: str, value, model: dict) -> str:
    """The pretrain_gpt.py flags that give architecture field `field` the value `value` (`model`:
    the other fields of the same model, where a flag depends on them), "no --FLAG" where leaving a
    flag out does."""
    simple = {
        "hidden_size": "--hidden-size",
        "num_layers": "--num-layers",
        "ffn_hidden_size": "--ffn-hidden-size",
        "num_attention_heads": "--num-attention-heads",
        "norm_epsilon": "--norm-epsilon",
        "rotary_base": "--rotary-base",
        "rotary_percent": "--rotary-percent",
        "vocab_size": "--vocab-size",
        "max_position_embeddings": "--max-position-embeddings",
    }
    switches = {
        "apply_layernorm_1p": ("--apply-layernorm-1p", True),
        "add_qkv_bias": ("--add-qkv-bias", True),
        "tie_embeddings": ("--untie-embeddings-and-output-weights", False),
        "add_bias_linear": ("--disable-bias-linear", False),
        "activation": ("--swiglu", "swiglu"),
        "gelu_approximate": ("--no-bias-gelu-fusion", "none"),
    }
    if field in simple:
        return f"{simple[field]} {value:g}" if isinstance(value, float) else f"{simple[field]} {value}"
    if field in switches:
        flag, on = switches[field]
        return flag if value == on else f"no {flag}"
    if field == "num_query_groups":
        heads = model.get("num_attention_heads")
        return (
            "no --group-query-attention"
            if value == heads or value is None
            else f"--group-query-attention --num-query-groups {value}"
        )
    if field == "kv_channels":
        return f"--kv-channels {value}" if value else "no --kv-channels"
    if field == "position_embedding":
        return f"--position-embedding-type {'rope' if value == 'rope' else 'learned_absolute'}"
    if field == "normalization":
        return f"--normalization {'RMSNorm' if value == 'rmsnorm' else 'LayerNorm'}"
    return f"{field}={value!r}"
