"""CreateVolume (and DeleteVolume) killed at each step of its order (name record = intent, image, volume record),
then retried after a restart: the name record and the volume record agree on one id, there is
one image of the asked size, and nothing the killed attempt half-wrote is left behind.

A SIGKILL (failpoint) is a process crash: the page cache survives it, so these tests check the
order and the retry's convergence, not what reaches the disk on a power cut."""
from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest

from csi_plugin.gen import csi_pb2
from tests.fixtures.csi import MiB

POINTS = ["volume.after_name", "volume.after_image", "volume.before_record", "volume.after_record"]


def pool_state_files(pool: Path):
    volumes = {p.stem: json.loads(p.read_text()) for p in (pool / "volumes").glob("*.json")}
    images = sorted(p.name for p in (pool / "images").iterdir())
    temps = sorted(p.name for d in ("names", "volumes", "images") for p in (pool / d).iterdir()
                   if p.name.startswith("."))
    return volumes, images, temps


def pool_state(pool: Path):
    names = [os.readlink(p) for p in (pool / "names").glob("volume-*.json")]      # pointers: target = id
    return (names, *pool_state_files(pool))


@pytest.mark.parametrize("point", POINTS)
def test_create_killed_at_each_step_converges_on_retry(make_plugin, monkeypatch, point):
    monkeypatch.setenv("DRSVC_FAILPOINTS", point)
    plugin = make_plugin()
    with pytest.raises(grpc.RpcError):
        plugin.create("crashy", 64 * MiB)
    plugin.proc.wait(timeout=20)
    assert plugin.proc.returncode == -9, f"the plugin did not die at {point}:\n{plugin.log_tail()}"

    names, volumes, images, _ = pool_state(plugin.pool)
    assert len(names) == 1, "the intent (name record) is in place before anything else"
    intent = names[0]
    # the volume record goes in last: present only when the kill came after it
    assert list(volumes) == ([intent] if point == "volume.after_record" else [])
    if point != "volume.after_name":
        assert images == [f"{intent}.img"]

    monkeypatch.delenv("DRSVC_FAILPOINTS")
    plugin.restart()
    vol = plugin.create("crashy", 64 * MiB)
    assert vol.volume_id == intent, "the retry resumes under the id its name record holds"
    assert plugin.create("crashy", 64 * MiB).volume_id == intent

    names, volumes, images, temps = pool_state(plugin.pool)
    assert names == [intent]
    assert list(volumes) == [intent] and volumes[intent]["state"] == "ready"
    assert volumes[intent]["name"] == "crashy" and volumes[intent]["capacity_bytes"] == 64 * MiB
    assert images == [f"{intent}.img"]
    assert (plugin.pool / "images" / f"{intent}.img").stat().st_size == 64 * MiB
    assert temps == [], "the killed attempt's temp files are gone"

    listed = plugin.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30)
    assert [e.volume.volume_id for e in listed.entries] == [intent]
    plugin.delete(intent)
    names, volumes, images, temps = pool_state(plugin.pool)
    assert (names, volumes, images, temps) == ([], {}, [], [])


def test_retry_after_kill_with_other_size_gets_what_it_asks(make_plugin, monkeypatch):
    """Nothing was answered before the kill, so a retry asking more gets a fresh image of its size."""
    monkeypatch.setenv("DRSVC_FAILPOINTS", "volume.before_record")
    plugin = make_plugin()
    with pytest.raises(grpc.RpcError):
        plugin.create("resized", 64 * MiB)
    plugin.proc.wait(timeout=20)
    monkeypatch.delenv("DRSVC_FAILPOINTS")
    plugin.restart()
    vol = plugin.create("resized", 128 * MiB)
    assert vol.capacity_bytes == 128 * MiB
    assert (plugin.pool / "images" / f"{vol.volume_id}.img").stat().st_size == 128 * MiB
    names, volumes, _, temps = pool_state(plugin.pool)
    assert names == [vol.volume_id] and list(volumes) == [vol.volume_id]
    assert temps == []


def test_delete_killed_before_its_record_goes_converges_on_retry(make_plugin, monkeypatch):
    """Killed after the image and the name went but before the volume record did: the record is
    set aside (a tombstone), so the volume is neither listed nor found; a retried delete finishes,
    and the name is free."""
    monkeypatch.setenv("DRSVC_FAILPOINTS", "volume.before_delete_record")
    plugin = make_plugin()
    vol = plugin.create("doomed", 64 * MiB)
    with pytest.raises(grpc.RpcError):
        plugin.delete(vol.volume_id)
    plugin.proc.wait(timeout=20)
    assert plugin.proc.returncode == -9, plugin.log_tail()
    names, volumes, images, temps = pool_state(plugin.pool)
    assert (names, volumes, images) == ([], {}, []) and temps == [f".{vol.volume_id}.json.deleting"]

    monkeypatch.delenv("DRSVC_FAILPOINTS")
    plugin.restart()
    assert plugin.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30).entries == []
    with pytest.raises(grpc.RpcError) as exc:
        plugin.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    plugin.delete(vol.volume_id)
    plugin.delete(vol.volume_id)
    assert pool_state(plugin.pool) == ([], {}, [], [])
    again = plugin.create("doomed", 64 * MiB)
    assert again.volume_id != vol.volume_id


def test_name_record_of_an_older_release_is_honoured(make_plugin):
    """Pools written before name pointers hold JSON name records: a retry finds the volume, delete drops it."""
    plugin = make_plugin()
    vol = plugin.create("legacy", 64 * MiB)
    (index,) = (plugin.pool / "names").glob("volume-*.json")
    assert index.is_symlink() and os.readlink(index) == vol.volume_id
    plugin.stop()
    index.unlink()
    index.write_text(json.dumps({"name": "legacy", "volume_id": vol.volume_id, "schema": 1}))
    plugin.start()
    assert plugin.create("legacy", 64 * MiB).volume_id == vol.volume_id
    assert not index.is_symlink()
    plugin.delete(vol.volume_id)
    assert not index.exists() and pool_state(plugin.pool) == ([], {}, [], [])


def test_creating_record_of_an_older_release_is_finished(make_plugin):
    """Older releases wrote a 'creating' volume record and a JSON name record before the image:
    killed then, a retry of the same name finishes that volume under its id."""
    plugin = make_plugin()
    vol = plugin.create("halfway", 64 * MiB)
    plugin.stop()
    pool = plugin.pool
    (index,) = (pool / "names").glob("volume-*.json")
    index.unlink()
    index.write_text(json.dumps({"name": "halfway", "volume_id": vol.volume_id, "schema": 1}))
    meta = pool / "volumes" / f"{vol.volume_id}.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), state="creating")))
    image = pool / "images" / f"{vol.volume_id}.img"
    image.unlink()
    (pool / "images" / f".{image.name}.partial").write_bytes(b"half")
    plugin.start()
    assert plugin.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30).entries == []
    again = plugin.create("halfway", 64 * MiB)
    assert again.volume_id == vol.volume_id
    assert not index.is_symlink()                # the older record stays as it was
    volumes, images, temps = pool_state_files(pool)
    assert volumes[vol.volume_id]["state"] == "ready" and images == [image.name] and temps == []
    assert image.stat().st_size == 64 * MiB
