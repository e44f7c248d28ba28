#!/usr/bin/env bash
# The main job: a local two-cluster environment (east, west) on real Kubernetes
# control planes. Stays up until Ctrl-C. (The full cross-cluster demo replaces
# this as the mirror, gateway and proxy land.)
source "$(dirname "$0")/lib.sh"
cd "$STRAIT_ROOT" || exit 1

bootstrap
build_control_plane
exec "$STRAIT_ROOT/target/debug/strait-testenv" up --clusters "${CLUSTERS:-east,west}" "$@"
