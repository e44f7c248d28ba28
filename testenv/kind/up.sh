#!/usr/bin/env bash
# Two linked kind clusters running Strait, for people with Docker:
#   1. kind clusters east and west (non-overlapping pod and Service ranges),
#   2. Strait's images built from release binaries by `strait-testenv images`
#      (the same OCI archives testenv's real nodes import; no Dockerfile build)
#      and loaded into both with `kind load image-archive`,
#   3. one trust anchor and an issuer per cluster (`strait identity`),
#   4. `strait install` into both (gateway Service as NodePort: kind has no
#      load balancer; the nodes of both clusters share Docker's kind network),
#   5. linked both ways (`strait link … | kubectl apply -f -`),
#   6. the sample app (sample-app.yaml) in both, exported in west,
#   7. `strait check` (if this CLI has it) and a request from an east pod to
#      echo-west, the mirror of west's echo, through the QUIC gateway.
#
#   bash testenv/kind/up.sh          # then: bash testenv/kind/down.sh
#   bash testenv/kind/up.sh --down   # tear down when done (also on failure)
#
# Contexts: kind-east, kind-west. Work files: $STRAIT_KIND_WORK.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DOWN_AFTER=false
for arg in "$@"; do
  case "$arg" in
    --down) DOWN_AFTER=true ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) die "unknown argument $arg (use --down or --help)" ;;
  esac
done
if $DOWN_AFTER; then
  trap 'bash "$KIND_DIR/down.sh"' EXIT
fi

need docker kind kubectl cargo
docker info >/dev/null 2>&1 || die "docker is not running (or this user may not use it)"
mkdir -p "$STRAIT_KIND_WORK"
cd "$STRAIT_ROOT" || exit 1

say "building the strait CLI and the components (release)"
cargo build --release --locked -p strait-cli -p strait-identity -p strait-mirror \
  -p strait-gateway -p strait-proxy -p strait-testenv
STRAIT="$STRAIT_ROOT/target/release/strait"

for cluster in "${CLUSTERS[@]}"; do
  if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
    say "kind cluster $cluster exists: reusing it"
  else
    say "creating kind cluster $cluster"
    kind create cluster --name "$cluster" --config "$KIND_DIR/cluster-$cluster.yaml" --wait 120s
  fi
done

say "building the images ($REGISTRY/strait-<component>:$STRAIT_KIND_TAG) as OCI archives"
mapfile -t archives < <("$STRAIT_ROOT/target/release/strait-testenv" images \
  --bin-dir "$STRAIT_ROOT/target/release" --registry "$REGISTRY" --tag "$STRAIT_KIND_TAG" \
  --out-dir "$STRAIT_KIND_WORK/images")
for archive in "${archives[@]}"; do
  for cluster in "${CLUSTERS[@]}"; do
    kind load image-archive "$archive" --name "$cluster"
  done
done

anchor="$STRAIT_KIND_WORK/anchor"
if [[ ! -f "$anchor/ca.crt" ]]; then
  say "creating the trust anchor ($anchor; keep ca.key offline in real life)"
  "$STRAIT" identity trust-anchor --out-dir "$anchor"
fi
for cluster in "${CLUSTERS[@]}"; do
  if [[ ! -f "$STRAIT_KIND_WORK/$cluster/issuer.crt" ]]; then
    "$STRAIT" identity issuer --anchor-cert "$anchor/ca.crt" --anchor-key "$anchor/ca.key" \
      --cluster "$cluster" --out-dir "$STRAIT_KIND_WORK/$cluster"
  fi
  say "installing Strait into $cluster"
  "$STRAIT" install --identity-dir "$STRAIT_KIND_WORK/$cluster" --cluster-name "$cluster" \
    --gateway-service-type NodePort --tag "$STRAIT_KIND_TAG" --image-pull-policy IfNotPresent \
    | kc "$cluster" apply -f -
done
for cluster in "${CLUSTERS[@]}"; do
  kc "$cluster" -n strait-system rollout status deploy/strait-identity --timeout 180s
  kc "$cluster" -n strait-system rollout status daemonset/strait-proxy --timeout 180s
  kc "$cluster" -n strait-system rollout status deploy/strait-gateway --timeout 180s
  kc "$cluster" -n strait-multicluster rollout status deploy/strait-mirror --timeout 180s
done

# The other cluster reaches this one's API server on Docker's kind network, not
# on the 127.0.0.1 port of the local kubeconfig.
api_address() {
  local ip
  ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$1-control-plane")
  [[ -n "$ip" ]] || die "no address for $1-control-plane on the kind network"
  printf 'https://%s:6443' "$ip"
}
link() {
  local source=$1 target=$2
  say "linking $source → $target"
  "$STRAIT" link --context "kind-$target" --cluster-name "$target" \
    --api-server-address "$(api_address "$target")" | kc "$source" apply -f -
}
link east west
link west east

say "deploying the sample app; exporting demo/echo in west"
for cluster in "${CLUSTERS[@]}"; do
  kc "$cluster" apply -f "$KIND_DIR/sample-app.yaml"
  kc "$cluster" -n demo rollout status deploy/echo --timeout 180s
  kc "$cluster" -n demo rollout status deploy/client --timeout 180s
done
# The same as `strait export svc/echo -n demo`.
kc west -n demo label --overwrite svc/echo strait.dev/exported=true

say "waiting for the mirror demo/echo-west in east"
for _ in $(seq 60); do
  kc east -n demo get svc/echo-west >/dev/null 2>&1 && break
  sleep 2
done
kc east -n demo get svc/echo-west
kc east -n strait-multicluster get links

if "$STRAIT" check --help >/dev/null 2>&1; then
  for cluster in "${CLUSTERS[@]}"; do
    say "strait check ($cluster)"
    "$STRAIT" check --context "kind-$cluster" --wait 120s
  done
else
  say "this strait has no 'check' yet: skipping it"
fi

say "east client → echo-west (east proxy → QUIC → west gateway → west pod)"
answer=""
for _ in $(seq 30); do
  if answer=$(kc east -n demo exec deploy/client -- \
      curl -sS --max-time 5 http://echo-west.demo.svc.cluster.local/hostname); then
    break
  fi
  sleep 2
done
[[ "$answer" == echo-* ]] || die "no answer from west's echo through the gateway (got: ${answer:-nothing}); look at: kubectl --context kind-east -n strait-system logs daemonset/strait-proxy"
say "answered by west pod $answer"
say "up: contexts kind-east and kind-west; tear down with: bash testenv/kind/down.sh"
