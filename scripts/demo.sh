#!/usr/bin/env bash
# The main job: the two-cluster demo. Two local Kubernetes clusters (east, west)
# on real control planes and real nodes (kubelet, containerd, kube-proxy in
# network namespaces), Strait installed in each with `strait install` from
# images built here, linked with `strait link`; a pod in east calls a service
# exported in west through the QUIC gateway, and the demo shows each hop with
# its evidence. Exits when done (everything torn down); `--stay` keeps it up
# for kubectl until Ctrl-C. Needs root (nodes are network namespaces).
# `strait-testenv up` still gives bare clusters without the mesh.
source "$(dirname "$0")/lib.sh"
cd "$STRAIT_ROOT" || exit 1

bootstrap
[[ $(id -u) -eq 0 ]] || die "the demo needs root: its nodes and pods are network namespaces (run: sudo -E bash scripts/demo.sh)"
build_control_plane
say "building Strait's binaries (cargo build --bins)"
cargo build --quiet --bins
exec "$STRAIT_ROOT/target/debug/strait-testenv" demo "$@"
