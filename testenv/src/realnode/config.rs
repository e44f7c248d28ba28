//! The configuration files of a node's containerd, kubelet, kube-proxy and CNI.

use std::path::Path;

use super::{NodeSpec, PAUSE_IMAGE};
use crate::net::NetNode;

pub(super) fn kubeconfig_yaml(
    server: &str,
    ca_pem: &str,
    cert: &crate::pki::CertPair,
) -> std::io::Result<String> {
    let config =
        crate::kubeconfig::with_client_cert("node", server, ca_pem, &cert.cert_pem, &cert.key_pem);
    crate::kubeconfig::to_yaml(&config).map_err(std::io::Error::other)
}

/// containerd 1.6 (Debian's), with the CRI settings this kind of machine needs.
pub(super) fn containerd_config(dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{d}/containerd.sock"

[ttrpc]
  address = "{d}/containerd.ttrpc.sock"

[debug]
  address = ""
  level = "warn"

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # runc may not lower oom_score_adj here: no CAP_SYS_RESOURCE on this kind of machine.
  restrict_oom_score_adj = true
  # Pod network namespaces in /var/run/netns (the node's own /run), as on kind
  # and most distributions: where transparent mode's hostPath finds them.
  enable_selinux = false
  disable_apparmor = true
  max_container_log_line_size = 16384

[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "/run/containerd/runc"

[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/opt/cni/bin"
  conf_dir = "/etc/cni/net.d"
"#
    )
}

pub(super) fn kubelet_config(dir: &Path, net: &NetNode, spec: &NodeSpec, cgroup: &str) -> String {
    let d = dir.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 is deprecated in the kubelet and refused by default; this kind of machine has only v1 controllers.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
containerRuntimeEndpoint: unix://{d}/containerd.sock
address: {ip}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {d}/ca.crt
authorization:
  mode: Webhook
clusterDomain: cluster.local
clusterDNS: ["{dns}"]
resolvConf: {d}/resolv.conf
podCIDR: {pod_cidr}
serializeImagePulls: false
failSwapOn: false
rotateCertificates: false
serverTLSBootstrap: false
# Nodes share the host's disk and memory: evict only when they are nearly gone.
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
maxPods: 110
shutdownGracePeriod: 0s
nodeStatusReportFrequency: 10s
"#,
        ip = net.ip(),
        dns = spec.cluster_dns,
        pod_cidr = net.pod_cidr(),
    )
}

pub(super) fn kube_proxy_config(dir: &Path, node: &str, spec: &NodeSpec) -> String {
    let d = dir.display();
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
hostnameOverride: {node}
clusterCIDR: {cidr}
clientConnection:
  kubeconfig: {d}/kube-proxy.kubeconfig
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# nf_conntrack_max and the TCP timeouts are host-wide or read-only outside
# the host's namespace: leave them as they are.
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        cidr = spec.cluster_cidr,
    )
}

pub(super) fn cni_conflist(net: &NetNode) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "testenv",
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": false,
                "mtu": 1500,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{
                        "subnet": net.pod_cidr(),
                        "gateway": net.pod_gateway().to_string(),
                    }]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ],
    })
    .to_string()
}
