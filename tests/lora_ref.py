"""LoRA adapters for the tests, made with PEFT on the tiny models, and HF transformers + PEFT
greedy output as the reference.

    d = make_adapter(tmp_path / "a", base_dir, rank=8, seed=1)      # random A and B (B non-zero)
    ref = peft_greedy(base_dir, d, prompt_ids, 12)                   # 12 greedy tokens (EOS ordinary)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_GEN: dict[tuple, list[int]] = {}


def make_adapter(path: str | Path, base_dir: str | Path, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                 targets: Sequence[str] = tuple(ALL_TARGETS), use_rslora: bool = False, std: float = 0.2) -> Path:
    """Save a PEFT LoRA adapter of `base_dir` with random A and B at `path` (B is zero in a fresh
    PEFT adapter; random here so the delta changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                     use_rslora=use_rslora, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(path))
    return Path(path)


@torch.no_grad()
def peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None, prompt: Sequence[int], n: int) -> list[int]:
    """HF (+ PEFT when `adapter_dir` is given) greedy continuation: exactly n tokens, EOS ordinary."""
    key = (str(base_dir), str(adapter_dir), tuple(prompt), n)
    if key not in _GEN:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter_dir))
        model.eval()
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=[], pad_token_id=0)
        _GEN[key] = out[0, ids.shape[1]:].tolist()
    return list(_GEN[key])


def peft_to_gguf(adapter_dir: str | Path, out: str | Path, arch: str, n_head: int, n_kv_head: int,
                 qtype: str = "F32") -> Path:
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: `general.type` adapter,
    `adapter.type` lora, `adapter.lora.alpha`; `blk.{i}.{attn_q|...}.weight.lora_a` / `.lora_b`,
    with B's q/k rows permuted like the base weights for llama (tests/gguf_export.py's permute)."""
    import gguf
    import json

    import numpy as np
    from safetensors.numpy import load_file

    from tests.gguf_export import LAYER_MAP, llamacpp_permute

    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for key, t in sorted(load_file(str(Path(adapter_dir) / "adapter_model.safetensors")).items()):
        rest = key.removeprefix("base_model.model.model.layers.")
        idx, rest = rest.split(".", 1)
        module, ab = rest.rsplit(".lora_", 1)  # "self_attn.q_proj", "A.weight"
        t = t.astype(np.float32)
        if ab.startswith("B") and arch == "llama" and module.endswith(("q_proj", "k_proj")):
            t = llamacpp_permute(t, n_head if module.endswith("q_proj") else n_kv_head)
        name = f"blk.{idx}.{LAYER_MAP[module + '.weight']}.lora_{ab[0].lower()}"
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32 if qtype == "F32" else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
