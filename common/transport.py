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
* Key directory (``zeroserve keys DIR``): ``create_curve_keys`` makes it; ``curve_server_keys``
  (the scheduler) and ``curve_client_keys`` (workers, detokenizer, clients) load their side of
  it, or raise ``CurveKeyError`` naming the missing file and the command that creates it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shutil
import socket as _socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from common.errors import CurveKeyError
from common.protocol import MAX_MESSAGE_SIZE, ProtocolError, decode, encode

__all__ = [
    "CURVE_CLIENT_ENV",
    "CURVE_KEYS_ENV",
    "DEFAULT_CURVE_CLIENT",
    "DEFAULT_HOST",
    "DEFAULT_HWM",
    "CurveClientKeys",
    "CurveKeyDir",
    "CurveServerKeys",
    "allow_client",
    "arecv_msg",
    "asend_msg",
    "bind_free_port",
    "check_client_name",
    "close_all",
    "create_curve_keys",
    "curve_client",
    "curve_client_keys",
    "curve_server",
    "curve_server_keys",
    "free_port",
    "free_port_block",
    "generate_keys",
    "is_loopback",
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


# --------------------------------------------------------------------------------------------
# CURVE key directory: one layout, made by `zeroserve keys DIR`, read by every process
# --------------------------------------------------------------------------------------------
#
#   DIR/server.key               the scheduler's public key       -> every host
#   DIR/server.key_secret        the scheduler's secret key       -> the scheduler host only
#   DIR/clients/NAME.key         client NAME's public key         (a copy in allowed/ lets it in)
#   DIR/clients/NAME.key_secret  client NAME's secret key         -> the hosts that run client NAME
#   DIR/allowed/NAME.key         the allow-list the scheduler reads at start (delete one to revoke)
#
# A worker, detokenizer or client host needs only server.key and clients/NAME.key_secret, at the
# same paths under its own copy of DIR.

CURVE_KEYS_ENV = "ZEROSERVE_CURVE_KEYS"
CURVE_CLIENT_ENV = "ZEROSERVE_CURVE_CLIENT"
DEFAULT_CURVE_CLIENT = "client"
CURVE_SERVER_NAME = "server"
CURVE_CLIENTS_DIR = "clients"
CURVE_ALLOWED_DIR = "allowed"
_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class CurveServerKeys:
    """What the scheduler needs to be a CURVE server: its key pair and the allow-list folder."""

    secret_key_file: Path
    allowed_dir: Path

    def socket_kwargs(self) -> dict[str, Any]:
        """``make_socket`` keyword arguments for a bound CURVE server socket."""
        return {"curve_server_secret_key": self.secret_key_file}


@dataclass(frozen=True)
class CurveClientKeys:
    """What a worker, detokenizer or client needs to connect as CURVE client ``name``."""

    name: str
    secret_key_file: Path
    server_public_key_file: Path

    def socket_kwargs(self) -> dict[str, Any]:
        """``make_socket`` keyword arguments for a connecting CURVE client socket."""
        return {"curve_client_secret_key": self.secret_key_file,
                "curve_server_public_key": self.server_public_key_file}


def _keys_cmd(key_dir: Path, client: str | None = None) -> str:
    return f"`zeroserve keys {key_dir}" + (f" --client {client}`" if client else "`")


def check_client_name(name: str) -> str:
    """A client name is a file name in the key directory: letters, digits, ``_ . -`` (max 64)."""
    if not isinstance(name, str) or not _CLIENT_NAME.fullmatch(name):
        raise CurveKeyError(f"bad CURVE client name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
                            "starting with a letter or digit")
    return name


def _read_key_file(path: Path, what: str, make_it: str, *, secret: bool) -> None:
    """Fail with a CurveKeyError that says what to do unless ``path`` holds a readable key."""
    if not path.is_file():
        raise CurveKeyError(f"CURVE key file missing: {path} ({what}); {make_it}")
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except PermissionError:
        raise CurveKeyError(f"cannot read CURVE key file {path} ({what}): permission denied for uid {os.getuid()}; "
                            "make it readable by the user this process runs as (in the compose image: "
                            "`chown -R 10001 DIR` on the host)") from None
    except (OSError, ValueError) as e:
        raise CurveKeyError(f"broken CURVE key file {path} ({what}): {e}; {make_it}") from None
    if secret and secret_key is None:
        raise CurveKeyError(f"CURVE key file {path} ({what}) holds no secret key; {make_it}")
    if public is None:
        raise CurveKeyError(f"CURVE key file {path} ({what}) holds no public key; {make_it}")


def _key_dir(key_dir: str | os.PathLike) -> Path:
    d = Path(key_dir).expanduser()
    if not d.is_dir():
        raise CurveKeyError(f"CURVE key directory {d} does not exist; create it with {_keys_cmd(d)} "
                            "(on the scheduler host, then copy the files each host needs)")
    return d


def curve_server_keys(key_dir: str | os.PathLike | None) -> CurveServerKeys | None:
    """The scheduler's side of a key directory (None without one: plain, unauthenticated sockets).

    Checks the files now, so a scheduler with a broken key directory stops at start with a
    message naming the missing file, instead of refusing every peer later."""
    if key_dir is None or key_dir == "" or key_dir is False:
        return None
    d = _key_dir(key_dir)
    secret = d / f"{CURVE_SERVER_NAME}.key_secret"
    _read_key_file(secret, "the scheduler's secret key", f"create it with {_keys_cmd(d)} on this host", secret=True)
    allowed = d / CURVE_ALLOWED_DIR
    if not allowed.is_dir() or not any(allowed.glob("*.key")):
        raise CurveKeyError(f"no allowed client keys in {allowed} (every worker, detokenizer and client would be "
                            f"refused); add one with {_keys_cmd(d, DEFAULT_CURVE_CLIENT)}")
    for f in sorted(allowed.glob("*.key")):
        _read_key_file(f, "an allowed client's public key", f"delete it, or re-copy it from {d / CURVE_CLIENTS_DIR}",
                       secret=False)
    return CurveServerKeys(secret_key_file=secret, allowed_dir=allowed)


def curve_client_keys(key_dir: str | os.PathLike | None, name: str | None = None) -> CurveClientKeys | None:
    """Client ``name``'s side of a key directory (None without one: a plain connection).

    ``name`` defaults to ``DEFAULT_CURVE_CLIENT`` ("client"). Needs ``clients/NAME.key_secret``
    and ``server.key``; the error says which is missing and where it comes from."""
    if key_dir is None or key_dir == "" or key_dir is False:
        return None
    name = check_client_name(name or DEFAULT_CURVE_CLIENT)
    d = _key_dir(key_dir)
    secret = d / CURVE_CLIENTS_DIR / f"{name}.key_secret"
    _read_key_file(secret, f"the secret key of CURVE client {name!r}",
                   f"create it with {_keys_cmd(d, name)} on the scheduler host and copy "
                   f"{CURVE_CLIENTS_DIR}/{name}.key_secret here (or pick another client name with --curve-client)",
                   secret=True)
    server_public = d / f"{CURVE_SERVER_NAME}.key"
    _read_key_file(server_public, "the scheduler's public key",
                   f"copy {CURVE_SERVER_NAME}.key from the scheduler host's key directory (made by {_keys_cmd(d)})",
                   secret=False)
    return CurveClientKeys(name=name, secret_key_file=secret, server_public_key_file=server_public)


@dataclass
class CurveKeyDir:
    """What ``create_curve_keys`` did: per file, whether it was created now or already there."""

    directory: Path
    server_created: bool
    clients_created: dict[str, bool]  # name -> created now (False: kept the existing pair)
    clients_allowed: dict[str, bool]  # name -> its public key is in allowed/

    @property
    def server_public(self) -> Path:
        """The scheduler's public key: every host needs it."""
        return self.directory / f"{CURVE_SERVER_NAME}.key"

    @property
    def server_secret(self) -> Path:
        """The scheduler's secret key: stays on the scheduler host."""
        return self.directory / f"{CURVE_SERVER_NAME}.key_secret"

    @property
    def allowed_dir(self) -> Path:
        """The allow-list folder the scheduler's authenticator reads at start."""
        return self.directory / CURVE_ALLOWED_DIR

    def client_public(self, name: str) -> Path:
        """Client ``name``'s public key (copied into allowed/ to let it in)."""
        return self.directory / CURVE_CLIENTS_DIR / f"{name}.key"

    def client_secret(self, name: str) -> Path:
        """Client ``name``'s secret key: goes to the hosts that run that client."""
        return self.directory / CURVE_CLIENTS_DIR / f"{name}.key_secret"


def create_curve_keys(directory: str | os.PathLike, clients: Iterable[str] = (DEFAULT_CURVE_CLIENT,)) -> CurveKeyDir:
    """Create (or complete) a key directory: the server pair, one pair per client name, and the
    allow-list. Existing key pairs are never replaced (that would lock every host out), and an
    existing client whose key was removed from allowed/ (revoked) stays out; a client created
    now is allowed. Safe to run again to add clients; restart the scheduler afterwards."""
    d = Path(directory).expanduser().resolve()
    names = [check_client_name(n) for n in dict.fromkeys(clients)]
    if d.exists() and not d.is_dir():
        raise CurveKeyError(f"{d} exists and is not a directory; pick another path for the CURVE keys")
    d.mkdir(parents=True, exist_ok=True)
    server_created = _ensure_pair(d, CURVE_SERVER_NAME, "the scheduler's key pair")
    clients_dir = d / CURVE_CLIENTS_DIR
    allowed = d / CURVE_ALLOWED_DIR
    allowed.mkdir(exist_ok=True)
    created: dict[str, bool] = {}
    for name in names:
        created[name] = _ensure_pair(clients_dir, name, f"client {name!r}'s key pair")
        if created[name]:
            allow_client(allowed, clients_dir / f"{name}.key")
    known = sorted({p.name[: -len(".key_secret")] for p in clients_dir.glob("*.key_secret")} | set(names))
    return CurveKeyDir(directory=d, server_created=server_created,
                       clients_created={n: created.get(n, False) for n in known},
                       clients_allowed={n: (allowed / f"{n}.key").is_file() for n in known})


def _ensure_pair(directory: Path, name: str, what: str) -> bool:
    """Create ``name.key`` + ``name.key_secret`` unless both exist; True when created now."""
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.is_file() and secret.is_file():
        return False
    if public.exists() or secret.exists():
        have, lack = (public, secret) if public.exists() else (secret, public)
        raise CurveKeyError(f"{have} exists but {lack} does not ({what}); not replacing half a key pair: restore "
                            f"{lack.name}, or delete {have.name} to make a new pair (hosts holding the old key then "
                            "need the new one)")
    generate_keys(directory, name)
    return True


def is_loopback(host: str) -> bool:
    """True when ``host`` (a bind host) is reachable only from this machine."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
