"""Memory-centric tiling (ZeRO-Infinity's TiledLinear): a linear layer cut into a grid of tiles over
its input and output features, each tile a module of its own, so ZeRO stage 3 (which makes every
module's parameters one unit) gathers one tile at a time instead of the whole weight.

y = x W^T + b with W cut into `out_splits` row blocks and `in_splits` column blocks:
y_o = sum_i x_i W_oi^T + b_o, and y = [y_0, ..., y_{O-1}]. Tile (o, 0) carries b_o. The sum over
input blocks runs in a different order from the untiled matmul's, so in fp32 each output element
may differ by the usual summation bound, |y_tiled - y| <= 2 n eps sum_k |x_k W_jk| with n the input
features and eps = 2^-24 (each of the two results is within n eps of the exact sum); with
in_splits = 1 only the matmul's own blocking differs. Gradients carry the same bound.

Applied from outside the model, as parallelize applies TP: `tile_linears(model, names, ...)` swaps
matching nn.Linear layers (or an untied output head) in place. Each tile parameter carries a
`TileShard` (attribute `tile_shard`) naming the untiled parameter it is cut from and where, so the
layout-independent init (seed, name) builds the untiled weight and slices it: a tiled run starts
from the same weights as an untiled one. This module owns the tiles; it does not touch ZeRO, TP
layers (tensor-parallel layers are refused) or the pure model's code.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from megazero.core.errors import UsageError
from megazero.models.gpt import LMHead
from megazero.models.weight_grad import Linear, linear
from megazero.models.param_info import param_info, set_param_info


def split_sizes(total: int, parts: int) -> list[int]:
    """`parts` sizes summing to `total`, the first ones larger by one where it does not divide."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclasses.dataclass(frozen=True)
class TileShard:
    """The tile is rows [row0, row0 + rows) and columns [col0, col0 + cols) of the untiled parameter
    `source` (of shape `full`); a bias tile has no columns."""

    source: str
    full: tuple[int, ...]
    row0: int
    rows: int
    col0: int = 0
    cols: int = 0

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        piece = full.narrow(0, self.row0, self.rows)
        return piece.narrow(1, self.col0, self.cols) if self.cols else piece


