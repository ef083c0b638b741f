"""Incremental, UTF-8 safe detokenization with stop strings (vLLM semantics).

Text is produced by decoding a small window of recent tokens twice, once without and once with
the new tokens, and taking the difference (the "prefix offset / read offset" technique), so a
step costs O(window), not O(output). The window starts a few tokens back so tokenizers that
strip a leading space at the start of a decode (SentencePiece/Metaspace) still produce the
right spaces.

Two kinds of text are held back from the caller:

* a window whose decoded text ends in U+FFFD: byte-level BPE (or byte-fallback) split a
  multi-byte character across tokens; it is emitted once later tokens complete it (or at
  `finish()` if they never do, exactly as the full decode would show it);
* with stop strings, the trailing characters that are a proper prefix of some stop string,
  so no delta ever shows text that a later stop match cuts off.

Invariant: the concatenation of every `text_delta` returned by `add_tokens` plus the string
returned by `finish()` equals `.text`, at every point in time (`.text` is what was emitted).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroserve.common.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "DetokenizerDelta"]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded in front of the first output tokens


@dataclass
class DetokenizerDelta:
    text_delta: str  # new text the user may see now
    stop_str: str | None = None  # the stop string that matched: the request must finish now
    tokens: int | None = None  # with stop_str: the ids of this call up to the one that completed it


class IncrementalDetokenizer:
    """Turns a stream of output token ids into user-visible text deltas for one request."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = bool(params.skip_special_tokens)
        self.include_stop = bool(params.include_stop_str_in_output)
        self.min_tokens = int(params.min_tokens)  # stop strings count only after this many tokens
        self.stops: list[str] = [s for s in (params.stop or []) if s]
        context = [int(t) for t in list(prompt_token_ids)[-_PROMPT_CONTEXT_TOKENS:]]
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends inside a character: decode the output on its own
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # cache of decode(ids[prefix:read])
        self._pending = ""  # released by the decoder, held back as a possible stop-string start
        self._parts: list[str] = []  # emitted deltas (joined lazily: no quadratic string growth)
        self.stop_str: str | None = None
        self.finished = False
        self.num_output_tokens = 0

    # ----------------------------------------------------------------------------- decoding

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _release(self, force: bool) -> str:
        """New text from the token window; '' while the window ends in a partial character."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        prefix = self._prefix_text
        full = self._decode(self._ids[self._prefix_offset:])
        if not force and (len(full) <= len(prefix) or full.endswith(_REPLACEMENT)):
            return ""  # nothing visible yet, or an incomplete multi-byte character: wait
        if full.startswith(prefix):
            new = full[len(prefix):]
        else:  # a decoder that rewrote earlier text: keep what is new by length
            new = full[len(prefix):] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        # keep the window small: drop tokens before the new prefix offset
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new

    # ----------------------------------------------------------------------------- stops
    #
    # Emitted text never contains the start of a stop-string match (the held-back suffix is every
    # char that could begin one), so a match always lies inside `_pending + new text`: the search
    # and the buffer stay O(longest stop + new text) per step.

    def _find_stop(self, buf: str) -> tuple[int, int, str] | None:
        """Earliest-ending stop occurrence in buf (ties: the longer one), i.e. the one a
        char-by-char stream completes first, whatever the token grouping."""
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < (best[0], best[1])):
                best = (i + len(s), i, s)
        return best

    def _holdback(self, buf: str) -> int:
        """How many trailing chars of buf are a proper prefix of some stop string."""
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        return keep

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta

    def _advance(self, new_text: str, final: bool) -> DetokenizerDelta:
        buf = self._pending + new_text
        self._pending = ""
        if self.stops and new_text and self.num_output_tokens > self.min_tokens:
            hit = self._find_stop(buf)
            if hit is not None:
                end, start, s = hit
                self.stop_str = s
                self.finished = True
                return DetokenizerDelta(self._emit(buf[:end] if self.include_stop else buf[:start]), s)
        if final or not self.stops:
            return DetokenizerDelta(self._emit(buf))
        keep = self._holdback(buf)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return DetokenizerDelta(self._emit(buf[:len(buf) - keep]))

    # ----------------------------------------------------------------------------- API

    def add_tokens(self, token_ids: list[int]) -> DetokenizerDelta:
        """Feed newly generated token ids; returns the text the user may see now. With stop
        strings the ids go in one at a time, so a match names the token that completed it
        (`tokens`): the same token however the ids were grouped into calls, so a stream and a
        result of one request, batched differently on their way here, end on the same token.
        After a stop string matched (or `finish()`), further tokens are ignored."""
        if self.finished:
            return DetokenizerDelta("")
        ids = [int(t) for t in token_ids]
        if not self.stops or len(ids) <= 1:
            return self._feed(ids)
        parts = []
        for i, t in enumerate(ids):
            d = self._feed([t])
            parts.append(d.text_delta)
            if d.stop_str is not None:
                return DetokenizerDelta("".join(parts), d.stop_str, tokens=i + 1)
        return DetokenizerDelta("".join(parts))

    def _feed(self, ids: list[int]) -> DetokenizerDelta:
        if not ids:
            return DetokenizerDelta("")
        self._ids.extend(ids)
        self.num_output_tokens += len(ids)
        d = self._advance(self._release(force=False), final=False)
        if d.stop_str is not None:
            d.tokens = len(ids)
        return d

    def finish(self) -> str:
        """The request ended for another reason (length, eos, abort): release everything held
        back (an incomplete character shows as U+FFFD, as the full decode would show it).
        Returns the last delta; afterwards `.text` is final."""
        if self.finished:
            return ""
        d = self._advance(self._release(force=True), final=True)
        self.finished = True
        return d.text_delta

    @property
    def text(self) -> str:
        """The output text as the user sees it so far: exactly the joined deltas."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""
