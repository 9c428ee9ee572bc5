"""Wire protocol framing: pure encode/decode, no I/O (see docs/design/wire-protocol.md).

Every frame starts with an 8-byte header ``magic "DR" | type u8 | flags u8 |
body length u32`` (big endian). Control frames carry one small JSON object;
record frames carry a fixed binary header and the (encoded) payload; hash
frames carry block digests. Control and bulk data never share a frame.
"""
from __future__ import annotations

import json
import struct
from collections import namedtuple

import xxhash

from ... import errors
from ...errors import DrsvcError, RemoteError, StreamCorrupt, UnsupportedVersion

MAGIC = b"DR"
# 2: the `serve` verb (a warm receiver answers many requests, each a `request`
#    control message naming an allowlisted verb); a v1 peer is refused.
# 3: two-phase transactions (prepared / decide) for groups spanning nodes
# 4: striped transactions (records carry their plan index, `stripe` channels hand their stream to
#    the transaction's receiver) and the one-flight transaction (`begin` with an expectation)
VERSION = 4
SUPPORTED_VERSIONS = (3, 4)

FRAME = struct.Struct(">2sBBI")
T_CONTROL = 1
T_RECORD = 2
T_HASHES = 3
T_IRECORD = 4          # version 4: a record frame whose body starts with its plan index (u32)
_TYPES = {T_CONTROL, T_RECORD, T_HASHES, T_IRECORD}

# member u16 | codec u8 | flags u8 | offset u64 | length u32 | checksum u64
RECORD = struct.Struct(">HBBQIQ")
INDEX = struct.Struct(">I")
CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_ZERO = 2
CODECS = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_ZERO: "zero"}

HASHES = struct.Struct(">Q")  # first block index, then 16-byte digests
DIGEST_SIZE = 16

MAX_CONTROL = 1 << 20
MAX_DATA_RECORD = 4 << 20    # decoded length of a data record
MAX_ZERO_RECORD = 1 << 31    # a zero record carries no payload, so it may be long
MAX_BODY = RECORD.size + MAX_DATA_RECORD + (64 << 10)

# The manifest entry is codec independent: it names content, not encoding.
MANIFEST_ENTRY = struct.Struct(">HBQIQ")


class RecordHeader(namedtuple("RecordHeader", "member codec offset length checksum index", defaults=(-1,))):
    """A record's header; ``index`` is the record's place in the plan (version 4), -1 when
    arrival order implies it. A named tuple: the receiver parses one per record, and
    starts once per channel (no dataclasses machinery at import)."""

    __slots__ = ()

    @property
    def is_zero(self) -> bool:
        return self.codec == CODEC_ZERO


def payload_checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


# -- encode -------------------------------------------------------------------
def frame_header(ftype: int, length: int, flags: int = 0) -> bytes:
    return FRAME.pack(MAGIC, ftype, flags, length)


def encode_control(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":"), sort_keys=True).encode()
    if len(body) > MAX_CONTROL:
        raise StreamCorrupt(reason=f"control message of {len(body)} bytes is too large")
    return frame_header(T_CONTROL, len(body)) + body


def encode_record_header(member: int, codec: int, offset: int, length: int,
                         checksum: int, payload_len: int, index: int | None = None) -> bytes:
    """Frame header + record header; the payload follows as separate bytes. With *index*
    (version 4) the frame is an indexed record: the plan index leads the body."""
    if index is None:
        return (frame_header(T_RECORD, RECORD.size + payload_len)
                + RECORD.pack(member, codec, 0, offset, length, checksum))
    return (frame_header(T_IRECORD, INDEX.size + RECORD.size + payload_len) + INDEX.pack(index)
            + RECORD.pack(member, codec, 0, offset, length, checksum))


def encode_record(member, codec, offset, length, checksum, payload=b"", index: int | None = None) -> bytes:
    return encode_record_header(member, codec, offset, length, checksum, len(payload), index) + bytes(payload)


def encode_hashes(first_block: int, digests: bytes) -> bytes:
    if len(digests) % DIGEST_SIZE:
        raise ValueError("digests must be a multiple of 16 bytes")
    return frame_header(T_HASHES, HASHES.size + len(digests)) + HASHES.pack(first_block) + digests


