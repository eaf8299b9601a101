"""What loading a LoRA adapter costs a replica, in the router's unit (prefill tokens): the
figures behind RouterConfig.adapter_load_tokens and adapter_host_load_tokens.

On one engine and an adapter in peft's files (rank 16, every target module): the seconds to read an
adapter from its checkpoint (load_peft_adapter: disk -> host), to copy it into a device slot
(LoraSlots.load: host -> device), and to prefill one prompt token (a 512-token prompt, no
prefix hit); each load's seconds over the seconds per token is its cost in tokens.

  .venv/bin/python -m bench.engine.lora_load_cost [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from splitserve.engine.builtin_models.corpus_tokenizer import train_tokenizer, write_tokenizer
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.lora.lora_slots import LoraSlots
from splitserve.engine.lora.peft_checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter, target_shape
from splitserve.proto.messages.sampling_params import SamplingParams

# A small but not toy Llama shape, with the corpus tokenizer's 512 tokens.
SHAPE = dict(
    vocab_size=512,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16
PROMPT_TOKENS = 512


def write_base(out: Path) -> None:
    """transformers' random Llama for SHAPE (the `train` extra), with the corpus tokenizer."""
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHAPE)).save_pretrained(out)
    write_tokenizer(train_tokenizer(SHAPE["vocab_size"]), out, SHAPE["max_position_embeddings"])


def write_adapter(engine: LLMEngine, out: Path) -> None:
    """A random adapter in peft's files and key names, for the engine's model."""
    out.mkdir()
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": TARGETS, "bias": "none"}
    (out / CONFIG_FILE).write_text(json.dumps(config))
    tensors = {}
    for layer in range(engine.model_config.num_hidden_layers):
        for target in TARGETS:
            out_dim, in_dim = target_shape(engine.model_config, target)
            key = f"base_model.model.model.layers.{layer}.{'mlp' if target in TARGETS[4:] else 'self_attn'}.{target}"
            tensors[f"{key}.lora_A.weight"] = 0.01 * torch.randn(RANK, in_dim)
            tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(out_dim, RANK)
    save_file(tensors, str(out / WEIGHTS_FILE))


def measure(work: Path, repeats: int) -> dict[str, float]:
    base = work / "base"
    write_base(base)
    engine = LLMEngine(EngineConfig(model=str(base), num_kv_blocks=256, enable_lora=True, max_lora_rank=RANK))
    adapter_dir = work / "adapter"
    write_adapter(engine, adapter_dir)
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
