"""CURVE (ZeroMQ's authentication and encryption): key files, the key directory layout that
`zeroserve keys DIR` makes and every process reads, and the scheduler's ZAP allow-list.

* ``generate_keys`` (zmq.auth key files), ``curve_server`` / ``curve_client`` (call before
  bind/connect, or pass the key files to ``transport.make_socket``), ``start_authenticator``
  (a ZAP handler thread with an allow-list directory of client public keys).
* Key directory: ``create_curve_keys`` makes it; ``curve_server_keys`` (the scheduler) and
  ``curve_client_keys`` (workers, detokenizer, clients) load their side of it, or raise
  ``CurveKeyError`` naming the missing file and the command that creates it.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from common.errors import CurveKeyError

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
