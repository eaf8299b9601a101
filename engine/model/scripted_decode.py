"""The CPU pure-decode step as one TorchScript call, so that it runs without the GIL.

Why: with async scheduling the forward runs on the forward thread while the loop thread
schedules the next step in Python (engine/step_pipeline.py). An eager forward is ~10 torch
calls per layer, and torch releases the GIL only inside each call: between calls the forward
thread must take the GIL back, and waits while the loop thread holds it (up to a switch
interval, 5 ms by default, each time). TorchScript's interpreter runs a whole graph with the GIL
released (torch/csrc/jit/python/pybind_utils.h, runAndInsertCall), and DecodeGraph
(engine/model/decode_graph.py) keeps it from needing the GIL midway.

It covers what the decode pool and the colocated engine run in steady state: a pure-decode
batch of two or more sequences on CPU in float32, with plain or oneDNN-packed weights and an
unquantized cache. Where every row samples greedily with nothing changing its logits, the
placeholder fill, forward, logits and argmax are one call (ModelRunner's greedy step);
otherwise the forward is, and sampling runs as before. Everything else (prefill, quantized
weights or KV, one sequence, a KV sender's per-layer hook, CUDA) runs the eager forward.
SPLITSERVE_CPU_DECODE_FORWARD=eager turns it off (the benchmark's A/B switch).

The same scripted module also runs the prefill of one fresh prompt (engine/model/prefill_graph.py:
the first token's forward at low load); SPLITSERVE_CPU_PREFILL_FORWARD=eager turns that off.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from splitserve.engine.config import CPU_DECODE_FORWARD_ENV, CPU_PREFILL_FORWARD_ENV
from splitserve.engine.model.layers import DecoderLayer
from splitserve.engine.model.prefill_graph import PrefillGraph, prefill_graph_applies
from splitserve.engine.ops.onednn_packed_weight import OneDnnPackedWeight

logger = logging.getLogger(__name__)


# SPLITSERVE_CPU_DECODE_FORWARD=eager keeps the eager forward (the benchmark's A/B switch).
CPU_DECODE_FORWARDS = ("scripted", "eager")
# The scripted fresh-prompt prefill is on unless SPLITSERVE_CPU_PREFILL_FORWARD=eager. Its steps
# cost differently from the eager forward's, so the step cost profile keeps them on a line of
# their own (engine/step_cost_profile.py) and the local/remote prefill choice prices each path
# on the line of the forward it runs (cluster/routing/prefill_placement.py); warm_prefill keeps
# TorchScript's first, instrumented calls out of that line.
PREFILL_FORWARD_DEFAULT = "scripted"


def cpu_decode_forward(env: str = CPU_DECODE_FORWARD_ENV, default: str = "scripted") -> str:
    """The configured CPU decode forward (or, env CPU_PREFILL_FORWARD_ENV, the fresh prompt's
    prefill forward); ValueError naming the choices."""
    value = os.environ.get(env, default).strip().lower() or default
    if value not in CPU_DECODE_FORWARDS:
        raise ValueError(f"{env} must be one of {', '.join(CPU_DECODE_FORWARDS)}, got {value!r}")
    return value


def warm_prefill(graph: torch.jit.ScriptModule, num_layers: int) -> None:
    """Run the scripted prefill twice on a scratch cache. TorchScript's profiling executor runs
    a method's first call instrumented and optimizes it on the second: for the tiny test model's
    256-token prompt 46 and 18 ms against 1.4 ms after (the eager forward's first call: 6.6 ms).
    Unwarmed, a replica's first requests paid that in their first token, and the step cost
    profile read it as the replica's cost per token: 6x the eager prefill replica's, so the
    router sent an idle decode replica's 32-token tail remote (vs_vllm_bench.md, issue 41)."""
    block_size, num_tokens = 16, 20  # two blocks: a read-out over a block table like a prompt's
    shape = (2, block_size, graph.num_kv_heads, graph.head_dim)
    graph.key_caches = [torch.zeros(shape) for _ in range(num_layers)]
    graph.value_caches = [torch.zeros(shape) for _ in range(num_layers)]
    ids = torch.arange(num_tokens, dtype=torch.int64)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    graph.pinned = [ids, tables]
    with torch.inference_mode():  # as LlamaForCausalLM.forward runs it
        for _ in range(2):
            graph.prefill(ids, ids, ids, tables, True)
    graph.key_caches, graph.value_caches, graph.pinned = [], [], []


def decode_plan_applies(meta, kv_cache) -> bool:
    """A step the scripted forward runs: one new token for each of two or more sequences, over
    an unquantized float32 CPU cache (attention.make_decode_plan's condition)."""
    return (
        meta.is_pure_decode
        and meta.num_seqs >= 2
        and not kv_cache.quantized
        and kv_cache.dtype == torch.float32
        and kv_cache.device.type == "cpu"
    )


class ScriptedDecodeForward:
    """A model's DecodeGraph, scripted; build() returns None where the model's weights are not
    all plain float32 tensors or all oneDNN-packed, or TorchScript cannot compile it."""

    def __init__(self, graph: torch.jit.ScriptModule, num_layers: int, prefills: bool):
        """prefills: run a fresh prompt's prefill too (prefill_applies), where no layer is windowed."""
        self.graph = graph
        self.num_layers = num_layers
        self.prefills = prefills
        self._kv_cache = None  # the KVCache whose planes the graph holds

    @classmethod
    def build(cls, model) -> ScriptedDecodeForward | None:
        if model.dtype != torch.float32 or model.device.type != "cpu" or not model._layer_list:
            return None
        # The layers' matmul weights, and a mixture of experts' experts' (model._matmul_modules).
        weights = [getattr(m, n) for m in model._matmul_modules() for n in DecoderLayer.LINEAR_WEIGHTS if hasattr(m, n)]
        if all(isinstance(w, OneDnnPackedWeight) for w in weights):
            packed = True
        elif all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 and not w.is_meta for w in weights):
            packed = False
        else:
            return None
        head = model.lm_head
        if isinstance(head, OneDnnPackedWeight):
            lm_head, lm_head_packed = head.packed, True
        elif isinstance(head, torch.Tensor):
            lm_head, lm_head_packed = head.data, False
        else:
            return None
        try:
            with warnings.catch_warnings():
                # torch 2.10+ marks torch.jit deprecated for torch.compile / torch.export. Neither
                # gives a call that runs without the GIL and without a compile per process that
                # takes minutes on two cores; TorchScript does, and torch still ships it.
                warnings.simplefilter("ignore", DeprecationWarning)
                graph = torch.jit.script(PrefillGraph(model, packed, lm_head, lm_head_packed))
        except (RuntimeError, AttributeError, ValueError) as exc:  # a torch whose TorchScript cannot take it
            logger.warning("CPU decode steps run eagerly: TorchScript failed (%s)", exc)
            return None
        windowed = any(layer.window is not None for layer in model._layer_list)
        prefills = not windowed and cpu_decode_forward(CPU_PREFILL_FORWARD_ENV, PREFILL_FORWARD_DEFAULT) == "scripted"
        if prefills:
            warm_prefill(graph, len(model._layer_list))
        return cls(graph, len(model._layer_list), prefills)

    def __call__(self, input_ids, positions, kv_cache, meta) -> torch.Tensor:
        """LlamaForCausalLM.forward's final hidden states."""
        step = self._step_inputs(input_ids, positions, kv_cache, meta)
        return self.graph(*step, meta.max_context_len)

    def greedy_step(
        self, input_ids, positions, kv_cache, meta, fill_rows: torch.Tensor, fill_ids: torch.Tensor
    ) -> torch.Tensor:
        """Each row's argmax token (int64 [B]) for a step whose every row samples greedily with
        nothing changing its logits; fill_rows/fill_ids: the placeholder rows and their tokens."""
        step = self._step_inputs(input_ids, positions, kv_cache, meta, fill_rows, fill_ids)
        return self.graph.greedy_step(fill_rows, fill_ids, *step, meta.max_context_len)

    def prefill_applies(self, meta, kv_cache, output_rows: list[int] | None) -> bool:
        """A step prefill() runs: one fresh prompt reading out no row or its last one."""
        return self.prefills and prefill_graph_applies(meta, kv_cache, output_rows)

    def prefill(self, input_ids, positions, kv_cache, meta, output_rows: list[int] | None) -> torch.Tensor:
        """LlamaForCausalLM.forward(output_rows=...) for a step prefill_applies to."""
        self._step_inputs(input_ids, positions, kv_cache, meta)
        return self.graph.prefill(input_ids, positions, meta.slot_mapping, meta.block_tables, bool(output_rows))

    def _step_inputs(self, input_ids, positions, kv_cache, meta, *more: torch.Tensor) -> list[torch.Tensor]:
        if self._kv_cache is not kv_cache:
            self.graph.key_caches = [kv_cache.key_cache(i) for i in range(self.num_layers)]
            self.graph.value_caches = [kv_cache.value_cache(i) for i in range(self.num_layers)]
            self._kv_cache = kv_cache
        step = [input_ids, positions, meta.slot_mapping, meta.block_tables, meta.context_lens]
        self.graph.pinned = step + list(more)  # DecodeGraph's docstring: why
        return step
