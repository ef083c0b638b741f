"""Tokenizers loaded, and their transformers views made (xgrammar takes one; the scheduler
prepares one grammar compiler per served model in parallel), from several threads at once in a
fresh process. transformers' lazy top-level module is not safe to import from two threads at the
same time: without common/tokenizer.py's import lock all but one thread got `ImportError: cannot
import name ...`, and a scheduler serving two models answered every request for one of them with
that error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import cached_model_dir

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, threading
from zeroserve.common.tokenizer import load_tokenizer
assert "transformers" not in sys.modules  # the race is in the first import
errors, barrier = [], threading.Barrier(4)
def load():
    barrier.wait()
    try:
        load_tokenizer(sys.argv[1]).to_transformers()
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=load) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(errors)
sys.exit(1 if errors else 0)
"""


def test_tokenizers_load_in_parallel_threads_of_a_fresh_process():
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(cached_model_dir("llama"))], cwd=ROOT,
                       capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-2000:]}"
