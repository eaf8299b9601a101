"""What loading a LoRA adapter costs a replica, in the router's unit (prefill tokens): the
figures behind RouterConfig.adapter_load_tokens and adapter_host_load_tokens.

On one engine serving a peft adapter (rank 16, every target module): the seconds to read an
adapter from its checkpoint (load_peft_adapter: disk -> host), to copy it into a device slot
(LoraSlots.load: host -> device), and to prefill one prompt token (a 512-token prompt, no
prefix hit); each load's seconds over the seconds per token is its cost in tokens.

  .venv/bin/python -m bench.engine.lora_load_cost [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.lora.lora_slots import LoraSlots
from splitserve.engine.lora.peft_checkpoint import load_peft_adapter
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.peft_adapters import write_peft_adapter
from tests.helpers.transformers_checkpoint import SERVABLE_SHAPE, write_transformers_checkpoint

# The served test shape widened and deepened to a small but not toy model.
SHAPE = {**SERVABLE_SHAPE, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8}
SHAPE.update(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16
PROMPT_TOKENS = 512


def measure(work: Path, repeats: int) -> dict[str, float]:
    base = work / "base"
    write_transformers_checkpoint(transformers.LlamaConfig(**SHAPE), base, seed=0, tokenizer=True)
    adapter_dir = write_peft_adapter(base, work / "adapter", 1, RANK, 2 * RANK, TARGETS)
    engine = LLMEngine(
        EngineConfig(
            model=str(base),
            num_kv_blocks=256,
            enable_lora=True,
            lora_modules={"a": str(adapter_dir)},
            max_lora_rank=RANK,
        )
    )
    config, dtype, device = engine.model_config, engine.model.dtype, engine.model.device
    disk, copy, prefill = [], [], []
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(repeats + 1):  # the first round warms up
        started = time.perf_counter()
        adapter = load_peft_adapter(f"r{i}", adapter_dir, config, RANK)
        read = time.perf_counter()
        LoraSlots(config, 1, RANK, dtype, device).load(adapter)
        copied = time.perf_counter()
        prompt = [(7 * i + 13 * j) % 500 + 5 for j in range(PROMPT_TOKENS)]  # no prefix hit
        engine.generate([prompt], params)
        done = time.perf_counter()
        if i:
            disk.append(read - started)
            copy.append(copied - read)
            prefill.append((done - copied) / PROMPT_TOKENS)
    # The slot copy includes allocating the slots' stacks (a fresh LoraSlots): an upper bound.
    per_token = statistics.median(prefill)
    disk_s, copy_s = statistics.median(disk), statistics.median(copy)
    return {
        "disk_load_s": disk_s,
        "slot_copy_s": copy_s,
        "prefill_s_per_token": per_token,
        "adapter_load_tokens": (disk_s + copy_s) / per_token,
        "adapter_host_load_tokens": copy_s / per_token,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        for name, value in measure(Path(work), args.repeats).items():
            print(f"{name}: {value:.6g}")


if __name__ == "__main__":
    main()
