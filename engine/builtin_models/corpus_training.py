"""Train a make-model checkpoint briefly on the built-in corpus (CPU, transformers' model, AdamW).

The weights start from make-model's random init, are loaded into the transformers class the
checkpoint's `architectures` names (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM),
trained with a causal-LM loss on `CorpusBatches`, and come back under the same HF names, so the
trained checkpoint is written exactly like a random one and both loaders read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.engine.builtin_models.corpus_batches import IGNORE_INDEX, CorpusBatches


@dataclass(frozen=True)
class TrainingRecipe:
    """Hyper-parameters; all of them are part of a trained checkpoint's cache key."""

    batch_size: int = 8
    seq_len: int = 128
    peak_lr: float = 5e-3
    warmup_fraction: float = 0.1  # linear warm-up, then cosine decay to 0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    max_grad_norm: float = 1.0
    copy_fraction: float = 0.25  # rows that teach copying (see CorpusBatches)
    max_span_tokens: int = 32


@dataclass
class TrainingResult:
    """What a run did: the loss of every step and what it cost (written as training.json)."""

    steps: int
    recipe: TrainingRecipe
    num_threads: int
    losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time: on a shared machine wall time mostly measures the neighbours

    @property
    def tokens_seen(self) -> int:
        return self.steps * self.recipe.batch_size * self.recipe.seq_len


def train_on_corpus(
    checkpoint_dir: str | Path,
    weights: dict,
    tokenizer,
    steps: int,
    seed: int,
    recipe: TrainingRecipe | None = None,
    num_threads: int = 1,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[dict, TrainingResult]:
    """Train `weights` (HF names, float32) for `steps` AdamW steps; return new weights + result.

    checkpoint_dir must already hold config.json (the architecture to build). One intra-op
    thread by default: these shapes gain little from more, and on a shared 2-core machine
    OpenMP barriers make multi-threaded steps several times slower.
    """
    import torch
    import transformers

    recipe = recipe or TrainingRecipe()
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        model = _load_hf_model(Path(checkpoint_dir), weights)
        batches = CorpusBatches(
            tokenizer,
            recipe.seq_len,
            seed,
            copy_fraction=recipe.copy_fraction,
            max_span_tokens=recipe.max_span_tokens,
        )
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=recipe.peak_lr,
            betas=(recipe.adam_beta1, recipe.adam_beta2),
            weight_decay=recipe.weight_decay,
        )
        warmup = max(1, round(recipe.warmup_fraction * steps))
        schedule = transformers.get_cosine_schedule_with_warmup(optimizer, warmup, steps)
        result = TrainingResult(steps=steps, recipe=recipe, num_threads=num_threads)
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        model.train()
        for step in range(steps):
            inputs, labels = batches.sample(recipe.batch_size)
            logits = model(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            result.losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(step, result.losses[-1])
        result.wall_s = time.perf_counter() - start_wall
        result.cpu_s = time.process_time() - start_cpu
        state = model.state_dict()
        trained = {name: state[name].detach().to(weights[name].dtype).contiguous().clone() for name in weights}
    finally:
        torch.set_num_threads(previous_threads)
    return trained, result


def _load_hf_model(checkpoint_dir: Path, weights: dict):
    import transformers

    config = transformers.AutoConfig.from_pretrained(checkpoint_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # A tied output projection is the embedding itself, so it has no weight of its own.
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    return model.float()
