#!/usr/bin/env bash
# Failover of one clusterset service served by two clusters, on installed Strait (root):
# local pods killed, back, then the remote gateway killed, under open-loop load.
#   bash scripts/bench-failover.sh    (STRAIT_BENCH_RATE=1000 STRAIT_BENCH_SECS=15)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bootstrap
build_control_plane
cd "$STRAIT_ROOT" || exit 1
release_flags
# The images are built from these binaries (release, as users run them).
cargo build --release --bins
exec cargo bench -p strait-cli --bench failover
