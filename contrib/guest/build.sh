#!/usr/bin/env bash
# Build the vzram test guest (kernel + initramfs) from Debian packages only.
# The guest runs udevd with vzram's own rule (contrib/udev/60-vzram.rules).
#
#   contrib/guest/build.sh [CACHE_DIR]
#
# CACHE_DIR defaults to ${VZRAM_GUEST_DIR:-$HOME/.cache/vzram-guest}.
# Outputs $CACHE/vmlinuz and $CACHE/initramfs.cpio.gz; prints their paths.
# Idempotent and fast (no apt calls) when the outputs were built from the
# current files in this directory; the kernel version is then kept as cached
# (reproducible CI). To pick up a newer Debian kernel, set
# VZRAM_GUEST_REBUILD=1 or delete the cache.
#
# Env: VZRAM_GUEST_KERNEL_PKG  override the kernel package (default: what
#                              linux-image-cloud-amd64 depends on)
#      VZRAM_GUEST_REBUILD=1   force a rebuild
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
UDEV_RULE="$HERE/../udev/60-vzram.rules"
CACHE="${1:-${VZRAM_GUEST_DIR:-$HOME/.cache/vzram-guest}}"
mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"

log() { echo "vzram-guest: $*" >&2; }
die() { log "error: $*"; exit 1; }

# Run as root directly, otherwise via sudo if there is one.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else die "need root (or sudo) for: $*"; fi
}

# Parallel test runs may all call us: one builder at a time per cache.
exec 9>"$CACHE/.lock"
flock 9

# --- up to date? (cheap: hash of our own inputs, no apt) ----------------------
local_hash="$(cat "$HERE/build.sh" "$HERE/init" "$HERE/pressure.c" "$UDEV_RULE" | sha256sum | cut -d' ' -f1)"
if [ "${VZRAM_GUEST_REBUILD:-0}" != 1 ] && [ -z "${VZRAM_GUEST_KERNEL_PKG:-}" ] \
    && [ -s "$CACHE/vmlinuz" ] && [ -s "$CACHE/initramfs.cpio.gz" ] \
    && [ "$(head -n1 "$CACHE/stamp" 2>/dev/null)" = "$local_hash" ]; then
    log "up to date ($(sed -n 2p "$CACHE/stamp"))"
    echo "kernel=$CACHE/vmlinuz"
    echo "initramfs=$CACHE/initramfs.cpio.gz"
    exit 0
fi

# --- host tools ---------------------------------------------------------------
need_pkgs=()
# busybox-static (not busybox): the initramfs has no libc to link against.
for p in busybox-static kmod cpio gzip gcc libc6-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need_pkgs+=("$p")
done
command -v apt-get >/dev/null || die "apt-get not found (Debian/Ubuntu host required)"
if [ "${#need_pkgs[@]}" -gt 0 ]; then
    log "installing ${need_pkgs[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${need_pkgs[@]}" >&2 \
    || { as_root apt-get update >&2 && as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends "${need_pkgs[@]}" >&2; }
fi
DEPMOD="$(command -v depmod || echo /sbin/depmod)"
MODPROBE="$(command -v modprobe || echo /sbin/modprobe)"
BUSYBOX=/bin/busybox

# --- which kernel -------------------------------------------------------------
kpkg="${VZRAM_GUEST_KERNEL_PKG:-}"
if [ -z "$kpkg" ]; then
    kpkg="$(apt-cache depends linux-image-cloud-amd64 2>/dev/null \
        | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
    if [ -z "$kpkg" ]; then
        # Stale/missing package lists on a fresh machine.
        as_root apt-get update >&2
        kpkg="$(apt-cache depends linux-image-cloud-amd64 \
            | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
    fi
fi
[ -n "$kpkg" ] || die "cannot find the linux-image-*-cloud-amd64 package"
kpkg_ver="$(apt-cache policy "$kpkg" | awk '/Candidate:/ {print $2}')"

