#!/usr/bin/env bash
# Cross-cluster benchmark: QUIC vs the TCP + TLS fallback across a shaped WAN (root).
#   bash scripts/bench-wan.sh    (STRAIT_BENCH_RATES=200,1000,1800 STRAIT_BENCH_SECS=10 STRAIT_BENCH_DELAY_MS=25 STRAIT_BENCH_LOSS=1)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bootstrap
build_control_plane
cd "$STRAIT_ROOT" || exit 1
release_flags
cargo build --release --bins
STRAIT_PROXY_LOG="${STRAIT_PROXY_LOG:-warn}" exec cargo bench -p strait-proxy --bench wan
