#!/usr/bin/env bash
# Build deploy/Containerfile on this machine and smoke-test the image without running a container.
#
#   bash scripts/build-image.sh [--tag localhost/drsvc:dev] [--rebuild-base]
#
# 1. A Debian bookworm base from Debian's packages (mmdebstrap), imported as
#    localhost/drsvc-base:bookworm; kept between runs (--rebuild-base makes it anew).
# 2. podman build --isolation chroot with BASE set to it (RUN steps included).
# 3. The smoke test: podman image mount, then chroot into the image and run
#    `drsvc --version`, `python -m csi_plugin --help` and the receiver's --help.
#    (`podman run` needs a cgroup setup this sandbox does not have; mount + chroot does not.)
# The last line is one JSON object: image, base, build_s, smoke_s, size_bytes, ok.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=localhost/drsvc:dev
BASE_TAG=localhost/drsvc-base:bookworm
REBUILD_BASE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) TAG=$2; shift 2 ;;
    --rebuild-base) REBUILD_BASE=1; shift ;;
    *) echo "usage: $0 [--tag IMAGE] [--rebuild-base]" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "run as root (podman image mount, chroot)" >&2; exit 2; }

need=()
command -v podman >/dev/null || need+=(podman)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" uidmap >/dev/null
fi

now() { date +%s.%N; }
work=$(mktemp -d /var/tmp/drsvc-image.XXXXXX)
mounted=""
cleanup() {
  if [ -n "$mounted" ]; then
    umount "$mounted/proc" "$mounted/dev" 2>/dev/null || true
    podman image unmount "$TAG" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

t0=$(now)
if [ "$REBUILD_BASE" = 1 ] || ! podman image exists "$BASE_TAG"; then
  echo "== base: Debian bookworm by mmdebstrap -> $BASE_TAG"
  mmdebstrap --quiet --variant=apt \
    --include=python3,python3-venv,ca-certificates,util-linux,mount,e2fsprogs,xfsprogs \
    bookworm "$work/base.tar"
  podman import --quiet "$work/base.tar" "$BASE_TAG" >/dev/null
fi
t1=$(now)

echo "== podman build --isolation chroot -> $TAG (BASE=$BASE_TAG)"
ca=()     # this host's CA bundle, for pip behind a TLS-intercepting proxy (mounted, not copied)
bundle=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
if [ -f "$bundle" ]; then
  ca=(--volume "$bundle:/run/drsvc-build-ca.crt:ro" --build-arg PIP_CERT=/run/drsvc-build-ca.crt)
fi
podman build --isolation chroot --build-arg "BASE=$BASE_TAG" "${ca[@]}" -f deploy/Containerfile -t "$TAG" .
t2=$(now)

echo "== smoke test: podman image mount + chroot"
mounted=$(podman image mount "$TAG")
mount --bind /dev "$mounted/dev"          # python reads /dev/urandom and /dev/null
mount -t proc proc "$mounted/proc"
env -i PATH=/opt/drsvc/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$mounted" drsvc --version
env -i PATH=/opt/drsvc/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$mounted" python -m csi_plugin --help >/dev/null
env -i PATH=/opt/drsvc/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$mounted" drsvc-receiver --help >/dev/null
env -i PATH=/opt/drsvc/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$mounted" python -m drsvc.replication.receiver --help >/dev/null
for tool in losetup mount fsfreeze mkfs.ext4 mkfs.xfs resize2fs xfs_growfs; do
  chroot "$mounted" /bin/sh -c "command -v $tool" >/dev/null || { echo "missing in the image: $tool" >&2; exit 1; }
done
t3=$(now)
size=$(podman image inspect --format '{{.Size}}' "$TAG")
python3 - "$TAG" "$BASE_TAG" "$t0" "$t1" "$t2" "$t3" "$size" <<'PY'
import json, sys
tag, base, t0, t1, t2, t3, size = sys.argv[1:]
t0, t1, t2, t3 = map(float, (t0, t1, t2, t3))
print(json.dumps({"image": tag, "base": base, "base_s": round(t1 - t0, 1), "build_s": round(t2 - t1, 1),
                  "smoke_s": round(t3 - t2, 1), "size_bytes": int(size), "ok": True}))
PY
