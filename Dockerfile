# Runtime image of the vzram daemon. Sockets live in the /run/vzram volume,
# which the VMM (QEMU, cloud-hypervisor) must share with this container.
#   docker build -t vzram .
#   docker run -v /run/vzram:/run/vzram vzram serve --socket /run/vzram/vm1.sock --size 8G --control /run/vzram/control.sock
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
COPY tests ./tests
RUN cargo build --release -p vzram --locked

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin vzram \
 && install -d -o vzram -g vzram -m 0750 /run/vzram
COPY --from=build /src/target/release/vzram /usr/local/bin/vzram
USER vzram
VOLUME ["/run/vzram"]
ENTRYPOINT ["/usr/local/bin/vzram"]
CMD ["serve", "--socket", "/run/vzram/vzram.sock", "--size", "4G", "--control", "/run/vzram/control.sock"]