work="$(mktemp -d "$CACHE/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# --- kernel package: download (cached), unpack, never install -----------------
deb="$(ls "$CACHE"/"${kpkg}"_*.deb 2>/dev/null | head -n1 || true)"
if [ -z "$deb" ] || ! dpkg-deb -f "$deb" Version | grep -qxF "$kpkg_ver"; then
    rm -f "$CACHE"/linux-image-*.deb
    log "downloading $kpkg $kpkg_ver"
    # _apt cannot write into root-only dirs; download in a world-writable
    # temp dir to avoid the "unsandboxed" warning, then move it.
    dl="$(mktemp -d)"; chmod 777 "$dl"
    (cd "$dl" && apt-get download "$kpkg") >&2
    mv "$dl"/*.deb "$CACHE"/
    rmdir "$dl"
    deb="$(ls "$CACHE"/"${kpkg}"_*.deb | head -n1)"
fi
log "unpacking $(basename "$deb")"
dpkg-deb -x "$deb" "$work/k"

# --- udev package: download (cached), unpack, never install ------------------
# Debian links udevadm (which is also systemd-udevd) without systemd's shared
# library; it needs only a few libraries the host has (see below).
udev_candidate() { apt-cache policy udev | awk '/Candidate:/ && $2 != "(none)" {print $2}'; }
udev_ver="$(udev_candidate)"
if [ -z "$udev_ver" ]; then
    as_root apt-get update >&2
    udev_ver="$(udev_candidate)"
fi
[ -n "$udev_ver" ] || die "no udev package in the apt lists"
udeb="$(ls "$CACHE"/udev_*.deb 2>/dev/null | head -n1 || true)"
if [ -z "$udeb" ] || ! dpkg-deb -f "$udeb" Version | grep -qxF "$udev_ver"; then
    rm -f "$CACHE"/udev_*.deb
    log "downloading udev $udev_ver"
    dl="$(mktemp -d)"; chmod 777 "$dl"
    if ! (cd "$dl" && apt-get download "udev=$udev_ver") >&2; then
        # Stale lists name a version the mirror no longer has.
        as_root apt-get update >&2
        udev_ver="$(udev_candidate)"
        (cd "$dl" && apt-get download "udev=$udev_ver") >&2
    fi
    mv "$dl"/*.deb "$CACHE"/
    rmdir "$dl"
    udeb="$(ls "$CACHE"/udev_*.deb | head -n1)"
fi
dpkg-deb -x "$udeb" "$work/u"
[ -x "$work/u/bin/udevadm" ] || die "unexpected udev package layout"
kver="$(ls "$work/k/lib/modules" | head -n1)"
[ -n "$kver" ] && [ -f "$work/k/boot/vmlinuz-$kver" ] || die "unexpected kernel package layout"
kmods="$work/k/lib/modules/$kver"
# The .deb ships without modules.dep; generate it so modprobe can resolve deps.
"$DEPMOD" -b "$work/k" "$kver"

# --- initramfs tree -----------------------------------------------------------
root="$work/root"
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,mnt,etc,root,usr/bin,usr/sbin,lib/modules/"$kver"}
cp "$BUSYBOX" "$root/bin/busybox"
# Symlink every applet so the init script can use plain names.
for a in $("$BUSYBOX" --list); do
    [ -e "$root/bin/$a" ] || ln -s busybox "$root/bin/$a"
done
# The kernel calls /sbin/modprobe itself (e.g. zram loading its compressor).
ln -s ../bin/busybox "$root/sbin/modprobe"
install -m 0755 "$HERE/init" "$root/init"

# udevd and vzram's rule, nothing else of udev's rules: no module loading or
# renaming behind /init's back.
install -D -m 0755 "$work/u/bin/udevadm" "$root/bin/udevadm"
mkdir -p "$root/lib/systemd" "$root/etc/udev/rules.d" "$root/run"
ln -sf ../../bin/udevadm "$root/lib/systemd/systemd-udevd"
install -m 0644 "$UDEV_RULE" "$root/etc/udev/rules.d/60-vzram.rules"
# Its libraries and the dynamic loader, from the host (the same Debian
# release as the package), at the paths the loader searches.
if ldd "$work/u/bin/udevadm" | grep -q "not found"; then
    die "udevadm: $(ldd "$work/u/bin/udevadm" | grep "not found" | tr '\n' ' ')"
fi
ldd "$work/u/bin/udevadm" | awk '/=> \// {print $3} /^\t\/.*ld-linux/ {print $1}' | sort -u \
    | while read -r lib; do
    [ -f "$lib" ] || die "udevadm needs $lib, which this host lacks"
    case "$lib" in
        */ld-linux*) dst="$root/lib64/$(basename "$lib")" ;;
        *) dst="$root/lib/x86_64-linux-gnu/$(basename "$lib")" ;;
    esac
    install -D -m 0755 "$(readlink -f "$lib")" "$dst"
done
[ -e "$root/lib64/ld-linux-x86-64.so.2" ] || die "no dynamic loader for udevadm"
gcc -static -O2 -Wall -o "$root/bin/vzram-pressure" "$HERE/pressure.c"
strip "$root/bin/vzram-pressure" 2>/dev/null || true

# Modules wanted by /init. Anything built into this kernel is skipped by
# modprobe --show-depends ("builtin ..."). zram/lz4 are optional extras.
want=(virtio_pci virtio_blk ext4 crc32c_generic zram lz4 lzo_rle)
for m in "${want[@]}"; do
    "$MODPROBE" -d "$work/k" -S "$kver" --show-depends "$m" 2>/dev/null || log "module $m not found (ok if optional)"
done | awk '$1 == "insmod" {print $2}' | sort -u | while read -r ko; do
    rel="${ko#"$kmods"/}"
    dst="$root/lib/modules/$kver/$rel"
    mkdir -p "$(dirname "$dst")"
    # Busybox modprobe may not handle compressed modules: store them plain.
    case "$ko" in
        *.ko.xz) xz -dc "$ko" >"${dst%.xz}" ;;
        *.ko.zst) zstd -qdc "$ko" >"${dst%.zst}" ;;
        *.ko.gz) gzip -dc "$ko" >"${dst%.gz}" ;;
        *) cp "$ko" "$dst" ;;
    esac
done
for f in modules.order modules.builtin modules.builtin.modinfo; do
    [ -f "$kmods/$f" ] && cp "$kmods/$f" "$root/lib/modules/$kver/"
done
"$DEPMOD" -b "$root" "$kver"
for m in virtio_pci virtio_blk; do
    grep -q "/$m.ko" "$root/lib/modules/$kver/modules.dep" \
        || grep -q "/$m.ko" "$root/lib/modules/$kver/modules.builtin" \
        || die "module $m missing from initramfs"
done
echo "$kver" >"$root/etc/kernel-release"

# --- pack ---------------------------------------------------------------------
(cd "$root" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) \
    | gzip -9n >"$work/initramfs.cpio.gz"
cp "$work/k/boot/vmlinuz-$kver" "$work/vmlinuz"
mv -f "$work/vmlinuz" "$CACHE/vmlinuz"
mv -f "$work/initramfs.cpio.gz" "$CACHE/initramfs.cpio.gz"
printf '%s\n%s\n' "$local_hash" "$kpkg $kpkg_ver" >"$CACHE/stamp"
log "built guest for kernel $kver ($(du -h "$CACHE/initramfs.cpio.gz" | cut -f1) initramfs)"
echo "kernel=$CACHE/vmlinuz"
echo "initramfs=$CACHE/initramfs.cpio.gz"
