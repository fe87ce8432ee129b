# Runtime image of the vzram daemon. Sockets live in the /run/vzram volume,
# which the VMM (QEMU, cloud-hypervisor) must share with this container.
#
# The default command serves one 4 GiB device, /run/vzram/vzram.sock, with
# mode 0660 (--socket-mode), as the image's user (uid 10001). Give the host
# directory to that uid and to the group the VMM runs in (kvm for QEMU under
# libvirt on Debian and Ubuntu), setgid so that the sockets get that group;
# the VMM's user then connects, nobody else does. The control socket stays
# 0600: `docker exec vzram vzram stat`.
#
# Device state (every page the guests swapped out) lives in
# /var/lib/vzram/state: bind-mount a tmpfs of the host there. Not the
# container's own /dev/shm, which `docker restart` replaces with an empty
# one: a reconnecting QEMU would find a blank disk. The pool may use up to
# --host-mem-limit (4G here) and the slot tables 1/512 of the devices'
# size: size the tmpfs for that, or guest writes fail (IOERR) when it fills.
# Without the bind mount Docker makes an anonymous volume on disk (the
# daemon warns that the state is not on tmpfs).
#
#   sudo install -d -m 2770 -o 10001 -g kvm /run/vzram
#   sudo install -d -m 0700 -o 10001 /run/vzram-state
#   sudo mount -t tmpfs -o size=4200m,mode=0700,uid=10001 tmpfs /run/vzram-state
#   docker build -t vzram .
#   docker run -d --name vzram -v /run/vzram:/run/vzram \
#     -v /run/vzram-state:/var/lib/vzram/state vzram
#   # /run/vzram/vzram.sock: srw-rw---- 10001 kvm
#
# Other devices: `docker run ... vzram serve --socket-mode 0660
# --host-mem-limit ... --device ...` (arguments replace the whole default
# command: keep --socket-mode, and a host limit that fits in --shm-size).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
COPY tests ./tests
RUN cargo build --release -p vzram --locked

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin vzram \
 && install -d -o vzram -g vzram -m 2770 /run/vzram \
 && install -d -o vzram -g vzram -m 0700 /var/lib/vzram/state
COPY --from=build /src/target/release/vzram /usr/local/bin/vzram
USER vzram
ENV VZRAM_STATE_DIR=/var/lib/vzram/state
VOLUME ["/run/vzram", "/var/lib/vzram/state"]
ENTRYPOINT ["/usr/local/bin/vzram"]
CMD ["serve", "--socket", "/run/vzram/vzram.sock", "--name", "vzram", "--size", "4G", "--host-mem-limit", "4G", "--socket-mode", "0660", "--control", "/run/vzram/control.sock"]
