"""The client host of tests/test_multihost.py: runs inside its namespace, talks to the test by files.

    python -m tests.netns_client SPEC.json

SPEC: {"address", "curve_keys", "out", "mode", ...}. Modes:
* ready: wait until `groups` groups are ready (and the detokenizer), write the stats;
* generate: greedy-generate `prompts` (token id lists) at once, write {"tokens": [...]};
* partition: create the file `armed`, wait for the file `go` (the test has just cut group
  `watch`'s host off: the scheduler, which has not noticed yet, routes some requests there),
  generate as above, then wait until `watch` is ready again (the test heals the link after the
  requests finished), writing {"tokens", "ready", "requeued"}.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zeroserve import Client, SamplingParams


def _wait(c: Client, until, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s = c.stats()
            if until(s):
                return s
        except Exception:  # the scheduler is not up yet, or a call timed out: ask again
            pass
        time.sleep(0.1)
    raise TimeoutError(f"not there in {timeout}s")


def _generate(spec: dict, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    with Client(spec["address"], curve_keys=spec["curve_keys"], timeout_s=30.0) as c, \
            ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: c.generate(p, params), prompts))
    return [list(map(int, o.outputs[0].token_ids)) for o in outs]


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out: dict = {}
    with Client(spec["address"], curve_keys=spec["curve_keys"], timeout_s=5.0) as c:
        if spec["mode"] == "ready":
            s = _wait(c, lambda s: sum(g["state"] == "ready" for g in s["groups"]) >= spec["groups"]
                      and s["detokenizer"]["connected"], spec.get("timeout", 60))
            out["stats"] = s
        elif spec["mode"] == "generate":
            out["tokens"] = _generate(spec, spec["prompts"])
        else:  # partition: armed, wait for the test's go (it has cut `watch` off), generate, await the rejoin
            Path(spec["armed"]).touch()
            deadline = time.monotonic() + 30
            while not Path(spec["go"]).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("no go from the test")
                time.sleep(0.01)
            out["tokens"] = _generate(spec, spec["prompts"])
            watch = spec["watch"]
            s = _wait(c, lambda s: any(g["name"] == watch and g["state"] == "ready" for g in s["groups"]),
                      spec.get("timeout", 60))
            out["ready"] = sorted(g["name"] for g in s["groups"] if g["state"] == "ready")
            out["requeued"] = s["metrics"].get("requeued", 0)
    tmp = Path(spec["out"] + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(spec["out"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
