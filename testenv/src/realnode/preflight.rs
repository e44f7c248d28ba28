//! Checks before a node starts: root, the programs and kernel features a
//! node needs, and the host ports its cluster binds; each failure names its fix.

use std::path::Path;
use std::process::Command;

use super::cgroup::cgroup_hierarchies;
use super::{CNI_PLUGIN_DIR, CNI_PLUGINS, NodeError};
use crate::net::is_root;

/// Ports a real-node cluster's own services bind on the host, at the
/// cluster's LAN address (the API server's port is picked free).
const HOST_PORTS: &[(u16, &str)] = &[(53, "CoreDNS (cluster DNS)")];

/// Fails if a socket bound to every address (0.0.0.0, or a dual-stack `::`)
/// holds one of [`HOST_PORTS`]: the cluster's bind to its LAN address would
/// then fail half-way through `up`. The probe binds a documentation address
/// (RFC 5737) with IP_FREEBIND, which the kernel refuses exactly when it would
/// refuse the LAN address, and needs no address of the host.
pub fn check_host_ports() -> Result<(), NodeError> {
    use socket2::{Domain, Protocol, Socket, Type};
    // One probe at a time: two clusters starting at once would otherwise
    // see each other's probe socket as the port's holder.
    static PROBING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = PROBING.lock().unwrap_or_else(|e| e.into_inner());
    for &(port, component) in HOST_PORTS {
        let probe = std::net::SocketAddr::from(([192, 0, 2, 1], port));
        for (ty, proto, protocol) in [
            (Type::STREAM, Protocol::TCP, "tcp"),
            (Type::DGRAM, Protocol::UDP, "udp"),
        ] {
            let setup = |e: std::io::Error| NodeError::Setup {
                node: "(host)".into(),
                what: format!("probe port {port}/{protocol}"),
                message: e.to_string(),
            };
            let socket = Socket::new(Domain::IPV4, ty, Some(proto)).map_err(setup)?;
            socket.set_freebind_v4(true).map_err(setup)?;
            match socket.bind(&probe.into()) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                    return Err(NodeError::PortInUse {
                        port,
                        protocol,
                        component,
                        holder: port_holder(port, protocol),
                    });
                }
                Err(e) => return Err(setup(e)),
            }
        }
    }
    Ok(())
}

/// Who holds a port, as `ss` tells it (best effort: empty if it cannot).
fn port_holder(port: u16, protocol: &str) -> String {
    let flag = if protocol == "tcp" {
        "-Hlnpt"
    } else {
        "-Hlnpu"
    };
    let out = Command::new("ss")
        .args([flag, &format!("sport = :{port}")])
        .output();
    match out {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<&str> = text
                .lines()
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .filter_map(|words| {
                    // One protocol, no header: state, queues, local, peer, process.
                    let local = words.get(3)?;
                    let wildcard = ["0.0.0.0:", "*:", "[::]:"]
                        .iter()
                        .any(|p| local.starts_with(p));
                    wildcard.then(|| words.get(5).copied()).flatten()
                })
                .collect();
            if lines.is_empty() {
                String::new()
            } else {
                format!(", by {}", lines.join(" "))
            }
        }
        _ => String::new(),
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path)
            .any(|dir| std::fs::metadata(dir.join(program)).is_ok_and(|m| m.is_file()))
    })
}

/// Checks, before anything starts, that this host can run real nodes; the
/// error names what to install or change.
pub fn preflight() -> Result<(), NodeError> {
    let missing = |what: &str, fix: &str| NodeError::Missing {
        what: what.into(),
        fix: fix.into(),
    };
    if !is_root() {
        return Err(missing(
            "root",
            "run as root (containerd, the kubelet and network namespaces need it), as CI does",
        ));
    }
    for (program, package) in [
        ("containerd", "containerd"),
        ("ctr", "containerd"),
        ("runc", "runc"),
        ("iptables", "iptables"),
        ("iptables-restore", "iptables"),
        ("conntrack", "conntrack"),
        ("nsenter", "util-linux"),
        ("unshare", "util-linux"),
        ("mount", "mount"),
    ] {
        if !on_path(program) {
            return Err(missing(
                &format!("`{program}`"),
                &format!(
                    "apt-get install {package} (scripts/lib.sh installs it with the other packages)"
                ),
            ));
        }
    }
    for plugin in CNI_PLUGINS {
        let path = Path::new(CNI_PLUGIN_DIR).join(plugin);
        if !path.exists() {
            return Err(missing(
                &format!("the CNI plugin {}", path.display()),
                "apt-get install containernetworking-plugins",
            ));
        }
    }
    let hierarchies = cgroup_hierarchies();
    for controller in ["memory", "cpu", "cpuset", "pids", "freezer", "devices"] {
        if !hierarchies
            .iter()
            .any(|h| h.controllers.iter().any(|c| c == controller))
        {
            return Err(missing(
                &format!("the cgroup v1 `{controller}` hierarchy under /sys/fs/cgroup"),
                "testenv's kubelet runs on cgroup v1 (hybrid hosts such as this project's machines); \
                 on a cgroup-v2-only host use kind (testenv/kind/up.sh)",
            ));
        }
    }
    // The node's writes go to overlays on these (mkdir of a missing one would
    // write on the host).
    for top in ["/etc", "/var", "/opt"] {
        if !Path::new(top).is_dir() {
            return Err(missing(
                &format!("the folder {top}"),
                &format!("create {top} (a standard folder; real nodes overlay it with their own)"),
            ));
        }
    }
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !filesystems.lines().any(|l| l.ends_with("\toverlay")) {
        return Err(missing(
            "the overlay filesystem",
            "a kernel with overlayfs (containerd's snapshotter and the node's /etc, /var overlays use it)",
        ));
    }
    check_host_ports()
}
