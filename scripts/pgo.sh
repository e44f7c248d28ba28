#!/usr/bin/env bash
# Trains pgo/strait.profdata, the profile release builds optimise with
# (release_flags in lib.sh: the benchmark scripts; deploy/images/Dockerfile) (root).
#   bash scripts/pgo.sh        (then commit pgo/strait.profdata and its .llvm-version)
# 1. builds strait-proxy and strait-gateway instrumented (target/pgo-instrumented);
# 2. runs the node proxy and cross-cluster benchmarks with them (STRAIT_BIN_DIR) as
#    the workload: HTTP/1 at 1 000 and 10 000 rps through a proxy pair, and QUIC
#    and TCP + TLS bulk, requests and connection set-up through a gateway;
# 3. merges what they counted into pgo/strait.profdata. Not sparse: code the workload
#    never ran is then known as cold, optimised for size and laid out apart from the
#    hot code, and that is most of the gain (a sparse profile measured none).
# Run it again when the data path changes much: code changed since the profile
# was trained is optimised as without one (nothing breaks, the gain fades).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
APT_PACKAGES+=(haproxy)
bootstrap
build_control_plane
cd "$STRAIT_ROOT" || exit 1

# llvm-profdata must be the one of this rustc's LLVM.
rustup component add llvm-tools >/dev/null 2>&1 || die "rustup component add llvm-tools failed: llvm-profdata is needed to merge the profiles"
profdata="$(find "$(rustc --print sysroot)/lib/rustlib" -name llvm-profdata -type f | head -1)"
[[ -x "$profdata" ]] || die "llvm-profdata not found under $(rustc --print sysroot) after installing llvm-tools"

raw="$STRAIT_ROOT/target/pgo-raw"
instrumented="$STRAIT_ROOT/target/pgo-instrumented"
say "building strait-proxy and strait-gateway instrumented ($instrumented)"
RUSTFLAGS="-Cprofile-generate=$raw" cargo build --release -p strait-proxy -p strait-gateway --bins \
  --target-dir "$instrumented"
# Build scripts and proc macros of that build wrote profiles too: only the benchmarks' count.
rm -rf "$raw"

# The benchmarks and their other binaries as the benchmark scripts build them.
release_flags
cargo build --release --bins
export STRAIT_BIN_DIR="$instrumented/release" STRAIT_PROXY_LOG=warn
say "workload: node proxy pair (scripts/bench-proxy.sh's benchmark, one round)"
STRAIT_BENCH_RATES=1000,10000 STRAIT_BENCH_REPEAT=1 cargo bench -p strait-proxy --bench mesh
say "workload: cross-cluster through a gateway (scripts/bench-wan.sh's benchmark, one round)"
STRAIT_BENCH_RATES=1000 STRAIT_BENCH_REPEAT=1 STRAIT_BENCH_SECS=5 cargo bench -p strait-proxy --bench wan

shopt -s nullglob
files=("$raw"/*.profraw)
((${#files[@]})) || die "the workload wrote no profile to $raw: did the proxies and gateway exit by SIGTERM?"
mkdir -p "$(dirname "$PGO_PROFILE")"
"$profdata" merge -o "$PGO_PROFILE" "${files[@]}"
rustc -vV | sed -n 's/^LLVM version: //p' >"$PGO_PROFILE.llvm-version"
say "wrote $PGO_PROFILE ($(du -h "$PGO_PROFILE" | cut -f1), from ${#files[@]} processes): commit it"
