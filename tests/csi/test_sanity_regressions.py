"""Answers csi-sanity checks that once regressed here (csi-sanity itself is not in CI)."""
import grpc
import pytest

from csi_plugin.gen import csi_pb2


@pytest.mark.parametrize("rpc", ["NodeGetVolumeStats", "NodeExpandVolume"])
@pytest.mark.parametrize("existing", [False, True])
def test_relative_volume_path_is_not_found(plugin, rpc, existing):
    vid = plugin.create("sanity-rel").volume_id if existing else "vol-missing"
    req = getattr(csi_pb2, f"{rpc}Request")(volume_id=vid, volume_path="some/path")
    with pytest.raises(grpc.RpcError) as e:
        getattr(plugin.node, rpc)(req)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
