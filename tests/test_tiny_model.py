"""make-tiny-model: the directories it writes are real HF checkpoints, deterministic, and built
so greedy comparisons are meaningful (clear top-1 margins, varied outputs)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from zeroserve.common.model_config import ModelConfig
from zeroserve.services import tiny_model
from zeroserve.services.tiny_model import SIZES, make_tiny_model, tiny_config
from tests.helpers import cached_model_dir, load_hf_model, make_model_dir, torch_single_thread  # noqa: F401

TEXTS = ["Hello world, the café is open. 日本語 🤖", "12345 apples\n\n  and\tthree   pears!!", "",
         " leading space", "Dear Mara, the days here are long.", "über naïve\r\nline ends"]

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "granite",
                                  "olmo2", "mixtral", "qwen3moe", "olmoe"])
def test_hf_loads_model_and_tokenizer(arch):
    from transformers import AutoTokenizer

    d = cached_model_dir(arch)
    files = {p.name for p in d.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= files
    hf = load_hf_model(d)
    assert type(hf).__name__ == ModelConfig.from_dir(d).architecture
    tok = AutoTokenizer.from_pretrained(str(d))
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert len(tok) <= hf.config.vocab_size
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids  # AutoTokenizer and the raw file agree
        assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless
        assert (ids[:1] == [1]) == (arch in ("llama", "mistral"))  # only llama-style adds <s>
        assert all(0 <= i < hf.config.vocab_size for i in ids)
    out = hf(torch.tensor([tok("Dear Mara").input_ids])).logits
    assert out.shape[-1] == hf.config.vocab_size and torch.isfinite(out).all()


def test_tokenizer_compresses_corpus_text():
    tok = Tokenizer.from_file(str(cached_model_dir("llama") / "tokenizer.json"))
    text = "Before the first frost, the gentle baker carried a basket of pears to the harbor town."
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode()) / 2  # merges learned from the corpus, not just bytes


def test_deterministic_and_seeded(tmp_path):
    a = make_model_dir(tmp_path / "a", "qwen3", seed=1)
    b = make_model_dir(tmp_path / "b", "qwen3", seed=1)
    c = make_model_dir(tmp_path / "c", "qwen3", seed=2)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tokenizer_training_is_cached(tmp_path):
    make_tiny_model(tmp_path / "warm", "llama")
    t0 = time.perf_counter()
    for i in range(3):
        make_tiny_model(tmp_path / f"m{i}", "llama")
    assert time.perf_counter() - t0 < 3.0
    info = tiny_model._trained_bpe_json.cache_info()
    assert info.hits >= 3


def test_config_overrides_and_tied(tmp_path):
    d = make_model_dir(tmp_path, "llama", tie_word_embeddings=True, vocab_size=600, num_hidden_layers=3)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 600 and cfg["num_hidden_layers"] == 3
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [600, 64]
    assert "lm_head.weight" not in keys
    assert "model.layers.2.mlp.down_proj.weight" in keys
    q2 = make_model_dir(tmp_path, "qwen2")
    with safe_open(str(q2 / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.self_attn.q_proj.bias" in set(f.keys())
    q3 = make_model_dir(tmp_path, "qwen3")
    with safe_open(str(q3 / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.self_attn.k_norm.weight" in set(f.keys())
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_tiny_model(tmp_path / "y", arch="llama", vocab_size=100)


def test_sizes():
    for size, want in (("tiny", (64, 2, 4, 2, 128, 512)), ("default", (256, 4, 8, 4, 704, 2048)),
                       ("bench", (512, 8, 8, 4, 1408, 8192))):
        c = tiny_config("llama", size)
        assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
                c["intermediate_size"], c["vocab_size"]) == want
    bench = ModelConfig.from_hf_dict({**tiny_config("llama", "bench"), "architectures": ["LlamaForCausalLM"]})
    assert 25e6 < bench.num_params() < 40e6
    assert SIZES["bench"][1] < 8192  # the tokenizer is smaller than the bench model's vocab


def test_default_size_builds_and_loads(tmp_path):
    d = make_tiny_model(tmp_path / "default", "llama", size="default")
    cfg = ModelConfig.from_dir(d)
    assert cfg.hidden_size == 256 and cfg.vocab_size == 2048
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == 2048  # the corpus is rich enough: every model id is a real token


def test_sharded_output(tmp_path):
    d = make_model_dir(tmp_path, "qwen2", shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] > 0
    load_hf_model(d)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True), ("gemma2", True), ("phi3", False),
                                       ("granite", False), ("olmo2", False), ("gemma3", True)])
def test_greedy_outputs_are_varied_with_clear_margins(arch, tied):
    hf = load_hf_model(cached_model_dir(arch, tie_word_embeddings=tied))
    min_gaps, distinct = [], []
    for s in range(4):
        seq = torch.randint(3, 512, (1, 10), generator=torch.Generator().manual_seed(s))
        gaps = []
        with torch.no_grad():
            for _ in range(24):  # greedy, one full forward per step (cheaper than generate())
                logits = hf(input_ids=seq).logits[0, -1]
                top2 = logits.topk(2).values
                gaps.append((top2[0] - top2[1]).item())
                seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
        min_gaps.append(min(gaps))
        distinct.append(len(set(seq[0, 10:].tolist())))
    assert min(min_gaps) > 1e-3, min_gaps  # >> fp32 noise (~1e-5)
    assert min(distinct) >= 8, distinct  # no collapse onto one repeated token


def test_cli(tmp_path, capsys):
    rc = tiny_model.main([str(tmp_path / "cli"), "--arch", "qwen2", "--size", "tiny", "--seed", "4",
                          "--tie-word-embeddings", "true"])
    assert rc == 0 and "qwen2" in capsys.readouterr().out
    cfg = ModelConfig.from_dir(tmp_path / "cli")
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.tie_word_embeddings and cfg.hidden_size == 64


@pytest.mark.parametrize("arch,architecture", [("gemma2", "Gemma2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"),
                                               ("phi3", "Phi3ForCausalLM"), ("granite", "GraniteForCausalLM"),
                                               ("olmo2", "Olmo2ForCausalLM")])
def test_cli_dense_families(tmp_path, capsys, arch, architecture):
    rc = tiny_model.main([str(tmp_path / arch), "--arch", arch, "--size", "tiny"])
    assert rc == 0 and arch in capsys.readouterr().out
    assert ModelConfig.from_dir(tmp_path / arch).architecture == architecture
