"""IncrementalDetokenizer: UTF-8 safe streaming, stop strings, special tokens, fuzz."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from zeroserve.common.detokenize import IncrementalDetokenizer
from zeroserve.common.sampling_params import SamplingParams

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the quick brown fox jumps over a lazy dog hello world done stop end "
         "café naïve Zürich résumé façade señor ångström "
         "中文 字符 日本語 한국어 東京 "
         "😀 🎉 👍🏽 👨‍👩‍👧 🚀 ∑ ∞ →").split()


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(lines, trainer)
    t = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=SPECIALS[0], extra_special_tokens=SPECIALS[1:])
    assert t.all_special_ids == [0, 1, 2]
    return t


def _decode(tok, ids, skip=True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _stream(tok, ids, params=None, prompt=(), chunks=None, check_prefix=True):
    """Feed ids (one at a time, or in the given chunk sizes); returns (detok, deltas, finish_text)."""
    d = IncrementalDetokenizer(tok, list(prompt), params or SamplingParams())
    deltas: list[str] = []
    i = 0
    sizes = iter(chunks) if chunks is not None else None
    while i < len(ids):
        n = next(sizes) if sizes is not None else 1
        r = d.add_tokens(ids[i:i + n])
        i += n
        deltas.append(r.text_delta)
        assert "".join(deltas) == d.text
        if r.stop_str is not None:
            assert d.stop_str == r.stop_str
            break
    tail = d.finish()
    assert "".join(deltas) + tail == d.text
    return d, deltas, tail


TEXTS = {
    "ascii": "the quick brown fox jumps over the lazy dog, hello world!",
    "emoji": "hello 😀 world 🎉🎉 👍🏽 family 👨‍👩‍👧 rocket🚀",
    "cjk": "中文字符 日本語のテキスト 한국어 東京タワー",
    "accented": "café naïve Zürich résumé façade señor ångström Ωμέγα",
    "mixed": "café😀中文 → ∞ ∑ done",
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_token_by_token_matches_full_decode(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert _decode(tok, ids) == text
    if name in ("emoji", "cjk", "accented"):
        # the fixture really splits multi-byte characters across tokens
        assert any("\ufffd" in _decode(tok, [i]) for i in ids)
    d, deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == text == d.text
    assert tail == ""  # everything was complete before finish
    assert not any("\ufffd" in x for x in deltas)  # never a partial character
    # also in random chunks and after a prompt
    rng = random.Random(len(text))
    chunks = [rng.randint(1, 4) for _ in ids]
    prompt = tok.encode("the prompt says 中")
    d2, deltas2, tail2 = _stream(tok, ids, prompt=prompt, chunks=chunks)
    assert "".join(deltas2) + tail2 == text


def test_prompt_context_ending_inside_a_character(tok):
    ids = tok.encode("😀")
    assert len(ids) >= 2
    prompt, out = ids[:1], ids[1:] + tok.encode(" ok")
    d, deltas, tail = _stream(tok, out, prompt=prompt)
    assert d.text == _decode(tok, out)


def test_window_stays_small(tok):
    calls: list[int] = []

    class Spy:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    text = " ".join(TEXTS.values()) * 20
    ids = tok.encode(text)
    d, deltas, tail = _stream(Spy(), ids, prompt=tok.encode("some prompt"))
    assert d.text == text
    assert len(ids) > 1000 and max(calls) <= 12
    assert len(d._ids) <= 12


def test_finish_releases_incomplete_character(tok):
    ids = tok.encode("ok 🦀")  # not in the training text: split into byte tokens
    cut = ids[:-1]
    assert _decode(tok, cut).endswith("\ufffd")
    d, deltas, tail = _stream(tok, cut)
    assert "".join(deltas) in ("ok", "ok ")  # the partial character is held back
    assert tail.endswith("\ufffd") and d.text == _decode(tok, cut)
    assert d.add_tokens(ids[-1:]).text_delta == ""  # finished: ignored


# ------------------------------------------------------------------------------ stop strings


def _ref_stop(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Earliest-ending occurrence wins (ties: the longer one), as a char-by-char stream sees it."""
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0], best[1])):
            best = (i + len(s), i, s)
    if best is None:
        return full, None
    end, start, s = best
    return full[:end] if include else full[:start], s


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "hello world café done and more text"
    ids = tok.encode(text)
    stop = "café do"
    assert not any(stop in _decode(tok, [i]) for i in ids)  # only visible across tokens
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    for chunks in (None, [3] * len(ids), [len(ids)]):
        d, deltas, tail = _stream(tok, ids, params, chunks=chunks)
        expect = "hello world café do" if include else "hello world "
        assert d.text == expect and d.stop_str == stop and tail == ""


