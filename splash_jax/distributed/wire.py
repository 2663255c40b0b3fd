"""The command channel's wire format: length-prefixed frames of a JSON header and raw arrays.

A command is a name, JSON-able fields and a few numpy arrays (the step's packed int32 buffers).
No pickle: the port is on the cluster network, and a frame must never be able to run code.
Frame: u32 total length | u32 header length | header (JSON) | array bytes, in header order.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct

import numpy as np

_LEN = struct.Struct("!II")
MAX_FRAME = 1 << 30


@dataclasses.dataclass
class Command:
    op: str
    fields: dict = dataclasses.field(default_factory=dict)
    arrays: dict[str, np.ndarray | None] = dataclasses.field(default_factory=dict)


def encode(cmd: Command) -> bytes:
    specs, blobs = [], []
    for name, a in cmd.arrays.items():
        if a is None:
            specs.append([name, None, None])
            continue
        a = np.ascontiguousarray(a)
        specs.append([name, a.dtype.str, list(a.shape)])
        blobs.append(a.tobytes())
    header = json.dumps({"op": cmd.op, "fields": cmd.fields, "arrays": specs}, separators=(",", ":")).encode()
    body = b"".join(blobs)
    return _LEN.pack(_LEN.size + len(header) + len(body), len(header)) + header + body


def decode(payload: bytes) -> Command:
    """payload: a frame without its first 4 bytes (total length)."""
    (hlen,) = struct.unpack_from("!I", payload, 0)
    header = json.loads(payload[4 : 4 + hlen])
    arrays, offset = {}, 4 + hlen
    for name, dtype, shape in header["arrays"]:
        if dtype is None:
            arrays[name] = None
            continue
        dt = np.dtype(dtype)
        size = int(np.prod(shape)) * dt.itemsize
        arrays[name] = np.frombuffer(payload, dt, int(np.prod(shape)), offset).reshape(shape).copy()
        offset += size
    return Command(header["op"], header["fields"], arrays)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes; raises ConnectionError on EOF (the peer closed or died)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def recv_command(sock: socket.socket) -> Command:
    (total,) = struct.unpack("!I", recv_exact(sock, 4))
    if not 4 <= total <= MAX_FRAME:
        raise ConnectionError(f"bad frame length {total}")
    return decode(recv_exact(sock, total - 4))
