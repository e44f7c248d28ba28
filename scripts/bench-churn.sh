#!/usr/bin/env bash
# Churn and scale of the mirror controller (Istio's scale test shape) on two testenv API servers:
# 500 exported Services × 20 endpoints (+500 unexported), a scale event per second and a relabel per
# minute for 10 minutes, then 1,000 export-label flips.
#   bash scripts/bench-churn.sh [--json FILE]    (STRAIT_CHURN_SECS=600 STRAIT_CHURN_SERVICES=500)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
bootstrap
build_control_plane
cd "$STRAIT_ROOT" || exit 1
release_flags
exec cargo bench -p strait-mirror --bench churn -- "$@"
