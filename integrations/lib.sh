# What each integration's apply.sh shares: sourced, not run.

# parse_args USAGE ARG...: sets `checkout` to the first ARG and `build` to
# whether the second is --build; exits with USAGE otherwise.
parse_args() {
    local usage=$1
    shift
    checkout=${1:?usage: $usage}
    build=false
    case "${2:-}" in
    "") ;;
    --build) build=true ;;
    *) echo "unknown option $2; usage: $usage" >&2 && exit 2 ;;
    esac
}

# apply_patches PATCH_DIR CHECKOUT COMMIT: applies PATCH_DIR/*.patch to the
# git checkout CHECKOUT in order, each once (the applied ones are listed in
# its .git/vm-latency-patches); warns where CHECKOUT is not at or after
# COMMIT, which the patches are against.
apply_patches() {
    local dir=$1 checkout=$2 want=$3 patch name applied
    applied="$(git -C "$checkout" rev-parse --absolute-git-dir)/vm-latency-patches"
    if ! git -C "$checkout" merge-base --is-ancestor "$want" HEAD 2>/dev/null; then
        echo "warning: $checkout is not at or after $want, which the patches are against" >&2
    fi
    for patch in "$dir"/*.patch; do
        name=$(basename "$patch")
        if grep -qxF "$name" "$applied" 2>/dev/null; then
            echo "already applied: $name"
        elif git -C "$checkout" apply "$patch"; then
            echo "$name" >>"$applied"
            echo "applied $name"
        else
            echo "$name does not apply to $checkout" >&2
            return 1
        fi
    done
}

# patch_crates CHECKOUT REPO CRATE...: adds to CHECKOUT's Cargo.toml (once) a
# [patch.crates-io] section taking each CRATE from REPO/crates, and with
# MICRO_HTTP=PATH (a checkout of firecracker-microvm/micro-http at the commit
# Cargo.lock names) micro_http's git dependency from there, for a machine
# without GitHub.
patch_crates() {
    local checkout=$1 repo=$2 crate
    shift 2
    grep -q '^# vm-latency crates' "$checkout/Cargo.toml" && return 0
    {
        echo
        echo '# vm-latency crates, from the repository apply.sh ran from'
        echo '[patch.crates-io]'
        for crate in "$@"; do
            echo "$crate = { path = \"$repo/crates/$crate\" }"
        done
        if [ -n "${MICRO_HTTP:-}" ]; then
            echo '[patch."https://github.com/firecracker-microvm/micro-http"]'
            echo "micro_http = { path = \"$(cd "$MICRO_HTTP" && pwd)\" }"
        fi
    } >>"$checkout/Cargo.toml"
}
