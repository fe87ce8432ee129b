#!/usr/bin/env bash
# A second frontend for the e2e tests: QEMU 10 (Debian's bookworm-backports
# qemu-system-x86), unpacked with dpkg -x beside the system's QEMU, never
# installed.
#
#   contrib/guest/qemu10.sh [DIR]
#
# DIR defaults to ${VZRAM_QEMU10_DIR:-$HOME/.cache/vzram-qemu10}. Prints the
# path of DIR/qemu-system-x86_64, a wrapper that runs QEMU 10 in a private
# mount namespace with its own module directory bind-mounted over the
# system's /usr/lib/x86_64-linux-gnu/qemu (the modules must match the
# binary); it execs in place, so its pid is QEMU's. Needs root (apt, the
# mount namespace). The backports source is given to apt for these calls
# only: the host's own sources and package lists are left as they were.
# Idempotent: nothing is fetched when DIR already holds the binary.
set -euo pipefail

DIR="${1:-${VZRAM_QEMU10_DIR:-$HOME/.cache/vzram-qemu10}}"
SUITE="bookworm-backports"
log() { echo "vzram-qemu10: $*" >&2; }

mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
exec 9>"$DIR/.lock"
flock 9

if [ ! -x "$DIR/root/usr/bin/qemu-system-x86_64" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $SUITE main" \
        >"$work/sources.list"
    opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
          -o APT::Sandbox::User=root)
    log "fetching qemu-system-x86 from $SUITE"
    apt-get "${opts[@]}" update -qq
    (cd "$work/debs" && apt-get "${opts[@]}" download -qq \
        "qemu-system-x86/$SUITE" "qemu-system-common/$SUITE" "qemu-system-data/$SUITE")
    rm -rf "$DIR/root.new"
    mkdir -p "$DIR/root.new"
    for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$DIR/root.new"; done
    rm -rf "$DIR/root"
    mv "$DIR/root.new" "$DIR/root"
fi

# The wrapper: the system's module directory must exist to be mounted over
# (qemu-system-x86 from the release makes it).
cat >"$DIR/qemu-system-x86_64" <<EOF
#!/bin/sh
# QEMU 10 from $DIR/root with its own modules (see contrib/guest/qemu10.sh).
exec unshare -m --propagation private sh -c 'mkdir -p /usr/lib/x86_64-linux-gnu/qemu && mount --bind "\$0/usr/lib/x86_64-linux-gnu/qemu" /usr/lib/x86_64-linux-gnu/qemu && exec "\$0/usr/bin/qemu-system-x86_64" "\$@"' "$DIR/root" "\$@"
EOF
chmod +x "$DIR/qemu-system-x86_64"
"$DIR/qemu-system-x86_64" --version | head -1 >&2
echo "$DIR/qemu-system-x86_64"
