"""Prompt forms and checks, shared by every entry point: the client (before it sends), the
scheduler (on Submit and after tokenizing) and the in-process engine, so a prompt is accepted or
refused the same way on every path. No torch: the client imports this."""

from __future__ import annotations

from typing import Any

import numpy as np

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.sampling_params import INT32_MAX

EMPTY_PROMPT = "the prompt is empty; send some text or token ids"
MAX_PROMPT_TEXT_BYTES = 8 << 20  # a text prompt (or a conversation's contents) is refused above this, untokenized


def check_text_size(total: int | str, what: str = "the prompt text") -> None:
    """Refuse text over MAX_PROMPT_TEXT_BYTES (UTF-8) before anyone tokenizes it."""
    if isinstance(total, str):
        if len(total) <= MAX_PROMPT_TEXT_BYTES // 4:  # cannot be over: at most 4 bytes a character
            return
        total = len(total.encode("utf-8", "surrogatepass"))
    if total > MAX_PROMPT_TEXT_BYTES:
        raise InvalidRequest(f"{what} is {total} bytes; the limit is {MAX_PROMPT_TEXT_BYTES} bytes "
                             f"({MAX_PROMPT_TEXT_BYTES >> 20} MiB): shorten it")


def split_prompt(prompt: Any, vocab_size: int | None = None) -> tuple[str | None, np.ndarray | None]:
    """The prompt forms every entry point takes: text, a list of token ids, or a dict with
    ``prompt_token_ids`` or ``prompt``. Returns (text, None) or (None, int32 ids); ids are
    checked against the vocabulary when it is known (the client does not know it)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequest(f"a dict prompt's 'prompt' must be text, got {type(prompt).__name__}")
        else:
            raise InvalidRequest("a dict prompt needs 'prompt_token_ids' (a list of token ids) or 'prompt' (text)")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest(EMPTY_PROMPT)
        check_text_size(prompt)
        return prompt, None
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        raise InvalidRequest(f"a prompt is text, a list of token ids or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
    hi = INT32_MAX + 1 if vocab_size is None else vocab_size
    if type(prompt) is list and prompt and set(map(type, prompt)) == _JUST_INT:
        # the common form (JSON, the clients), checked at C speed: a Python loop over the ids
        # was the largest single item in a profile of the gateway's request path (56 us for
        # 128 ids; this path ~20 us)
        if min(prompt) < 0 or max(prompt) >= hi:
            raise InvalidRequest(_id_range_error(hi, vocab_size))
        return None, np.array(prompt, dtype=np.int32)
    if isinstance(prompt, (list, tuple)) and any(isinstance(t, bool) or not isinstance(t, (int, np.integer))
                                                  for t in prompt):
        raise InvalidRequest("prompt token ids must be a non-empty flat list of integers")
    try:
        arr = np.asarray(prompt)
    except (ValueError, OverflowError):
        arr = np.asarray([], dtype=object)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise InvalidRequest("prompt token ids must be a non-empty flat list of integers")
    if int(arr.min()) < 0 or int(arr.max()) >= hi:
        raise InvalidRequest(_id_range_error(hi, vocab_size))
    return None, arr.astype(np.int32)


_JUST_INT = {int}


def _id_range_error(hi: int, vocab_size: int | None) -> str:
    return (f"prompt token ids must be integers in [0, {hi})"
            + (" (and below the model's vocab size)" if vocab_size is None else " for this model"))


def check_token_ids(ids: Any, vocab_size: int, what: str) -> None:
    a = np.asarray(ids)
    if a.size and (a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) >= vocab_size):
        raise InvalidRequest(f"{what} must be integers in [0, {vocab_size}) for this model")


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens == 0:
        raise InvalidRequest(EMPTY_PROMPT)
    if num_tokens >= max_model_len:
        raise InvalidRequest(
            f"the prompt has {num_tokens} tokens but this model serves at most {max_model_len} tokens in total "
            "(max_model_len, capped by the KV cache); shorten the prompt so at least one token can be generated")


def check_prompt_ids(ids: Any, vocab_size: int, max_model_len: int) -> None:
    """A tokenized prompt fits the model: non-empty, in its vocabulary, room to generate."""
    check_prompt_length(len(ids), max_model_len)
    check_token_ids(ids, vocab_size, "prompt token ids")
