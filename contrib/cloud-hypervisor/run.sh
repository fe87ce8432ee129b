#!/usr/bin/env bash
# Attach a vzram disk to a cloud-hypervisor VM. vhost-user needs the guest
# memory shared with the backend: --memory shared=on is required.
#   contrib/cloud-hypervisor/run.sh KERNEL DISK_IMAGE
# Env: VZRAM_SOCK     the disk's socket (default /tmp/vzram-ch.sock)
#      VZRAM_CONTROL  the daemon's control socket (default: VZRAM_SOCK with .ctl)
#      VZRAM          the vzram binary (default: vzram on PATH)
#      VZRAM_WAIT     seconds to wait for the daemon to be ready (default 10)
#      VZRAM_NAME     the device's name, and so its state's (default: ch-
#                     and the root image's name without its extension)
# Each run is a new boot of the VM, whose swap starts empty: the device is
# started --fresh, so it never serves pages of an earlier VM with the same
# name (nor fails when the size changed). State goes where vzram's default
# puts it ($VZRAM_STATE_DIR, else /run/vzram/state as root, see README),
# under that name.
set -euo pipefail
kernel=${1:?kernel}; rootfs=${2:?root disk image}
sock=${VZRAM_SOCK:-/tmp/vzram-ch.sock}
ctl=${VZRAM_CONTROL:-${sock%.sock}.ctl}
vzram=${VZRAM:-vzram}
wait_s=${VZRAM_WAIT:-10}
name=${VZRAM_NAME:-ch-$(basename "${rootfs%.*}")}

"$vzram" serve --socket "$sock" --size 2G --queues 2 --control "$ctl" --name "$name" --fresh &
pid=$!
# SIGTERM: the daemon removes its sockets and exits.
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true' EXIT

# Ready once the control socket answers: the daemon binds every device
# socket before it serves anything. Bounded, and given up at once if the
# daemon exits (a bad flag, a socket in use).
deadline=$((SECONDS + wait_s))
until "$vzram" stat --control "$ctl" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
        rc=0; wait "$pid" || rc=$?
        echo "run.sh: vzram exited (status $rc) before it was ready" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "run.sh: vzram not ready after ${wait_s}s (no answer on $ctl)" >&2
        exit 1
    fi
    sleep 0.1
done

cloud-hypervisor \
  --kernel "$kernel" --cmdline "console=ttyS0 root=/dev/vda1 rw" \
  --cpus boot=2 --memory size=1G,shared=on \
  --disk path="$rootfs" --disk vhost_user=true,socket="$sock",num_queues=2,queue_size=256 \
  --serial tty --console off
