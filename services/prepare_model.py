"""`zeroserve prepare-model`: put a model where the cluster's processes will read it, and check it.

Compose's one-shot `model-init` service runs it before anything else reads the model, so a wrong
path or an unreadable file stops the stack with one clear line instead of every service failing
on its own. It takes what the processes take: an HF directory (config.json, safetensors,
tokenizer.json) or a .gguf file, and the built-in model (`$ZEROSERVE_CACHE/default-model`), which
it creates. With `--source` it first copies an HF directory or a .gguf file into place (e.g. from a
read-only mount into the shared models volume, so that every container, and in a swarm every
replica on that node, reads one copy).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from zeroserve.common.errors import ModelLoadError


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=os.environ.get("ZEROSERVE_MODEL") or None,
                    help="the model path the processes read: an HF directory or a .gguf file (env ZEROSERVE_MODEL; "
                         "default: the built-in model under $ZEROSERVE_CACHE, created here). With --source: "
                         "where the copy goes")
    ap.add_argument("--source", default=os.environ.get("ZEROSERVE_MODEL_SOURCE") or None,
                    help="copy this HF directory or .gguf file to --model first (env ZEROSERVE_MODEL_SOURCE; "
                         "without --model: into $ZEROSERVE_CACHE under its own name). An existing copy of the "
                         "same files and sizes is kept")
    ap.add_argument("--models-dir", default=os.environ.get("ZEROSERVE_MODELS_DIR") or None,
                    help="a model pool's folder (env ZEROSERVE_MODELS_DIR): check every model in it instead of one; "
                         "a broken one is reported, an empty folder is an error")


def check_catalog(models_dir: str) -> int:
    """A model pool's folder (`--models-dir`): each model checked as `check_model` checks one. A
    broken model does not stop the stack (the pool lists it as failed, with the reason); an
    empty folder does."""
    from zeroserve.common.catalog import scan_dir

    entries = scan_dir(models_dir)
    ok = 0
    for e in entries:
        try:
            cfg = check_model(Path(e.path)) if e.config is not None else None
        except ModelLoadError as err:
            e.error = str(err)
            cfg = None
        if cfg is None:
            print(f"model {e.name!r}: FAILED, the pool will list it as failed: {e.error}", flush=True)
        else:
            ok += 1
            print(f"model ready: {e.path} (served as {e.name!r}, {cfg.architecture})", flush=True)
    if not ok:
        raise ModelLoadError(f"--models-dir {models_dir!r} holds no model the processes can load (a .gguf file or "
                             "an HF directory per model)")
    return 0


def _cache_root() -> Path:
    return Path(os.environ.get("ZEROSERVE_CACHE", Path.home() / ".cache" / "zeroserve"))


def _files(src: Path) -> dict[str, int]:
    """Relative path -> size of each file under the directory `src`."""
    return {str(p.relative_to(src)): p.stat().st_size for p in sorted(src.rglob("*")) if p.is_file()}


def copy_model(src: Path, dest: Path) -> bool:
    """Copy `src` (a .gguf file or an HF directory) to `dest`; False when `dest` already holds the
    same files with the same sizes (a restarted model-init must not copy gigabytes again). The copy
    goes to a temporary sibling first and is renamed into place, so a reader never sees half a model."""
    if not src.exists():
        raise ModelLoadError(f"--source {str(src)!r} does not exist (mount it into the container?)")
    if src.is_file() and src.suffix.lower() != ".gguf":
        raise ModelLoadError(f"--source {str(src)!r} is a file but not a .gguf; give a .gguf file or an HF directory")
    if src.is_file() and dest.is_dir():
        raise ModelLoadError(f"--model {str(dest)!r} is a directory but --source is a file; give the file's path "
                             f"(e.g. {str(dest / src.name)!r})")
    if dest.exists():
        same = (dest.is_file() and src.is_file() and dest.stat().st_size == src.stat().st_size) or (
            dest.is_dir() and src.is_dir() and _files(dest) == _files(src))
        if same:
            return False
        raise ModelLoadError(f"--model {str(dest)!r} exists and differs from --source {str(src)!r}; remove it first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    try:
        if src.is_file():
            shutil.copyfile(src, tmp)
        else:
            shutil.copytree(src, tmp)
        tmp.rename(dest)
    except OSError as e:
        raise ModelLoadError(f"cannot copy {str(src)!r} to {str(dest)!r}: {e}") from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
    return True


def check_model(path: Path):
    """The ModelConfig the processes will build from `path`, and its tokenizer (both raise a
    ModelLoadError that names what is missing)."""
    from zeroserve.common.model_config import ModelConfig
    from zeroserve.common.tokenizer import load_tokenizer

    if not path.exists():
        raise ModelLoadError(f"model {str(path)!r} does not exist: mount your model (an HF directory or a .gguf "
                             "file) there, or pass --source to copy one in")
    cfg = ModelConfig.from_dir(path)
    load_tokenizer(path)
    return cfg


def run_cli(args: argparse.Namespace) -> int:
    from zeroserve.services.tiny_model import default_model_dir

    if args.models_dir and not args.model and not args.source:
        return check_catalog(args.models_dir)

    default = _cache_root() / "default-model"
    model = Path(args.model) if args.model else None
    if args.source:
        src = Path(args.source)
        model = model or _cache_root() / src.name
        copied = copy_model(src, model)
        print(f"{'copied' if copied else 'already in place'}: {src} -> {model}", flush=True)
    if model is None or model == default:
        model = default_model_dir()  # creates it once (random weights)
    cfg = check_model(model)
    print(f"model ready: {model} (served as {cfg.name!r}, {cfg.architecture})", flush=True)
    return 0
