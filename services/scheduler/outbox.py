"""What the scheduler's state wants sent: handlers return an Outbox, the process shell sends it.

Keeping sockets out of the state objects (groups.py, cluster.py) lets tests drive them with
fake messages and a fake clock, and keeps the one thread that owns the sockets the only one
that touches them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from zeroserve.common.chat import chat_prompt
from zeroserve.common.messages import Message

CLIENT, BACKEND, STEPS, EVENTS = "client", "backend", "steps", "events"  # the four sockets


class Item(NamedTuple):
    role: str  # CLIENT / BACKEND (ROUTERs), STEPS / EVENTS (PUBs)
    to: bytes | str  # peer identity on a ROUTER, group name on steps, topic on events
    msg: Message
    on_fail: Callable[[], None] | None = None  # runs when a ROUTER send fails (peer gone, queue full)


class TokenizeJob(NamedTuple):
    """A prompt to tokenize off the loop: text, or a conversation for the chat template. The
    result comes back to `Cluster.on_tokenized`."""

    key: str
    model: str
    text: str | None
    messages: list[dict[str, str]] | None = None
    ids: list[int] | None = None  # already tokenized: the job only compiles the constraint
    constraint: object = None  # StructuredOutputsParams: compiled in the same job
    tools: list[dict] | None = None  # chat: function definitions for the template

    def run(self, tokenizer: Callable[[], Any], chat_template: str | None,
            grammars: Any) -> tuple[str | None, list[int], object]:
        """(prompt text, token ids, compiled constraint or None): the scheduler process runs this
        in its pool, the in-process engine inline. `tokenizer()` may block while it loads (and
        is not called for token ids without a chat template)."""
        text, ids = self.text, self.ids
        if ids is None and self.messages is not None:  # the chat template, here for every client alike
            text, ids = chat_prompt(tokenizer(), self.messages, chat_template, self.tools)
        elif ids is None:
            ids = tokenizer().encode(text)
        # the grammar compiles here too, off the loop (xgrammar releases the GIL), cached
        return text, ids, (grammars.compile(self.constraint) if self.constraint is not None else None)


class Outbox:
    """Messages in the order they were made; the shell sends them in that order."""

    __slots__ = ("items", "tokenize")

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.tokenize: list[TokenizeJob] = []

    def to_client(self, ident: bytes, msg: Message) -> None:
        self.items.append(Item(CLIENT, ident, msg))

    def to_backend(self, ident: bytes, msg: Message, on_fail: Callable[[], None] | None = None) -> None:
        self.items.append(Item(BACKEND, ident, msg, on_fail))

    def publish(self, group: str, msg: Message) -> None:
        self.items.append(Item(STEPS, group, msg))

    def event(self, topic: str, msg: Message) -> None:
        self.items.append(Item(EVENTS, topic, msg))

    def tokenize_prompt(self, key: str, model: str, text: str | None,
                        messages: list[dict[str, str]] | None = None, ids: list[int] | None = None,
                        constraint: object = None, tools: list[dict] | None = None) -> None:
        self.tokenize.append(TokenizeJob(key, model, text, messages, ids, constraint, tools))

    def extend(self, other: Outbox) -> Outbox:
        self.items.extend(other.items)
        self.tokenize.extend(other.tokenize)
        return self

    def of(self, kind: type, role: str | None = None) -> list[Item]:
        """The items carrying messages of one type (tests and logging)."""
        return [it for it in self.items if isinstance(it.msg, kind) and (role is None or it.role == role)]

    def __iter__(self) -> Iterator[Item]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items or self.tokenize)

    def __repr__(self) -> str:
        return f"Outbox({[(it.role, it.to, type(it.msg).__name__) for it in self.items]})"
