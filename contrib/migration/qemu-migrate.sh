#!/bin/sh
# Live-migrate a QEMU guest whose disk is a vzram device, on one host or two.
# A recipe to read and adapt, not a tool: paths and sizes are examples.
#
#   source:       vzram A serves vm1 (8G) at /run/vzram/a/vm1.sock
#   destination:  vzram B serves vm1 (8G, the same size) incoming
#
# Order: destination device incoming (1), destination QEMU (2), then on the
# source start `vzram migrate` in the background (4) just before QEMU's
# migration (3); it prints nothing on stdout. The source keeps every page
# until the move is committed. Under libvirt, contrib/libvirt/hooks/qemu
# does (1) on "migrate begin" and (4) as `qemu DOMAIN vzram-send ADDR`.
set -eu
A_CTL=/run/vzram/a/control.sock
B_CTL=/run/vzram/b/control.sock
IN=/run/vzram/b/vm1.migrate

# 1. Destination: the device waits for its pages (requests wait meanwhile).
vzram add --control "$B_CTL" \
    --device "socket=/run/vzram/b/vm1.sock,size=8G,name=vm1,incoming=unix:$IN"

# 2. Destination QEMU, same machine options as the source, plus -incoming.
#    Its vhost-user-blk device connects to vzram B at start-up.
#   qemu-system-x86_64 ... \
#     -object memory-backend-memfd,id=mem,size=2G,share=on -numa node,memdev=mem \
#     -chardev socket,id=vz,path=/run/vzram/b/vm1.sock \
#     -device vhost-user-blk-pci,chardev=vz,num-queues=2 \
#     -incoming tcp:0:4444 -qmp unix:/run/qmp-dst.sock,server,wait=off

# 3. Source QEMU: start migrating RAM (QMP).
#   {"execute":"migrate","arguments":{"uri":"tcp:DEST:4444"}}

# 4. Source vzram: pre-copy while the guest runs; the last delta goes when
#    QEMU stops the VM at the end of its migration (GET_VRING_BASE). The
#    destination guest resumes at once, and its disk requests wait for that
#    delta (milliseconds). The move commits when the destination QEMU
#    runs the guest (it starts its rings, and vzram B says so); the source
#    QEMU's exit, a pause or a save commits nothing. A `vzram migrate`
#    whose client is killed is cancelled. Between hosts, tunnel the unix socket:
#      ssh -N -L /run/vzram/a/vm1.to-b:$IN root@DEST &
#    and use --to unix:/run/vzram/a/vm1.to-b.
vzram migrate --control "$A_CTL" --device vm1 --to "unix:$IN" >/dev/null &
# then step 3 (QMP migrate), and wait for it. If QEMU's migration fails or
# is cancelled (QMP migrate_cancel) while the guest still runs here, the
# rings never stop and the sender would go on: call it off, the destination
# drops what it took and the source keeps every page:
#   vzram migrate --control "$A_CTL" --device vm1 --cancel
wait

# 5. Check: the destination device serves, the source dropped its copy.
vzram stat --control "$B_CTL"
