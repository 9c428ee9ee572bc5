"""The sender's side of the receiver verbs, over any drsvc.transport.Peer."""
from __future__ import annotations

from pathlib import Path

from ..errors import DrsvcError, PeerUnreachable, StreamCorrupt
from . import protocol
from .blockmap import BlockMap
from .protocol import T_CONTROL, T_HASHES, FrameReader


def reader_for(peer, chan) -> FrameReader:
    def eof(got, want):
        raise PeerUnreachable(peer=peer.name, reason="the receiver closed the connection mid-reply")
    return FrameReader(chan.recv, on_eof=eof)


def _call(peer, verb: str, *args: str, expect: str) -> dict:
    chan = peer.open(verb, *args)
    try:
        chan.close_write()
        return reader_for(peer, chan).control(expect)
    finally:
        chan.close()


def hello(peer) -> dict:
    return _call(peer, "hello", expect="hello")


def peer_status(peer, unit_id: str) -> dict:
    """The replica's state on the peer (an unfinished committed journal is completed first)."""
    return _call(peer, "status", unit_id, expect="status")


def release_peer(peer, unit_id: str, *, delete_image: bool = False) -> dict:
    return _call(peer, "release", unit_id, "delete-image" if delete_image else "keep-image",
                 expect="released")


def read_maps(reader: FrameReader, dest: Path, block_size: int) -> dict:
    """Receive block maps into files under *dest*: volume_id -> (exists, size, path)."""
    out = {}
    while True:
        msg = reader.control()
        if msg["type"] == "done":
            return out
        if msg["type"] != "map":
            raise StreamCorrupt(reason=f"expected a map, got {msg['type']!r}")
        vol = msg["volume_id"]
        if not msg["exists"]:
            out[vol] = (False, 0, None)
            continue
        path = Path(dest) / f"{vol}.peer.map"
        with BlockMap.create(path, block_size, int(msg["size"])) as m:
            while True:
                ftype, body = reader.next_frame()
                if ftype == T_HASHES:
                    first, digests = protocol.parse_hashes(body)
                    m.write(first, digests)
                    continue
                if ftype == T_CONTROL:
                    end = protocol.parse_control(body)
                    if end["type"] == "error":
                        protocol.raise_error(end)
                    if end["type"] == "end":
                        break
                raise StreamCorrupt(reason="bad frame in a block map")
        out[vol] = (True, int(msg["size"]), path)


def fetch_maps(peer, unit_id: str, volumes, block_size: int, dest: Path) -> dict:
    chan = peer.open("hashes", unit_id, str(block_size), *volumes)
    try:
        chan.close_write()
        return read_maps(reader_for(peer, chan), dest, block_size)
    finally:
        chan.close()


class ApplySession:
    """One `apply` conversation: status/hashes requests, then one transaction."""

    def __init__(self, peer, unit_id: str, *, bwlimit: float | None = None):
        from ..transport import LimitedChannel, TokenBucket
        self.peer, self.unit_id = peer, unit_id
        chan = peer.open("apply")
        self.raw = chan
        self.chan = LimitedChannel(chan, TokenBucket(bwlimit)) if bwlimit else chan
        self.reader = reader_for(peer, self.chan)

    @property
    def bytes_sent(self) -> int:
        return self.raw.bytes_sent

    def send_control(self, msg: dict) -> None:
        self.send(protocol.encode_control(msg))

    def send(self, data) -> None:
        try:
            self.chan.send(data)
        except PeerUnreachable:
            self._surface_peer_error()
            raise

    def _surface_peer_error(self) -> None:
        """If the receiver stopped because it refused something, raise its typed error."""
        try:
            msg = self.reader.control()
        except DrsvcError as e:
            if getattr(e, "remote", False):
                raise
        except Exception:
            pass
        else:
            raise StreamCorrupt(reason=f"unexpected {msg['type']!r} from the receiver")

    def request_status(self) -> None:
        self.send_control({"type": "status", "unit": self.unit_id})

    def read_status(self) -> dict:
        return self.reader.control("status")

    def fetch_maps(self, volumes, block_size: int, dest: Path) -> dict:
        self.send_control({"type": "hashes", "unit": self.unit_id, "volumes": list(volumes),
                           "block_size": block_size})
        return read_maps(self.reader, dest, block_size)

    def begin(self, tx: dict) -> dict:
        self.send_control(dict(tx, type="begin", unit=self.unit_id, version=protocol.VERSION))
        return self.reader.control("ready")

    def restart(self) -> dict:
        self.send_control({"type": "restart"})
        return self.reader.control("ready")

    def commit(self, records: int, manifest: str) -> dict:
        self.send_control({"type": "commit", "records": records, "manifest": manifest})
        return self.reader.control("committed")

    def close(self) -> None:
        try:
            self.chan.send(protocol.encode_control({"type": "bye"}))
            self.chan.close_write()
        except DrsvcError:
            pass
        self.chan.close()
