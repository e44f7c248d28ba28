#!/usr/bin/env bash
# The tests: formatting, lints, fuzzing, then every test against real control planes.
# This is what CI runs (.ci/run). Cold: the control plane builds first (many
# minutes on 2 cores, progress shown); warm: a few minutes.
source "$(dirname "$0")/lib.sh"
cd "$STRAIT_ROOT" || exit 1

bootstrap
# A one-shot build gains nothing from incremental state, which costs gigabytes.
export CARGO_INCREMENTAL=0
say "disk: $(df -h --output=avail "$STRAIT_ROOT" | tail -1 | tr -d ' ') free where the build goes"
if pgrep -f "$CONTROLPLANE_PROCESSES" >/dev/null; then
  die "control-plane processes are already running (a \`strait-testenv up\`?): stop them first (strait-testenv down) so the orphan check means something"
fi
say "cargo fmt --check"
cargo fmt --all -- --check
say "cargo clippy --all-targets -- -D warnings"
cargo clippy --quiet --workspace --all-targets -- -D warnings
say "fuzz: every target for a fixed time (scripts/fuzz.sh)"
"$STRAIT_ROOT/scripts/fuzz.sh"
build_control_plane
say "cargo test --workspace"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace 2>&1 | tee "$log"
check_no_orphans
# One closing line with the totals of every test binary (cargo prints one line per binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
