#!/usr/bin/env bash
# One-command demo: start vzram, boot the tiny test guest with swap on the
# vzram disk, push it to 1.5x its RAM, and print the daemon's stats.
#
#   contrib/qemu.sh [--mem 256M] [--size 1G] [--queues 2] [--test swap]
#                   [--append 'vzram.rounds=3'] [--backend vzram|qsd] [--reconnect 1]
#
# --backend qsd serves the disk from qemu-storage-daemon instead (a RAM file,
# no compression), to check the guest side without vzram.
# --reconnect SECS: QEMU's reconnect=SECS, as the README recommends (default
# 1): restart the daemon meanwhile and the guest carries on; 0 turns it off.
# Env: VZRAM_BIN (daemon binary), VZRAM_GUEST_DIR (guest cache), QEMU.
# Installs QEMU with apt (as root or via sudo) when it is missing.
# The last line is the verdict (PASS or FAIL). The sockets and the daemon's
# log live in a temporary directory removed on exit (the log is shown first
# when the run failed), so nothing is left in /tmp.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
mem=256M size=1G queues=2 test=swap append="" backend=vzram reconnect=1
while [ $# -gt 0 ]; do
    case "$1" in
        --mem) mem="$2"; shift 2 ;;
        --size) size="$2"; shift 2 ;;
        --queues) queues="$2"; shift 2 ;;
        --test) test="$2"; shift 2 ;;
        --append) append="$2"; shift 2 ;;
        --backend) backend="$2"; shift 2 ;;
        --reconnect) reconnect="$2"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "qemu.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

work="$(mktemp -d "${TMPDIR:-/tmp}/vzram-demo.XXXXXX")"
sock="$work/demo.sock"
ctl="$work/control.sock"
log="$work/daemon.log"
# The device's state files (tmpfs): the demo's own, removed at the end, so
# that it neither recovers an earlier run's disk nor leaves RAM behind.
shm=/dev/shm
[ -d "$shm" ] || shm=/tmp
state="$shm/vzram-demo-state.$$"
daemon_pid=""
img=""
# shellcheck disable=SC2317  # invoked via trap
cleanup() {
    if [ -n "$daemon_pid" ]; then
        kill "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
    [ -z "$img" ] || rm -f "$img"
    rm -rf "$state" "$work"
}
trap cleanup EXIT

# A fresh machine has no QEMU: install it from Debian/Ubuntu as .ci/run does
# (as root, or through sudo). $QEMU names a QEMU of your own instead.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else echo "qemu.sh: need root (or sudo) to install QEMU, or set QEMU=" >&2; exit 1; fi
}
need=()
if [ -z "${QEMU:-}" ] && ! command -v qemu-system-x86_64 >/dev/null; then need+=(qemu-system-x86); fi
# qemu-storage-daemon ships in qemu-system-common on Debian 12.
if [ "$backend" = qsd ] && ! command -v qemu-storage-daemon >/dev/null; then need+=(qemu-system-common); fi
if ((${#need[@]})); then
    command -v apt-get >/dev/null || { echo "qemu.sh: ${need[*]} missing and no apt-get; install QEMU or set QEMU=" >&2; exit 1; }
    # A backported qemu-utils (newer than the release's QEMU) blocks the
    # release's qemu-system-x86: the release's qemu-utils comes with it.
    if [[ " ${need[*]} " == *" qemu-system-x86 "* ]] && dpkg -s qemu-utils >/dev/null 2>&1 \
        && [ -r /etc/os-release ]; then
        need+=(--allow-downgrades "qemu-utils/$(. /etc/os-release && echo "$VERSION_CODENAME")")
    fi
    echo "qemu.sh: installing ${need[*]}" >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 \
    || { as_root apt-get update -qq >&2 && as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${need[@]}" >&2; }
fi

"$HERE/guest/build.sh" >/dev/null

case "$backend" in
vzram)
    bin="${VZRAM_BIN:-}"
    if [ -z "$bin" ] && command -v cargo >/dev/null; then
        # Always ask cargo: a no-op when fresh, and never a stale binary.
        echo "qemu.sh: cargo build --release -p vzram" >&2
        (cd "$ROOT" && cargo build --release -p vzram)
        bin="$ROOT/target/release/vzram"
    fi
    if [ -z "$bin" ]; then
        for b in "$ROOT/target/release/vzram" "$ROOT/target/debug/vzram"; do
            [ -x "$b" ] && { bin="$b"; break; }
        done
    fi
    [ -n "$bin" ] || { echo "qemu.sh: no vzram binary and no cargo; set VZRAM_BIN" >&2; exit 1; }
    echo "qemu.sh: $bin serve --socket $sock --size $size --queues $queues --control $ctl" >&2
    VZRAM_STATE_DIR="$state" \
        "$bin" serve --socket "$sock" --size "$size" --queues "$queues" --control "$ctl" >"$log" 2>&1 &
    daemon_pid=$!
    ;;
qsd)
    img="/dev/shm/vzram-demo.$$.img"
    truncate -s "$size" "$img"
    qemu-storage-daemon \
        --blockdev "driver=file,node-name=f,filename=$img,discard=unmap" \
        --export "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path=$sock,writable=on,num-queues=$queues" \
        >"$log" 2>&1 &
    daemon_pid=$!
    ;;
*) echo "qemu.sh: unknown backend $backend" >&2; exit 2 ;;
esac

# The daemon creates the socket once it listens; QEMU fails if it is absent.
for _ in $(seq 100); do
    [ -S "$sock" ] && break
    kill -0 "$daemon_pid" 2>/dev/null || { echo "qemu.sh: daemon exited:" >&2; cat "$log" >&2; exit 1; }
    sleep 0.1
done
[ -S "$sock" ] || { echo "qemu.sh: no socket at $sock after 10s" >&2; cat "$log" >&2; exit 1; }

start=$(date +%s)
rc=0
# run.sh's own temporary file goes to the demo's directory too.
TMPDIR="$work" "$HERE/guest/run.sh" --check --socket "$sock" --mem "$mem" --queues "$queues" --test "$test" \
    --reconnect "$reconnect" ${append:+--append "$append"} || rc=$?
secs=$(($(date +%s) - start))

echo "--- daemon stats ---"
case "$backend" in
vzram) "$bin" stat --control "$ctl" || rc=1 ;;
qsd) du -h --apparent-size "$img"; du -h "$img" ;;
esac
if [ "$rc" -ne 0 ]; then
    echo "--- daemon log ---"
    cat "$log"
    echo "qemu.sh: FAIL: the guest (test $test, $mem of RAM) did not finish cleanly against $backend after ${secs}s (rc=$rc); its console and the daemon's log are above"
    exit "$rc"
fi
what="guest test $test"
[ "$test" != swap ] || what="guest swapped 1.5x its $mem of RAM to the disk and read every page back intact"
echo "qemu.sh: PASS: $what ($backend, ${size} disk, ${secs}s)"
exit 0
