"""How torch's ProcessGroupNCCL keeps a collective's tensors alive and orders the streams around it,
by torch version: the model megazero.core.stream_check (the CPU stream sanitizer) and the dry run's
trace check collectives against. Owns only the choice and its words; checks nothing itself.

- torch >= 2.8 (pytorch PR #148590, relanded as #150398; the GPU image's 2.11): an asynchronous
  collective or batched p2p runs on its communicator's modelled stream after the work queued on the
  issuing stream; no stream is recorded on its tensors: the comm layer's Handle holds them ("the
  stash") until its wait, which orders only the waiting stream after the op (the event recorded on
  the communicator's stream). A synchronous collective runs on the current stream itself.
- before 2.8: every collective ran on the communicator's stream with its tensors record_stream'ed
  there, a synchronous one waited for by the current stream.
"""

from __future__ import annotations

import torch

STASH, RECORD_STREAM = "stash", "record_stream"  # how NCCL keeps collective tensors alive (nccl_semantics)


def nccl_semantics(version: str | None = None) -> str:
    """How torch's ProcessGroupNCCL orders a collective's tensors, for torch `version` (default: this
    one's). STASH from 2.8 on: pytorch PR #148590 (relanded as #150398) removed every record_stream; an
    async op holds its tensors on the host until work.wait(), the wait orders only the waiting stream
    after NCCL's work, and a sync op runs on the current stream (TORCH_NCCL_AVOID_RECORD_STREAMS is
    ignored, and was removed by PR #194701). RECORD_STREAM before: every tensor was recorded on
    NCCL's stream, where sync ops ran too, joined back to the current stream."""
    release = torch.torch_version.TorchVersion(version if version is not None else torch.__version__)
    return STASH if release >= (2, 8) else RECORD_STREAM


def describe_semantics(semantics: str) -> str:
    return (
        "NCCL as torch >= 2.8: async ops' tensors stashed until wait"
        if semantics == STASH
        else "NCCL as torch < 2.8: tensors recorded on its stream"
    )
