#!/usr/bin/env bash
# Builds target/debian/vzram_<version>_<arch>.deb from a staged tree with
# dpkg-deb alone: no debhelper, no cargo-deb. Needs the Rust toolchain
# (rust-version in Cargo.toml), dpkg, binutils (strip, objdump) and gzip,
# as a fresh Debian 12 with rustup has them.
#
#   contrib/package/deb.sh && sudo apt install ./target/debian/vzram_*.deb
#
# By default it builds the daemon (`cargo build --release -p vzram`).
# Environment:
#   VZRAM_DEB_BIN  package this binary instead of building one (the tests
#                  pass their debug build; stripped here either way)
#   VZRAM_DEB_OUT  the directory the .deb goes to (default target/debian)
#   VZRAM_DEB_MAINTAINER  the control file's (and changelog's) Maintainer
#   SOURCE_DATE_EPOCH     the changelog's date (default: the last commit's)
# Prints the path of the .deb on its last line.
#
# lintian (tests/package.rs runs it) reports no error and one warning,
# initial-upload-closes-no-bugs: the changelog closes no Debian bug, as
# nothing was filed in Debian's tracker. Its remaining notes (-I) are left
# too: hardening-no-fortify-functions (a Rust binary calls no _chk
# functions), package-supports-alternative-init-but-no-init.d-script (no
# sysvinit script is shipped; `serve --pidfile` is there for one), and
# bash-term-in-posix-shell (awk's `function` inside the libvirt hook).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"

for tool in dpkg-deb dpkg strip objdump gzip; do
  command -v "$tool" >/dev/null || { echo "deb.sh: $tool is missing" >&2; exit 1; }
done

if [ -n "${VZRAM_DEB_BIN:-}" ]; then
  bin=$VZRAM_DEB_BIN
else
  cargo build --release -p vzram
  bin=${CARGO_TARGET_DIR:-$repo/target}/release/vzram
fi
[ -x "$bin" ] || { echo "deb.sh: no vzram binary at $bin" >&2; exit 1; }

