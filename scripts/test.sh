#!/usr/bin/env bash
# The tests: formatting, lints, then every test against real control planes.
# This is what CI runs (.ci/run). Cold: the control plane builds first (many
# minutes on 2 cores, progress shown); warm: a few minutes.
source "$(dirname "$0")/lib.sh"
cd "$STRAIT_ROOT"

bootstrap
if pgrep -f 'strait-controlplane (etcd|kube-apiserver|kube-controller-manager)' >/dev/null; then
  die "control-plane processes are already running (a \`strait-testenv up\`?): stop them first (strait-testenv down) so the orphan check means something"
fi
say "cargo fmt --check"
cargo fmt --all -- --check
say "cargo clippy --all-targets -- -D warnings"
cargo clippy --quiet --workspace --all-targets -- -D warnings
build_control_plane
say "cargo test --workspace"
cargo test --workspace
check_no_orphans
