# shellcheck shell=bash
# Shared by the scripts in this folder: make a fresh machine of this project's
# kind ready (Rust, Go, kubectl, Debian packages), without asking.
set -euo pipefail

STRAIT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export STRAIT_ROOT

say() { printf '\033[1m[strait]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[31m[strait] error:\033[0m %s\n' "$*" >&2; exit 1; }

# Debian packages the tests and the demo use. testenv installs what it needs
# itself, so a fresh machine (or CI's clean clone) needs no manual step.
APT_PACKAGES=(procps iproute2 util-linux curl tcpdump iptables iperf3 socat proxychains4 shellcheck
  # Real nodes (testenv --real-nodes): container runtime, CNI plugins, kube-proxy's conntrack, the pause image's C build.
  containerd runc containernetworking-plugins conntrack gcc libc6-dev
  # The MCS conformance suite's pod images (testenv/src/images/conformance.rs; socat is above).
  busybox-static netcat-openbsd bind9-dnsutils
  # deploy/observability/'s scrape configuration and dashboard, checked against a real Prometheus;
  # `strait dashboard`, checked in a real headless browser over WebDriver.
  prometheus chromium chromium-driver)

bootstrap() {
  command -v cargo >/dev/null || die "cargo not found: install Rust (rustup) 1.89 or newer"
  command -v go >/dev/null || die "go not found: install Go 1.26 or newer (testenv builds the Kubernetes control plane with it)"
  local go_minor
  go_minor="$(go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')"
  [[ "$go_minor" -ge 26 ]] || die "Go $(go env GOVERSION) is too old: the control plane (Kubernetes v1.36) needs Go 1.26 or newer"

  local missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    if [[ $(id -u) -eq 0 ]]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
  fi
  command -v kubectl >/dev/null || die "kubectl not found: it ships with machines of this kind; install kubectl 1.35–1.37 to match the test clusters (Kubernetes v1.36)"
}

# Builds (or finds in the cache) the control plane, with progress on stderr.
build_control_plane() {
  say "control plane: building or reusing the cached build (cache: ${STRAIT_CACHE_DIR:-~/.cache/strait})"
  cargo build --quiet -p strait-testenv --bin strait-testenv
  STRAIT_CONTROLPLANE_BIN="$("$STRAIT_ROOT/target/debug/strait-testenv" build)"
  export STRAIT_CONTROLPLANE_BIN
  say "control plane: $STRAIT_CONTROLPLANE_BIN ($("$STRAIT_CONTROLPLANE_BIN" version))"
}

# Release builds (benchmarks, images) optimise with the profile in
# pgo/strait.profdata, trained by scripts/pgo.sh on the node proxy and gateway
# benchmarks: hot code optimised for speed and laid out together, code the
# training never ran optimised for size and laid apart (fewer code pages
# resident). Call after
# build_control_plane (the debug builds stay as the tests build them);
# STRAIT_PGO=0 builds without it (as does a missing profile, with a warning).
PGO_PROFILE="$STRAIT_ROOT/pgo/strait.profdata"
release_flags() {
  if [[ "${STRAIT_PGO:-1}" == 0 ]]; then
    return
  fi
  if [[ ! -f "$PGO_PROFILE" ]]; then
    say "warning: $PGO_PROFILE is missing: release builds without profile-guided optimisation (bash scripts/pgo.sh trains it)"
    return
  fi
  # An older LLVM cannot read a newer one's profile format.
  local trained current
  trained="$(cat "$PGO_PROFILE.llvm-version" 2>/dev/null || echo 0)"
  current="$(rustc -vV | sed -n 's/^LLVM version: //p')"
  current="${current:-0}"
  if ((${current%%.*} < ${trained%%.*})); then
    say "warning: $PGO_PROFILE comes from LLVM $trained, this rustc has LLVM $current: release builds without profile-guided optimisation (a newer Rust, or bash scripts/pgo.sh)"
    return
  fi
  RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-Cprofile-use=$PGO_PROFILE -Clink-arg=-Wl,-z,keep-text-section-prefix"
  export RUSTFLAGS
}

# Every process strait-controlplane runs (control planes, and real nodes' kubelets and kube-proxies).
CONTROLPLANE_PROCESSES='strait-controlplane (etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|coredns)'

# Fails if any control-plane process outlived the run (the no-orphans rule).
check_no_orphans() {
  local left
  left="$(pgrep -f "$CONTROLPLANE_PROCESSES" || true)"
  if [[ -n "$left" ]]; then
    ps -o pid,ppid,etime,args -p "$(echo "$left" | paste -sd,)" >&2 || true
    die "control-plane processes were left running after the tests"
  fi
  say "no control-plane process left behind"
  # Node topologies: each cluster LAN shows in the host only as stlan<N>, gone with its namespace.
  local links
  links="$(ip -o link show 2>/dev/null | grep -o 'stlan[0-9]*' || true)"
  [[ -z "$links" ]] || die "cluster LAN interfaces were left after the tests: $(echo "$links" | paste -sd' ')"
  say "no cluster network left behind"
  # Real nodes: containerd (and its shims and containers) live in a cgroup per node.
  local cgroups
  cgroups="$(find /sys/fs/cgroup -mindepth 2 -maxdepth 2 -name 'strait-node-*' 2>/dev/null || true)"
  [[ -z "$cgroups" ]] || die "real-node cgroups were left after the tests: $(echo "$cgroups" | paste -sd' ')"
  left="$(pgrep -f 'containerd --config /tmp/strait-testenv' || true)"
  [[ -z "$left" ]] || die "a real node's containerd was left running: $left"
  local path
  for path in /etc/cni /opt/cni /var/lib/cni /var/lib/kubelet /var/lib/containerd /run/containerd /var/log/pods; do
    [[ ! -e "$path" ]] || die "$path exists on the host: a real node wrote outside its folder"
  done
  say "no real node left behind"
}
