"""Parameters OpenAI or vLLM clients may send that splitserve does not implement, each with
the reason. A request that sets one to anything but its neutral value gets a 400 naming it,
never a 200 that silently ignores it. docs/FEATURES.md lists the same table."""

from __future__ import annotations

from typing import Any

# name -> (values that change nothing and are accepted, why the rest are refused)
UNSUPPORTED_PARAMETERS: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "insertion (fill-in-the-middle) is not implemented"),
    "min_p": ((None, 0, 0.0), "min-p sampling is not implemented; use top_p or top_k"),
    "typical_p": ((None, 1, 1.0), "typical sampling is not implemented"),
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1, 1.0), "only used by beam search, which is not implemented"),
    "allowed_token_ids": ((None, []), "not implemented; logit_bias can ban tokens"),
    "bad_words": ((None, []), "not implemented; logit_bias can ban single tokens"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated; a too-long prompt is a 400"),
    "skip_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "logits_processors": ((None, []), "custom logits processors cannot be sent to the server"),
    "functions": ((None, []), "the legacy functions API is not implemented; use tools"),
    "function_call": ((None, "none"), "the legacy functions API is not implemented; use tool_choice"),
    "audio": ((None,), "audio output is not implemented"),
    "modalities": ((None, ["text"]), "only text output is implemented"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "chat_template": ((None,), "the model's own chat template is always used"),
    "chat_template_kwargs": ((None, {}), "the model's own chat template is always used"),
    "add_generation_prompt": ((None, True), "the assistant turn is always opened"),
    "continue_final_message": ((None, False), "the assistant turn is always opened"),
}


def refused_parameter(raw: dict[str, Any]) -> tuple[str, str] | None:
    """The first unsupported parameter raw sets to a non-neutral value: (name, message)."""
    for name, (neutral, reason) in UNSUPPORTED_PARAMETERS.items():
        if name in raw and not any(raw[name] == value and type(raw[name]) is type(value) for value in neutral):
            return name, f"{name} is not supported: {reason}"
    return None
