"""The model catalog (common/catalog.py): what a models folder and a config file become, keep_alive
in Ollama's spellings, and the bounded per-model cache the scheduler and detokenizer keep."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.common.catalog import FOREVER, BoundedCache, load_catalog, parse_keep_alive  # noqa: E402
from zeroserve.common.errors import InvalidRequest  # noqa: E402
from tests.helpers import cached_model_dir  # noqa: E402


@pytest.mark.parametrize("given, seconds", [("5m", 300.0), ("30s", 30.0), ("1h30m", 5400.0), ("250ms", 0.25),
                                            (0, 0.0), ("0", 0.0), (12.5, 12.5), (-1, FOREVER), ("-1m", FOREVER)])
def test_keep_alive_in_ollamas_spellings(given, seconds):
    assert parse_keep_alive(given) == seconds


@pytest.mark.parametrize("bad", ["5 minutes", "m5", "", True, None, [1]])
def test_a_keep_alive_that_is_no_duration_is_refused_in_words(bad):
    with pytest.raises(InvalidRequest, match="duration"):
        parse_keep_alive(bad)


def _folder(tmp_path: Path) -> Path:
    import shutil

    d = tmp_path / "models"
    d.mkdir()
    shutil.copytree(cached_model_dir("llama"), d / "llama-one")
    (d / "notes.txt").write_text("not a model")
    (d / ".hidden").mkdir()
    bad = d / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    return d


def test_a_models_folder_lists_each_model_and_keeps_a_broken_one_with_its_reason(tmp_path):
    cat = load_catalog(str(_folder(tmp_path)), None, keep_alive_s=60.0)
    assert sorted(cat) == ["broken", "llama-one"]
    assert cat["llama-one"].config is not None and cat["llama-one"].keep_alive_s == 60.0 and not cat["llama-one"].error
    assert cat["broken"].config is None and "broken.gguf" in cat["broken"].error


def test_a_config_file_names_models_and_overrides_the_folder(tmp_path):
    d = _folder(tmp_path)
    cfg = tmp_path / "pool.toml"
    cfg.write_text('models_dir = "models"\nkeep_alive = "10s"\n\n[models.chat]\npath = "models/llama-one"\n'
                   'pinned = true\nkeep_alive = -1\nmax_groups = 2\n')
    cat = load_catalog(None, str(cfg))
    assert sorted(cat) == ["broken", "chat", "llama-one"]
    assert (cat["chat"].pinned, cat["chat"].keep_alive_s, cat["chat"].max_groups) == (True, FOREVER, 2)
    assert cat["llama-one"].keep_alive_s == 10.0 and cat["chat"].path == str(d / "llama-one")


@pytest.mark.parametrize("text, words", [("bogus = 1\n", "unknown key"), ("[models.x]\npinned = true\n", "give path"),
                                         ('[models.x]\npath = "m"\nmax_groups = 0\n', "max_groups"),
                                         ("[models\n", "pool.toml"), ('keep_alive = "soon"\n', "duration")])
def test_a_bad_config_file_is_refused_in_words(tmp_path, text, words):
    cfg = tmp_path / "pool.toml"
    cfg.write_text(text)
    with pytest.raises(InvalidRequest, match=words):
        load_catalog(None, str(cfg))


def test_bounded_cache_keeps_the_latest_and_the_kept_ones():
    made = []
    cache = BoundedCache(lambda k: made.append(k) or k.upper(), capacity=2, keep=frozenset({"fixed"}))
    for k in ("fixed", "a", "b", "a", "c", "a"):
        assert cache.get(k) == k.upper()
    assert made == ["fixed", "a", "b", "c"]  # "a" stayed: used again before "c" came
    assert "fixed" in cache and "a" in cache and "c" in cache and "b" not in cache and len(cache) == 3


def test_the_gateway_takes_ollamas_keep_alive_into_the_sampling_params():
    from zeroserve.services.gateway.protocol import CompletionRequest

    def keep_alive(v):
        return CompletionRequest(model="m", prompt="hi", keep_alive=v)._params(4, None).keep_alive

    assert (keep_alive("5m"), keep_alive(0), keep_alive(-1), keep_alive(None)) == (300.0, 0.0, -1.0, None)
    with pytest.raises(InvalidRequest, match="duration"):
        keep_alive("later")