def error_message(exc: BaseException) -> dict:
    """A control message naming a domain error, so it is re-raised typed on the other side."""
    if isinstance(exc, DrsvcError):
        fields = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                  for k, v in exc.fields.items()}
        return {"type": "error", "error": type(exc).__name__, "message": exc.message, "fields": fields}
    return {"type": "error", "error": "RemoteError", "message": f"{type(exc).__name__}: {exc}",
            "fields": {"reason": f"{type(exc).__name__}: {exc}"}}


def raise_error(msg: dict):
    """Raise the domain error a peer reported in an error control message."""
    name = msg.get("error", "")
    cls = getattr(errors, name, None)
    message = str(msg.get("message", "peer failed"))
    if isinstance(cls, type) and issubclass(cls, DrsvcError):
        try:
            exc = cls.__new__(cls)
            DrsvcError.__init__(exc, message, **dict(msg.get("fields") or {}))
        except Exception:
            exc = RemoteError(message, reason=message)
    else:
        exc = RemoteError(message, reason=message)
    exc.remote = True
    raise exc


# -- decode -------------------------------------------------------------------
def parse_frame_header(raw: bytes) -> tuple[int, int, int]:
    if len(raw) != FRAME.size:
        raise StreamCorrupt(reason="truncated frame header")
    magic, ftype, flags, length = FRAME.unpack(raw)
    if magic != MAGIC:
        raise StreamCorrupt(reason=f"bad frame magic {magic!r}")
    if ftype not in _TYPES:
        raise StreamCorrupt(reason=f"unknown frame type {ftype}")
    limit = MAX_CONTROL if ftype == T_CONTROL else MAX_BODY
    if length > limit:
        raise StreamCorrupt(reason=f"frame of {length} bytes exceeds {limit}")
    return ftype, flags, length


