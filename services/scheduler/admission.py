"""Admission checks and seeds, shared by the in-process engine and the scheduler process."""

from __future__ import annotations

from common.errors import InvalidRequest
from common.sampling_params import SamplingParams


def child_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request: a fixed mix, so n > 1 samples differ but repeat."""
    if index == 0:
        return seed
    x = (seed ^ (index * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def validate_prompt(prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """Accept a string, a list of token ids or {"prompt_token_ids": [...]}; return (text, ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            return validate_prompt(prompt["prompt"], tokenizer, vocab_size)
        else:
            raise InvalidRequest("a dict prompt needs 'prompt_token_ids' (a list of token ids) or 'prompt' (text)")
    elif isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("the prompt is empty; send some text or token ids")
        return prompt, tokenizer.encode(prompt)
    else:
        ids = prompt
    if not isinstance(ids, (list, tuple)) or not ids:
        raise InvalidRequest("prompt token ids must be a non-empty list of integers")
    check_token_ids(ids, vocab_size, "prompt token ids")
    return None, list(ids)


def check_token_ids(ids, vocab_size: int, what: str) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"{what} must be integers in [0, {vocab_size}) for this model")


def check_params_for_model(params: SamplingParams, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: ids must exist in this model's vocabulary."""
    if params.stop_token_ids:
        check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
