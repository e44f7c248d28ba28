//! Nodes and pods as Linux network namespaces, one LAN per cluster.
//!
//! ```text
//!  host netns                 cluster LAN netns             node netns            pod netns
//!  stlan<S> 10.S.0.1/24 ◄veth► host ─┐                       ┌─ eth0 10.S.0.(10+n)
//!  (API server binds here)           br0 ── n<n> ◄──veth──► ─┘  lo   10.S.n.1 (pod gw)
//!  routes 10.S.n.0/24 via node                                   p<m> ◄──veth──► eth0 10.S.n.(1+m)/32
//! ```
//!
//! - Every namespace is held by an *anchor* (`unshare --net sleep infinity`)
//!   started through [`process::ChildProcess`], so it dies with its owner: on
//!   `Drop`, on a panic, and (through `PR_SET_PDEATHSIG`) when the test process
//!   is SIGKILLed. The kernel then deletes the namespace and every veth and
//!   bridge in it. Nothing is named in /run/netns, so nothing can be left there.
//! - The only interface in the host namespace is `stlan<S>`, one per cluster; its
//!   name is the host-wide lock on the slot `S` (so parallel test processes never
//!   share addresses) and it vanishes with the LAN namespace.
//! - Isolation holds by construction: each cluster's bridge lives in its own
//!   namespace, nodes and pods have routes only to their own cluster, and the host
//!   never forwards what arrives on `stlan<S>` (`conf.stlan<S>.forwarding=0`).
//!   The LAN namespace itself is `10.S.0.254` on `br0` (routes to every pod range),
//!   the router a WAN ([`crate::wan`]) plugs into; nodes route through it only
//!   to the gateway addresses a WAN exposes.
//!
//! Needs root (CAP_NET_ADMIN) and `ip` (iproute2), `unshare`/`nsenter`
//! (util-linux), `sysctl` (procps).

use std::ffi::OsStr;
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, Weak};

mod netns;
mod node;
mod nsid;

pub(crate) use netns::Netns;
use node::NodeInner;
pub use node::{NetNode, NetPod, RouterForward};
pub use nsid::NsId;

/// Second octet of the first cluster slot; slots take 10.200.0.0/16 … 10.249.0.0/16,
/// clear of the service ranges testenv hands out (10.96.0.0/16 and up).
const FIRST_SLOT: u8 = 200;
const SLOTS: u8 = 50;
/// Nodes per cluster: node n owns the pod range 10.S.n.0/24.
const MAX_NODES: u8 = 200;
/// Pods per node: 10.S.n.2 … 10.S.n.251.
const MAX_PODS: u8 = 250;
/// Last octet of the LAN namespace's own address on `br0` (10.S.0.254): the
/// router towards a WAN. Node addresses end at 10.S.0.(10 + MAX_NODES).
const ROUTER_HOST: u8 = 254;
/// Prefix of the host-side interface of each cluster LAN (`stlan200`, …).
pub const HOST_IF_PREFIX: &str = "stlan";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(
        "testenv nodes need root (CAP_NET_ADMIN) to make network namespaces, veths and bridges: \
         run these tests as root, as CI does (e.g. `sudo -E cargo test -p strait-testenv --test nodes`), \
         or set STRAIT_SKIP_ROOT_TESTS=1 to skip them (they are then reported as SKIPPED)"
    )]
    NotRoot,
    #[error(
        "cannot run `{command}`: {source}; install {package} (scripts/lib.sh lists it in APT_PACKAGES)"
    )]
    Missing {
        command: String,
        package: &'static str,
        source: io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("network namespace for {what} did not come up: {message}")]
    Anchor { what: String, message: String },
    #[error(
        "all {SLOTS} cluster network slots are taken (interfaces {HOST_IF_PREFIX}{FIRST_SLOT}…): \
         too many clusters with nodes at once on this host; see `ip -o link | grep {HOST_IF_PREFIX}`"
    )]
    NoSlot,
    #[error("WAN: {0}")]
    Wan(String),
    #[error("{what}: at most {max} per {per}")]
    Full {
        what: &'static str,
        max: u8,
        per: &'static str,
    },
}

