#!/usr/bin/env bash
# Applies this folder's patches to a Firecracker checkout and, with --build,
# builds its release binary there.
#
#   integrations/firecracker/apply.sh CHECKOUT [--build]
#
# The patches are against commit 81b38b9da (v1.17.0-dev, 2026-08-21); the
# checkout's Cargo.toml gets a [patch.crates-io] section that takes
# dirty-log from this repository (MICRO_HTTP=PATH: see ../lib.sh). The build
# uses toolchain 1.95.0 (RUSTUP_TOOLCHAIN overrides it) rather than the newer
# one Firecracker's rust-toolchain.toml pins, and needs libclang and
# libseccomp (Debian: libclang-dev libseccomp-dev).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=../lib.sh
. "$here/../lib.sh"
parse_args "apply.sh FIRECRACKER_CHECKOUT [--build]" "$@"
apply_patches "$here/patches" "$checkout" 81b38b9da
patch_crates "$checkout" "$repo" dirty-log
if $build; then
    (cd "$checkout" && RUSTUP_TOOLCHAIN=${RUSTUP_TOOLCHAIN:-1.95.0} cargo build --release -p firecracker)
    # Firecracker's .cargo/config.toml puts its target folder in build/cargo_target.
    echo "built $(cd "$checkout" && cd "${CARGO_TARGET_DIR:-build/cargo_target}" && pwd)/release/firecracker"
fi
