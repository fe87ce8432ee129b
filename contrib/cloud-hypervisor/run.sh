#!/usr/bin/env bash
# Attach a vzram disk to a cloud-hypervisor VM. vhost-user needs the guest
# memory shared with the backend: --memory shared=on is required.
#   contrib/cloud-hypervisor/run.sh KERNEL DISK_IMAGE
set -euo pipefail
kernel=${1:?kernel}; rootfs=${2:?root disk image}
sock=${VZRAM_SOCK:-/tmp/vzram-ch.sock}
vzram serve --socket "$sock" --size 2G --queues 2 &
trap 'kill $!' EXIT
while [ ! -S "$sock" ]; do sleep 0.1; done
cloud-hypervisor \
  --kernel "$kernel" --cmdline "console=ttyS0 root=/dev/vda1 rw" \
  --cpus boot=2 --memory size=1G,shared=on \
  --disk path="$rootfs" --disk vhost_user=true,socket="$sock",num_queues=2,queue_size=256 \
  --serial tty --console off
