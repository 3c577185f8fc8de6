#!/usr/bin/env bash
# Builds `spillway-base:local`, the image the Spillway image starts FROM, out
# of this machine's own files: the C/C++ runtime libraries the binaries link
# against (found with ldd), the dynamic loader, CA certificates and a passwd
# entry. No registry is involved, so it works where nothing can be pulled.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
binaries=("$root/target/release/spillway" "$root/target/release/spillway-loadgen")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
mkdir -p "$rootfs"/{etc,tmp,var/lib/spillway,usr/local/bin}
chmod 1777 "$rootfs/tmp"
for library in $(ldd "${binaries[@]}" | grep -o '/[^ ]*\.so[^ ]*' | sort -u); do
    mkdir -p "$rootfs$(dirname "$library")"
    cp -L "$library" "$rootfs$library"
done
echo 'root:x:0:0:root:/root:/sbin/nologin' > "$rootfs/etc/passwd"
echo 'root:x:0:' > "$rootfs/etc/group"
[[ -d /etc/ssl/certs ]] && mkdir -p "$rootfs/etc/ssl" && cp -rL /etc/ssl/certs "$rootfs/etc/ssl/"
tar -C "$rootfs" -c . | docker import - spillway-base:local >/dev/null
echo "make-base: built spillway-base:local"