/// Whether this process runs with effective uid 0.
pub fn is_root() -> bool {
    // "Uid:\treal\teffective\tsaved\tfs"
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// For tests that need root: true if running as root. Otherwise panics with how
/// to run them, unless `STRAIT_SKIP_ROOT_TESTS=1`, which skips loudly (false).
pub fn root_or_skip(test: &str) -> bool {
    if is_root() {
        return true;
    }
    if std::env::var("STRAIT_SKIP_ROOT_TESTS").as_deref() == Ok("1") {
        // Straight to the stderr stream: the test harness swallows `eprintln!`
        // of passing tests, and a skip must never be silent.
        let _ = writeln!(
            io::stderr(),
            "\n******** SKIPPED (needs root): {test} (STRAIT_SKIP_ROOT_TESTS=1) ********\n"
        );
        return false;
    }
    panic!("{test}: {}", NetError::NotRoot);
}

pub(crate) fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

fn package_of(program: &OsStr) -> &'static str {
    match program.to_str() {
        Some("ip") => "iproute2",
        Some("sysctl") => "procps",
        Some("tc") => "iproute2",
        Some("tcpdump") => "tcpdump",
        Some(p) if p.starts_with("iptables") => "iptables",
        _ => "util-linux",
    }
}

/// Runs `cmd` to completion, feeding it `stdin`; an error carries its stderr.
pub(crate) fn run(mut cmd: Command, stdin: Option<&str>) -> Result<String, NetError> {
    let command = describe(&cmd);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| NetError::Missing {
        package: package_of(cmd.get_program()),
        command: command.clone(),
        source,
    })?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A failed write shows up as the command's own error below.
        let _ = pipe.write_all(input.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|source| NetError::Missing {
            package: package_of(cmd.get_program()),
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(NetError::Command {
            command: match stdin {
                Some(input) => format!("{command} <<< {input:?}"),
                None => command,
            },
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One cluster's LAN: a bridge in its own namespace, with the host attached
/// at `10.S.0.1` so nodes reach the cluster's API server there.
#[derive(Debug)]
pub struct ClusterNetwork {
    lan: Arc<Lan>,
}

#[derive(Debug)]
pub(crate) struct Lan {
    pub(crate) cluster: String,
    pub(crate) slot: u8,
    host_if: String,
    nodes: Mutex<NodeRegistry>,
    pub(crate) netns: Netns,
}

#[derive(Debug, Default)]
struct NodeRegistry {
    next: u8,
    live: Vec<Weak<NodeInner>>,
    /// Destinations (gateways of other clusters) every node routes via the
    /// LAN's router, nodes added later included.
    via_router: Vec<String>,
}

impl ClusterNetwork {
    /// Makes the LAN of cluster `cluster` and attaches the host to it.
    pub fn create(cluster: &str) -> Result<Self, NetError> {
        let netns = Netns::new(&format!("cluster {cluster} LAN"))?;
        let (slot, host_if) = claim_slot(&netns)?;
        let lan = Lan {
            cluster: cluster.into(),
            slot,
            host_if,
            nodes: Mutex::new(NodeRegistry {
                next: 1,
                ..NodeRegistry::default()
            }),
            netns,
        };
        lan.netns.ip(&[
            "link set lo up".into(),
            "link add br0 type bridge".into(),
            "link set br0 up".into(),
            "link set host master br0".into(),
            "link set host up".into(),
            format!("addr add {}/24 dev br0", lan.router_ip()),
        ])?;
        let host_ip = lan.host_ip();
        // The host must not route between cluster LANs (nor anywhere else) for them.
        let conf = format!("/proc/sys/net/ipv4/conf/{}/forwarding", lan.host_if);
        std::fs::write(&conf, "0").map_err(|e| NetError::Command {
            command: format!("write 0 to {conf}"),
            status: "failed".into(),
            stderr: e.to_string(),
        })?;
        // Best effort: keep IPv6 autoconfiguration chatter off the LAN.
        let _ = std::fs::write(
            format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", lan.host_if),
            "1",
        );
        let mut cmd = Command::new("ip");
        cmd.args(["-batch", "-"]);
        run(
            cmd,
            Some(&format!(
                "addr add {host_ip}/24 dev {0}\nlink set {0} up\n",
                lan.host_if
            )),
        )?;
        tracing::debug!(cluster, %host_ip, host_if = %lan.host_if, "cluster network up");
        Ok(Self { lan: Arc::new(lan) })
    }

    pub fn cluster(&self) -> &str {
        &self.lan.cluster
    }

    /// The host's address on this LAN: bind the cluster's API server here.
    pub fn host_ip(&self) -> Ipv4Addr {
        self.lan.host_ip()
    }

    /// `10.S.0.0/16`: every node and pod address of this cluster.
    pub fn cidr(&self) -> String {
        format!("10.{}.0.0/16", self.lan.slot)
    }

    /// Name of the host-side interface (`stlan<S>`), e.g. for leak checks.
    pub fn host_interface(&self) -> &str {
        &self.lan.host_if
    }

    /// A command run inside the LAN namespace, where the bridge `br0` lives.
    /// This is where a WAN/gateway link between clusters is to be attached.
    pub fn lan_command(&self, program: impl AsRef<OsStr>) -> Command {
        self.lan.netns.command(program)
    }

    /// `net:[inode]` of the LAN namespace.
    pub fn netns_id(&self) -> String {
        self.lan.netns.id()
    }

    /// The LAN router's address (`10.S.0.254`), where a WAN enters the LAN.
    pub fn router_ip(&self) -> Ipv4Addr {
        self.lan.router_ip()
    }

    /// Forwards TCP `port` of the LAN router's address to `target` on the
    /// host (the API server, say), as a cloud's load balancer fronts an API
    /// server: with [`crate::Wan::expose_router`], other clusters' pods reach
    /// it across the WAN. The listener is made inside the LAN namespace by a
    /// short-lived thread (a socket keeps the namespace it was made in); the
    /// copying runs in this process's runtime, so it ends with the returned
    /// guard, or with this process, and leaves nothing behind. Needs a tokio runtime.
    pub fn forward_from_router(
        &self,
        port: u16,
        target: std::net::SocketAddr,
    ) -> io::Result<RouterForward> {
        let addr = std::net::SocketAddr::from((self.lan.router_ip(), port));
        let listener = netns::listen_tcp_in(self.lan.netns.pid, addr)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let task = tokio::spawn(async move {
            // Connections live in this set: aborting the task drops it, which
            // aborts them, so no socket keeps the LAN namespace (and its host
            // interface) alive after the guard is gone.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((mut inbound, _)) = accepted else { break };
                        // Closed with a reset: a graceful close could leave an
                        // orphaned socket retransmitting its FIN to a peer
                        // whose network is already gone, holding the
                        // namespace for minutes.
                        let _ = socket2::SockRef::from(&inbound)
                            .set_linger(Some(std::time::Duration::ZERO));
                        connections.spawn(async move {
                            if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                            }
                        });
                    }
                    Some(_) = connections.join_next() => {}
                }
            }
        });
        Ok(RouterForward { task })
    }

    pub(crate) fn lan(&self) -> &Arc<Lan> {
        &self.lan
    }

    /// Adds a node: a namespace on the bridge with the next node address and
    /// pod range, routed to and from every other node of this cluster.
    pub fn add_node(&self, name: &str) -> Result<NetNode, NetError> {
        let lan = &self.lan;
        let mut registry = lan.nodes.lock().unwrap_or_else(|e| e.into_inner());
        let index = registry.next;
        if index > MAX_NODES {
            return Err(NetError::Full {
                what: "nodes",
                max: MAX_NODES,
                per: "cluster",
            });
        }
        // Taken even if set-up fails: a half-made node's interfaces may linger
        // while the kernel tears its namespace down.
        registry.next += 1;
        let node = NodeInner {
            name: name.into(),
            index,
            ip: Ipv4Addr::new(10, lan.slot, 0, 10 + index),
            lan: lan.clone(),
            next_pod: Mutex::new(1),
            netns: Netns::new(&format!("node {name} of {}", lan.cluster))?,
        };
        let ip = node.ip;
        let gateway = node.pod_gateway();
        lan.netns.ip(&[
            format!(
                "link add n{index} type veth peer name eth0 netns {}",
                node.netns.pid
            ),
            format!("link set n{index} master br0"),
            format!("link set n{index} up"),
        ])?;
        let mut lines = vec![
            "link set lo up".into(),
            format!("addr add {ip}/24 dev eth0"),
            "link set eth0 up".into(),
            format!("addr add {gateway}/32 dev lo"),
        ];
        registry.live.retain(|w| w.strong_count() > 0);
        let others: Vec<Arc<NodeInner>> = registry.live.iter().filter_map(Weak::upgrade).collect();
        for other in &others {
            lines.push(format!("route add {} via {}", other.pod_cidr(), other.ip));
        }
        let router = lan.router_ip();
        for destination in &registry.via_router {
            lines.push(format!("route add {destination} via {router}"));
        }
        node.netns.ip(&lines)?;
        node.netns.sysctl("net.ipv4.ip_forward=1")?;
        for other in &others {
            other
                .netns
                .ip(&[format!("route add {} via {ip}", node.pod_cidr())])?;
        }
        // The LAN namespace routes replies from a WAN to the node's pods.
        lan.netns
            .ip(&[format!("route add {} via {ip}", node.pod_cidr())])?;
        let mut cmd = Command::new("ip");
        cmd.args(["route", "add", &node.pod_cidr(), "via", &ip.to_string()])
            .args(["dev", &lan.host_if]);
        run(cmd, None)?;
        let node = Arc::new(node);
        registry.live.push(Arc::downgrade(&node));
        Ok(NetNode { inner: node })
    }
}

