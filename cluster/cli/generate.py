"""`splitserve generate`: offline generation with the colocated engine."""

from __future__ import annotations

import argparse
import json
import sys
import typing

from splitserve.engine.config import DEFAULT_NUM_KV_BLOCKS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS
from splitserve.engine.speculative.speculative_config import SpeculativeConfig

SPECULATIVE_PREFIX = "speculative."


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    """`--speculative.<field>` for every SpeculativeConfig field, named, typed and described as
    `splitserve serve`'s (which derives them from ServeConfig.speculative)."""
    group = parser.add_argument_group("speculative decoding")
    for name, info in SpeculativeConfig.model_fields.items():
        annotation = info.annotation
        kwargs: dict = {"help": info.description, "default": argparse.SUPPRESS}
        if typing.get_origin(annotation) is typing.Literal:
            kwargs["choices"] = typing.get_args(annotation)
        elif annotation is int:
            kwargs.update(type=int, metavar="N")
        else:
            kwargs["metavar"] = "DIR"
        group.add_argument(
            f"--{SPECULATIVE_PREFIX}{name.replace('_', '-')}", dest=f"{SPECULATIVE_PREFIX}{name}", **kwargs
        )


def speculative_from_args(args: argparse.Namespace) -> dict:
    prefix = SPECULATIVE_PREFIX
    return {key.removeprefix(prefix): value for key, value in vars(args).items() if key.startswith(prefix)}


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text offline with the colocated engine",
        description="Generate from one or more prompts (several --prompt flags run as one batch).",
    )
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument(
        "--prompt-token-ids", action="append", help="comma-separated prompt token ids, e.g. 1,2,3 (repeat for a batch)"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: the checkpoint's")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="quantize the matmul weights at load (as `serve --quantization`)",
    )
    p.add_argument(
        "--num-kv-blocks", type=int, default=DEFAULT_NUM_KV_BLOCKS, help="KV-cache blocks (block-size tokens each)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV-cache storage: auto = the model dtype; fp8/int8 = 1 byte per value + a scale per token and head",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N ranks on this node (processes; gloo on CPU, NCCL on CUDA)",
    )
    add_speculative_flags(p)
    p.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt with token_ids (generated ids) and text"
    )
    p.set_defaults(func=run_generate)


def _parse_ids(raw: str) -> list[int]:
    try:
        return [int(x) for x in raw.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"--prompt-token-ids must be comma-separated integers, got {raw!r}") from None


def run_generate(args: argparse.Namespace) -> int:
    from splitserve.engine.config import ConfigError, EngineConfig
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model.loader import CheckpointError
    from splitserve.engine.parallel.tp_group import TensorParallelError
    from splitserve.proto.messages.invalid_request import InvalidRequestError
    from splitserve.proto.messages.sampling_params import SamplingParams

    try:
        prompts = args.prompt if args.prompt else [_parse_ids(r) for r in args.prompt_token_ids]
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                quantization=args.quantization,
                num_kv_blocks=args.num_kv_blocks,
                kv_cache_dtype=args.kv_cache_dtype,
                block_size=args.block_size,
                speculative=speculative_from_args(args),
                tensor_parallel_size=args.tensor_parallel_size,
            )
        )
        try:
            outputs = engine.generate(prompts, params)
        finally:
            engine.close()
    except (ValueError, ConfigError, CheckpointError, InvalidRequestError, OSError, TensorParallelError) as exc:
        print(f"splitserve generate: error: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        if args.json:
            print(json.dumps({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason}))
        else:
            print(out.text)
    return 0
