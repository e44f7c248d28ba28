# shellcheck shell=bash
# shellcheck disable=SC2034 # the variables are for the scripts that source this file
# Shared by up.sh and down.sh: names, folders and small helpers.
set -euo pipefail

KIND_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STRAIT_ROOT="$(cd "$KIND_DIR/../.." && pwd)"
# The two clusters (kind prefixes contexts with kind-).
CLUSTERS=(east west)
# Identity files, kubeconfig and the built CLI's output live here.
STRAIT_KIND_WORK="${STRAIT_KIND_WORK:-${TMPDIR:-/tmp}/strait-kind}"
# Images are built as ghcr.io/strait-dev/strait-<component>:$STRAIT_KIND_TAG
# and loaded into the kind nodes (never pushed).
STRAIT_KIND_TAG="${STRAIT_KIND_TAG:-kind}"
REGISTRY="ghcr.io/strait-dev"

say() { printf '\033[1;34m[strait-kind]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[31m[strait-kind] error:\033[0m %s\n' "$*" >&2; exit 1; }

need() {
  local cmd
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null || die "$cmd not found: install it (kind: https://kind.sigs.k8s.io/docs/user/quick-start/)"
  done
}

# kubectl against one cluster by its short name.
kc() {
  local cluster=$1
  shift
  kubectl --context "kind-$cluster" "$@"
}
