#!/usr/bin/env bash
# Deletes the two kind clusters made by up.sh and its work folder.
#   bash testenv/kind/down.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need kind

for cluster in "${CLUSTERS[@]}"; do
  if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
    say "deleting kind cluster $cluster"
    kind delete cluster --name "$cluster"
  fi
done
rm -rf "$STRAIT_KIND_WORK"
say "done"
