#!/usr/bin/env bash
# Applies this folder's patches to a Cloud Hypervisor checkout and, with
# --build, builds its release binaries there.
#
#   integrations/cloud-hypervisor/apply.sh CHECKOUT [--build]
#
# The patches are against commit ae44c2971 (v54-dev, 2026-08-22); the
# checkout's Cargo.toml gets a [patch.crates-io] section that takes
# halt-poll, dirty-log and vcpu-sched from this repository (MICRO_HTTP=PATH:
# see ../lib.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=../lib.sh
. "$here/../lib.sh"
parse_args "apply.sh CLOUD_HYPERVISOR_CHECKOUT [--build]" "$@"
apply_patches "$here/patches" "$checkout" ae44c2971
patch_crates "$checkout" "$repo" halt-poll dirty-log vcpu-sched
if $build; then
    (cd "$checkout" && cargo build --release --bin cloud-hypervisor --bin ch-remote)
    echo "built $(cd "$checkout" && cd "${CARGO_TARGET_DIR:-target}" && pwd)/release/cloud-hypervisor"
fi
