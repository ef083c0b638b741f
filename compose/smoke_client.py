"""The requests of compose/smoke.sh and compose/swarm-smoke.sh, through the Python client.

Runs inside a zeroserve container (`docker exec -i CONTAINER python - ADDRESS MODE [N]` with this
file on stdin), so the host needs no Python packages. Modes:
  chat       one chat request; prints the answer
  load N     N concurrent completions of a fixed length; every one must finish with all its tokens
             (a worker killed meanwhile: its requests are requeued and finish on another group)
Exit 0 when every request finished as asked; the last line is a JSON summary.
"""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from zeroserve import Client, SamplingParams

address, mode = sys.argv[1], sys.argv[2]
with Client(address, timeout_s=30.0, request_timeout_s=600.0) as c:
    if mode == "chat":
        out = c.chat([{"role": "user", "content": "Name one colour of the rainbow."}],
                     SamplingParams(max_tokens=24, temperature=0.0))
        text = out.outputs[0].text
        print(f"python client chat: {text!r}")
        ok = out.finished and bool(text.strip())
        print(json.dumps({"mode": "chat", "ok": ok, "tokens": len(out.outputs[0].token_ids)}))
        sys.exit(0 if ok else 1)
    n, max_tokens = int(sys.argv[3]), 48
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()

    def one(i):
        try:
            o = c.generate(f"Request {i}: write about the sea.", params).outputs[0]
            return len(o.token_ids), o.finish_reason, None
        except Exception as e:  # noqa: BLE001 - reported in the summary
            return 0, None, f"{type(e).__name__}: {e}"

    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(one, range(n)))
    done = sum(1 for t, r, e in res if t == max_tokens and r == "length")
    errors = [e for _, _, e in res if e]
    print(json.dumps({"mode": "load", "requests": n, "finished_all_tokens": done, "errors": errors,
                      "wall_s": round(time.monotonic() - t0, 1)}))
    sys.exit(0 if done == n else 1)
