#!/usr/bin/env bash
# Builds Strata's image without any registry image, as CI does: a Debian base made with
# mmdebstrap from Debian's packages and imported into podman, then the Containerfile's
# `prebuilt` target with the `strata` binary copied in.
#
# Usage: scripts/build-image.sh [--binary PATH] TAG
#   By default the binary is the portable release build (x86-64-v3; the engine picks its
#   AVX-512/VNNI kernels at run time), built here into target/x86-64-v3/.
#   --binary PATH copies that binary instead (CI passes the one its tests already built).
# Needs podman, runc and mmdebstrap (apt-get install podman runc mmdebstrap uidmap
# fuse-overlayfs). The base is made once and kept as localhost/strata-base:bookworm.
set -euo pipefail
cd "$(dirname "$0")/.."

binary=""
if [ "${1:-}" = "--binary" ]; then
    binary=$2
    shift 2
fi
tag=${1:?usage: scripts/build-image.sh [--binary PATH] TAG}
base=localhost/strata-base:bookworm

for tool in podman mmdebstrap; do
    command -v "$tool" >/dev/null || {
        echo "$tool not found: apt-get install podman runc mmdebstrap uidmap fuse-overlayfs" >&2
        exit 1
    }
done

if [ -z "$binary" ]; then
    echo "== release binary for x86-64-v3"
    RUSTFLAGS="-C target-cpu=x86-64-v3" cargo build --release --locked -p strata-cli \
        --features kubernetes --target-dir target/x86-64-v3
    binary=target/x86-64-v3/release/strata
fi
[ -x "$binary" ] || { echo "no executable binary at $binary" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# This machine's cgroups are in hybrid mode and it may not raise resource limits: runc, the
# cgroupfs manager and no default ulimits (../shared/peers/containers/README.md).
printf '[containers]\ndefault_ulimits = []\n' > "$work/containers.conf"
pm() { CONTAINERS_CONF="$work/containers.conf" podman --runtime runc --cgroup-manager cgroupfs "$@"; }

if ! pm image exists "$base"; then
    echo "== Debian base from Debian's packages (mmdebstrap)"
    mmdebstrap --variant=apt --include=ca-certificates bookworm "$work/rootfs.tar"
    pm import "$work/rootfs.tar" "$base"
    rm -f "$work/rootfs.tar"
fi

echo "== image $tag"
mkdir "$work/context"
cp "$binary" "$work/context/strata"
pm build --build-arg BASE="$base" \
    --target prebuilt -f Containerfile -t "$tag" "$work/context"
pm image inspect --format 'built {{.Id}}: user {{.Config.User}}, entrypoint {{.Config.Entrypoint}}' "$tag"