def parse_control(body) -> dict:
    try:
        msg = json.loads(bytes(body))
    except ValueError as e:
        raise StreamCorrupt(reason=f"control frame is not JSON: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise StreamCorrupt(reason="control frame must be an object with a type")
    return msg


def parse_record(body, indexed: bool = False) -> tuple[RecordHeader, memoryview]:
    """A record frame's header and payload; *indexed*: a T_IRECORD body (its index first)."""
    index, at = -1, 0
    if indexed:
        if len(body) < INDEX.size:
            raise StreamCorrupt(reason="truncated record index")
        (index,), at = INDEX.unpack_from(body), INDEX.size
    if len(body) < at + RECORD.size:
        raise StreamCorrupt(reason="truncated record header")
    member, codec, _flags, offset, length, checksum = RECORD.unpack_from(body, at)
    payload = memoryview(body)[at + RECORD.size:]
    if codec == CODEC_ZERO:
        if len(payload) or not 0 < length <= MAX_ZERO_RECORD:
            raise StreamCorrupt(reason="bad zero record")
    elif codec == CODEC_RAW:
        if len(payload) != length or not 0 < length <= MAX_DATA_RECORD:
            raise StreamCorrupt(reason=f"raw record length {length} != payload {len(payload)}")
    elif codec == CODEC_ZSTD:
        if not 0 < length <= MAX_DATA_RECORD or not payload:
            raise StreamCorrupt(reason="bad zstd record")
    else:
        raise StreamCorrupt(reason=f"unknown codec {codec}")
    return RecordHeader(member, codec, offset, length, checksum, index), payload


def parse_hashes(body) -> tuple[int, bytes]:
    if len(body) < HASHES.size or (len(body) - HASHES.size) % DIGEST_SIZE:
        raise StreamCorrupt(reason="bad hash frame")
    (first,) = HASHES.unpack_from(body)
    return first, bytes(memoryview(body)[HASHES.size:])


def decode_payload(hdr: RecordHeader, payload, dctx=None):
    """Decoded bytes of a data record (None for a zero record), checksum verified."""
    if hdr.codec == CODEC_ZERO:
        return None
    if hdr.codec == CODEC_ZSTD:
        import zstandard  # lazily: the receiver only pays for it when it gets zstd data
        dctx = dctx or zstandard.ZstdDecompressor()
        try:
            data = dctx.decompress(bytes(payload), max_output_size=hdr.length)
        except zstandard.ZstdError as e:
            raise StreamCorrupt(reason=f"zstd payload at {hdr.offset}: {e}") from None
        if len(data) != hdr.length:
            raise StreamCorrupt(reason=f"zstd payload at {hdr.offset} decodes to {len(data)} bytes")
    else:
        data = payload
    if payload_checksum(data) != hdr.checksum:
        raise StreamCorrupt(reason=f"checksum mismatch in record at offset {hdr.offset}")
    return data


class ManifestChain:
    """A running hash over every record's (member, kind, offset, length, checksum).

    A chain (h = xxh3_128(h || entry)) rather than one streaming hasher, so the
    16-byte state can be reported in a resume handshake and continued.
    """

    __slots__ = ("value", "count")

    def __init__(self, value: bytes = bytes(16), count: int = 0):
        self.value = value
        self.count = count

    def update(self, member: int, is_zero: bool, offset: int, length: int, checksum: int) -> None:
        self.value = xxhash.xxh3_128_digest(
            self.value + MANIFEST_ENTRY.pack(member, 1 if is_zero else 0, offset, length, checksum))
        self.count += 1

    def hexdigest(self) -> str:
        return self.value.hex()


# -- sets of plan indices (a striped transaction's resume handshake) -----------
def to_ranges(indices) -> list[list[int]]:
    """Sorted distinct indices as [[first, last], ...] (inclusive), compact on the wire."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def from_ranges(ranges, limit: int) -> set[int]:
    """The indices [[first, last], ...] names, each checked against 0 <= i < limit."""
    out: set[int] = set()
    try:
        for first, last in ranges or ():
            first, last = int(first), int(last)
            if not 0 <= first <= last < limit:
                raise StreamCorrupt(reason=f"index range {first}..{last} outside 0..{limit - 1}")
            out.update(range(first, last + 1))
    except (TypeError, ValueError):
        raise StreamCorrupt(reason="bad index ranges") from None
    return out


class FrameReader:
    """Reads frames from ``recv(n)`` (returns up to n bytes, b"" at EOF)."""

    def __init__(self, recv, on_eof=None):
        self._recv = recv
        self._on_eof = on_eof   # the sender maps a vanished receiver to PeerUnreachable
        self.source = None      # the receiver's Input, when a stripe may hand it on

    def read_exact(self, n: int, *, eof_ok: bool = False):
        chunks = []
        got = 0
        while got < n:
            b = self._recv(n - got)
            if not b:
                if eof_ok and got == 0:
                    return None
                if self._on_eof is not None:
                    self._on_eof(got, n)
                raise StreamCorrupt(reason=f"stream ended after {got} of {n} bytes")
            chunks.append(b)
            got += len(b)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def next_frame(self, *, eof_ok: bool = False):
        """Return (type, body) or None on a clean EOF between frames when eof_ok."""
        raw = self.read_exact(FRAME.size, eof_ok=eof_ok)
        if raw is None:
            return None
        ftype, _flags, length = parse_frame_header(raw)
        body = self.read_exact(length) if length else b""
        return ftype, body

    def control(self, expect: str | None = None) -> dict:
        """Next frame, which must be a control message; peer errors are raised typed."""
        frame = self.next_frame()
        if frame[0] != T_CONTROL:
            raise StreamCorrupt(reason=f"expected a control frame, got type {frame[0]}")
        msg = parse_control(frame[1])
        if msg["type"] == "error":
            raise_error(msg)
        if expect and msg["type"] != expect:
            raise StreamCorrupt(reason=f"expected {expect!r}, got {msg['type']!r}")
        return msg


def check_version(version) -> int:
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(version=version, supported=list(SUPPORTED_VERSIONS))
    return version


def check_greeting(msg: dict) -> dict:
    """The first message of a `serve` channel: the receiver's hello. A receiver older
    than version 2 answers the `serve` verb with UnknownVerb; both are refused typed."""
    if msg.get("type") == "error" and msg.get("error") == "UnknownVerb":
        raise UnsupportedVersion("the peer's receiver predates protocol version 2 (it has no `serve` "
                                 f"verb); upgrade drsvc at the peer (this side speaks {VERSION})",
                                 version=1, supported=list(SUPPORTED_VERSIONS))
    if msg.get("type") == "error":
        raise_error(msg)
    if msg.get("type") != "hello":
        raise StreamCorrupt(reason=f"expected the receiver's hello, got {msg.get('type')!r}")
    if msg.get("version") not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(f"the peer speaks protocol version {msg.get('version')}, this side "
                                 f"{list(SUPPORTED_VERSIONS)}; run the same drsvc release at both sites",
                                 version=msg.get("version"), supported=list(SUPPORTED_VERSIONS))
    return msg
