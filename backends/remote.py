"""RPC workers as the app reaches them: endpoints and checks, for a target spread over several machines
through llama.cpp's RPC backend (the native side, reached through backends.host, is
backends/llamacpp/rpc.py).

Everything here is plain Python (sockets, no native library), so the chat server's supervisor can check a
worker, and name it when it is lost, without loading llama.cpp: a check is a TCP connect plus the protocol's
hello and device count, with short timeouts, because the native client aborts its process instead of
returning an error when a worker refuses, times out or fails the handshake.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

from backends.base import BackendError

DEFAULT_PORT = 50052
CHECK_TIMEOUT_S = 3.0  # a worker on a LAN answers the hello in milliseconds; a busy one not at all
PROTOCOL_MAJOR = 7  # RPC_PROTO_MAJOR_VERSION of the llama.cpp vendored by llama-cpp-python 0.3.36
_CMD_HELLO, _CMD_DEVICE_COUNT = 14, 15  # rpc_cmd values of that protocol version
_HELLO_PAYLOAD = 24  # bytes the client sends with its hello (zeros: no optional transport features)
REBUILD = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --no-cache-dir --force-reinstall --no-deps '
           '"llama-cpp-python==0.3.36"')
SECURITY = ("the RPC protocol has no authentication or encryption and a worker runs whatever graph a client "
            "sends: serve only on a trusted network, or keep the worker on 127.0.0.1 and reach it through an "
            "SSH tunnel (ssh -N -L 50052:127.0.0.1:50052 HOST) or a VPN")
_LOOPBACK_NAMES = ("localhost",)


class RPCError(BackendError):
    """An RPC worker cannot be used; the message names it and says what to do."""


class WorkerUnreachable(RPCError):
    """A worker refused, timed out or failed the handshake. `endpoint` names it."""

    def __init__(self, endpoint: str, why: str) -> None:
        super().__init__(f"the RPC worker {endpoint} is not usable: {why}; start it there with "
                         f"`dsbd-chat rpc-worker --host ... --port {split(endpoint)[1]}` (or check the address, "
                         "the firewall or an SSH tunnel)")
        self.endpoint, self.why = endpoint, why


class NoRPCSupport(RPCError):
    """The installed llama-cpp-python was built without GGML_RPC."""


# ---------------------------------------------------------------- endpoints


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


def split(endpoint: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port). Raises RPCError with the expected form."""
    text = endpoint.strip()
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)", text) or re.fullmatch(r"([^:\[\]]+):(\d+)", text)
    if not m:
        raise RPCError(f"RPC endpoint {endpoint!r} must be HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT}, "
                       f"[fd00::2]:{DEFAULT_PORT})")
    host, port = m.group(1), int(m.group(2))
    if not 1 <= port <= 65535:
        raise RPCError(f"RPC endpoint {endpoint!r}: port must be between 1 and 65535")
    if ":" not in host and not _HOST.fullmatch(host):
        raise RPCError(f"RPC endpoint {endpoint!r}: {host!r} is not a host name or an IP address")
    return host, port


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoints(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """'a:1,b:2' (or a list of such) -> ('a:1', 'b:2'), normalised; duplicates are an error (one client each)."""
    if text is None:
        return ()
    parts = text.split(",") if isinstance(text, str) else [p for t in text for p in str(t).split(",")]
    out = []
    for p in (p.strip() for p in parts):
        if not p:
            continue
        ep = join(*split(p))
        if ep in out:
            raise RPCError(f"RPC endpoint {ep} is listed twice: a worker serves one client (one load) at a time")
        out.append(ep)
    return tuple(out)


def is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------- checks (pure Python, before any native call)


@dataclass(frozen=True)
class WorkerInfo:
    endpoint: str
    version: tuple[int, int, int]
    n_devices: int


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the worker closed the connection")
        buf += chunk
    return buf


def check(endpoint: str, *, timeout: float = CHECK_TIMEOUT_S) -> WorkerInfo:
    """Connect, say hello, ask the device count, disconnect. Raises WorkerUnreachable (never aborts)."""
    host, port = split(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise WorkerUnreachable(endpoint, f"no answer to a TCP connect in {timeout:g} s") from None
    except ConnectionRefusedError:
        raise WorkerUnreachable(endpoint, "connection refused (no worker listening on that port)") from None
    except OSError as e:
        raise WorkerUnreachable(endpoint, e.strerror or str(e)) from None
    try:
        with sock:
            sock.settimeout(timeout)
            sock.sendall(bytes([_CMD_HELLO]) + struct.pack("<Q", _HELLO_PAYLOAD) + bytes(_HELLO_PAYLOAD))
            size = struct.unpack("<Q", _recv(sock, 8))[0]
            if not 12 <= size <= 4096:
                raise WorkerUnreachable(endpoint, "it does not speak llama.cpp's RPC protocol")
            version = struct.unpack("<III", _recv(sock, size)[:12])
            if version[0] != PROTOCOL_MAJOR:
                raise WorkerUnreachable(
                    endpoint, f"it speaks RPC protocol {'.'.join(map(str, version))}, this install speaks "
                              f"{PROTOCOL_MAJOR}.x: run the worker with this same dsbd-chat version (a packaged "
                              "rpc-server from another llama.cpp build is rejected)")
            sock.sendall(bytes([_CMD_DEVICE_COUNT]) + struct.pack("<Q", 0))
            if struct.unpack("<Q", _recv(sock, 8))[0] != 4:
                raise WorkerUnreachable(endpoint, "malformed device-count reply")
            n = struct.unpack("<I", _recv(sock, 4))[0]
    except socket.timeout:
        raise WorkerUnreachable(endpoint, f"no handshake in {timeout:g} s (busy serving another client? a "
                                          "worker serves one client at a time)") from None
    except (ConnectionError, OSError) as e:
        raise WorkerUnreachable(endpoint, f"the handshake failed ({e})") from None
    if n < 1:
        raise WorkerUnreachable(endpoint, "it serves no device")
    return WorkerInfo(endpoint, version, n)


def check_all(endpoints: Sequence[str], *, timeout: float = CHECK_TIMEOUT_S) -> list[WorkerInfo]:
    return [check(ep, timeout=timeout) for ep in endpoints]


def first_unreachable(endpoints: Sequence[str], *, timeout: float = 1.0) -> tuple[str, str] | None:
    """(endpoint, why) of the first worker that fails the check, else None (all answer)."""
    for ep in endpoints:
        try:
            check(ep, timeout=timeout)
        except WorkerUnreachable as e:
            return ep, e.why
    return None
