#!/usr/bin/env bash
# Builds a minimal Debian bookworm image with python3 locally and `docker import`s it, for
# machines that can reach Debian's archive but no container registry (so `FROM python:3.11-slim`
# cannot be pulled). Cached: does nothing when the image already exists.
#
#   docker/make_base_image.sh [IMAGE]        # default kvfleet-base:bookworm
#   KVFLEET_DEBIAN_MIRROR=http://... to override the mirror (default: the one apt uses here)
set -euo pipefail

IMAGE="${1:-kvfleet-base:bookworm}"
SUITE=bookworm

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE exists; skipping"
    exit 0
fi

# The mirror apt already uses on this machine (deb822 or one-line sources), else Debian's CDN.
mirror_from_apt() {
    local f
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
        [ -r "$f" ] || continue
        # deb822 "URIs: http://..." or one-line "deb [opts] http://... suite"; skip security.
        sed -nE 's/^URIs:[[:space:]]*([^[:space:]]+).*/\1/p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' "$f" \
            | grep -v security | head -n1 && return 0
    done
    return 0
}
MIRROR="${KVFLEET_DEBIAN_MIRROR:-$(mirror_from_apt)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap" >&2; exit 1; }

ROOTFS="$(mktemp -d /tmp/kvfleet-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR"

# The host's CA bundle: on machines whose HTTPS goes through an inspecting proxy it holds that
# proxy's CA, which pip inside the build needs (Debian's own bundle is a subset of it otherwise).
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
fi

# Trim what an image does not need: apt lists, caches, docs, man pages, locales.
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/usr/share/locale/* "$ROOTFS"/tmp/* "$ROOTFS"/var/log/*.log

tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "kvfleet base: debootstrap $SUITE minbase + python3 from $MIRROR" \
    - "$IMAGE"
docker image ls "$IMAGE"
