#!/usr/bin/env bash
# Make the local base image (default local/debian:bookworm) from this machine's Debian mirror
# with debootstrap: for machines that cannot pull images (no registry access, air-gapped,
# behind a proxy). `scripts/images.sh` calls it; it does nothing when the image exists
# (REBUILD_BASE=1 makes it again).
#
# The image is Debian bookworm (minbase) with ca-certificates and the apt sources of the mirror,
# and it trusts what this machine trusts: the extra CA certificates in
# /usr/local/share/ca-certificates (a TLS-intercepting proxy's, a corporate CA's) are copied in,
# so image builds on it reach PyPI and Maven Central the way this machine does.
set -euo pipefail

image="${1:-local/debian:bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"

if docker image inspect "$image" >/dev/null 2>&1 && [ "${REBUILD_BASE:-0}" != 1 ]; then
  echo "make-base: $image exists" >&2
  exit 0
fi

# The mirror this machine's apt uses (deb822 sources first, then the one-line format).
mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list.d/debian.sources ]; then
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
fi
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
  mirror=$(awk '$1 == "deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
fi
mirror="${mirror:-http://deb.debian.org/debian}"
security="${DEBIAN_SECURITY_MIRROR:-${mirror%/debian}/debian-security}"

command -v debootstrap >/dev/null || {
  echo "make-base: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "make-base: debootstrap needs root" >&2; exit 1; }

rootfs=$(mktemp -d /var/tmp/rollstream-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
began=$(date +%s)
echo "make-base: debootstrap $suite from $mirror into $rootfs" >&2
debootstrap --variant=minbase --include=ca-certificates "$suite" "$rootfs" "$mirror" >&2

cat > "$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
SOURCES
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
  chroot "$rootfs" update-ca-certificates >&2
fi
# what a container image needs no copy of
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/var/log/*.log "$rootfs"/dev/*

tar -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["bash"]' \
  --message "debootstrap --variant=minbase $suite $mirror" - "$image" >&2
echo "make-base: $image made in $(( $(date +%s) - began )) s ($(docker image inspect -f '{{.Size}}' "$image") bytes)" >&2
