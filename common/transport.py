"""ZeroMQ socket helpers shared by every process and the client.

* ``make_context()`` / ``make_socket(ctx, zmq.ROUTER, bind=..., connect=..., identity=...)``:
  sockets with safe defaults: LINGER 0 (closing never blocks), bounded SNDHWM/RCVHWM,
  MAXMSGSIZE (a peer sending a bigger frame is disconnected by libzmq; it reconnects by
  itself and the socket keeps serving everyone else), ROUTER_MANDATORY on ROUTER sockets (a
  send to a peer that is gone fails instead of vanishing) and ROUTER_HANDOVER (a restarted
  peer reusing its identity takes the route over), TCP keepalive. Works with ``zmq.Context``
  and ``zmq.asyncio.Context``.
* Addresses: a bare port number means ``tcp://127.0.0.1:<port>``; ``bind_free_port(sock)``
  binds an ephemeral port on 127.0.0.1 and returns the address. Bind elsewhere only when
  told to (and then use CURVE).
* ``send_msg`` / ``recv_msg`` (and ``asend_msg`` / ``arecv_msg`` for asyncio sockets) put
  ``common.protocol`` messages on the wire with ``copy=False`` frames. The first frame is the
  peer identity on ROUTER sockets and the topic on PUB/SUB sockets; ``recv_msg`` returns it
  (None on DEALER). A bad message raises ``ProtocolError`` with ``.identity`` set so the
  caller can answer it; the socket is fine afterwards.
* ``try_send``: a non-blocking send for loops that must never stall (the scheduler): False
  when the peer is gone or its queue is full.
* CURVE: ``generate_keys`` (zmq.auth key files), ``curve_server`` / ``curve_client`` (call
  before bind/connect, or pass the key files to ``make_socket``), ``start_authenticator``
  (a ZAP handler thread with an allow-list directory of client public keys).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket as _socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from common.protocol import MAX_MESSAGE_SIZE, ProtocolError, decode, encode

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_HWM",
    "allow_client",
    "arecv_msg",
    "asend_msg",
    "bind_free_port",
    "close_all",
    "curve_client",
    "curve_server",
    "free_port",
    "free_port_block",
    "generate_keys",
    "make_context",
    "make_socket",
    "recv_msg",
    "send_msg",
    "start_authenticator",
    "tcp_addr",
    "try_send",
]

DEFAULT_HWM = 10_000  # messages queued per peer before sends block (or fail with NOBLOCK)
DEFAULT_HOST = "127.0.0.1"
TCP_KEEPALIVE_IDLE_S = 30
TCP_KEEPALIVE_INTVL_S = 10
TCP_KEEPALIVE_CNT = 3

_TOPIC_FIRST = (zmq.PUB, zmq.XPUB, zmq.SUB, zmq.XSUB)


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
    reconnect_ivl_max_ms: int = 2000,
    curve_server_secret_key: str | os.PathLike | None = None,
    curve_client_secret_key: str | os.PathLike | None = None,
    curve_server_public_key: str | os.PathLike | None = None,
) -> zmq.Socket:
    """A socket with safe defaults, optionally bound / connected (after CURVE is set up).

    ``identity`` sets the routing id a DEALER shows to a ROUTER (non-empty, <= 255 bytes,
    not starting with a zero byte). ``subscribe`` (SUB) is a topic or list of topics.
    ``immediate`` makes a DEALER queue messages only to completed connections (so a send
    with no scheduler reachable fails with NOBLOCK instead of piling up).
    ``heartbeat_*`` turn on ZMTP heartbeats (dead TCP peers detected by libzmq itself).
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


def _frames(sock: zmq.Socket, msg: Any, identity: bytes | None, max_message_size: int) -> list:
    frames = encode(msg, max_message_size=max_message_size)
    if identity is not None:
        return [identity, *frames]
    st = sock.type
    if st == zmq.ROUTER:
        raise ValueError("sending on a ROUTER socket needs the peer identity")
    if st in _TOPIC_FIRST:
        raise ValueError("sending on a PUB socket needs a topic (pass it as identity)")
    return frames


def send_msg(
    sock: zmq.Socket,
    msg: Any,
    identity: bytes | None = None,
    *,
    flags: int = 0,
    max_message_size: int = MAX_MESSAGE_SIZE,
) -> None:
    """Encode and send; ``identity`` is the peer (ROUTER) or the topic (PUB).

    Raises ProtocolError for a message that cannot be encoded, zmq.Again with NOBLOCK when the
    queue is full, zmq.ZMQError(EHOSTUNREACH) on a ROUTER for an unknown peer. Arrays are
    sent zero-copy: do not modify them until the send is done.
    """
    sock.send_multipart(_frames(sock, msg, identity, max_message_size), flags=flags, copy=False)


