"""Freeing a tensor's memory while keeping the tensor object, and giving the memory back.

Stage 3 releases gathered parameters and offload empties device buffers this way, so views that
autograd saved (or that a storage handed out) stay valid and see the memory again once it returns.
"""

from __future__ import annotations

import torch

from megazero.core.kernels import resize_storage


def drop_storage(t: torch.Tensor) -> None:
    """Frees a tensor's memory but keeps the tensor (and views of it) for `ensure_storage`."""
    resize_storage(t.untyped_storage(), 0)


def ensure_storage(t: torch.Tensor) -> None:
    """Gives a tensor emptied by `drop_storage` its memory back, zero-filled."""
    if t.untyped_storage().nbytes() == 0 and t.numel() > 0:
        resize_storage(t.untyped_storage(), t.numel() * t.element_size())
        t.zero_()
