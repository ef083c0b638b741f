"""CURVE (ZeroMQ's authentication and encryption): key files, the key directory layout that
`zeroserve keys DIR` makes and every process reads, and the scheduler's ZAP allow-lists.

* ``generate_keys`` (zmq.auth key files), ``curve_server`` / ``curve_client`` (call before
  bind/connect, or pass the key files to ``transport.make_socket``), ``start_authenticator``
  (a ZAP handler thread admitting the public keys of allow-list folders, per ZAP domain).
* Key directory: one key pair per process role (client, worker, detokenizer), an allow-list
  per role. ``create_curve_keys`` makes it; ``curve_server_keys`` (the scheduler) and
  ``curve_client_keys`` (workers, detokenizer, clients: each its own role) load their side of
  it, or raise ``CurveKeyError`` naming the missing file and the command that creates it.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from zeroserve.common.errors import CurveKeyError

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
    """Copy a public key file into an allow-list directory (restart the authenticator after)."""
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


class CurveAllowList:
    """A ZAP credentials provider (pyzmq ``configure_curve_callback``): ZAP domain -> the z85
    public keys admitted on sockets of that domain. A callback rather than ``configure_curve``
    because a domain may admit the keys of several folders (backend: workers + detokenizers)."""

    def __init__(self, keys: Mapping[str, Iterable[bytes]]) -> None:
        self.keys = {domain: frozenset(k) for domain, k in keys.items()}

    @classmethod
    def from_dirs(cls, dirs: Mapping[str, Iterable[str | os.PathLike]]) -> CurveAllowList:
        """Read the ``*.key`` files of each domain's folders now (a missing folder admits nobody)."""
        return cls({domain: {k for f in folders if Path(f).is_dir() for k in zmq.auth.load_certificates(str(f))}
                    for domain, folders in dirs.items()})

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys.get(domain, ())


def start_authenticator(
    ctx: zmq.Context, allowed: str | os.PathLike | Mapping[str, Iterable[str | os.PathLike]], *,
    allow_ips: Iterable[str] = (),
) -> ThreadAuthenticator:
    """Start a ZAP handler on ``ctx`` that admits only CURVE clients whose public key file is in
    an allow-list folder (and, if given, only from ``allow_ips``). ``allowed``: one folder for
    sockets without a ZAP domain, or ZAP domain -> its folders (a socket names its domain with
    ``make_socket(zap_domain=...)``; a domain not listed admits nobody). Keys are read now: start
    a new one after changing them. Start it before binding; ``.stop()`` it before closing ``ctx``."""
    if isinstance(ctx, zmq.asyncio.Context):  # the authenticator thread needs a blocking context
        ctx = zmq.Context.shadow(ctx.underlying)
    dirs = {"*": [allowed]} if isinstance(allowed, (str, os.PathLike)) else allowed  # "*": sockets without a domain
    provider = CurveAllowList.from_dirs(dirs)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    ips = list(allow_ips)
    if ips:
        auth.allow(*ips)
    for domain in provider.keys:
        auth.configure_curve_callback(domain, provider)
    return auth


# --------------------------------------------------------------------------------------------
# CURVE key directory: one layout, made by `zeroserve keys DIR`, read by every process
# --------------------------------------------------------------------------------------------
#
#   DIR/server.key                     the scheduler's public key      -> every host
#   DIR/server.key_secret              the scheduler's secret key      -> the scheduler host only
#   DIR/clients/NAME.key_secret        client NAME's secret key        -> the hosts that run client NAME
#   DIR/workers/NAME.key_secret        worker key NAME's secret key    -> the worker hosts that use it
#   DIR/detokenizers/NAME.key_secret   detokenizer NAME's secret key   -> the detokenizer's host
#   DIR/ROLEDIR/NAME.key               its public key (a copy in allowed/ROLEDIR/ lets it in)
#   DIR/allowed/{clients,workers,detokenizers}/NAME.key
#                                      the allow-lists the scheduler reads at start (delete one to revoke)
#
# A worker, detokenizer or client host needs only server.key and its role's NAME.key_secret, at
# the same paths under its own copy of DIR. Each scheduler socket admits the roles in
# SOCKET_ROLES, so a client's key cannot pose as a worker or read prompts on the steps port.

CURVE_KEYS_ENV = "ZEROSERVE_CURVE_KEYS"
CURVE_CLIENT_ENV = "ZEROSERVE_CURVE_CLIENT"
CURVE_ROLES = ("client", "worker", "detokenizer")  # each role's default key name is the role's name
ROLE_DIRS = {"client": "clients", "worker": "workers", "detokenizer": "detokenizers"}
DEFAULT_CURVE_CLIENT = "client"
CURVE_SERVER_NAME = "server"
CURVE_CLIENTS_DIR = ROLE_DIRS["client"]
CURVE_ALLOWED_DIR = "allowed"
# the scheduler's sockets (their ZAP domain is the socket's name) and the roles each admits
SOCKET_ROLES = {"client": ("client",), "backend": ("worker", "detokenizer"), "steps": ("worker", "detokenizer"),
                "events": CURVE_ROLES}