impl Lan {
    fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.slot, 0, 1)
    }

    /// The LAN namespace's address on `br0`, next hop of nodes towards a WAN.
    pub(crate) fn router_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.slot, 0, ROUTER_HOST)
    }

    /// Routes `destination` (e.g. `10.201.0.11/32`) from every node of this
    /// LAN, present and future, via the LAN's router.
    pub(crate) fn route_nodes_via_router(&self, destination: &str) -> Result<(), NetError> {
        let mut registry = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        if registry.via_router.iter().any(|d| d == destination) {
            return Ok(());
        }
        registry.live.retain(|w| w.strong_count() > 0);
        let router = self.router_ip();
        for node in registry.live.iter().filter_map(Weak::upgrade) {
            node.netns
                .ip(&[format!("route replace {destination} via {router}")])?;
        }
        registry.via_router.push(destination.into());
        Ok(())
    }
}

/// Claims the first free slot host-wide: creating `stlan<S>` fails with
/// "File exists" if another process (or cluster) holds S.
fn claim_slot(lan: &Netns) -> Result<(u8, String), NetError> {
    let mut list_routes = Command::new("ip");
    list_routes.args(["-4", "-o", "route", "show"]);
    let routes = run(list_routes, None)?;
    for slot in FIRST_SLOT..FIRST_SLOT + SLOTS {
        let host_if = format!("{HOST_IF_PREFIX}{slot}");
        // Skip ranges the host itself uses (a real 10.S network); ours have no route yet.
        if routes
            .lines()
            .any(|l| l.starts_with(&format!("10.{slot}.")))
        {
            continue;
        }
        let mut cmd = Command::new("ip");
        cmd.args([
            "link", "add", &host_if, "type", "veth", "peer", "name", "host",
        ])
        .args(["netns", &lan.pid.to_string()]);
        match run(cmd, None) {
            Ok(_) => return Ok((slot, host_if)),
            Err(NetError::Command { stderr, .. }) if stderr.contains("File exists") => continue,
            Err(e) => return Err(e),
        }
    }
    Err(NetError::NoSlot)
}
