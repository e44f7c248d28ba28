#!/usr/bin/env bash
# Single-stream bulk throughput: iperf3 over loopback, pod to pod, and through
# CONNECT on the node proxy pair (root).   bash scripts/bench-bulk.sh   (STRAIT_BENCH_SECS=10)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
APT_PACKAGES+=(haproxy)
bootstrap
build_control_plane
cd "$STRAIT_ROOT" || exit 1
release_flags
cargo build --release --bins
STRAIT_PROXY_LOG="${STRAIT_PROXY_LOG:-warn}" exec cargo bench -p strait-proxy --bench bulk
