"""A small typed client of one host's ``agentbox-pool`` (``$AGENTBOX_DATA/run/pool.sock``).

The pool speaks HTTP/1.1 over a unix socket (``api/src/pool.rs`` is the contract). Only the
standard library is used: ``http.client`` with a connection class that dials ``AF_UNIX``.
Every request opens its own connection, so one client may be shared by threads.

Errors come back as exceptions, split in two families, because the cluster manager treats
them differently:

* the pool answered and refused (:class:`LeaseNotFound`, :class:`LeaseLost`,
  :class:`NoFreeSlot`, :class:`Draining`, :class:`SlotFailed`, :class:`PoolRequestError`):
  the node is healthy;
* the pool could not be reached, answered nonsense, or failed as a whole
  (:class:`PoolUnavailable`): the node is treated as lost.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

DEFAULT_SOCKET = "/var/lib/agentbox/run/pool.sock"
SOCKET_ENV = "AGENTBOX_POOL_SOCKET"

# Replies larger than this are refused rather than buffered without bound (a file read is
# base64 in JSON; the pool caps reads itself, this is only a guard against a broken peer).
MAX_REPLY_BYTES = 256 * 1024 * 1024


class PoolError(Exception):
    """Anything the pool client raises. ``code`` is the pool's error code, if it sent one."""

    def __init__(self, message: str, code: Optional[str] = None, status: Optional[int] = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return self.message

    def __reduce__(self):  # keep code/status across pickling (Ray ships exceptions)
        return (type(self), (self.message, self.code, self.status))


class PoolUnavailable(PoolError):
    """The pool's socket is missing or refused, the request timed out, or the reply was not
    the pool's API: the node's pool is gone as far as a caller can tell."""


class PoolRequestError(PoolError):
    """The pool answered with an error other than the ones below (bad request, ...)."""


class LeaseNotFound(PoolError, KeyError):
    """404 ``lease_not_found``: no active lease matches (a ``KeyError``, as the reference's
    ``active local_bwrap lease not found``)."""


class LeaseLost(PoolError):
    """410 ``lease_lost``: the lease's slot died while leased; acquire again."""


class NoFreeSlot(PoolError):
    """503 ``no_free_slot``: every slot of this host is leased or resetting."""


class Draining(PoolError):
    """409 ``draining``: the pool takes no new leases."""


class SlotFailed(PoolError):
    """502 ``slot_failed``: the launcher or the gateway failed this request for one slot (a
    command, a file, a port to expose). A 5xx, but the pool answered: the node and its other
    slots are not lost."""


_BY_CODE = {
    "lease_not_found": LeaseNotFound,
    "lease_lost": LeaseLost,
    "no_free_slot": NoFreeSlot,
    "draining": Draining,
    "slot_failed": SlotFailed,
}


# `_request`'s default timeout: the client's own (``None`` there means no bound).
_CLIENT_TIMEOUT: Any = object()


class _UnixConnection(http.client.HTTPConnection):
    """``http.client`` over a unix socket: the host name is only the ``Host`` header."""

    def __init__(self, path: str, timeout: Optional[float]):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def socket_from_env(environ: Optional[Mapping[str, str]] = None) -> str:
    """The pool socket of this host: ``$AGENTBOX_POOL_SOCKET``, else the packaged default."""
    env = os.environ if environ is None else environ
    return env.get(SOCKET_ENV) or DEFAULT_SOCKET


def _lease_ref(trajectory_id: Optional[str], lease_id: Optional[str]) -> Dict[str, str]:
    if trajectory_id is None and lease_id is None:
        raise ValueError("trajectory_id or lease_id is required")
    ref: Dict[str, str] = {}
    if trajectory_id is not None:
        ref["trajectory_id"] = str(trajectory_id)
    if lease_id is not None:
        ref["lease_id"] = str(lease_id)
    return ref


class PoolClient:
    """One host's pool. ``timeout`` bounds every request (connect, send and reply) but a
    command's, whose answer waits for the command (:meth:`run_command`)."""

    def __init__(self, socket_path: Optional[str] = None, timeout: float = 30.0):
        self.socket_path = socket_path or socket_from_env()
        self.timeout = float(timeout)

    def __repr__(self) -> str:
        return f"PoolClient({self.socket_path!r})"

    # -- transport ------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
        timeout: Any = _CLIENT_TIMEOUT,
    ) -> Dict[str, Any]:
        """One request; ``timeout`` in seconds, ``None`` for none, by default this client's."""
        conn = _UnixConnection(self.socket_path,
                               self.timeout if timeout is _CLIENT_TIMEOUT else timeout)
        try:
            payload = None if body is None else json.dumps(body).encode("utf-8")
            headers = {"Accept": "application/json"}
            if payload is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read(MAX_REPLY_BYTES + 1)
            status = resp.status
        except (OSError, http.client.HTTPException) as err:
            raise PoolUnavailable(
                f"pool at {self.socket_path}: {method} {path}: {err.__class__.__name__}: {err}"
            ) from err
        finally:
            conn.close()
        if len(raw) > MAX_REPLY_BYTES:
            raise PoolUnavailable(f"pool at {self.socket_path}: {path}: reply too large")
        try:
            doc = json.loads(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, ValueError) as err:
            raise PoolUnavailable(
                f"pool at {self.socket_path}: {path}: HTTP {status}, not JSON: {raw[:200]!r}"
            ) from err
        if 200 <= status < 300:
            if not isinstance(doc, dict):
                raise PoolUnavailable(f"pool at {self.socket_path}: {path}: not a JSON object")
            return doc
        error = doc.get("error") if isinstance(doc, dict) else None
        if not isinstance(error, dict):
            raise PoolUnavailable(
                f"pool at {self.socket_path}: {path}: HTTP {status} without an error body"
            )
        code = str(error.get("code", ""))
        message = f"{code}: {error.get('message', '')}"
        cls = _BY_CODE.get(code)
        if cls is None:
            # Any other 5xx (`internal`, `shutting_down`) means the pool itself is broken or
            # going away; a 4xx is our request.
            cls = PoolUnavailable if status >= 500 else PoolRequestError
        raise cls(message, code, status)

    # -- routes ---------------------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """``GET /status``: the pool's counts and slots (``PoolStatus``)."""
        return self._request("GET", "/status")

    def acquire(
        self, trajectory_id: str, env_type: Optional[str] = None,
        env_args: Optional[Any] = None,
    ) -> Dict[str, Any]:
        """``POST /acquire``: a lease (the same one again for a trajectory that holds one)."""
        body: Dict[str, Any] = {"trajectory_id": str(trajectory_id)}
        if env_type is not None:
            body["env_type"] = env_type
        if env_args is not None:
            body["env_args"] = env_args
        return self._request("POST", "/acquire", body)

    def release(
        self, trajectory_id: Optional[str] = None, lease_id: Optional[str] = None,
        reason: Optional[str] = None,
    ) -> Dict[str, Any]:
        """``POST /release``; an unknown lease answers ``already_released``."""
        body: Dict[str, Any] = _lease_ref(trajectory_id, lease_id)
        if reason is not None:
            body["reason"] = reason
        return self._request("POST", "/release", body)

    def run_command(
        self, command: Union[str, Sequence[str]], *, trajectory_id: Optional[str] = None,
        lease_id: Optional[str] = None, cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
        stdin: Optional[str] = None, reply_timeout: Optional[float] = None,
    ) -> Dict[str, Any]:
        """``POST /run_command`` in the leased slot's workspace. The answer comes when the
        command ends, so the HTTP timeout is not this client's: it is ``reply_timeout`` when
        the caller says how long it waits (the cluster manager does), else the command's
        ``timeout`` plus this client's; with neither, none (the pool runs a command without a
        timeout up to the launcher's maximum, which this client does not know). So a long
        command is not cut before its caller gives up and taken for a dead pool."""
        body: Dict[str, Any] = _lease_ref(trajectory_id, lease_id)
        body["command"] = command if isinstance(command, str) else [str(c) for c in command]
        if cwd is not None:
            body["cwd"] = cwd
        if env:
            body["env"] = {str(k): str(v) for k, v in env.items()}
        if timeout is not None:
            body["timeout"] = float(timeout)
        if stdin is not None:
            body["stdin"] = stdin
        if reply_timeout is not None:
            http_timeout: Optional[float] = float(reply_timeout)
        elif timeout is not None:
            http_timeout = self.timeout + float(timeout)
        else:
            http_timeout = None
        return self._request("POST", "/run_command", body, timeout=http_timeout)

    def read_file(
        self, path: str, *, trajectory_id: Optional[str] = None,
        lease_id: Optional[str] = None, max_bytes: Optional[int] = None,
    ) -> Dict[str, Any]:
        """``POST /read_file``: the reply carries ``content_base64``."""
        body: Dict[str, Any] = _lease_ref(trajectory_id, lease_id)
        body["path"] = path
        if max_bytes is not None:
            body["max_bytes"] = int(max_bytes)
        return self._request("POST", "/read_file", body)

    def read_bytes(self, path: str, **kwargs: Any) -> bytes:
        """The decoded content of :meth:`read_file`."""
        return base64.b64decode(self.read_file(path, **kwargs)["content_base64"])

    def write_file(
        self, path: str, content: Union[str, bytes], *, trajectory_id: Optional[str] = None,
        lease_id: Optional[str] = None, encoding: str = "utf-8", append: bool = False,
    ) -> Dict[str, Any]:
        """``POST /write_file``; ``str`` content is encoded with ``encoding``."""
        data = content.encode(encoding) if isinstance(content, str) else bytes(content)
        body: Dict[str, Any] = _lease_ref(trajectory_id, lease_id)
        body["path"] = path
        body["content_base64"] = base64.b64encode(data).decode("ascii")
        body["append"] = bool(append)
        return self._request("POST", "/write_file", body)

    def drain(self) -> Dict[str, Any]:
        """``POST /drain``: no new leases; the current ones keep running."""
        return self._request("POST", "/drain", {})

    def undrain(self) -> Dict[str, Any]:
        """``POST /undrain``."""
        return self._request("POST", "/undrain", {})


def decode_content(reply: Mapping[str, Any], encoding: Optional[str]) -> Union[str, bytes]:
    """A ``/read_file`` reply's content: bytes for ``encoding=None``, else strictly decoded."""
    data = base64.b64decode(reply["content_base64"])
    return data if encoding is None else data.decode(encoding)


__all__: List[str] = [
    "DEFAULT_SOCKET", "SOCKET_ENV", "PoolClient", "PoolError", "PoolUnavailable",
    "PoolRequestError", "LeaseNotFound", "LeaseLost", "NoFreeSlot", "Draining", "SlotFailed",
    "socket_from_env", "decode_content",
]