def try_send(
    sock: zmq.Socket, msg: Any, identity: bytes | None = None, *, max_message_size: int = MAX_MESSAGE_SIZE
) -> bool:
    """Non-blocking send: False when the peer is gone (ROUTER) or its queue is full."""
    try:
        sock.send_multipart(_frames(sock, msg, identity, max_message_size), flags=zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        return False
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:
            return False
        raise


def _split(sock_type: int, frames: list, max_message_size: int) -> tuple[bytes | None, Any]:
    head: bytes | None = None
    if sock_type == zmq.ROUTER or sock_type in _TOPIC_FIRST:
        if not frames:
            raise ProtocolError("empty message")
        head = frames[0].bytes if isinstance(frames[0], zmq.Frame) else bytes(frames[0])
        frames = frames[1:]
    try:
        return head, decode(frames, max_message_size=max_message_size)
    except ProtocolError as e:
        e.identity = head
        raise


def recv_msg(
    sock: zmq.Socket,
    *,
    timeout: float | None = None,
    flags: int = 0,
    max_message_size: int = MAX_MESSAGE_SIZE,
) -> tuple[bytes | None, Any]:
    """Receive and decode one message -> (identity or topic or None, message).

    ``timeout`` in seconds raises TimeoutError when nothing arrives. A bad message raises
    ProtocolError (``.identity`` = who sent it); it has been consumed, the next call goes on.
    Arrays in the message are read-only views of the received frames.
    """
    if timeout is not None and not sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN):
        raise TimeoutError(f"no message within {timeout} s")
    frames = sock.recv_multipart(flags=flags if timeout is None else flags | zmq.NOBLOCK, copy=False)
    return _split(sock.type, frames, max_message_size)


async def asend_msg(
    sock: zmq.asyncio.Socket, msg: Any, identity: bytes | None = None, *, max_message_size: int = MAX_MESSAGE_SIZE
) -> None:
    """``send_msg`` for a ``zmq.asyncio`` socket."""
    await sock.send_multipart(_frames(sock, msg, identity, max_message_size), copy=False)


async def arecv_msg(
    sock: zmq.asyncio.Socket, *, timeout: float | None = None, max_message_size: int = MAX_MESSAGE_SIZE
) -> tuple[bytes | None, Any]:
    """``recv_msg`` for a ``zmq.asyncio`` socket (TimeoutError after ``timeout`` seconds)."""
    fut = sock.recv_multipart(copy=False)
    if timeout is None:
        frames = await fut
    else:
        try:
            frames = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(f"no message within {timeout} s") from None
    return _split(sock.type, frames, max_message_size)


def close_all(*socks: zmq.Socket | None) -> None:
    """Close sockets (LINGER 0), ignoring ones already closed or None."""
    for s in socks:
        if s is not None and not s.closed:
            s.close(linger=0)


# --------------------------------------------------------------------------------------------
# CURVE
# --------------------------------------------------------------------------------------------


def generate_keys(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (secret, mode 0600) in ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(d), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def allow_client(allowed_dir: str | os.PathLike, public_key_file: str | os.PathLike) -> Path:
    """Copy a client's public key file into an allow-list directory (reconfigure the authenticator after)."""
    d = Path(allowed_dir)
    d.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(public_key_file, d / Path(public_key_file).name))


def curve_server(sock: zmq.Socket, secret_key_file: str | os.PathLike) -> None:
    """Make ``sock`` a CURVE server with the key pair in ``secret_key_file`` (before bind)."""
    public, secret = zmq.auth.load_certificate(str(secret_key_file))
    if secret is None:
        raise ValueError(f"{secret_key_file} holds no secret key")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def curve_client(
    sock: zmq.Socket, secret_key_file: str | os.PathLike, server_public_key_file: str | os.PathLike
) -> None:
    """Make ``sock`` a CURVE client: its own key pair, and the server's public key (before connect)."""
    public, secret = zmq.auth.load_certificate(str(secret_key_file))
    if secret is None:
        raise ValueError(f"{secret_key_file} holds no secret key")
    server_public, _ = zmq.auth.load_certificate(str(server_public_key_file))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def start_authenticator(
    ctx: zmq.Context, allowed_keys_dir: str | os.PathLike, *, allow_ips: Iterable[str] = ()
) -> ThreadAuthenticator:
    """Start a ZAP handler on ``ctx`` that admits only CURVE clients whose public key file is in
    ``allowed_keys_dir`` (and, if given, only from ``allow_ips``). Start it before binding;
    call ``.stop()`` before closing the context. After adding keys, call
    ``auth.configure_curve(domain="*", location=dir)`` again."""
    if isinstance(ctx, zmq.asyncio.Context):  # the authenticator thread needs a blocking context
        ctx = zmq.Context.shadow(ctx.underlying)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    ips = list(allow_ips)
    if ips:
        auth.allow(*ips)
    auth.configure_curve(domain="*", location=str(allowed_keys_dir))
    return auth
