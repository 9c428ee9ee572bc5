"""Protocol framing: round trips and rejection of malformed frames (pure, no I/O)."""
import io
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drsvc.errors import (BaseMismatch, RemoteError, StreamCorrupt, UnknownVerb,
                          UnsupportedVersion)
from drsvc.replication.wire import frames as p

pytestmark = pytest.mark.fast     # no root, no lab: tests/conftest.py keeps it so


def reader_of(data: bytes) -> p.FrameReader:
    return p.FrameReader(io.BytesIO(data).read)


def test_control_round_trip():
    msg = {"type": "begin", "unit": "vol-1", "members": [{"volume_id": "a", "size": 5}]}
    r = reader_of(p.encode_control(msg))
    assert r.control("begin") == msg
    assert r.next_frame(eof_ok=True) is None


@given(member=st.integers(0, 0xFFFF), offset=st.integers(0, 2**63), data=st.binary(min_size=1, max_size=5000))
@settings(max_examples=60, deadline=None)
def test_record_round_trip(member, offset, data):
    ck = p.payload_checksum(data)
    frame = p.encode_record(member, p.CODEC_RAW, offset, len(data), ck, data)
    ftype, body = reader_of(frame).next_frame()
    assert ftype == p.T_RECORD
    hdr, payload = p.parse_record(body)
    assert (hdr.member, hdr.offset, hdr.length, hdr.checksum) == (member, offset, len(data), ck)
    assert bytes(p.decode_payload(hdr, payload)) == data


def test_zstd_and_zero_records():
    import zstandard
    data = b"abc" * 4000
    packed = zstandard.ZstdCompressor(level=1).compress(data)
    frame = p.encode_record(1, p.CODEC_ZSTD, 4096, len(data), p.payload_checksum(data), packed)
    hdr, payload = p.parse_record(reader_of(frame).next_frame()[1])
    assert p.decode_payload(hdr, payload) == data
    zframe = p.encode_record(0, p.CODEC_ZERO, 0, 1 << 20, 0)
    zh, zp = p.parse_record(reader_of(zframe).next_frame()[1])
    assert zh.is_zero and p.decode_payload(zh, zp) is None


def test_hashes_round_trip():
    digests = bytes(range(32))
    ftype, body = reader_of(p.encode_hashes(7, digests)).next_frame()
    assert ftype == p.T_HASHES and p.parse_hashes(body) == (7, digests)


@pytest.mark.parametrize("mutate", [
    lambda f: b"XX" + f[2:],                                   # bad magic
    lambda f: f[:2] + b"\x09" + f[3:],                         # unknown frame type
    lambda f: f[:4] + struct.pack(">I", 1 << 30) + f[8:],      # absurd length
    lambda f: f[:-1],                                          # truncated payload
    lambda f: f[:-1] + bytes([f[-1] ^ 1]),                     # corrupted payload
    lambda f: f[:8] + f[8:10] + b"\x07" + f[11:],              # unknown codec
])
def test_corrupt_frames_are_rejected(mutate):
    data = b"payload-" * 100
    frame = p.encode_record(0, p.CODEC_RAW, 0, len(data), p.payload_checksum(data), data)
    with pytest.raises(StreamCorrupt):
        ftype, body = reader_of(mutate(frame)).next_frame()
        hdr, payload = p.parse_record(body)
        p.decode_payload(hdr, payload)


def test_raw_length_must_match_payload():
    frame = p.encode_record_header(0, p.CODEC_RAW, 0, 10, 0, 4) + b"abcd"
    with pytest.raises(StreamCorrupt):
        p.parse_record(reader_of(frame).next_frame()[1])


def test_control_must_be_json_object():
    bad = p.frame_header(p.T_CONTROL, 5) + b"[1,2]"
    with pytest.raises(StreamCorrupt):
        reader_of(bad).control()


def test_typed_errors_cross_the_wire():
    msg = p.error_message(BaseMismatch(unit_id="u", have=3, base=2))
    r = reader_of(p.encode_control(msg))
    with pytest.raises(BaseMismatch) as e:
        r.control()
    assert e.value.fields["have"] == 3 and "generation 3" in str(e.value)
    with pytest.raises(RemoteError):
        p.raise_error({"type": "error", "error": "NotADrsvcError", "message": "x"})
    with pytest.raises(UnknownVerb):
        p.raise_error(p.error_message(UnknownVerb(verb="id")))


def test_version_check():
    assert p.check_version(3) == 3
    for old in (1, 2, 99, None):
        with pytest.raises(UnsupportedVersion):
            p.check_version(old)


def test_greeting_of_an_old_or_other_peer_is_refused_clearly():
    """A v1 receiver has no `serve` verb: it answers UnknownVerb, which is refused by name."""
    assert p.check_greeting({"type": "hello", "version": 3})["version"] == 3
    with pytest.raises(UnsupportedVersion, match="predates protocol version 2"):
        p.check_greeting(p.error_message(UnknownVerb(verb="serve")))
    for other in (2, 5):      # 2 has no two-phase transactions: it would apply a prepared round
        with pytest.raises(UnsupportedVersion, match=f"speaks protocol version {other}"):
            p.check_greeting({"type": "hello", "version": other})


def test_indexed_records_and_index_ranges_round_trip():
    """Version 4 records carry their plan index; a resume names held indices as ranges."""
    frame = p.encode_record(1, p.CODEC_RAW, 4096, 3, p.payload_checksum(b"abc"), b"abc", index=70000)
    ftype, _flags, length = p.parse_frame_header(frame[:p.FRAME.size])
    assert ftype == p.T_IRECORD and length == len(frame) - p.FRAME.size
    hdr, payload = p.parse_record(frame[p.FRAME.size:], indexed=True)
    assert (hdr.index, hdr.member, hdr.offset, bytes(payload)) == (70000, 1, 4096, b"abc")
    assert p.parse_record(p.encode_record(0, p.CODEC_ZERO, 0, 8192, 0)[p.FRAME.size:])[0].index == -1
    assert p.to_ranges([5, 1, 2, 3, 9, 8]) == [[1, 3], [5, 5], [8, 9]]
    assert p.from_ranges([[1, 3], [5, 5], [8, 9]], 10) == {1, 2, 3, 5, 8, 9}
    with pytest.raises(StreamCorrupt):
        p.from_ranges([[8, 10]], 10)


def test_manifest_chain_is_order_and_content_sensitive():
    a, b = p.ManifestChain(), p.ManifestChain()
    a.update(0, False, 0, 4096, 1)
    a.update(0, True, 4096, 4096, 0)
    b.update(0, True, 4096, 4096, 0)
    b.update(0, False, 0, 4096, 1)
    assert a.hexdigest() != b.hexdigest() and a.count == b.count == 2
    c = p.ManifestChain(a.value, a.count)   # resumable from its 16-byte state
    c.update(1, False, 0, 1, 2)
    a.update(1, False, 0, 1, 2)
    assert c.hexdigest() == a.hexdigest()


def test_eof_mid_frame_is_corrupt():
    with pytest.raises(StreamCorrupt):
        reader_of(p.encode_control({"type": "x"})[:5]).next_frame(eof_ok=True)