# The version the binary says it is (Cargo.toml's), and this machine's arch.
upstream=$("$bin" --version | awk '{print $2}')
[[ $upstream =~ ^[0-9][0-9A-Za-z.+~]*$ ]] || { echo "deb.sh: bad version '$upstream'" >&2; exit 1; }
# Debian revision 1: a package of an upstream release, not a native one.
version=$upstream-1
maintainer=${VZRAM_DEB_MAINTAINER:-vzram maintainers <vzram@users.noreply.github.com>}
arch=$(dpkg --print-architecture)
out=${VZRAM_DEB_OUT:-$repo/target/debian}
mkdir -p "$out"
stage=$(mktemp -d "$out/stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT
chmod 0755 "$stage"
umask 022

# The files, at the paths Debian gives them.
install -d "$stage/usr/bin"
# As dh_strip: no symbols, no .comment or .note sections.
strip --strip-unneeded --remove-section=.comment --remove-section=.note \
  -o "$stage/usr/bin/vzram" "$bin"
chmod 0755 "$stage/usr/bin/vzram"
install -D -m 0644 -t "$stage/lib/systemd/system" \
  contrib/systemd/vzram.service contrib/systemd/vzram.socket contrib/systemd/vzram-control.socket
install -D -m 0644 contrib/udev/60-vzram.rules "$stage/lib/udev/rules.d/60-vzram.rules"
install -D -m 0644 "$here/vzram.sysusers" "$stage/usr/lib/sysusers.d/vzram.conf"
install -D -m 0644 "$here/vzram.toml" "$stage/etc/vzram/vzram.toml"
install -D -m 0644 "$here/50-vzram.json" "$stage/usr/share/qemu/vhost-user/50-vzram.json"
doc=$stage/usr/share/doc/vzram
install -D -m 0644 README.md "$doc/README.md"
install -D -m 0644 SECURITY.md "$doc/SECURITY.md"
# README's links go to docs/ by topic: shipped beside it, so they resolve.
for f in docs/*.md; do
  install -D -m 0644 "$f" "$doc/$f"
done
install -D -m 0644 "$here/copyright" "$doc/copyright"
# The recipes README points to, as examples (not executable: copy one to
# use it, e.g. `install -m 0755 .../examples/libvirt/hooks/qemu
# /etc/libvirt/hooks/qemu`).
ex=$doc/examples
install -D -m 0644 -t "$ex/libvirt" contrib/libvirt/*.xml
install -D -m 0644 -t "$ex/libvirt/hooks" contrib/libvirt/hooks/qemu
install -D -m 0644 -t "$ex/cloud-hypervisor" contrib/cloud-hypervisor/run.sh
install -D -m 0644 -t "$ex/migration" contrib/migration/qemu-migrate.sh
install -D -m 0644 -t "$ex/systemd" \
  contrib/systemd/vzram.service contrib/systemd/vzram.socket contrib/systemd/vzram-control.socket
install -D -m 0644 -t "$ex/prometheus" contrib/prometheus/vzram.rules.yml \
  contrib/prometheus/vzram.rules.test.yml contrib/prometheus/vzram-dashboard.json

# Debian's changelog, dated by the last commit (reproducible), else now.
epoch=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)}
sed -e "s/@VERSION@/$upstream/" -e "s/@MAINTAINER@/$maintainer/" \
  -e "s/@DATE@/$(LC_ALL=C date -u -R -d "@$epoch")/" "$here/changelog" |
  gzip -9n >"$doc/changelog.Debian.gz"
chmod 0644 "$doc/changelog.Debian.gz"

# The manual pages and completions, made by the binary from its own
# command line definitions.
man=$stage/usr/share/man/man1
install -d "$man"
"$stage/usr/bin/vzram" man --dir "$man" >/dev/null
gzip -9n "$man"/*.1
# vzram.toml(5) is written into man5 beside man1.
gzip -9n "$man"/../man5/*.5
install -d "$stage/usr/share/bash-completion/completions" \
  "$stage/usr/share/zsh/vendor-completions" "$stage/usr/share/fish/vendor_completions.d"
"$stage/usr/bin/vzram" completions bash >"$stage/usr/share/bash-completion/completions/vzram"
"$stage/usr/bin/vzram" completions zsh >"$stage/usr/share/zsh/vendor-completions/_vzram"
"$stage/usr/bin/vzram" completions fish >"$stage/usr/share/fish/vendor_completions.d/vzram.fish"

# Depends, from the shared libraries the binary needs (dpkg-shlibdeps
# wants a debian/ source tree): glibc at the newest symbol version used.
depends=()
for lib in $(objdump -p "$stage/usr/bin/vzram" | awk '$1 == "NEEDED" {print $2}'); do
  case $lib in
    libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | ld-linux*)
      glibc=$(objdump -T "$stage/usr/bin/vzram" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
      dep="libc6 (>= $glibc)" ;;
    libgcc_s.so.1) dep="libgcc-s1 (>= 4.2)" ;;
    *) echo "deb.sh: $lib: which package has it? add it here" >&2; exit 1 ;;
  esac
  [[ " ${depends[*]:-} " == *" $dep "* ]] || depends+=("$dep")
done
depends_line=$(printf '%s, ' "${depends[@]}")
depends_line=${depends_line%, }

install -d "$stage/DEBIAN"
installed_kb=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat >"$stage/DEBIAN/control" <<EOF
Package: vzram
Version: $version
Architecture: $arch
Maintainer: $maintainer
Installed-Size: $installed_kb
Depends: $depends_line
Recommends: systemd
Section: admin
Priority: optional
Description: compressed RAM block devices for VMs (vhost-user-blk)
 zram for virtual machines: a host-side vhost-user-blk backend daemon that
 keeps every 4 KiB page a guest writes compressed (lz4 or zstd) in one
 shared, memory-capped pool in host RAM. Guests see an ordinary virtio disk
 and mostly use it as swap. One process serves many VMs.
 .
 The service is installed, not enabled: edit /etc/vzram/vzram.toml, then
 systemctl enable --now vzram.
EOF
echo /etc/vzram/vzram.toml >"$stage/DEBIAN/conffiles"
install -m 0755 "$here/postinst" "$here/prerm" "$here/postrm" "$stage/DEBIAN/"
# md5sums of every file but the conffiles (dpkg keeps theirs), as dh_md5sums.
(cd "$stage" && find . -path ./DEBIAN -prune -o -path ./etc -prune -o -type f -printf '%P\0' |
  LC_ALL=C sort -z | xargs -0 md5sum >DEBIAN/md5sums)
chmod 0644 "$stage/DEBIAN/md5sums"

deb=$out/vzram_${version}_${arch}.deb
dpkg-deb --build --root-owner-group "$stage" "$deb" >&2
echo "$deb"
