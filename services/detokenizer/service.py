"""The detokenizer process: token ids in, UTF-8-safe text deltas and stop-string hits out.

It holds one IncrementalDetokenizer per live sequence and answers each `DetokTokens` batch
with one `DetokOutputs`. It keeps no state the scheduler cannot rebuild: after a restart the
scheduler replays every live sequence (`DetokNew` with the tokens already delivered, fed here
without emitting text), so streams continue without loss or repeats. Joining, heartbeats (from
this loop, on the one socket) and noticing a restarted scheduler are `zeroserve.services.backend_peer`'s.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid

import zmq

from zeroserve.common import messages as P
from zeroserve.common.codec import ProtocolError
from zeroserve.common.catalog import MAX_CATALOG_TOKENIZERS, BoundedCache, CatalogEntry, load_catalog
from zeroserve.common.config import DetokenizerArgs, from_cli_args
from zeroserve.common.curve import curve_client_keys
from zeroserve.common.detokenize import IncrementalDetokenizer
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import get_logger, setup_logging
from zeroserve.common.memory import freeze_startup_heap
from zeroserve.common.model_config import ModelConfig
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.common.tokenizer import load_tokenizer
from zeroserve.services.backend_peer import BackendPeer, Refused
from zeroserve.services.tiny_model import default_model_dir

log = get_logger("detokenizer")


class DetokenizerService:
    def __init__(self, scheduler_addr: str, model_dirs: list[str], worker_id: str | None = None,
                 heartbeat_interval_s: float = 1.0, curve_keys: str | None = None,
                 curve_client: str | None = None, catalog: dict[str, CatalogEntry] | None = None) -> None:
        self.scheduler_addr = scheduler_addr
        self.curve = curve_client_keys(curve_keys, curve_client, role="detokenizer")  # None: a plain connection
        self.worker_id = worker_id or f"detok-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.tokenizers = {}
        for d in model_dirs:
            self.tokenizers[ModelConfig.from_dir(d).name] = load_tokenizer(d)  # no transformers import
        self.default = next(iter(self.tokenizers), None)
        # catalog models (the scheduler's model pool): a tokenizer loads on the model's first
        # request, on this loop (tens of ms), and the MAX_CATALOG_TOKENIZERS latest stay
        self.catalog = {n: e.path for n, e in (catalog or {}).items() if e.config is not None}
        self.catalog_tokenizers = BoundedCache(lambda name: load_tokenizer(self.catalog[name]), MAX_CATALOG_TOKENIZERS)
        if self.default is None and self.catalog:
            self.default = next(iter(self.catalog))
        self.hb_interval = heartbeat_interval_s
        self.states: dict[str, IncrementalDetokenizer] = {}
        self.skip: dict[str, int] = {}  # replayed requests: chars the client already has
        self.owed: dict[str, str] = {}  # replayed requests: text released but never delivered
        self.stop = threading.Event()

    def _tokenizer(self, params: SamplingParams):
        name = params.model or self.default
        tok = self.tokenizers.get(name)
        if tok is None and name in self.catalog:
            tok = self.catalog_tokenizers.get(name)
        if tok is None:
            raise InvalidRequest(f"the detokenizer has no tokenizer for model {name!r}; start it with --model")
        return tok

    def run(self) -> int:
        freeze_startup_heap()
        ctx = zmq.Context()
        # IMMEDIATE: HELLOs and heartbeats are only queued on a live connection (none pile up for a
        # scheduler that is away, each to be answered "rejoin" later)
        peer = BackendPeer(ctx, self.scheduler_addr, self.worker_id, role="detokenizer", curve=self.curve,
                           heartbeat_interval_s=self.hb_interval, immediate=True)
        try:
            while self._join(peer):
                self._serve(peer)
        finally:
            peer.goodbye("stopping")
            peer.close()
            ctx.term()
        return 0

    def _hello(self) -> P.Hello:
        return P.Hello(role="detokenizer", worker_id=self.worker_id, host=socket.gethostname(), pid=os.getpid(),
                       model=self.default or "")

    def _join(self, peer: BackendPeer) -> bool:
        """Until welcomed (True) or told to stop (False); a refusal is retried: the scheduler may
        be restarting with other settings."""
        while not self.stop.is_set():
            try:  # what arrives meanwhile comes from before a restart: answer it
                welcome = peer.join(self._hello, self.stop, on_message=lambda msg: self._answer(peer, msg))
                if welcome is not None:
                    log.info("connected", scheduler=welcome.scheduler_id)
                    return True
            except Refused as e:
                log.warning("refused by the scheduler", reason=e.detail)
                self.stop.wait(1.0)
        return False

    def _serve(self, peer: BackendPeer) -> None:
        """Answer the scheduler until told to stop, or until it no longer knows us (then start over)."""
        while not self.stop.is_set():
            wait = peer.maybe_heartbeat(lambda: {"live": len(self.states)})
            if not peer.ch.poll(wait):
                continue
            for _ in range(1000):
                try:
                    got = peer.ch.recv_nowait()
                except ProtocolError as e:
                    log.warning("bad message dropped", reason=e.reason)
                    continue
                if got is None:
                    break
                if peer.note(got[1]):  # the scheduler restarted: it replays what is live after our HELLO
                    peer.rejoin.clear()
                    self.states.clear()
                    self.skip.clear()
                    self.owed.clear()
                    return
                self._answer(peer, got[1])

    def _answer(self, peer: BackendPeer, msg) -> None:
        reply = self.handle(msg)
        if reply is not None:
            peer.ch.send(reply)

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
            ids, texts, stops = [], [], []
            for rid, toks, reason in zip(msg.req_ids, msg.per_request(), msg.finish_reasons):
                det = self.states.get(rid)
                if det is None:
                    continue
                delta = det.add_tokens(toks.tolist()) if len(toks) else None
                text = delta.text_delta if delta else ""
                stop = delta.stop_str if delta else None
                if stop is None and reason is not None:
                    text += det.finish()
                text = self._reconcile(rid, text)
                if stop is not None or reason is not None:
                    del self.states[rid]
                    self.skip.pop(rid, None)
                    self.owed.pop(rid, None)
                ids.append(rid)
                texts.append(text)
                stops.append(stop)
            return P.DetokOutputs(seq=msg.seq, req_ids=ids, text_deltas=texts, stop_strs=stops)
        if isinstance(msg, P.DetokFree):
            for rid in msg.req_ids:
                self.states.pop(rid, None)
                self.skip.pop(rid, None)
                self.owed.pop(rid, None)
            return None
        if isinstance(msg, P.Error):
            log.warning("scheduler reported an error", code=msg.code, message=msg.message)
        return None


def main(args) -> int:
    setup_logging(service="detokenizer")
    dargs = from_cli_args(DetokenizerArgs, args)
    catalog = load_catalog(dargs.models_dir, dargs.models_config)
    dirs = dargs.models or ([] if catalog else [str(default_model_dir())])
    svc = DetokenizerService(dargs.scheduler, dirs, worker_id=dargs.worker_id,
                             heartbeat_interval_s=dargs.heartbeat_interval_s, curve_keys=dargs.curve_keys,
                             curve_client=dargs.curve_client, catalog=catalog)
    signal.signal(signal.SIGTERM, lambda *_: svc.stop.set())
    signal.signal(signal.SIGINT, lambda *_: svc.stop.set())
    return svc.run()
