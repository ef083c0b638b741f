"""The detokenizer's state, free of sockets: token ids in, UTF-8-safe text deltas and stop
strings out.

One IncrementalDetokenizer per live sequence; `handle(msg)` applies one scheduler message and
returns the reply, if any. The detokenizer process (service.py) runs it behind its socket, the
in-process engine (services/engine.py) calls it directly: both deliver text the same way.
"""

from __future__ import annotations

from zeroserve.common import messages as P
from zeroserve.common.detokenize import IncrementalDetokenizer
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import get_logger
from zeroserve.common.sampling_params import SamplingParams

log = get_logger("detokenizer")


class Detokenizer:
    def __init__(self, tokenizers: dict[str, object]) -> None:
        self.tokenizers = tokenizers  # model name -> tokenizer
        self.default = next(iter(tokenizers), None)
        self.states: dict[str, IncrementalDetokenizer] = {}
        self.skip: dict[str, int] = {}  # replayed requests: chars the client already has
        self.owed: dict[str, str] = {}  # replayed requests: text released but never delivered

    def _tokenizer(self, params: SamplingParams):
        name = params.model or self.default
        tok = self.tokenizers.get(name)
        if tok is None:
            raise InvalidRequest(f"the detokenizer has no tokenizer for model {name!r}; start it with --model")
        return tok

    def clear(self) -> None:
        """Forget every sequence (the scheduler restarted: it replays what is live)."""
        self.states.clear()
        self.skip.clear()
        self.owed.clear()

    def _drop(self, rid: str) -> None:
        self.states.pop(rid, None)
        self.skip.pop(rid, None)
        self.owed.pop(rid, None)

    def _reconcile(self, rid: str, text: str) -> str:
        if rid in self.owed:
            text = self.owed.pop(rid) + text
        n = self.skip.get(rid)
        if n:
            cut = min(n, len(text))
            text = text[cut:]
            if n - cut:
                self.skip[rid] = n - cut
            else:
                del self.skip[rid]
        return text

    def handle(self, msg):
        """Apply one message; returns the reply to send, if any."""
        if isinstance(msg, P.DetokNew):
            for item in msg.items:
                try:
                    params = item.params
                    det = IncrementalDetokenizer(self._tokenizer(params), item.prompt_token_ids.tolist(), params)
                except InvalidRequest as e:
                    log.warning("cannot detokenize request", req=item.req_id, reason=str(e))
                    continue
                if len(item.output_token_ids):
                    # replay: the client already has `text_offset` chars. Fed in one go, the decoder
                    # may hold back a different amount than it did token by token; reconcile.
                    det.add_tokens(item.output_token_ids.tolist())
                    gap = item.text_offset - len(det.text)
                    if gap > 0:
                        self.skip[item.req_id] = gap
                    elif gap < 0:
                        self.owed[item.req_id] = det.text[item.text_offset:]
                self.states[item.req_id] = det
            return None
        if isinstance(msg, P.DetokTokens):
            ids, texts, stops, kept = [], [], [], []
            # plain lists sliced by the counts: per-request arrays (np.split) and a tolist() each
            # cost more than the decoding at a few tokens per request
            flat, end = msg.token_ids.tolist(), 0
            for rid, n, reason in zip(msg.req_ids, msg.counts.tolist(), msg.finish_reasons):
                toks, end = flat[end:end + n], end + n
                det = self.states.get(rid)
                if det is None:
                    continue
                delta = det.add_tokens(toks) if toks else None
                text = delta.text_delta if delta else ""
                stop = delta.stop_str if delta else None
                if stop is None and reason is not None:
                    text += det.finish()
                text = self._reconcile(rid, text)
                if stop is not None or reason is not None:
                    self._drop(rid)
                ids.append(rid)
                texts.append(text)
                stops.append(stop)
                kept.append(delta.tokens if stop is not None else -1)
            return P.DetokOutputs(seq=msg.seq, req_ids=ids, text_deltas=texts, stop_strs=stops, stop_tokens=kept)
        if isinstance(msg, P.DetokFree):
            for rid in msg.req_ids:
                self._drop(rid)
            return None
        if isinstance(msg, P.Error):
            log.warning("scheduler reported an error", code=msg.code, message=msg.message)
        return None
