"""One step's LoRA: which tokens have which adapter slot, and the per-token delta it adds to a
projection's output in a batch that mixes adapters and the base model.

The delta is a segmented gather matmul (punica's SGMV, in torch): a segment is rows of one
slot, and goes through its own slot's A and B only, rank r per token whatever the number of
adapters in the step. Per projection group (engine/lora/lora_slots.py) one shrink covers the
group's targets (q, k and v side by side), and each target's expand adds to its own columns of
the group's output. Never a forward per adapter, and the base weights are never merged, so the
base tokens of the batch compute exactly what they would alone.

The segments are laid out once per step (every layer and group reuses the layout), one of:
- RUNS: each run of consecutive tokens of one adapter (a prompt chunk) a segment in place: a
  matmul reads the run's rows of the input and adds to its rows of the output, with no gather,
  scatter or delta buffer. For long runs (a prefill of 16 prompts of 128 tokens over 8
  adapters: 0.6x PADDED's time, on the benchmark's model).
- PADDED: the adapter tokens sorted by slot, each slot's padded to the longest (padding rows
  have scaling 0), the shrink and each expand one bmm over the slots; the tokens gathered into
  that order and their deltas scattered back. For short runs in about equal segments (a decode
  batch), where a call per segment would cost more than its arithmetic.
- SORTED: the adapter tokens sorted by slot as PADDED, without padding, a matmul per slot; for
  unequal segments of short runs (one adapter in most of a decode batch).

Before this, one GEMM over the step's slots' A and B side by side, each token masked to its own
slot: arithmetic grew with the adapters in a step (8 slots: 8x the rank), 0.72x the base
alone's throughput at 8 adapters (bench/results/multi_lora.md).

On CUDA, where triton imports, a step of up to KERNEL_MAX_TOKENS tokens runs
engine/ops/triton_lora.py's kernels instead (KERNEL): a shrink and an expand per target over every
token at once, each token indexing its own slot, whatever the layout would have been. Longer
steps and CPU keep the torch layouts: bench/gpu_check/gpu_check.py check 13 on an H200 (8 slots of
rank 16, a Llama-3-8B-like layer) measured the kernels 1.06-1.17x the torch layouts at 1 and 64
tokens, 0.76-0.95x at 256 and 0.44-0.49x on an 8 x 256-token prefill."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from splitserve.engine.lora.lora_slots import NO_ADAPTER, LoraSlots

PADDED, RUNS, SORTED, KERNEL = "padded", "runs", "sorted", "kernel"
# triton is an optional extra, imported on the first CUDA batch: CPU-only processes never pay for it.
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Padding the slots' segments to the longest is allowed up to this share of extra rows, or any
# padding while the padded rows stay this few (a call per segment then costs more than them).
PAD_SHARE, SMALL_ROWS = 0.25, 256
# Runs this long on average are matmuls in place; shorter ones would be too many calls.
LONG_RUN = 32
KERNEL_MAX_TOKENS = 128  # between the measured 64 (the kernels win) and 256 (they lose)


class LoraBatch:
    """seq_slots[i]: the slot of sequence i's adapter (None: the base), num_tokens[i] its
    tokens in the step, laid out one sequence after the other."""

    def __init__(
        self,
        slots: LoraSlots,
        seq_slots: Sequence[int | None],
        num_tokens: Sequence[int],
        use_kernel: bool | None = None,
    ):
        """use_kernel: the Triton kernels (None: where the slots are on CUDA, triton imports and
        the step has at most KERNEL_MAX_TOKENS tokens; True on CPU tensors runs them only under
        TRITON_INTERPRET=1, as the tests do)."""
        self.slots = slots
        if use_kernel is None:
            use_kernel = slots.device.type == "cuda" and HAS_TRITON and sum(num_tokens) <= KERNEL_MAX_TOKENS
        self.kernel = None
        if use_kernel:
            from splitserve.engine.ops import triton_lora

            self.kernel = triton_lora
            per_token = [
                NO_ADAPTER if slot is None else slot for slot, n in zip(seq_slots, num_tokens) for _ in range(n)
            ]
            self.token_slots = torch.tensor(per_token, dtype=torch.int32, device=slots.device)
        rows_of: dict[int, list[int]] = {}
        runs: list[tuple[int, int, int]] = []  # (first row, rows, slot) in step order
        start = 0
        for slot, n in zip(seq_slots, num_tokens):
            if slot is not None and n:
                rows_of.setdefault(slot, []).extend(range(start, start + n))
                if runs and runs[-1][2] == slot and sum(runs[-1][:2]) == start:
                    runs[-1] = (runs[-1][0], runs[-1][1] + n, slot)
                else:
                    runs.append((start, n, slot))
            start += n
        used = sorted(rows_of)
        rows = sum(len(rows_of[slot]) for slot in used)
        self.longest = max((len(rows_of[slot]) for slot in used), default=0)
        if rows >= LONG_RUN * len(runs):
            self.layout = RUNS
        elif len(used) * self.longest <= max(rows * (1 + PAD_SHARE), SMALL_ROWS):
            self.layout = PADDED
        else:
            self.layout = SORTED
        order: list[int] = []
        scaling: list[float] = []
        self.segments: list[tuple[int, int, int]] = runs  # RUNS: rows of the step
        if self.layout != RUNS:  # the segments are rows of the tokens sorted by slot
            self.segments = []
            for slot in used:
                pad = self.longest - len(rows_of[slot]) if self.layout == PADDED else 0
                self.segments.append((len(order), len(rows_of[slot]), slot))
                # A padding row repeats one of the segment's rows, with scaling 0: it adds exact zeros.
                order += rows_of[slot] + rows_of[slot][:1] * pad
                scaling += [slots.slot_scaling[slot]] * len(rows_of[slot]) + [0.0] * pad
        device = slots.device
        # PADDED with one adapter for all the tokens, in step order: no gather and no scatter.
        self.in_order = order == list(range(start))
        self.order = torch.tensor(order, dtype=torch.int64, device=device)
        self.scaling = torch.tensor(scaling, dtype=slots.dtype, device=device).unsqueeze(1)
        self.used = torch.tensor(used, dtype=torch.int64, device=device)
        self.every_slot = used == list(range(slots.max_loras))  # PADDED: the stacks as they are
        if self.kernel is not None:
            self.layout = KERNEL

    @classmethod
    def for_sequences(
        cls, slots: LoraSlots, adapters: Sequence[str | None], num_tokens: Sequence[int]
    ) -> LoraBatch | None:
        """The batch of sequences with these adapters (None: the base) and new-token counts;
        None when no sequence has an adapter, so a base-only step runs as without LoRA."""
        if all(name is None for name in adapters):
            return None
        seq_slots = [None if name is None else slots.slot_of[name] for name in adapters]
        return cls(slots, seq_slots, num_tokens)

    def add_delta(self, out: torch.Tensor, layer: int, group: str, x: torch.Tensor) -> None:
        """out += each adapter token's scaling * lora_B(lora_A(x)) for the group's targets
        (LoraSlots.columns: their outputs side by side are out's columns), in place."""
        if group not in self.slots.a_t or not self.segments:  # no adapter targets the group, or no token
            return
        if self.kernel is not None:
            self._kernel_delta(out, layer, group, x)
            return
        if self.layout == RUNS:
            self._per_segment(x, out, layer, group)
            return
        inputs = x if self.in_order else x.index_select(0, self.order)
        if self.layout == PADDED:
            delta = self._padded(inputs, layer, group, out.shape[1])
        else:
            delta = torch.zeros(inputs.shape[0], out.shape[1], dtype=out.dtype, device=out.device)
            self._per_segment(inputs, delta, layer, group)
        if self.in_order:
            out.add_(delta)
        else:
            out.index_add_(0, self.order, delta)

    def _kernel_delta(self, out: torch.Tensor, layer: int, group: str, x: torch.Tensor) -> None:
        """The Triton shrink over the group's targets, then each target's expand into its columns."""
        assert self.kernel is not None
        rank = self.slots.max_rank
        shrunk = self.kernel.lora_shrink(x, self.slots.a_t[group][layer], self.token_slots)
        for i, (target, first, cols) in enumerate(self.slots.columns[group]):
            if target in self.slots.b:
                self.kernel.lora_expand(
                    shrunk[:, i * rank : (i + 1) * rank],
                    self.slots.b[target][layer],
                    self.token_slots,
                    self.slots.scaling,
                    out[:, first : first + cols],
                )

    def _padded(self, inputs: torch.Tensor, layer: int, group: str, width: int) -> torch.Tensor:
        """The delta of the padded rows [slots used * longest, width], by bmm over the slots."""
        count, longest, rank = self.used.shape[0], self.longest, self.slots.max_rank
        a_t = self.slots.a_t[group][layer]  # [slots, in, targets * rank]
        if not self.every_slot:
            a_t = a_t.index_select(0, self.used)
        shrunk = torch.bmm(inputs.view(count, longest, -1), a_t)
        shrunk.view(count * longest, -1).mul_(self.scaling)  # scaled here: rank columns, not width
        delta = torch.empty(count, longest, width, dtype=inputs.dtype, device=inputs.device)
        for i, (target, first, cols) in enumerate(self.slots.columns[group]):
            columns = delta[:, :, first : first + cols]
            if target not in self.slots.b:  # no adapter targets it: a zero delta
                columns.zero_()
                continue
            b = self.slots.b[target][layer]  # [slots, rank, out]
            b = b if self.every_slot else b.index_select(0, self.used)
            torch.bmm(shrunk[:, :, i * rank : (i + 1) * rank], b, out=columns)
        return delta.view(count * longest, width)

    def _per_segment(self, inputs: torch.Tensor, out: torch.Tensor, layer: int, group: str) -> None:
        """out[rows] += the delta of inputs[rows], a matmul per segment (rows, slot)."""
        rank, a_t = self.slots.max_rank, self.slots.a_t[group][layer]
        shrunk = torch.empty(inputs.shape[0], a_t.shape[2], dtype=inputs.dtype, device=inputs.device)
        for first, n, slot in self.segments:
            torch.mm(inputs[first : first + n], a_t[slot], out=shrunk[first : first + n])
        for i, (target, column, cols) in enumerate(self.slots.columns[group]):
            if target not in self.slots.b:
                continue
            b = self.slots.b[target][layer]
            for first, n, slot in self.segments:
                rows = slice(first, first + n)
                out[rows, column : column + cols].addmm_(
                    shrunk[rows, i * rank : (i + 1) * rank], b[slot], alpha=self.slots.slot_scaling[slot]
                )
