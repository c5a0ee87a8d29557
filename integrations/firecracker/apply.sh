#!/usr/bin/env bash
# Applies this folder's patches to a Firecracker checkout and, with --build,
# builds its release binary there.
#
#   integrations/firecracker/apply.sh CHECKOUT [--build]
#
# The patches are against commit 81b38b9da (v1.17.0-dev, 2026-08-21); the
# checkout's Cargo.toml gets a [patch.crates-io] section that takes
# dirty-log from this repository (MICRO_HTTP=PATH: see ../lib.sh). The build
# is Firecracker's release kind: the musl target, with its seccomp filters
# (FC_TARGET=x86_64-unknown-linux-gnu builds one without filters). It uses
# toolchain 1.95.0 (RUSTUP_TOOLCHAIN overrides it) rather than the newer one
# Firecracker's rust-toolchain.toml pins, and needs libclang and libseccomp
# (Debian: libclang-dev libseccomp-dev), and for musl musl-gcc (musl-tools).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=../lib.sh
. "$here/../lib.sh"
parse_args "apply.sh FIRECRACKER_CHECKOUT [--build]" "$@"
apply_patches "$here/patches" "$checkout" 81b38b9da
patch_crates "$checkout" "$repo" dirty-log
$build || exit 0

target=${FC_TARGET:-x86_64-unknown-linux-musl}
toolchain=${RUSTUP_TOOLCHAIN:-1.95.0}
out=$(cd "$checkout" && mkdir -p "${CARGO_TARGET_DIR:-build/cargo_target}" && cd "${CARGO_TARGET_DIR:-build/cargo_target}" && pwd)
if [[ $target == *-musl ]]; then
    command -v musl-gcc >/dev/null || {
        echo "building for $target needs musl-gcc: apt-get install musl-tools" >&2
        exit 1
    }
    rustup target list --toolchain "$toolchain" --installed | grep -qx "$target" ||
        rustup target add --toolchain "$toolchain" "$target"
    # userfaultfd-sys compiles C against <linux/userfaultfd.h>; musl-gcc sees
    # no kernel headers, so it gets the system's linux/ and asm/ alone.
    headers="$out/musl-kernel-headers"
    mkdir -p "$headers"
    ln -sfn /usr/include/linux "$headers/linux"
    ln -sfn "/usr/include/$(uname -m)-linux-gnu/asm" "$headers/asm"
    ln -sfn /usr/include/asm-generic "$headers/asm-generic"
    export "CFLAGS_${target//-/_}=-idirafter $headers"
fi
(cd "$checkout" && RUSTUP_TOOLCHAIN=$toolchain cargo build --release -p firecracker --target "$target")
# Firecracker's .cargo/config.toml puts its target folder in build/cargo_target.
echo "built $out/$target/release/firecracker"
