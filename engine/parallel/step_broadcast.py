"""How the driver hands each forward pass to the other ranks: a small header over each rank's
pipe (the command, the sizes and the metadata's Python lists), then the step's token ids,
positions, slots and block tables as one int64 tensor broadcast on the group (on the device:
NCCL moves it GPU to GPU). The rank waits on its pipe with no timeout -- an idle engine sends
nothing -- and every collective after the header is bounded by the group's timeout.

Rank 0 runs the one scheduler, prefix cache and sampler; the others run no scheduler at all,
only the forward of the batch they are sent (the issue's "rank 0 decides, the others follow").
A sampled token reaches them as an input id of the next step's batch, so every rank's KV cache
gets the same token without a broadcast of its own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.parallel.tp_group import TensorParallelGroup

FORWARD = "forward"  # run the model on the broadcast batch (writes its KV), maybe its logits too
LOGITS = "logits"  # compute this rank's vocabulary rows' logits for the broadcast hidden rows
STOP = "stop"  # leave the loop and exit
COMMAND = "command"  # hand the payload to the rank's FollowerExtension (follower_extension.py)
HOST_KV = "host_kv"  # copy blocks between the rank's device KV cache and its host KV tier


class ForwardHeader(NamedTuple):
    kind: str
    num_tokens: int
    table_width: int
    query_start_loc: list[int]
    context_lens: list[int]
    max_query_len: int
    rank_work: Any = None  # the extension's work for this forward (follower_extension.py)
    # The output rows whose logits the rank computes and gathers right after this forward (the
    # driver's next compute_logits: tp_model.py); None: a LOGITS command will say.
    logits_rows: list[int] | None = None


class LogitsHeader(NamedTuple):
    kind: str
    num_rows: int


class CommandHeader(NamedTuple):
    kind: str
    payload: Any


class HostCopyHeader(NamedTuple):
    """The host KV tier's copy on every rank (its own KV heads): "save" device blocks to host
    slots, or "load" host slots into device blocks; the driver's scheduler picked both lists."""

    kind: str
    op: str
    host_slots: list[int]
    device_blocks: list[int]


def forward_header(
    input_ids: torch.Tensor, meta: AttentionMetadata, rank_work: Any = None, logits_rows: list[int] | None = None
) -> ForwardHeader:
    return ForwardHeader(
        FORWARD,
        int(input_ids.shape[0]),
        int(meta.block_tables.shape[1]),
        list(meta.query_start_loc_cpu),
        list(meta.context_lens_cpu),
        meta.max_query_len,
        rank_work,
        list(logits_rows) if logits_rows else None,
    )


def broadcast_forward(
    group: TensorParallelGroup, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> None:
    """The driver's side, after the header went out: the batch's tensors to every rank."""
    payload = torch.cat(
        [input_ids, positions, meta.slot_mapping, meta.block_tables.reshape(-1).to(torch.int64)]
    ).contiguous()
    group.broadcast(payload)


def receive_forward(
    group: TensorParallelGroup, header: ForwardHeader
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A follower's side: the batch the driver broadcast, as input ids, positions and metadata."""
    n, num_seqs = header.num_tokens, len(header.context_lens)
    payload = torch.empty(3 * n + num_seqs * header.table_width, dtype=torch.int64, device=group.device)
    group.broadcast(payload)
    input_ids, positions, slots, tables = payload.split([n, n, n, num_seqs * header.table_width])
    device = group.device
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor(header.query_start_loc, dtype=torch.int32, device=device),
        context_lens=torch.tensor(header.context_lens, dtype=torch.int32, device=device),
        block_tables=tables.view(num_seqs, header.table_width).to(torch.int32),
        query_start_loc_cpu=header.query_start_loc,
        context_lens_cpu=header.context_lens,
        max_query_len=header.max_query_len,
        max_context_len=max(header.context_lens),
    )
    return input_ids, positions, meta


def receive_hidden(group: TensorParallelGroup, header: LogitsHeader, hidden_size: int, dtype: torch.dtype):
    """A follower's copy of the hidden rows the driver computes logits for."""
    hidden = torch.empty(header.num_rows, hidden_size, dtype=dtype, device=group.device)
    return group.broadcast(hidden)
