#!/usr/bin/env bash
# Install what drsvc needs on a fresh Debian/Ubuntu machine (run as root). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
pkgs=(redis-server redis-sentinel openssh-server openssh-client xfsprogs e2fsprogs util-linux mount rsync btrfs-progs iproute2 kmod procps prometheus chromium)
# kubectl renders deploy/ (`kubectl kustomize`, tests/ops/test_deploy.py): Debian's kubernetes-client,
# unless a kubectl is installed already (another package that ships /usr/bin/kubectl conflicts with it)
command -v kubectl >/dev/null 2>&1 || pkgs+=(kubernetes-client)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# a distro redis or sshd started by the package is not ours: the sites start their own
python3 -m pip install -q --disable-pip-version-check -e '.[test]'
# An editable install leaves the tree as source. Byte-compile it here, as pip does for a
# regular install: every receiver, worker and plugin process would otherwise compile the
# modules it imports again, and with PYTHONDONTWRITEBYTECODE set nothing is cached either.
python3 -m compileall -q -j 0 drsvc drsvc_cli drsvc_lab csi_plugin workers bench >/dev/null
