"""Constrained decoding's state: grammars compiled by xgrammar, one matcher per constrained sequence.

Where it lives (the scheduler, as in vLLM v1) and why: the policy knows, when it builds a step,
which sequences sample in it and every token they have, so it fills each one's next-token
bitmask into the step (`Step.token_bitmask`, one int32 row of ceil(vocab/32) words) and advances
the matcher with the token the worker returns. A request that fails over to another group or is
preempted keeps its matcher with its tokens: nothing to replay, and workers stay stateless about
grammars. The cost is the bitmask's bytes (6 KiB per constrained row for a 49k vocabulary) and
the scheduler's CPU to fill it (xgrammar: ~5-40 us a row, benchmarks/grammar_backends.py).

Why xgrammar over llguidance (benchmarks/grammar_backends.py, SmolLM2's 49,152 tokens): mask and
advance per token 4.4 us vs 19.7 us median for a nested JSON schema (p99 40 vs 438 us), a
compiled-grammar cache built in (a schema seen before: 0.15 ms; llguidance re-creates its matcher
at ~1 ms each time), and it is vLLM's and SGLang's default backend, so its JSON Schema subset is
the one users of those servers already meet. llguidance compiles a cold schema faster (1.8 vs
19 ms); compilation runs in the scheduler's tokenizer pool (xgrammar releases the GIL), off the
loop, and once per distinct constraint.

JSON is generated compact (no free whitespace between tokens): with any-whitespace grammars a
model can emit whitespace until max_tokens, which random-weight and small models do.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.sampling_params import StructuredOutputsParams

CACHE_LIMIT_BYTES = 512 << 20  # compiled grammars kept per model (xgrammar evicts LRU past it)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _ebnf_choice(choices: list[str]) -> str:
    # each choice a JSON-escaped EBNF string literal (xgrammar's EBNF takes JSON string escapes)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; thread-safe, cached by constraint.

    The tokenizer's preparation (~0.4 s for a 49k vocabulary) happens on the first constraint,
    in whichever thread asks first (the scheduler's pool, never its loop)."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer  # called once, on the first constraint (it may still be loading)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # xgrammar reads a transformers tokenizer (it imports transformers itself)
                tok = self.tokenizer().to_transformers()
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar for `so`; InvalidRequest saying what is wrong with it."""
        c = self._get()
        kind = so.kind
        try:
            if kind in ("json", "json_object"):
                return c.compile_grammar(json_schema_ebnf(so.schema_text() if kind == "json" else '{"type": "object"}'))
            if kind == "regex":
                return c.compile_regex(so.regex)
            if kind == "choice":
                return c.compile_grammar(_ebnf_choice(so.choice))
            return c.compile_grammar(_gbnf_root(so.grammar))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its parser's words
            msg = str(e).strip().splitlines()
            detail = " ".join(msg[:3])[:600] if msg else type(e).__name__
            raise InvalidRequest(f"structured_outputs: the {kind} constraint does not compile: {detail}") from None


# xgrammar 0.2's rule for a string with minLength/maxLength lets raw control characters through
# (JSON requires them escaped: json.loads refuses such output); its unbounded strings exclude them
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n]'


@functools.lru_cache(maxsize=128)  # schemas up to MAX_CONSTRAINT_BYTES: bounded memory
def json_schema_ebnf(schema: str) -> str:
    """The schema's grammar (compact JSON, strict: no properties beyond the schema's unless it
    allows them), as EBNF; cached, and the compiler caches what it compiles from it."""
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)).replace(
        _LOOSE_CHARS, _JSON_CHARS)


def _gbnf_root(grammar: str) -> str:
    """llama.cpp's GBNF and vLLM's EBNF both start at `root`; a Lark-style `start:` is refused with a
    pointer (xgrammar reads `name ::= ...` rules)."""
    if "::=" not in grammar:
        raise InvalidRequest("structured_outputs: grammar must be EBNF/GBNF rules (`root ::= ...`), as llama.cpp "
                             "and vLLM take it")
    return grammar


class Constraint:
    """One sequence's matcher: the tokens it may take next, and whether its grammar has ended."""

    __slots__ = ("matcher", "terminated")

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        # memory per sequence: the grammar's parse state, which grows with the tokens taken, so at
        # most with max_model_len (xgrammar keeps it for rollback; we never roll back)
        self.matcher = xgr.GrammarMatcher(compiled)
        self.terminated = False

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (a worker's bug)."""
        ok = self.matcher.accept_token(token_id)
        self.terminated = self.matcher.is_terminated()
        return ok


def new_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.zeros((rows, bitmask_width(vocab_size)), np.int32)
