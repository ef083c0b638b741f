"""Result types returned by LLM.generate and the Client (vLLM's names)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_entries(ids_rows, lp_rows, ranks, k: int | None = None,
                    decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """vLLM-style logprobs from the raw rows: column 0 is the sampled token (with its rank),
    columns 1..k the top-k with rank j (all columns when k is None); `decode` names the tokens."""
    out = []
    ranks = ranks.tolist() if hasattr(ranks, "tolist") else list(ranks)
    for row_ids, row_lps, rank in zip(ids_rows.tolist(), lp_rows.tolist(), ranks):
        top = len(row_ids) - 1 if k is None else k
        entry = {row_ids[0]: Logprob(row_lps[0], rank, decode(row_ids[0]) if decode else None)}
        for j in range(1, top + 1):
            if row_ids[j] not in entry:
                entry[row_ids[j]] = Logprob(row_lps[j], j, decode(row_ids[j]) if decode else None)
        out.append(entry)
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # chat with tools: the calls parsed from `text` (OpenAI's shape: {"id", "type": "function",
    # "function": {"name", "arguments" (JSON text)}}) and the text outside them (None: only calls);
    # both None when the request had no tools
    tool_calls: list[dict] | None = None
    content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # seconds from the scheduler's receipt of the request to its first token leaving the
    # scheduler (None from engines without one, e.g. the offline LLM)
    first_token_latency: float | None = None
    # an embedding request: the pooled final hidden state as computed (not normalised; embed()
    # hands out EmbeddingOutput instead)
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (what ``embed()`` returns): L2-normalised unless asked otherwise."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


def item_logprobs(item, decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """The logprobs of one scheduler `Output` item, one dict per token; an item that carries no
    arrays gets empty dicts, so the list stays one entry per token."""
    if item.logprobs is None:
        return [{} for _ in range(len(item.token_ids))]
    ranks = item.ranks if item.ranks is not None else [None] * len(item.token_ids)
    return logprob_entries(item.logprob_token_ids, item.logprobs, ranks, decode=decode)


def completion_from_items(index: int, items: list, finish_reason: str | None, stop_reason: int | str | None,
                          want_logprobs: bool, decode: Callable[[int], str] | None = None) -> CompletionOutput:
    """Completion `index` of a request from its scheduler `Output` items (token-id and text
    deltas, in order): how the client and the in-process LLM both put a result together."""
    if not items:
        toks: list[int] = []
    elif len(items) == 1:
        toks = items[0].token_ids
    else:
        toks = [t for it in items for t in it.token_ids]
    lps = None
    if want_logprobs:
        lps = []
        for it in items:
            lps.extend(item_logprobs(it, decode))
    return CompletionOutput(index, "".join([it.text for it in items]), toks, finish_reason, lps, stop_reason)


def embedding_from_items(items: list) -> list[float] | None:
    """An embedding request's vector (as computed) from its scheduler `Output` items; None for a
    generation's."""
    return next((it.embedding.tolist() for it in items if it.embedding is not None), None)
