//! Capture inside a pod's network namespace: the listening sockets and the
//! `iptables` rules that redirect the pod's outbound traffic to them.

use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::process::Command;

/// Where a pod's outbound TCP is redirected, inside its namespace.
pub const OUTBOUND_PORT: u16 = 15001;
/// Where a pod's DNS queries (UDP 53) are redirected, inside its namespace.
pub const DNS_PORT: u16 = 15053;
/// The `nat` chain holding the pod's redirection rules.
pub const CHAIN: &str = "STRAIT_OUTPUT";

/// The `iptables` argument lists that install the redirection, in order.
pub fn install_rules() -> Vec<Vec<String>> {
    let rule = |s: &str| -> Vec<String> {
        ["-w", "-t", "nat"]
            .into_iter()
            .map(String::from)
            .chain(s.split_whitespace().map(String::from))
            .collect()
    };
    vec![
        rule(&format!("-N {CHAIN}")),
        rule(&format!(
            "-A {CHAIN} -p udp --dport 53 -j REDIRECT --to-ports {DNS_PORT}"
        )),
        rule(&format!("-A {CHAIN} -d 127.0.0.0/8 -j RETURN")),
        rule(&format!(
            "-A {CHAIN} -p tcp -j REDIRECT --to-ports {OUTBOUND_PORT}"
        )),
        rule(&format!("-A OUTPUT -j {CHAIN}")),
    ]
}

/// The `iptables` argument lists that remove it (each may fail harmlessly
/// when that part is already gone).
pub fn remove_rules() -> Vec<Vec<String>> {
    [
        format!("-D OUTPUT -j {CHAIN}"),
        format!("-F {CHAIN}"),
        format!("-X {CHAIN}"),
    ]
    .iter()
    .map(|s| {
        ["-w", "-t", "nat"]
            .into_iter()
            .map(String::from)
            .chain(s.split_whitespace().map(String::from))
            .collect()
    })
    .collect()
}

/// Runs `f` on a thread that has entered the network namespace at `netns`.
/// Sockets made there stay in that namespace; processes started there
/// (`iptables`) run in it. Blocking: call from `spawn_blocking`.
pub fn in_netns<T: Send + 'static>(
    netns: &Path,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let file = std::fs::File::open(netns).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("opening network namespace {}: {e}", netns.display()),
        )
    })?;
    std::thread::spawn(move || {
        rustix::thread::move_into_link_name_space(
            file.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(|e| {
            io::Error::other(format!(
                "entering the network namespace: {e} (the proxy needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
            ))
        })?;
        f()
    })
    .join()
    .map_err(|_| io::Error::other("the network-namespace thread panicked"))?
}

fn iptables(args: &[String]) -> io::Result<()> {
    let out = Command::new("iptables").args(args).output().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "running iptables: {e}; install iptables on the node (the proxy image ships it)"
            ),
        )
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "iptables {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// The sockets made inside one pod's namespace.
pub(super) struct PodSockets {
    pub tcp: std::net::TcpListener,
    pub dns: std::net::UdpSocket,
}

/// Inside the pod's namespace: sockets bound, then the rules (re)installed
/// unless exactly ours are in place. The sockets share their ports
/// (`SO_REUSEPORT`, root's only) with those of the proxy this one replaces,
/// which serves until it stops: during a rollout both take the pod's
/// connections, and the rules are never out, so nothing leaves the mesh.
pub(super) fn capture(netns: &Path) -> io::Result<PodSockets> {
    in_netns(netns, || {
        use socket2::{Domain, Protocol, Socket, Type};
        // Loopback only: REDIRECT sends the pod's own connections to
        // 127.0.0.1, and nothing outside the pod can reach these sockets and
        // pass for the pod. (UDP must answer from the address it was asked
        // at, or conntrack cannot undo the redirection on the answer.)
        let bind = |kind: Type, protocol: Protocol, port: u16| -> io::Result<Socket> {
            let socket = Socket::new(Domain::IPV4, kind, Some(protocol))?;
            socket.set_reuse_address(true)?;
            socket.set_reuse_port(true)?;
            socket.set_nonblocking(true)?;
            let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
            socket.bind(&addr.into())?;
            Ok(socket)
        };
        let tcp = bind(Type::STREAM, Protocol::TCP, OUTBOUND_PORT)?;
        tcp.listen(1024)?;
        let dns = bind(Type::DGRAM, Protocol::UDP, DNS_PORT)?;
        if !rules_in_place() {
            for args in remove_rules() {
                let _ = iptables(&args);
            }
            for args in install_rules() {
                iptables(&args)?;
            }
        }
        Ok(PodSockets {
            tcp: tcp.into(),
            dns: dns.into(),
        })
    })
}

/// Whether the namespace holds exactly the rules [`install_rules`] makes.
fn rules_in_place() -> bool {
    let rules = install_rules();
    let checks = rules[1..].iter().all(|args| {
        let check: Vec<String> = args
            .iter()
            .map(|a| {
                if a == "-A" {
                    "-C".to_string()
                } else {
                    a.clone()
                }
            })
            .collect();
        iptables(&check).is_ok()
    });
    let listed = Command::new("iptables")
        .args(["-w", "-t", "nat", "-S", CHAIN])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).lines().count());
    // `-N` plus the chain's own rules (the jump from OUTPUT is not listed).
    checks && listed == Some(rules.len() - 1)
}

pub(super) fn release(netns: &Path) -> io::Result<()> {
    in_netns(netns, || {
        for args in remove_rules() {
            let _ = iptables(&args);
        }
        Ok(())
    })
}

/// Whether `path` is a network namespace (nsfs), not a leftover file.
pub(super) fn is_netns(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|fs| fs.f_type == NSFS_MAGIC)
}

/// `NSFS_MAGIC` of linux/magic.h.
const NSFS_MAGIC: rustix::fs::FsWord = 0x6e73_6673;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_redirect_dns_then_skip_loopback_then_take_all_tcp() {
        let rules: Vec<String> = install_rules().iter().map(|r| r.join(" ")).collect();
        assert_eq!(
            rules,
            [
                "-w -t nat -N STRAIT_OUTPUT",
                "-w -t nat -A STRAIT_OUTPUT -p udp --dport 53 -j REDIRECT --to-ports 15053",
                "-w -t nat -A STRAIT_OUTPUT -d 127.0.0.0/8 -j RETURN",
                "-w -t nat -A STRAIT_OUTPUT -p tcp -j REDIRECT --to-ports 15001",
                "-w -t nat -A OUTPUT -j STRAIT_OUTPUT",
            ]
        );
        let undo: Vec<String> = remove_rules().iter().map(|r| r.join(" ")).collect();
        assert_eq!(undo[0], "-w -t nat -D OUTPUT -j STRAIT_OUTPUT");
    }
}
