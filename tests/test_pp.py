"""Pipeline parallelism on CPU, without the cluster: the stages of one group run as gloo ranks
(subprocesses of this file, like tests/test_tp.py) and each drives the in-process engine
(`LLMEngine`: the scheduler's policy and a `ModelRunner`) whose runner is its stage. Every rank
gets the same steps, so every rank must end with the same tokens, and those must equal the
pp=1 engine's and Hugging Face's fp32 greedy tokens, token for token.

Also checked: each stage holds only its layers (parameters and KV cache), the embedding on the
first stage and the LM head on the last, and a safetensors or GGUF load reads only the slice.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import cached_model_dir, random_prompt, torch_single_thread  # noqa: F401,E402
from tests.test_tp import rank_cli, run_ranks  # noqa: E402

MAX_TOKENS = 10
PROMPT_LENS = (5, 21, 40)  # under one KV block, across two, several
# name -> (arch, config overrides, GGUF type or None, compared with HF)
CASES = {
    "llama": ("llama", {}, None, True),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}, None, False),  # head on the last stage reads the embedding
    "gemma2": ("gemma2", {}, None, False),  # post-norm layers: no residual stream between stages
    "llama_3_layers": ("llama", {"num_hidden_layers": 3}, None, False),  # stages of 2 and 1 layers
    "llama_q8_gguf": ("llama", {}, "Q8_0", False),  # a stage's slice from a GGUF file, packed
    "mixtral": ("mixtral", {}, None, True),  # mixture of experts
    "qwen3moe": ("qwen3moe", {}, None, False),  # a dense layer among the sparse ones
}

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, min(vocab, 512), seed=70 + i) for i, n in enumerate(PROMPT_LENS)]


def generate(model_dir: str, tp: int = 1, pp: int = 1, tp_rank: int = 0, pp_rank: int = 0, wire=None,
             dtype: str = "auto", micro: int = 1, seeded: bool | None = None) -> dict:
    """Greedy tokens of every prompt from an LLMEngine whose runner is this shard (stage
    `pp_rank`, tp rank `tp_rank`; with pp > 1 the group's world must exist), all prompts in
    flight at once, plus what the shard holds. `wire`: how stages talk (None: ZeroMQ on CPU).
    `micro` > 1: the group keeps that many steps in flight, each over its own requests (the
    pipeline's micro-batches; in one process they run one after the other). `seeded` (default:
    with micro-batches): every prompt also runs seeded sampling beside the greedy run."""
    from zeroserve import SamplingParams
    from zeroserve.common.config import EngineArgs
    from zeroserve.services.engine import LLMEngine, stage_runner

    args = EngineArgs(model=model_dir, tp_size=tp, pp_size=pp, num_kv_blocks=48, max_num_batched_tokens=64, dtype=dtype)
    eng = LLMEngine(args, make_runner=stage_runner(tp_rank, tp, pp_rank, wire))
    eng.group.max_in_flight = micro  # what the scheduler gives a group of `micro` stages
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    vocab = eng.model_cfg.vocab_size
    ids = [eng.add_request(p, params) for p in _prompts(vocab)]
    seeded = [eng.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=5 + k,
                                                ignore_eos=True)) for k, p in enumerate(_prompts(vocab))] \
        if (micro > 1 if seeded is None else seeded) else []
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
    m = eng.runner.model
    return {"tokens": [list(outs[i]) for i in ids], "seeded": [list(outs[i]) for i in seeded],
            "peak_in_flight": eng.group.peak_in_flight, "layers": list(m.stage.layers),
            "kv_layers": len(eng.runner.kv_caches), "embed": m.embed_tokens is not None,
            "head": m.lm_head is not None, "tied": m.cfg.tie_word_embeddings, "param_bytes": eng.runner.param_bytes(),
            "mode": eng.runner.numeric_mode}


def _stage_worker(rank: int, world: int, port: int, payload: dict, out_path: str) -> None:
    """One shard of a tp x pp group (stage-major ranks): join the world, then generate."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    tp, pp = payload["tp"], payload["pp"]
    pp_rank, tp_rank = divmod(rank, tp)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results = {name: generate(d, tp, pp, tp_rank, pp_rank, payload["wire"], payload.get("dtype", "auto"),
                                  payload.get("micro", 1))
                   for name, d in payload["dirs"].items()}
        torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def _dirs(tmp_path: Path, names) -> dict[str, str]:
    from tests.gguf_export import export_hf_dir

    out = {}
    for name in names:
        arch, ov, qtype, _ = CASES[name]
        d = cached_model_dir(arch, **ov)
        out[name] = str(export_hf_dir(d, tmp_path / f"{name}.gguf", qtype=qtype) if qtype else d)
    return out


def _check(names, dirs, ref, shards, tp: int, pp: int) -> None:
    from tests.hf_reference import hf_greedy

    for name in names:
        arch, _, _, with_hf = CASES[name]
        want = ref[name]
        for rank, got in enumerate(shards):
            g = got[name]
            assert g["tokens"] == want["tokens"], f"{name}: rank {rank} (tp {tp} x pp {pp}) differs from pp=1"
            assert g["mode"] == want["mode"], f"{name}: rank {rank} computes in another numeric mode than pp=1"
            pp_rank = rank // tp
            assert g["embed"] == (pp_rank == 0 or (pp_rank == pp - 1 and g["tied"]))
            assert g["head"] == (pp_rank == pp - 1)
            assert g["kv_layers"] == len(g["layers"]) < want["kv_layers"]
        layers = sorted({tuple(s[name]["layers"]) for s in shards})
        assert [x for lr in layers for x in lr] == want["layers"], f"{name}: stages do not cover the layers once"
        if with_hf:
            for p, toks in zip(_prompts(512), want["tokens"]):
                assert toks == hf_greedy(arch, p, MAX_TOKENS), f"{name}: pp=1 differs from HF"


def test_pp2_matches_pp1_and_hf(tmp_path):
    dirs = _dirs(tmp_path, CASES)
    ref, shards = run_ranks(__file__, 2, {"dirs": dirs, "tp": 1, "pp": 2, "wire": None}, tmp_path,
                            lambda: {n: generate(d) for n, d in dirs.items()}, timeout=600)
    _check(CASES, dirs, ref, shards, 1, 2)
    for name in ("llama", "mixtral"):  # float weights: the two stages hold about half each
        full, parts = ref[name]["param_bytes"], [s[name]["param_bytes"] for s in shards]
        assert all(p < 0.75 * full for p in parts) and sum(parts) >= full, (name, full, parts)


@pytest.mark.parametrize("wire", ["zmq", "dist"])
def test_tp2_pp2_matches_pp1(tmp_path, wire):
    """Four shards, two per stage; the stages' links over ZeroMQ and over gloo send/recv."""
    names = ("llama", "mixtral")
    dirs = _dirs(tmp_path, names)
    ref, shards = run_ranks(__file__, 4, {"dirs": dirs, "tp": 2, "pp": 2, "wire": wire}, tmp_path,
                            lambda: {n: generate(d) for n, d in dirs.items()}, timeout=600)
    _check(names, dirs, ref, shards, 2, 2)


def test_pp2_bf16_matches_pp1(tmp_path):
    """--dtype bfloat16: every stage computes in the model's bf16 regime (services/worker/numerics.py:
    bf16 linears, fp32 activations between the stages) and the tokens equal bf16 pp=1's."""
    dirs = _dirs(tmp_path, ["llama"])
    ref, shards = run_ranks(__file__, 2, {"dirs": dirs, "tp": 1, "pp": 2, "wire": None, "dtype": "bfloat16"},
                            tmp_path, lambda: {"llama": generate(dirs["llama"], dtype="bfloat16")}, timeout=600)
    assert ref["llama"]["mode"].startswith("bfloat16/")
    _check(["llama"], dirs, ref, shards, 1, 2)


def test_pp2_micro_batches_match_pp1(tmp_path):
    """Two steps in flight per group, each over its own requests (the pipeline's micro-batches,
    services/scheduler/policy.py): greedy and seeded tokens equal pp=1's with one step over all
    of them (each row's arithmetic is the same whatever else is in its batch)."""
    names = ("llama", "mixtral")
    dirs = _dirs(tmp_path, names)

    def pp1():
        return {n: {"one": generate(d, seeded=True), "split": generate(d, micro=2)} for n, d in dirs.items()}

    ref, shards = run_ranks(__file__, 2, {"dirs": dirs, "tp": 1, "pp": 2, "wire": None, "micro": 2}, tmp_path,
                            pp1, timeout=600)
    for name in names:
        one, split = ref[name]["one"], ref[name]["split"]
        assert split["peak_in_flight"] == 2 and one["peak_in_flight"] == 1
        assert split["tokens"] == one["tokens"], f"{name}: micro-batched pp=1 differs from one step"
        for rank, got in enumerate(shards):
            g = got[name]
            assert g["peak_in_flight"] == 2, f"{name}: rank {rank} never had two steps in flight"
            assert g["tokens"] == one["tokens"], f"{name}: rank {rank} (pp=2, two in flight) differs from pp=1"
            assert g["seeded"] == split["seeded"], f"{name}: rank {rank}'s seeded tokens differ from pp=1's"
        assert split["seeded"] == one["seeded"], f"{name}: seeded tokens depend on the micro-batches"
        assert all(len(t) == MAX_TOKENS for t in one["seeded"])


def test_stage_layers_split():
    from zeroserve.common.errors import ModelLoadError
    from zeroserve.services.worker.pipeline import answering_rank, group_rank, stage_layers

    assert [stage_layers(5, 2, r) for r in range(2)] == [range(0, 3), range(3, 5)]
    assert [stage_layers(8, 4, r) for r in range(4)] == [range(2 * r, 2 * r + 2) for r in range(4)]
    with pytest.raises(ModelLoadError, match="too few for 3 pipeline stages"):
        stage_layers(2, 3, 0)
    # stage-major ranks; the last stage's tp rank 0 answers
    assert [group_rank(t, 2, p) for p in range(2) for t in range(2)] == [0, 1, 2, 3]
    assert answering_rank(2, 2) == 2 and answering_rank(1, 1) == 0


def test_one_process_refuses_several_stages():
    from zeroserve.common.config import EngineArgs
    from zeroserve.common.errors import InvalidRequest
    from zeroserve.services.engine import LLMEngine

    with pytest.raises(InvalidRequest, match="a process per pipeline stage"):
        LLMEngine(EngineArgs(model=str(cached_model_dir("llama")), pp_size=2))


def test_engine_args_refuse_speculation_with_pp():
    from zeroserve.common.config import EngineArgs
    from zeroserve.common.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="pipeline parallelism"):
        EngineArgs(model=None, pp_size=2, speculative_method="ngram")
    with pytest.raises(InvalidRequest, match="pp_size must be a positive integer"):
        EngineArgs(model=None, pp_size=0)


if __name__ == "__main__":
    rank_cli(_stage_worker)
