"""The detokenizer process: token ids in, UTF-8-safe text deltas and stop-string hits out.

Its state (state.py: one IncrementalDetokenizer per live sequence) answers each `DetokTokens`
batch with one `DetokOutputs`. It keeps no state the scheduler cannot rebuild: after a restart the
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
from zeroserve.common.catalog import CatalogEntry, load_catalog
from zeroserve.common.codec import ProtocolError
from zeroserve.common.config import DetokenizerArgs, from_cli_args
from zeroserve.common.curve import curve_client_keys
from zeroserve.common.log import get_logger, setup_logging
from zeroserve.common.memory import freeze_startup_heap
from zeroserve.common.model_config import ModelConfig
from zeroserve.common.tokenizer import load_tokenizer
from zeroserve.services.backend_peer import BackendPeer, Refused
from zeroserve.services.detokenizer.state import Detokenizer

log = get_logger("detokenizer")


class DetokenizerService:
    def __init__(self, scheduler_addr: str, model_dirs: list[str], worker_id: str | None = None,
                 heartbeat_interval_s: float = 1.0, curve_keys: str | None = None,
                 curve_client: str | None = None, catalog: dict[str, CatalogEntry] | None = None) -> None:
        self.scheduler_addr = scheduler_addr
        self.curve = curve_client_keys(curve_keys, curve_client, role="detokenizer")  # None: a plain connection
        self.worker_id = worker_id or f"detok-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        # no transformers import: tokenizers alone (common/tokenizer.py)
        self.state = Detokenizer({ModelConfig.from_dir(d).name: load_tokenizer(d) for d in model_dirs}, catalog)
        self.hb_interval = heartbeat_interval_s
        self.stop = threading.Event()

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
                       model=self.state.default or "")

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
            wait = peer.maybe_heartbeat(lambda: {"live": len(self.state.states)})
            if peer.rejoin.is_set():  # we left a scheduler that dropped or went silent (several addresses)
                peer.rejoin.clear()
                self.state.clear()
                return
            if not peer.ch.poll(min(wait, 0.2)):
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
                    self.state.clear()
                    return
                if isinstance(got[1], P.Pong):  # a heartbeat's answer (noted above)
                    continue
                if not peer.fence.admit(getattr(got[1], "term", 0)):  # from a deposed scheduler
                    continue
                self._answer(peer, got[1])

    def _answer(self, peer: BackendPeer, msg) -> None:
        reply = self.state.handle(msg)
        if reply is not None:
            peer.ch.send(reply)

def main(args) -> int:
    setup_logging(service="detokenizer")
    dargs = from_cli_args(DetokenizerArgs, args)
    catalog = load_catalog(dargs.models_dir, dargs.models_config)
    svc = DetokenizerService(dargs.scheduler, dargs.models, worker_id=dargs.worker_id,
                             heartbeat_interval_s=dargs.heartbeat_interval_s, curve_keys=dargs.curve_keys,
                             curve_client=dargs.curve_client, catalog=catalog)
    signal.signal(signal.SIGTERM, lambda *_: svc.stop.set())
    signal.signal(signal.SIGINT, lambda *_: svc.stop.set())
    return svc.run()