def test_a_stop_names_the_token_that_completed_it_however_ids_are_grouped(tok):
    """The detokenizer reports how many ids of a call the output keeps (up to the one whose
    text completed the stop string): a stream and a result of one request reach it grouped
    differently and must end on the same token."""
    text = "hello world café done and more text"
    ids = tok.encode(text)
    stop = "café do"
    one_by_one = _stream(tok, ids, SamplingParams(stop=[stop]))[0]
    last = one_by_one.num_output_tokens  # ids fed until the stop matched
    for size in range(1, len(ids) + 1):
        d = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop]))
        fed = 0
        for i in range(0, len(ids), size):
            r = d.add_tokens(ids[i:i + size])
            if r.stop_str is not None:
                fed += r.tokens
                break
            fed += len(ids[i:i + size])
        assert r.stop_str == stop and 1 <= r.tokens <= size
        assert fed == last and d.text == one_by_one.text, (size, fed, last)


def test_stop_string_at_the_very_start(tok):
    ids = tok.encode("stop here please")
    for include, expect in ((False, ""), (True, "stop")):
        d, deltas, tail = _stream(tok, ids, SamplingParams(stop=["stop"], include_stop_str_in_output=include))
        assert d.text == expect and d.stop_str == "stop"
        assert all(x == "" for x in deltas) or include


def test_multiple_stops_first_occurrence_wins(tok):
    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    d, _, _ = _stream(tok, ids, SamplingParams(stop=["dog", "fox", "zebra"]))
    assert d.text == "the quick brown " and d.stop_str == "fox"
    # the one that completes first in the stream wins, however the tokens are grouped
    for chunks in (None, [len(ids)], [2] * len(ids)):
        d, _, _ = _stream(tok, ids, SamplingParams(stop=["quick brown fox", "brown"]), chunks=chunks)
        assert d.text == "the quick " and d.stop_str == "brown"


def test_stop_emoji_and_cjk(tok):
    text = "hello 😀 world 中文 end"
    ids = tok.encode(text)
    d, _, _ = _stream(tok, ids, SamplingParams(stop=["😀"]))
    assert d.text == "hello "
    d, _, _ = _stream(tok, ids, SamplingParams(stop=["文 e"], include_stop_str_in_output=True))
    assert d.text == "hello 😀 world 中文 e"


def test_holdback_never_shows_text_that_is_cut_and_finish_releases_it(tok):
    text = "the fox jumps over the lazy dog"
    ids = tok.encode(text)
    # "the lazy cat" never matches, but "the lazy " is a prefix of it and is held while streaming
    params = SamplingParams(stop=["the lazy cat", "zebra"])
    d = IncrementalDetokenizer(tok, [], params)
    seen = ""
    held_any = False
    for n, i in enumerate(ids, 1):
        seen += d.add_tokens([i]).text_delta
        partial = _decode(tok, ids[:n])
        k = max((k for s in params.stop for k in range(len(s)) if partial.endswith(s[:k])), default=0)
        assert seen == partial[:len(partial) - k]  # exactly the possible stop prefix is held
        held_any |= k >= len("the lazy")
    assert held_any
    seen += d.finish()
    assert seen == text == d.text and d.stop_str is None
    # a held prefix at the very end is released by finish()
    ids = tok.encode("over the laz")
    d, deltas, tail = _stream(tok, ids, params)
    assert "".join(deltas) == "over " and tail == "the laz" and d.text == "over the laz"


# ------------------------------------------------------------------------------ special tokens


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi") + [1] + tok.encode(" there 😀") + [2, 0]
    d, deltas, _ = _stream(tok, ids, SamplingParams(skip_special_tokens=True))
    assert d.text == "hi there 😀"
    d, deltas, _ = _stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert d.text == "hi<|im_start|> there 😀<|im_end|><|endoftext|>"
    # a stop string that contains a special token's text only matches when specials are kept
    d, _, _ = _stream(tok, ids, SamplingParams(skip_special_tokens=False, stop=["<|im_end|>"]))
    assert d.text == "hi<|im_start|> there 😀" and d.stop_str == "<|im_end|>"


# ------------------------------------------------------------------------------ fuzz


def test_fuzz_random_token_sequences(tok):
    rng = random.Random(1234)
    vocab = len(tok)
    texts_for_stops = ["o", "the", "😀", "中", "é d", "\ufffd", "fox j", "a"]
    for trial in range(300):
        n = rng.randint(0, 40)
        if rng.random() < 0.5:
            ids = [rng.randrange(vocab) for _ in range(n)]  # random bytes: invalid UTF-8 splits
        else:
            ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))))
            if ids and rng.random() < 0.5:
                ids = ids[rng.randrange(len(ids)):]  # start mid-character
        skip = rng.random() < 0.7
        stops = rng.sample(texts_for_stops, rng.randint(0, 3))
        include = rng.random() < 0.5
        params = SamplingParams(stop=stops or None, include_stop_str_in_output=include,
                                skip_special_tokens=skip)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        chunks = [rng.randint(1, 5) for _ in range(len(ids))]
        d, deltas, tail = _stream(tok, ids, params, prompt=prompt, chunks=chunks)
        full = _decode(tok, ids, skip)
        expect, stop = _ref_stop(full, stops, include)
        assert d.text == expect, (trial, ids, stops)
        assert d.stop_str == stop


