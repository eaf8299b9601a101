"""The segmented LoRA delta's three layouts (engine/lora/lora_batch.py: PADDED, RUNS, SORTED):
each gives every token its own adapter's delta and base tokens none, and a mixed batch of
adapters and the base run through each one alone gives transformers + peft's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from splitserve.engine.lora import lora_batch
from splitserve.engine.lora.lora_batch import PADDED, RUNS, SORTED, LoraBatch
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.peft_adapters import FOUR_ADAPTERS, lora_engine, peft_greedy, write_base_and_adapters
from tests.helpers.transformers_checkpoint import SERVABLE_SHAPE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


ADAPTERS = FOUR_ADAPTERS
MAX_TOKENS = 6
NAMES: list[str | None] = [None, *ADAPTERS, "attn"]  # two requests share an adapter
PROMPTS = [[5 + (5 * i + 3 * j) % 400 for j in range(12 + 11 * i)] for i in range(len(NAMES))]
# (adapters, tokens per sequence, the layout the step takes): long runs of one adapter (prompt
# chunks) in place; short runs in about equal segments padded into one bmm per matmul (one
# adapter for all the tokens neither gathered nor scattered); unequal segments of short runs
# sorted by slot.
LAYOUTS = {
    "runs": (["attn", None, "qv", "all-rs", "all-rs", "mlp"], [300, 2, 1, 60, 40, 1], RUNS),
    "padded": ([None, "attn", "qv", None, "attn", "all-rs"], [2, 3, 1, 2, 1, 3], PADDED),
    "padded, one adapter in order": (["qv", "qv"], [4, 5], PADDED),
    "sorted": (["attn", None] * 150 + ["qv", "mlp"], [1] * 302, SORTED),
}
# Module settings that force one layout for every step.
FORCED = {
    RUNS: dict(LONG_RUN=0),
    PADDED: dict(LONG_RUN=10**9, SMALL_ROWS=10**9),
    SORTED: dict(LONG_RUN=10**9, SMALL_ROWS=0, PAD_SHARE=-1.0),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-layouts")
    return write_base_and_adapters(root, transformers.LlamaConfig(**SERVABLE_SHAPE), 7, ADAPTERS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("group", ["qkv", "gate_up"])
def test_each_mixed_token_gets_its_own_adapters_delta_and_base_tokens_none(checkpoint, layout, group):
    """The delta against each token's own adapter computed alone, target by target (the
    group's columns): base tokens get none, and nothing else of the output changes."""
    slots = lora_engine(checkpoint).runner.lora
    adapters, num_tokens, kind = LAYOUTS[layout]
    batch = LoraBatch.for_sequences(slots, adapters, num_tokens)
    assert batch is not None and batch.layout == kind
    assert batch.in_order == (layout == "padded, one adapter in order")
    x = torch.randn(sum(num_tokens), SERVABLE_SHAPE["hidden_size"])
    before = torch.randn(sum(num_tokens), sum(width for _, _, width in slots.columns[group]))
    out = before.clone()
    batch.add_delta(out, 1, group, x)
    token_adapters = [name for name, n in zip(adapters, num_tokens) for _ in range(n)]
    for t, name in enumerate(token_adapters):
        want = before[t].clone()
        for target, first, width in slots.columns[group]:
            if name is not None and target in slots.b:
                slot = slots.slot_of[name]
                a, b = slots.a[target][1, slot], slots.b[target][1, slot]
                want[first : first + width] += (b.T @ (a @ x[t])) * slots.scaling[slot]
        torch.testing.assert_close(out[t], want)


@pytest.mark.parametrize("layout", [RUNS, PADDED, SORTED])
def test_a_mixed_batch_in_each_layout_gives_transformers_peft_greedy_tokens(checkpoint, monkeypatch, layout):
    """Every step of a batch of four adapters, one of them twice, and the base (prompt chunks
    beside decodes) forced into one layout: each request gets transformers + peft's tokens."""
    for setting, value in FORCED[layout].items():
        monkeypatch.setattr(lora_batch, setting, value)
    taken: set[str] = set()
    build = LoraBatch.__init__

    def recording(self, *args):
        build(self, *args)
        taken.add(self.layout)

    monkeypatch.setattr(LoraBatch, "__init__", recording)
    base, adapters = checkpoint
    engine = lora_engine(checkpoint, max_num_batched_tokens=48)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, lora_adapter=n) for n in NAMES]
    outputs = engine.generate(PROMPTS, params)
    for name, prompt, out in zip(NAMES, PROMPTS, outputs):
        want = peft_greedy(base, None if name is None else adapters[name], prompt, MAX_TOKENS)
        assert out.token_ids == want, name
    assert taken == {layout}
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
