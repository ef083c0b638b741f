"""ZeroMQ socket helpers shared by every process and the client.

* ``make_context()`` / ``make_socket(ctx, zmq.ROUTER, bind=..., connect=..., identity=...)``:
  sockets with safe defaults: LINGER 0 (closing never blocks), bounded SNDHWM/RCVHWM,
  MAXMSGSIZE (a peer sending a bigger frame is disconnected by libzmq; it reconnects by
  itself and the socket keeps serving everyone else), ROUTER_MANDATORY on ROUTER sockets (a
  send to a peer that is gone fails instead of vanishing) and ROUTER_HANDOVER (a restarted
  peer reusing its identity takes the route over; ``router_handover=False`` keeps one live
  connection per identity instead: libzmq never reads a second DEALER that shows an identity
  in use, and the identity is free again once the first connection is gone, which ZMTP
  heartbeats, ``heartbeat_ivl_ms``, notice for peers that vanish without closing it; the
  scheduler's backend ROUTER works that way), TCP keepalive. Works with ``zmq.Context``
  and ``zmq.asyncio.Context``.
* Addresses: a bare port number means ``tcp://127.0.0.1:<port>``; ``bind_free_port(sock)``
  binds an ephemeral port on 127.0.0.1 and returns the address. Bind elsewhere only when
  told to (and then use CURVE).
* ``Channel``: a socket plus the codec; send, try_send (never blocks), recv, and dispatch by
  message type. Every process uses it (the asyncio client encodes with ``zeroserve.common.codec`` itself).
* CURVE keys and the allow-list live in ``common/curve.py``; ``make_socket`` takes key files.
"""

from __future__ import annotations

import ipaddress
import os
import socket as _socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import zmq
import zmq.asyncio

from zeroserve.common.codec import MAX_MESSAGE_SIZE, ProtocolError, decode, encode
from zeroserve.common.curve import curve_client, curve_server
from zeroserve.common.errors import InvalidRequest

__all__ = ["DEFAULT_HOST", "DEFAULT_HWM", "Channel", "bind_free_port", "close_all", "free_port",
           "free_port_block", "is_loopback", "make_context", "make_socket", "tcp_addr"]

DEFAULT_HWM = 10_000  # messages queued per peer before sends block (or fail with NOBLOCK)
DEFAULT_HOST = "127.0.0.1"
TCP_KEEPALIVE_IDLE_S = 30
TCP_KEEPALIVE_INTVL_S = 10
TCP_KEEPALIVE_CNT = 3

_TOPIC_FIRST = (zmq.PUB, zmq.XPUB, zmq.SUB, zmq.XSUB)
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)
_sync_send = zmq.Socket.send


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)`` without its per-frame Flag-enum
    arithmetic and checks: 5 us instead of 16 for a 3-frame message on the dev box, paid on
    every message of the services. ZeroMQ queues a multipart message whole or not at all
    (the high-water mark is checked at its first frame), so an error comes before anything
    was queued. Blocking sockets only: a zmq.asyncio socket must send through its own
    futures, which re-check its edge-triggered events afterwards."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _sync_send(sock, f, flags | _SNDMORE if i < last else flags, copy=False)


def make_context(io_threads: int = 1, *, asyncio_ctx: bool = False) -> zmq.Context:
    """A new context (``zmq.asyncio.Context`` with ``asyncio_ctx``). Close with ``ctx.destroy(linger=0)``."""
    ctx = zmq.asyncio.Context(io_threads) if asyncio_ctx else zmq.Context(io_threads)
    return ctx


def tcp_addr(addr: str | int, host: str = DEFAULT_HOST) -> str:
    """``5555`` -> ``tcp://127.0.0.1:5555``; anything with ``://`` is returned as it is."""
    if isinstance(addr, int) and not isinstance(addr, bool):
        return f"tcp://{_host(host)}:{addr}"
    if isinstance(addr, str) and "://" in addr:
        return addr
    if isinstance(addr, str) and addr.isdigit():
        return f"tcp://{_host(host)}:{addr}"
    raise ValueError(f"not a ZeroMQ address or port: {addr!r} (expected e.g. tcp://127.0.0.1:5555 or 5555)")


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _as_list(v: Any) -> list:
    if v is None:
        return []
    if isinstance(v, (str, int)):
        return [v]
    return list(v)