# ------------------------------------------------------------------------------ SentencePiece style


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    """Llama-2 style: '▁' for spaces, byte fallback tokens, and a decoder that strips the leading
    space of a decode (so decoding a window on its own would lose spaces)."""
    rng = random.Random(1)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(300)]

    def setup(t: Tokenizer) -> None:
        t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    setup(base)
    base.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    sp = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    setup(sp)
    sp.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_style_spaces_and_byte_fallback(sp_tok):
    text = "hello world 🦀 café 中文 the 👨‍👩‍👧 end"
    ids = sp_tok.encode(text, add_special_tokens=False)
    assert any(sp_tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback used
    d, deltas, tail = _stream(sp_tok, ids)
    assert d.text == _decode(sp_tok, ids) == text and tail == ""
    assert not any("\ufffd" in x for x in deltas)
    # continuing a prompt keeps the space that joins it to the output (as the full decode shows)
    prompt = sp_tok.encode("the prompt", add_special_tokens=False)
    d, deltas, tail = _stream(sp_tok, ids, prompt=prompt)
    full = _decode(sp_tok, prompt + ids)
    assert d.text == full[len(_decode(sp_tok, prompt)):] == " " + text
    # stop strings work on the spaced text
    d, _, _ = _stream(sp_tok, ids, SamplingParams(stop=["é 中"]))
    assert d.text == "hello world 🦀 caf"


def test_fuzz_sentencepiece_style(sp_tok):
    """ByteFallback turns a whole run of byte tokens into one U+FFFD per token when the run is not
    valid UTF-8, even bytes that were valid ASCII on their own (`<0x6B><0xC6>` -> two U+FFFD). A
    streaming decoder that already showed the "k" cannot take it back, so with invalid runs only
    the streaming invariants are checked; sequences of real text must match exactly."""
    rng = random.Random(7)
    vocab = len(sp_tok)
    for trial in range(200):
        if trial % 2:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        else:
            ids = sp_tok.encode(" ".join(rng.choice(WORDS + ["🦀", "ß", "Ж"]) for _ in range(rng.randint(1, 8))),
                                add_special_tokens=False)
            ids = ids[rng.randrange(len(ids)):] if rng.random() < 0.3 else ids  # may start mid-character
        stops = rng.sample(["o", "the", " ", "\ufffd", "é"], rng.randint(0, 2))
        params = SamplingParams(stop=stops or None, include_stop_str_in_output=rng.random() < 0.5,
                                skip_special_tokens=rng.random() < 0.7)
        chunks = [rng.randint(1, 4) for _ in ids]
        d, deltas, tail = _stream(sp_tok, ids, params, chunks=chunks)  # checks joined deltas == .text
        full = _decode(sp_tok, ids, params.skip_special_tokens)
        if trial % 2 == 0 or "\ufffd" not in full:
            assert (d.text, d.stop_str) == _ref_stop(full, stops, params.include_stop_str_in_output), (trial, ids)


# --------------------------------------------------------------------------- the detokenizer's tokenizer
@pytest.fixture(scope="module")
def decoder(tok, tmp_path_factory):
    """The same tokenizer saved as a model directory, loaded the way the detokenizer loads it."""
    from zeroserve.common.tokenizer import FastTokenizer

    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(str(d))
    return FastTokenizer(d)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_decoder_streams_exactly_like_the_transformers_tokenizer(tok, decoder, name):
    ids = tok.encode(TEXTS[name] + "<|im_end|> tail", add_special_tokens=False)
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip, stop=["done"] if name == "mixed" else None)
        a, da, ta = _stream(tok, ids, params)
        b, db, tb = _stream(decoder, ids, params)
        assert (da, ta, a.stop_str) == (db, tb, b.stop_str)
        assert decoder.decode(ids, skip_special_tokens=skip) == _decode(tok, ids, skip)


def test_detokenizer_loads_no_transformers_nor_torch(tmp_path):
    """Its restart time is the streams' stall: the decode path needs only `tokenizers`."""
    import subprocess
    import sys
    from pathlib import Path

    from helpers import cached_model_dir

    code = ("import sys; import zeroserve.services.detokenizer.service as s; from zeroserve.common.tokenizer import load_tokenizer; "
            f"load_tokenizer({str(cached_model_dir('llama'))!r}); "
            "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
