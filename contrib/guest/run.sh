#!/usr/bin/env bash
# Boot the vzram test guest against a vhost-user-blk socket.
#
#   contrib/guest/run.sh --socket SOCK [--mem 256M] [--queues N] [--test NAME[,NAME..]]
#                        [--append 'extra kernel args'] [--reconnect SECS] [--cache DIR]
#                        [--qemu-arg ARG]... [--print-cmd] [--check]
#
# The guest console (ttyS0) is this script's stdout. QEMU is exec'd, so the
# PID of this script is QEMU's: tests can kill it to simulate a crash.
# --reconnect SECS (default 1; 0 = off): when the backend goes away, QEMU
# keeps the guest running and reconnects every SECS seconds (a restarted
# vzram recovers the disk and QEMU resubmits what was in flight).
# --qemu-arg ARG: appended to QEMU's command line (repeatable), e.g.
# --qemu-arg -incoming --qemu-arg unix:/tmp/mig.sock for a migration target.
# --check: instead of exec, exit 0 only if the guest printed
# "VZRAM-GUEST-DONE rc=0" (QEMU itself exits 0 even when a scenario failed).
# Builds/refreshes the guest first (contrib/guest/build.sh).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
sock="" mem=256M queues=1 test=info append="" reconnect=1 print_cmd=0 check=0
extra=()
cache="${VZRAM_GUEST_DIR:-$HOME/.cache/vzram-guest}"
qemu="${QEMU:-qemu-system-x86_64}"

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --socket) sock="$2"; shift 2 ;;
        --mem) mem="$2"; shift 2 ;;
        --queues) queues="$2"; shift 2 ;;
        --test) test="$2"; shift 2 ;;
        --append) append="$2"; shift 2 ;;
        --reconnect) reconnect="$2"; shift 2 ;;
        --cache) cache="$2"; shift 2 ;;
        --qemu-arg) extra+=("$2"); shift 2 ;;
        --print-cmd) print_cmd=1; shift ;;
        --check) check=1; shift ;;
        -h|--help) usage ;;
        *) echo "run.sh: unknown argument $1" >&2; usage ;;
    esac
done
[ -n "$sock" ] || { echo "run.sh: --socket is required" >&2; usage; }
case "$reconnect" in
    ''|*[!0-9]*) echo "run.sh: --reconnect wants whole seconds, got '$reconnect'" >&2; usage ;;
esac
chardev="socket,id=c0,path=$sock"
reconnect=$((10#$reconnect))
[ "$reconnect" -eq 0 ] || chardev+=",reconnect=$reconnect"

# Cheap when the cache is current (no apt calls); rebuilds after edits to
# init/pressure.c so a stale initramfs is never booted.
if ! b="$("$HERE/build.sh" "$cache" 2>&1)"; then
    echo "$b" >&2
    exit 1
fi

# vhost-user needs guest RAM in a shareable fd (memfd, share=on) so the
# backend can mmap it; plain -m RAM would not work.
# KVM hangs on this host and -cpu host fails under TCG: use TCG with the
# default CPU model. quiet keeps kernel chatter from interleaving with the
# result lines; panic=-1 + -no-reboot turns a guest panic into a QEMU exit.
# shellcheck disable=SC2054  # commas are QEMU option syntax
cmd=(
    "$qemu"
    -accel tcg -smp 2 -machine pc
    -object "memory-backend-memfd,id=mem,size=$mem,share=on"
    -numa node,memdev=mem -m "$mem"
    -kernel "$cache/vmlinuz" -initrd "$cache/initramfs.cpio.gz"
    -append "console=ttyS0 quiet panic=-1 vzram.test=$test${append:+ $append}"
    -chardev "$chardev"
    -device "vhost-user-blk-pci,chardev=c0,num-queues=$queues"
    -nographic -nodefaults -serial stdio -monitor none -no-reboot
    ${extra[@]+"${extra[@]}"}
)
if [ "$print_cmd" = 1 ]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
[ "$check" = 1 ] || exec "${cmd[@]}"

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
# SeaBIOS clears the screen and turns line wrap off (ESC c, ESC [?7l):
# shown as they are, they leave the operator's terminal without wrap.
set +e
"${cmd[@]}" | sed -u 's/\x1b\[[0-9;?]*[A-Za-z]//g; s/\x1bc//g' | tee "$out"
rc=${PIPESTATUS[0]}
set -e
if ! grep -aq '^VZRAM-GUEST-DONE rc=0' "$out"; then
    echo "run.sh: guest did not report success (qemu rc=$rc)" >&2
    exit 1
fi
exit "$rc"
