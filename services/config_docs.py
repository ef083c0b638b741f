"""Write docs/configuration.md: every flag of every `zeroserve` command, read from the parser.

    python -m zeroserve.services.config_docs > docs/configuration.md     # regenerate
    python -m zeroserve.services.config_docs --check docs/configuration.md   # exit 1 if it drifted

The reference is made from `zeroserve.services.cli.build_parser()` itself, not from a list kept beside
it: the knobs of common/config.py reach the commands only through that parser, and the commands'
own options (`generate --max-tokens`, ...) live only there, so reading the parser covers both and
cannot miss a flag that a command takes. tests/test_config_docs.py fails when the committed file
differs from what this prints, and when a flag has no help text.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator

from zeroserve.common.config import ENV_PREFIX

# Variables read outside the flags (each names the code that reads it; a flag's own
# ZEROSERVE_<FLAG> variable is listed in its row instead).
OTHER_ENV = (
    ("ZEROSERVE_LOG_JSON", "`1`: JSON log lines (the same as `--log-json`)", "common/log.py"),
    ("ZEROSERVE_LOG_LEVEL", "debug, info (default), warning, error (the same as `--log-level`)", "common/log.py"),
    ("ZEROSERVE_CACHE", "where the built-in tiny model is written (default `~/.cache/zeroserve`)",
     "services/tiny_model.py"),
    ("ZEROSERVE_CPU_NATIVE", "`0`: do not compile the C kernels; the torch twins run instead", "kernels/cpu_native.py"),
    ("ZEROSERVE_CPU_STEP", "`0`: no compiled whole-decode step; each layer's ops are called from Python",
     "services/worker/model/cpu_step.py"),
    ("OMP_WAIT_POLICY", "unset: libgomp's spin-then-sleep default; `up` sets `PASSIVE` for its workers when their "
     "threads add up to more than the CPUs (teams spinning against each other slowed decode-sized ops 5-8x)",
     "services/worker/threads.py"),
)

_PLACEHOLDER = {"int": "N", "float": "X"}  # a value's kind, shorter than argparse's DEST
_ENV_SUFFIX = re.compile(r"\s*\[env ([A-Z0-9_]+)\]$")


@contextlib.contextmanager
def _clean_env() -> Iterator[None]:
    """Defaults as a fresh shell sees them: a ZEROSERVE_* variable set here would become a flag's
    default in the parser and leak into the reference."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    d = action.default
    if d is None or d == [] or d is argparse.SUPPRESS:
        return "unset"
    return f"`{d}`"


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:  # positional
        return f"`{action.metavar or action.dest}` (positional)"
    names = " / ".join(f"`{s}`" for s in action.option_strings)
    takes_value = action.nargs != 0
    if takes_value:
        meta = action.metavar or (f"{{{','.join(map(str, action.choices))}}}" if action.choices else
                                  _PLACEHOLDER.get(getattr(action.type, "__name__", ""), "TEXT"))
        names += f" {meta}" if action.nargs != "?" else f" [{meta}]"
    return names


def _help(action: argparse.Action) -> tuple[str, str]:
    """(help text, its environment variable or '')."""
    text = (action.help or "").replace("%%", "%")
    m = _ENV_SUFFIX.search(text)
    env = m.group(1) if m else ""
    text = _ENV_SUFFIX.sub("", text)
    if action.choices and action.metavar and not any(str(c) in text for c in action.choices):
        text += f" (one of: {', '.join(map(str, action.choices))})"
    return text, env


def _rows(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[argparse.Action]]]:
    """(section title, its actions) in the order `--help` prints them; no help flag, no subparsers."""
    for group in parser._action_groups:
        acts = [a for a in group._group_actions
                if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if acts:
            title = group.title or ""
            yield ("options" if title in ("optional arguments", "options") else title), acts


def undocumented(parser: argparse.ArgumentParser | None = None) -> list[str]:
    """`command flag` for every flag without help text (the test wants none)."""
    from zeroserve.services.cli import build_parser

    with _clean_env():
        parser = parser or build_parser()
    out = []
    for cmd, sub in _commands(parser):
        for _, acts in _rows(sub):
            out += [f"{cmd} {_flag(a)}" for a in acts if not _help(a)[0].strip()]
    return out


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [("zeroserve", parser)] + [(f"zeroserve {name}", p) for name, p in subs.choices.items()]


def _summary(parser: argparse.ArgumentParser) -> dict[str, str]:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.help or "" for a in subs._choices_actions}


def render() -> str:
    from zeroserve.services.cli import build_parser

    with _clean_env():
        parser = build_parser()
    summary = _summary(parser)
    cmds = _commands(parser)
    out = [
        "# Configuration reference",
        "",
        "<!-- GENERATED by `python -m zeroserve.services.config_docs > docs/configuration.md` from the parser in",
        "services/cli.py and the config dataclasses in common/config.py. Do not edit by hand:",
        "tests/test_config_docs.py fails when this file and the flags differ. -->",
        "",
        "Every setting is a field of a config dataclass in `common/config.py`; each command takes the",
        "groups it needs (`services/cli.py`). A flag listed with a variable also reads it: the",
        "variable, when set, is the flag's default, and the flag given on the command line wins.",
        "`zeroserve up` passes every value to its children as flags, so a variable set for `up`",
        "reaches all of them. Repeatable flags (`--model`) take a comma-separated list from the",
        "variable. Boolean flags take no value; a setting that is on by default is turned off",
        "with its `--no-...` flag.",
        "",
        "Commands: " + ", ".join(f"[`{c}`](#{c.replace(' ', '-')})" for c, _ in cmds) + ".",
        "",
    ]
    for cmd, sub in cmds:
        out += [f"## {cmd}", ""]
        name = cmd.split(" ", 1)[-1]
        desc = summary.get(name) if cmd != "zeroserve" else "options before the command (`zeroserve --log-json up`)"
        if desc:
            out += [desc[0].upper() + desc[1:] + ".", ""]
        for title, acts in _rows(sub):
            out += [f"**{title}**", "", "| flag | default | variable | meaning |", "|---|---|---|---|"]
            for a in acts:
                text, env = _help(a)
                out.append(f"| {_cell(_flag(a))} | {_cell(_default(a))} | {f'`{env}`' if env else ''} | "
                           f"{_cell(text)} |")
            out.append("")
    out += ["## Other environment variables", "", "| variable | meaning | read in |", "|---|---|---|"]
    out += [f"| `{k}` | {_cell(v)} | `{where}` |" for k, v, where in OTHER_ENV]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zeroserve.services.config_docs", description=__doc__.split("\n")[0])
    ap.add_argument("--check", metavar="FILE", help="compare FILE with the generated text; exit 1 if they differ")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{args.check} is out of date: run python -m zeroserve.services.config_docs > {args.check}",
                      file=sys.stderr)
                return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
