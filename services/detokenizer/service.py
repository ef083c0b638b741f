"""The detokenizer process: token ids in, UTF-8-safe text deltas and stop-string hits out.

It holds one IncrementalDetokenizer per live sequence and answers each `DetokTokens` batch
with one `DetokOutputs`. It keeps no state the scheduler cannot rebuild: after a restart the
scheduler replays every live sequence (`DetokNew` with the tokens already delivered, fed here
without emitting text), so streams continue without loss or repeats.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid

import zmq

from common import protocol as P
from common.detokenize import IncrementalDetokenizer
from common.errors import InvalidRequest
from common.log import get_logger, setup_logging
from common.model_config import ModelConfig
from common.sampling_params import SamplingParams
from common.tokenizer import load_tokenizer
from common.transport import curve_client_keys, make_socket

log = get_logger("detokenizer")


class DetokenizerService:
    def __init__(self, scheduler_addr: str, model_dirs: list[str], worker_id: str | None = None,
                 heartbeat_interval_s: float = 1.0, curve_keys: str | None = None,
                 curve_client: str | None = None) -> None:
        self.scheduler_addr = scheduler_addr
        self.curve = curve_client_keys(curve_keys, curve_client)  # None: a plain connection
        self.worker_id = worker_id or f"detok-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.tokenizers = {}
        for d in model_dirs:
            self.tokenizers[ModelConfig.from_dir(d).name] = load_tokenizer(d)
        self.default = next(iter(self.tokenizers), None)
        self.hb_interval = heartbeat_interval_s
        self.states: dict[str, IncrementalDetokenizer] = {}
        self.skip: dict[str, int] = {}  # replayed requests: chars the client already has
        self.owed: dict[str, str] = {}  # replayed requests: text released but never delivered
        self.stop = threading.Event()

    def _tokenizer(self, params: SamplingParams):
        name = params.model or self.default
        tok = self.tokenizers.get(name)
        if tok is None:
            raise InvalidRequest(f"the detokenizer has no tokenizer for model {name!r}; start it with --model")
        return tok

    def run(self) -> int:
        ctx = zmq.Context()
        # IMMEDIATE: no heartbeats pile up while the scheduler is away (each would be refused later)
        sock = make_socket(ctx, zmq.DEALER, connect=self.scheduler_addr, identity=self.worker_id, immediate=True,
                           **(self.curve.socket_kwargs() if self.curve else {}))
        try:
            self._hello(sock)
            last_hb = 0.0
            while not self.stop.is_set():
                now = time.monotonic()
                if now - last_hb >= self.hb_interval:
                    last_hb = now
                    try:
                        sock.send_multipart(P.encode(P.Heartbeat(worker_id=self.worker_id,
                                                                 stats={"live": len(self.states)})), zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # not connected: nobody to tell
                if not sock.poll(int(self.hb_interval * 1000)):
                    continue
                for _ in range(1000):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = P.decode(frames)
                    except P.ProtocolError as e:
                        log.warning("bad message dropped", reason=e.reason)
                        continue
                    reply = self.handle(msg)
                    if isinstance(reply, P.Welcome):  # the scheduler restarted: start over
                        self.states.clear()
                        self._hello(sock)
                    elif reply is not None:
                        sock.send_multipart(P.encode(reply))
        finally:
            try:
                sock.send_multipart(P.encode(P.Goodbye(worker_id=self.worker_id, reason="stopping")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            sock.close(linger=0)
            ctx.term()
        return 0

    def _hello(self, sock: zmq.Socket) -> None:
        unreachable_since, told = time.monotonic(), False
        while not self.stop.is_set():
            try:  # NOBLOCK (IMMEDIATE socket): a blocking send would hang while the scheduler is away or
                # refuses our CURVE key, and SIGTERM could not stop us
                sock.send_multipart(P.encode(P.Hello(role="detokenizer", worker_id=self.worker_id,
                                                     host=socket.gethostname(), pid=os.getpid(),
                                                     model=self.default or "")), zmq.NOBLOCK)
            except zmq.Again:
                if not told and time.monotonic() - unreachable_since > 5.0:
                    told = True
                    log.info("cannot reach the scheduler yet; retrying" + (
                        " (CURVE: is this detokenizer's key allowed, and server.key the scheduler's?)" if self.curve
                        else " (does the scheduler use CURVE? then pass --curve-keys)"),
                        scheduler=self.scheduler_addr, curve_client=self.curve.name if self.curve else None)
                time.sleep(0.1)
                continue
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not self.stop.is_set():
                if not sock.poll(200):
                    continue
                try:
                    msg = P.decode(sock.recv_multipart())
                except P.ProtocolError:
                    continue
                if isinstance(msg, P.Welcome):
                    if msg.accepted:
                        log.info("connected", scheduler=msg.scheduler_id)
                        return
                    if msg.reason.startswith("unknown worker"):
                        continue  # the answer to a heartbeat sent before this HELLO
                    log.warning("refused by the scheduler", reason=msg.reason)
                    time.sleep(1.0)
                    break
                if isinstance(msg, (P.DetokNew, P.DetokTokens, P.DetokFree)):  # from before a restart
                    reply = self.handle(msg)
                    if reply is not None:
                        sock.send_multipart(P.encode(reply))

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
        """Apply one message; returns the reply to send (or a refusal meaning 'say hello again')."""
        if isinstance(msg, P.DetokNew):
            for item in msg.items:
                try:
                    params = SamplingParams.from_dict(item.params)
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
        if isinstance(msg, P.Welcome) and not msg.accepted:
            return msg
        if isinstance(msg, P.Error):
            log.warning("scheduler reported an error", code=msg.code, message=msg.message)
        return None


def main(args) -> int:
    setup_logging(service="detokenizer")
    from services.engine import default_model_dir

    models = args.model or [str(default_model_dir())]
    svc = DetokenizerService(args.scheduler, models, worker_id=args.worker_id,
                             curve_keys=getattr(args, "curve_keys", None),
                             curve_client=getattr(args, "curve_client", None))
    signal.signal(signal.SIGTERM, lambda *_: svc.stop.set())
    signal.signal(signal.SIGINT, lambda *_: svc.stop.set())
    return svc.run()