_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _check_role(role: str) -> str:
    if role not in ROLE_DIRS:
        raise ValueError(f"unknown CURVE role {role!r}: one of {', '.join(CURVE_ROLES)}")
    return role


@dataclass(frozen=True)
class CurveServerKeys:
    """What the scheduler needs to be a CURVE server: its key pair and the allow-list folders."""

    secret_key_file: Path
    allowed_dir: Path  # DIR/allowed: one folder per role in it

    def socket_kwargs(self) -> dict[str, Any]:
        """``make_socket`` keyword arguments for a bound CURVE server socket (plus its zap_domain)."""
        return {"curve_server_secret_key": self.secret_key_file}

    def role_dir(self, role: str) -> Path:
        """The allow-list folder of ``role`` (client, worker, detokenizer)."""
        return self.allowed_dir / ROLE_DIRS[_check_role(role)]

    def allow_lists(self) -> dict[str, list[Path]]:
        """ZAP domain (the scheduler socket's name) -> the folders it admits; for ``start_authenticator``."""
        return {domain: [self.role_dir(r) for r in roles] for domain, roles in SOCKET_ROLES.items()}

    def key_counts(self) -> dict[str, int]:
        """role -> how many keys its allow-list holds."""
        return {r: len(list(self.role_dir(r).glob("*.key"))) for r in CURVE_ROLES}


@dataclass(frozen=True)
class CurveClientKeys:
    """What a worker, detokenizer or client needs to connect with key ``name`` of its ``role``."""

    name: str
    secret_key_file: Path
    server_public_key_file: Path
    role: str = "client"

    def socket_kwargs(self) -> dict[str, Any]:
        """``make_socket`` keyword arguments for a connecting CURVE client socket."""
        return {"curve_client_secret_key": self.secret_key_file,
                "curve_server_public_key": self.server_public_key_file}


def _keys_cmd(key_dir: Path, role: str | None = None, name: str | None = None) -> str:
    return f"`zeroserve keys {key_dir}" + (f" --{role} {name}`" if role and name else "`")