class LinearTile(nn.Module):
    """One tile: its own weight (and bias, on the first input block only), its own forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class TiledLinear(nn.Module):
    """A drop-in nn.Linear cut into out_splits x in_splits tiles (`tiles[o * in_splits + i]`)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, in_splits: int, out_splits: int, device=None, dtype=None
    ):
        super().__init__()
        if not (1 <= in_splits <= in_features and 1 <= out_splits <= out_features):
            raise UsageError(
                f"cannot tile a {out_features}x{in_features} linear into {out_splits}x{in_splits} "
                f"tiles; use 1..{out_features} output and 1..{in_features} input splits"
            )
        self.in_features, self.out_features = in_features, out_features
        self.in_sizes, self.out_sizes = split_sizes(in_features, in_splits), split_sizes(out_features, out_splits)
        self.tiles = nn.ModuleList(
            LinearTile(cols, rows, bias and i == 0, device, dtype)
            for rows in self.out_sizes
            for i, cols in enumerate(self.in_sizes)
        )

    def tile(self, o: int, i: int) -> LinearTile:
        return self.tiles[o * len(self.in_sizes) + i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = x.split(self.in_sizes, dim=-1) if len(self.in_sizes) > 1 else (x,)
        outputs = []
        for o in range(len(self.out_sizes)):
            y = self.tile(o, 0)(inputs[0])
            for i in range(1, len(inputs)):
                y = y + self.tile(o, i)(inputs[i])
            outputs.append(y)
        return torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]

    def mark_sources(self, weight_name: str, bias_name: str | None) -> None:
        """Tells each tile parameter which untiled parameter it is cut from (for the init)."""
        full = (self.out_features, self.in_features)
        rows = [sum(self.out_sizes[:o]) for o in range(len(self.out_sizes))]
        cols = [sum(self.in_sizes[:i]) for i in range(len(self.in_sizes))]
        for o, (row0, n_rows) in enumerate(zip(rows, self.out_sizes)):
            for i, (col0, n_cols) in enumerate(zip(cols, self.in_sizes)):
                tile = self.tile(o, i)
                set_param_info(tile.weight, tile_shard=TileShard(weight_name, full, row0, n_rows, col0, n_cols))
                if tile.bias is not None:
                    set_param_info(tile.bias, tile_shard=TileShard(bias_name, (self.out_features,), row0, n_rows))

    def full_weight(self, tile_weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The untiled weight, from the tiles' weights (or the given values, in `tiles` order)."""
        values = tile_weights if tile_weights is not None else [t.weight for t in self.tiles]
        n = len(self.in_sizes)
        return torch.cat([torch.cat(values[o * n : (o + 1) * n], dim=1) for o in range(len(self.out_sizes))])

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_splits: int, out_splits: int) -> "TiledLinear":
        """Same shape, device and dtype as `linear`; values are not copied (see copy_from)."""
        w = linear.weight
        return cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            in_splits,
            out_splits,
            device=w.device,
            dtype=w.dtype,
        )

    @torch.no_grad()
    def copy_from(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "TiledLinear":
        """Fills every tile from the untiled values (for tests and for tiling a materialised layer)."""
        for tile in self.tiles:
            tile.weight.copy_(param_info(tile.weight).tile_shard.local_from_full(weight))
            if tile.bias is not None:
                tile.bias.copy_(param_info(tile.bias).tile_shard.local_from_full(bias))
        return self


class TiledLMHead(nn.Module):
    """LMHead with its projection tiled; the same logits slicing and per-token loss."""

    def __init__(self, head: LMHead, in_splits: int, out_splits: int):
        super().__init__()
        self.vocab_size = head.vocab_size
        rows, cols = head.weight.shape
        self.linear = TiledLinear(
            cols, rows, False, in_splits, out_splits, device=head.weight.device, dtype=head.weight.dtype
        )

    def forward(self, x, labels=None):
        logits = self.linear(x)[..., : self.vocab_size]
        if labels is None:
            return logits
        losses = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
        return losses.view_as(labels)


def _tiled(name: str, module: nn.Module, in_splits: int, out_splits: int) -> nn.Module:
    if type(module) in (nn.Linear, Linear):
        tiled = TiledLinear.from_linear(module, in_splits, out_splits)
        bias_name = (param_info(module.bias).init_name or f"{name}.bias") if module.bias is not None else None
        tiled.mark_sources(param_info(module.weight).init_name or f"{name}.weight", bias_name)
        return tiled
    if type(module) is LMHead:
        if param_info(module.weight).shared_embedding:
            raise UsageError(
                f"cannot tile '{name}': its weight is the tied word embedding; add "
                f"--untie-embeddings-and-output-weights or leave it untiled"
            )
        tiled = TiledLMHead(module, in_splits, out_splits)
        tiled.linear.mark_sources(param_info(module.weight).init_name or f"{name}.weight", None)
        return tiled
    raise UsageError(
        f"cannot tile '{name}' ({type(module).__name__}): only plain nn.Linear layers and the "
        f"untied output head tile (tensor-parallel layers do not yet); name another module"
    )


def _is_tied_head(model: nn.Module, module: nn.Module) -> bool:
    embedding = getattr(model, "embedding", None)
    return type(module) is LMHead and embedding is not None and module.weight is embedding.word.weight


def tile_linears(model: nn.Module, names: list[str], in_splits: int, out_splits: int) -> list[str]:
    """Swaps the modules whose qualified names match any of `names` (fnmatch patterns, e.g.
    "output_head", "layers.*.mlp.fc1") for tiled ones, in place; returns the names swapped.

    Run it on the built model (meta device, after the TP swap and the pipeline split) before ZeRO
    materialises the parameters: ZeRO's init then fills each tile from its untiled parameter. A
    pattern matching nothing on this model (a pipeline stage without the head, say) is not an error;
    one matching nothing at all is for the caller to report (see `check_patterns_matched`).
    """
    matched = [
        (name, module)
        for name, module in model.named_modules()
        if name and any(fnmatch.fnmatchcase(name, pattern) for pattern in names)
    ]
    for name, module in matched:
        if _is_tied_head(model, module):
            raise UsageError(
                f"cannot tile '{name}': its weight is the tied word embedding; add "
                f"--untie-embeddings-and-output-weights or leave it untiled"
            )
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, _tiled(name, module, in_splits, out_splits))
    return [name for name, _ in matched]


def check_patterns_matched(names: list[str], swapped_per_chunk: list[list[str]]) -> None:
    """UsageError for a pattern that matched no module in any chunk (call it on every rank's union
    where stages differ)."""
    swapped = [name for chunk in swapped_per_chunk for name in chunk]
    for pattern in names:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in swapped):
            raise UsageError(
                f"tiling pattern '{pattern}' matches no module; use a module name such as "
                f"'output_head' or 'layers.*.mlp.fc1'"
            )
