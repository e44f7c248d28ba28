#!/usr/bin/env bash
# Node proxy benchmark: direct vs strait-proxy pair vs haproxy pair (root).
#   bash scripts/bench-proxy.sh        (STRAIT_BENCH_RATES=1000,10000 STRAIT_BENCH_SECS=10 STRAIT_BENCH_REPEAT=1)
# A/B of two builds on the same mesh, interleaved: STRAIT_BENCH_PROXY_B=/path/to/other/strait-proxy
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
APT_PACKAGES+=(haproxy)
bootstrap
build_control_plane
cd "$STRAIT_ROOT" || exit 1
release_flags
cargo build --release --bins
STRAIT_PROXY_LOG="${STRAIT_PROXY_LOG:-warn}" exec cargo bench -p strait-proxy --bench mesh