def make_socket(
    ctx: zmq.Context,
    sock_type: int,
    *,
    bind: str | int | Iterable[str | int] | None = None,
    connect: str | int | Iterable[str | int] | None = None,
    identity: bytes | str | None = None,
    subscribe: bytes | Iterable[bytes] | None = None,
    sndhwm: int = DEFAULT_HWM,
    rcvhwm: int = DEFAULT_HWM,
    max_message_size: int = MAX_MESSAGE_SIZE,
    router_mandatory: bool = True,
    router_handover: bool = True,
    immediate: bool = False,
    tcp_keepalive: bool = True,
    heartbeat_ivl_ms: int | None = None,
    heartbeat_timeout_ms: int | None = None,
    reconnect_ivl_ms: int = 100,
    # a restarted scheduler waits for its workers, detokenizer and clients to reconnect before
    # their streams go on: libzmq's backoff would have grown to 2 s during a 2 s restart; at
    # 250 ms a dead peer costs 4 connection attempts a second from each socket dialing it
    reconnect_ivl_max_ms: int = 250,
    curve_server_secret_key: str | os.PathLike | None = None,
    curve_client_secret_key: str | os.PathLike | None = None,
    curve_server_public_key: str | os.PathLike | None = None,
    zap_domain: str | None = None,
) -> zmq.Socket:
    """A socket with safe defaults, optionally bound / connected (after CURVE is set up).

    ``identity`` sets the routing id a DEALER shows to a ROUTER (non-empty, <= 255 bytes,
    not starting with a zero byte). ``subscribe`` (SUB) is a topic or list of topics.
    ``immediate`` makes a DEALER queue messages only to completed connections (so a send
    with no scheduler reachable fails with NOBLOCK instead of piling up).
    ``heartbeat_*`` turn on ZMTP heartbeats (dead TCP peers detected by libzmq itself).
    ``zap_domain`` (a bound CURVE server) names the ZAP domain the authenticator admits peers
    by (``curve.start_authenticator``), so each socket can have its own allow-list.
    """
    sock = ctx.socket(sock_type)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ivl_max_ms)
        if tcp_keepalive:
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)
        if heartbeat_ivl_ms:
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ivl_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms or 3 * heartbeat_ivl_ms)
        if sock_type == zmq.ROUTER:
            if router_mandatory:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if router_handover:
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if immediate:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if identity is not None:
            ident = identity.encode("utf-8") if isinstance(identity, str) else bytes(identity)
            if not 0 < len(ident) <= 255 or ident[0] == 0:
                raise ValueError(f"identity must be 1..255 bytes not starting with a zero byte, got {ident!r}")
            sock.setsockopt(zmq.ROUTING_ID, ident)
        if sock_type == zmq.SUB:
            for topic in ([subscribe] if isinstance(subscribe, bytes) else _as_list(subscribe)):
                sock.setsockopt(zmq.SUBSCRIBE, topic)
        if curve_server_secret_key is not None:
            curve_server(sock, curve_server_secret_key)
        if curve_client_secret_key is not None or curve_server_public_key is not None:
            if curve_client_secret_key is None or curve_server_public_key is None:
                raise ValueError("a CURVE client needs both curve_client_secret_key and curve_server_public_key")
            curve_client(sock, curve_client_secret_key, curve_server_public_key)
        if zap_domain is not None:  # before bind: libzmq reads it per incoming handshake
            sock.setsockopt_string(zmq.ZAP_DOMAIN, zap_domain)
        for addr in _as_list(bind):
            sock.bind(tcp_addr(addr))
        for addr in _as_list(connect):
            sock.connect(tcp_addr(addr))
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bind_free_port(sock: zmq.Socket, host: str = DEFAULT_HOST) -> str:
    """Bind an ephemeral TCP port on ``host`` (no race: the kernel picks it); returns the address."""
    if ":" in host.strip("[]"):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(f"tcp://{_host(host)}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that was free a moment ago (racy; prefer ``bind_free_port`` where you can)."""
    family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
    with _socket.socket(family, _socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def free_port_block(n: int = 4, host: str = DEFAULT_HOST) -> int:
    """A base port with ``n`` consecutive free ports (a scheduler binds port..port+3)."""
    import random

    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for i in range(n):
                s = _socket.socket()
                socks.append(s)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports found on {host}")


class Channel:
    """One socket and the codec: every process sends and receives its messages through one.

    ``to`` is the peer identity on a ROUTER and the topic on a PUB; ``recv`` returns the peer
    (ROUTER), the topic (SUB) or None (DEALER) with the message. A bad message raises
    ``ProtocolError`` with ``.identity`` set to its sender; it has been consumed and the socket
    is fine. Arrays are sent zero-copy: do not modify them until the send is done.
    """

    def __init__(self, sock: zmq.Socket, *, max_message_size: int = MAX_MESSAGE_SIZE) -> None:
        self.sock = sock
        self.max_message_size = max_message_size
        self._peer_first = sock.type == zmq.ROUTER or sock.type in _TOPIC_FIRST

    def frames(self, msg: Any, to: bytes | None = None) -> list:
        frames = encode(msg, max_message_size=self.max_message_size)
        if to is not None:
            return [to, *frames]
        if self._peer_first:
            raise ValueError("sending on a ROUTER needs the peer identity, on a PUB the topic (pass it as to=)")
        return frames

    def send(self, msg: Any, to: bytes | None = None) -> None:
        """Blocking send. Raises ProtocolError for a message that cannot be encoded and
        zmq.ZMQError(EHOSTUNREACH) on a ROUTER for a peer that is gone."""
        send_frames(self.sock, self.frames(msg, to))

    def try_send(self, msg: Any, to: bytes | None = None) -> bool:
        """Non-blocking send for loops that must never stall: False when the peer is gone, its
        queue is full or (DEALER with IMMEDIATE) nothing is connected."""
        return self.try_send_frames(self.frames(msg, to))

    def try_send_frames(self, frames: list) -> bool:
        try:
            send_frames(self.sock, frames, _NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def poll(self, timeout_s: float) -> bool:
        return bool(self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))

    def recv(self, timeout: float | None = None) -> tuple[bytes | None, Any]:
        """One message -> (peer or topic or None, message); TimeoutError after ``timeout`` s."""
        if timeout is not None and not self.poll(timeout):
            raise TimeoutError(f"no message within {timeout} s")
        return self._split(self.sock.recv_multipart(flags=0 if timeout is None else zmq.NOBLOCK, copy=False))

    def recv_nowait(self) -> tuple[bytes | None, Any] | None:
        """A waiting message, or None when there is none."""
        try:
            frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._split(frames)

    def _split(self, frames: list) -> tuple[bytes | None, Any]:
        head = None
        if self._peer_first:
            if not frames:
                raise ProtocolError("empty message")
            head = frames[0].bytes if isinstance(frames[0], zmq.Frame) else bytes(frames[0])
            frames = frames[1:]
        try:
            return head, decode(frames, max_message_size=self.max_message_size)
        except ProtocolError as e:
            e.identity = head
            raise

    def dispatch(self, handlers: Mapping[type, Callable[[bytes | None, Any], Any]], *,
                 on_bad: Callable[[ProtocolError], Any], on_error: Callable[[bytes | None, Any, Exception], Any],
                 limit: int = 10_000) -> int:
        """Handle every waiting message (at most ``limit``) by its type; returns how many.

        A message that does not decode goes to ``on_bad``; a type with no handler and any
        exception a handler raises go to ``on_error``, so one bad peer never stops the loop."""
        n = 0
        while n < limit:
            try:
                got = self.recv_nowait()
            except ProtocolError as e:
                n += 1
                on_bad(e)
                continue
            if got is None:
                break
            n += 1
            peer, msg = got
            handler = handlers.get(type(msg))
            try:
                if handler is None:
                    raise InvalidRequest(f"{type(msg).__name__} is not a message this socket takes")
                handler(peer, msg)
            except Exception as e:  # noqa: BLE001 - reported to on_error, never fatal
                on_error(peer, msg, e)
        return n

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(linger=0)


def close_all(*socks: zmq.Socket | None) -> None:
    """Close sockets (LINGER 0), ignoring ones already closed or None."""
    for s in socks:
        if s is not None and not s.closed:
            s.close(linger=0)


def is_loopback(host: str) -> bool:
    """True when ``host`` (a bind host) is reachable only from this machine."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