def check_client_name(name: str) -> str:
    """A key name is a file name in the key directory: letters, digits, ``_ . -`` (max 64)."""
    if not isinstance(name, str) or not _CLIENT_NAME.fullmatch(name):
        raise CurveKeyError(f"bad CURVE key name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
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
    flat = sorted(p.name for p in allowed.glob("*.key"))
    if flat:  # the old layout admitted these on every socket; guessing their role would widen or lock out
        raise CurveKeyError(
            f"{d} has the old CURVE key layout: {', '.join(flat)} directly in {allowed} (one allow-list for every "
            f"role); keys are now allowed per role in {CURVE_ALLOWED_DIR}/clients/, {CURVE_ALLOWED_DIR}/workers/ "
            f"and {CURVE_ALLOWED_DIR}/detokenizers/. Migrate with {_keys_cmd(d)} (those keys become client keys; "
            "workers and detokenizers get keys of their own, to copy to their hosts), or move each key into its "
            "role's folder")
    for role in CURVE_ROLES:
        folder = allowed / ROLE_DIRS[role]
        keys = sorted(folder.glob("*.key"))
        if not keys:
            raise CurveKeyError(f"no allowed {role} keys in {folder} (every {role} would be refused); add one with "
                                f"{_keys_cmd(d, role, role)}")
        for f in keys:
            _read_key_file(f, f"an allowed {role}'s public key",
                           f"delete it, or re-copy it from {d / ROLE_DIRS[role]}", secret=False)
    return CurveServerKeys(secret_key_file=secret, allowed_dir=allowed)


def curve_client_keys(key_dir: str | os.PathLike | None, name: str | None = None,
                      role: str = "client") -> CurveClientKeys | None:
    """Key ``name`` of ``role`` (client, worker, detokenizer) in a key directory (None without
    one: a plain connection).

    ``name`` defaults to the role's name. Needs ``ROLEDIR/NAME.key_secret`` (clients/, workers/,
    detokenizers/) and ``server.key``; the error says which is missing and where it comes from."""
    if key_dir is None or key_dir == "" or key_dir is False:
        return None
    name = check_client_name(name or _check_role(role))
    d = _key_dir(key_dir)
    rel = f"{ROLE_DIRS[_check_role(role)]}/{name}.key_secret"
    secret = d / rel
    old = (f"; {CURVE_CLIENTS_DIR}/{name}.key_secret here is a client key, and a {role} now needs a {role} key"
           if role != "client" and (d / CURVE_CLIENTS_DIR / f"{name}.key_secret").is_file() else "")
    _read_key_file(secret, f"the secret key of CURVE {role} {name!r}",
                   f"create it with {_keys_cmd(d, role, name)} on the scheduler host and copy {rel} here "
                   f"(or pick another {role} key name with --curve-client){old}", secret=True)
    server_public = d / f"{CURVE_SERVER_NAME}.key"
    _read_key_file(server_public, "the scheduler's public key",
                   f"copy {CURVE_SERVER_NAME}.key from the scheduler host's key directory (made by {_keys_cmd(d)})",
                   secret=False)
    return CurveClientKeys(name=name, secret_key_file=secret, server_public_key_file=server_public, role=role)


@dataclass
class CurveKeyDir:
    """What ``create_curve_keys`` did: per file, whether it was created now or already there."""

    directory: Path
    server_created: bool
    created: dict[str, dict[str, bool]]  # role -> name -> created now (False: kept the existing pair)
    allowed: dict[str, dict[str, bool]]  # role -> name -> its public key is in allowed/ROLEDIR/
    migrated: list[str] = field(default_factory=list)  # old flat allowed/NAME.key moved to allowed/clients/

    @property
    def server_public(self) -> Path:
        """The scheduler's public key: every host needs it."""
        return self.directory / f"{CURVE_SERVER_NAME}.key"

    @property
    def server_secret(self) -> Path:
        """The scheduler's secret key: stays on the scheduler host."""
        return self.directory / f"{CURVE_SERVER_NAME}.key_secret"

    def allowed_dir(self, role: str) -> Path:
        """The allow-list folder of ``role`` the scheduler's authenticator reads at start."""
        return self.directory / CURVE_ALLOWED_DIR / ROLE_DIRS[_check_role(role)]

    def public(self, role: str, name: str) -> Path:
        """Key ``name``'s public key (copied into allowed/ROLEDIR/ to let it in)."""
        return self.directory / ROLE_DIRS[_check_role(role)] / f"{name}.key"

    def secret(self, role: str, name: str) -> Path:
        """Key ``name``'s secret key: goes to the hosts that run that role with that name."""
        return self.directory / ROLE_DIRS[_check_role(role)] / f"{name}.key_secret"


def create_curve_keys(directory: str | os.PathLike, clients: Iterable[str] | None = None, *,
                      workers: Iterable[str] | None = None,
                      detokenizers: Iterable[str] | None = None) -> CurveKeyDir:
    """Create (or complete) a key directory: the server pair, key pairs per role, the allow-lists.

    Names: with none given, each role's default (its own name: client, worker, detokenizer);
    with some given, those, plus the default of a role that has no key pair yet (so the
    scheduler has someone to admit in every role). Existing key pairs are never replaced (that
    would lock every host out), and an existing key removed from allowed/ (revoked) stays out;
    a key created now is allowed. An old layout (flat allowed/*.key) is migrated: those keys
    were client keys and move to allowed/clients/. Safe to run again; restart the scheduler after."""
    d = Path(directory).expanduser().resolve()
    given = {"client": clients, "worker": workers, "detokenizer": detokenizers}
    names: dict[str, list[str]] = {}
    for role, listed in given.items():
        if listed is not None:
            names[role] = [check_client_name(n) for n in dict.fromkeys(listed)]
        elif all(v is None for v in given.values()) or not any((d / ROLE_DIRS[role]).glob("*.key_secret")):
            names[role] = [role]
        else:
            names[role] = []
    if d.exists() and not d.is_dir():
        raise CurveKeyError(f"{d} exists and is not a directory; pick another path for the CURVE keys")
    d.mkdir(parents=True, exist_ok=True)
    server_created = _ensure_pair(d, CURVE_SERVER_NAME, "the scheduler's key pair")
    allowed = d / CURVE_ALLOWED_DIR
    migrated = _migrate_flat_allow_list(allowed)
    created: dict[str, dict[str, bool]] = {}
    allowed_now: dict[str, dict[str, bool]] = {}
    for role in CURVE_ROLES:
        keys_dir, allow_dir = d / ROLE_DIRS[role], allowed / ROLE_DIRS[role]
        allow_dir.mkdir(parents=True, exist_ok=True)
        made = {}
        for name in names[role]:
            made[name] = _ensure_pair(keys_dir, name, f"{role} {name!r}'s key pair")
            if made[name]:
                allow_client(allow_dir, keys_dir / f"{name}.key")
        known = sorted({p.name[: -len(".key_secret")] for p in keys_dir.glob("*.key_secret")} | set(names[role]))
        created[role] = {n: made.get(n, False) for n in known}
        allowed_now[role] = {n: (allow_dir / f"{n}.key").is_file() for n in known}
    return CurveKeyDir(directory=d, server_created=server_created, created=created, allowed=allowed_now,
                       migrated=migrated)


def _migrate_flat_allow_list(allowed: Path) -> list[str]:
    """Move the old layout's allowed/NAME.key into allowed/clients/ (the old layout had client
    keys only); returns the names moved."""
    flat = sorted(allowed.glob("*.key"))
    target = allowed / CURVE_CLIENTS_DIR
    moved = []
    for f in flat:
        dest = target / f.name
        if dest.exists() and dest.read_bytes() != f.read_bytes():
            raise CurveKeyError(f"cannot migrate {f}: {dest} exists and holds another key; keep one of them and "
                                "delete the other")
        target.mkdir(parents=True, exist_ok=True)
        os.replace(f, dest)
        moved.append(f.name[: -len(".key")])
    return moved


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
