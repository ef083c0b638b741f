"""benchmarks/serve_peers.py's own parts: bf16 detection and that a server's whole process group
is stopped (no orphans, even when the leader ignores SIGINT)."""

import os
import subprocess
import sys
import time

from benchmarks.serve_peers import native_bf16, stop


def test_native_bf16_from_cpu_flags():
    assert native_bf16({"avx512f", "avx512_bf16"}) and native_bf16({"amx_bf16"})
    assert not native_bf16({"avx512f", "avx2"})


def test_stop_ends_the_whole_process_group():
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            "print(c.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        t0 = time.monotonic()
        stop(proc)
        assert proc.poll() is not None and time.monotonic() - t0 < 60
        for _ in range(50):  # the child got SIGTERM with its group; give it a moment to go
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the server's child outlived stop()")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
