"""Checkpoints: sharded (one safetensors file per rank), atomic, exactly resumable, and loadable at
any other layout of the same model. See files.py for the layout on disk, saver.py and loader.py."""

from .agreement import SaveError
from .files import CheckpointError
from .loader import LoadResult, load_checkpoint
from .reader import CheckpointReader
from .full_checkpoint import write_full_checkpoint
from .saver import CheckpointSaver

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "CheckpointSaver",
    "LoadResult",
    "SaveError",
    "load_checkpoint",
    "write_full_checkpoint",
]
