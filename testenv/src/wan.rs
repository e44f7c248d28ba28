//! A WAN between cluster LANs: the only path between clusters, open only to
//! the gateways it exposes, with the link conditions tests need (delay, loss,
//! UDP blocked, cut) and a capture point.
//!
//! ```text
//!  east LAN netns                        WAN netns (router)                      west LAN netns
//!  br0 10.E.0.254 ── wan 10.E.255.1/30 ◄veth► lanE 10.E.255.2/30  lanW 10.W.255.2/30 ◄veth► wan 10.W.255.1/30 ── br0 10.W.0.254
//!                                          routes 10.E.0.0/16 via 10.E.255.1, 10.W.0.0/16 via 10.W.255.1
//!                                          filter FORWARD policy DROP: WAN-LINK (cut/UDP block),
//!                                            ESTABLISHED,RELATED, NEW to each exposed gateway ip:port (TCP, UDP)
//!                                          mangle POSTROUTING → WAN-SHAPE (loss, delay line)
//! ```
//!
//! - Routes are added only as far as needed: once a west gateway `G` is
//!   exposed, every east node (present and future) routes `G/32` via east's
//!   LAN router `10.E.0.254`, east's LAN routes it into the WAN, and for the
//!   replies west's LAN and the gateway's node route `10.E.0.0/16` back. Any
//!   other west address stays "Network is unreachable" at east's nodes; the
//!   gateway node's return route is stopped at the WAN for anything but replies.
//! - Traffic between two clusters crosses exactly two WAN interfaces
//!   (`lan<S>`, one per cluster) and the WAN's forwarding path once per
//!   direction, where [`Wan::shape`] delays and drops it and [`Wan::capture`]
//!   sees it.
//! - Shaping is not tc netem: the kernels Strait's CI runs on are built without
//!   `sch_netem`. Loss is iptables `statistic` (DROP), delay is NFQUEUE with
//!   `strait-wan-delay` (a sibling binary of the tests, see [`crate::workspace_binary`])
//!   holding each packet for the delay in the WAN namespace: accurate to about
//!   half a millisecond, and each packet crosses user space once.
//! - The WAN namespace is anchored like the LANs ([`crate::net`]): dropping the
//!   [`Wan`], a panic or a SIGKILL of its owner removes the namespace and its
//!   veths (their `wan` peers in the LAN namespaces and the routes through them go too).
//! - The host is on every LAN (API servers bind there), so traffic from the
//!   test process itself never crosses the WAN.
//!
//! Needs root, `ip` (iproute2), `iptables` and `tcpdump`.

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::net::{ClusterNetwork, Lan, NetError, NetNode, NetPod, Netns, run};
use crate::process::{ChildProcess, log_tail};

/// The chain the link controls ([`Wan::cut`], [`Wan::block_udp`]) write to,
/// jumped to first from FORWARD.
const LINK_CHAIN: &str = "WAN-LINK";
/// The mangle chain of [`Wan::shape`], jumped to from POSTROUTING: after the
/// filter has decided, so a queued packet's verdict never bypasses it.
const SHAPE_CHAIN: &str = "WAN-SHAPE";
/// The NFQUEUE of the delay line.
const DELAY_QUEUE: u16 = 0;

/// The WAN router and its links to cluster LANs. See the module docs.
#[derive(Debug)]
pub struct Wan {
    netns: Netns,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    lans: Vec<Arc<Lan>>,
    gateways: Vec<Gateway>,
    /// The delay line while the WAN is shaped with a delay.
    delay_line: Option<ChildProcess>,
    /// Where logs go (the delay line's).
    logs: Option<tempfile::TempDir>,
}

#[derive(Debug)]
struct Gateway {
    ip: Ipv4Addr,
    /// The cluster LAN the address is on.
    home: Arc<Lan>,
    /// The node that holds the gateway (itself, or its pod): it gets the
    /// return routes. Kept alive by the WAN. None for the LAN router's own
    /// address (an API endpoint), which routes into the WAN already.
    node: Option<NetNode>,
}

/// `10.S.255.1`, the LAN end of cluster `slot`'s WAN link (`wan` in the LAN namespace).
fn lan_end(slot: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, slot, 255, 1)
}

/// `10.S.255.2`, the WAN end of cluster `slot`'s link (`lan<S>` in the WAN namespace).
fn wan_end(slot: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, slot, 255, 2)
}

fn cidr(slot: u8) -> String {
    format!("10.{slot}.0.0/16")
}

fn link_name(slot: u8) -> String {
    format!("lan{slot}")
}

impl Wan {
    /// An empty WAN: the router namespace, forwarding nothing yet.
    pub fn create() -> Result<Self, NetError> {
        let netns = Netns::new("WAN")?;
        netns.ip(&["link set lo up".into()])?;
        netns.sysctl("net.ipv4.ip_forward=1")?;
        // IPv4 only: no IPv6 autoconfiguration chatter in captures.
        netns.sysctl("net.ipv6.conf.all.disable_ipv6=1")?;
        netns.sysctl("net.ipv6.conf.default.disable_ipv6=1")?;
        let rules = format!(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n\
             :{LINK_CHAIN} - [0:0]\n-A FORWARD -j {LINK_CHAIN}\n\
             -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\nCOMMIT\n\
             *mangle\n:{SHAPE_CHAIN} - [0:0]\n-A POSTROUTING -j {SHAPE_CHAIN}\nCOMMIT\n"
        );
        let mut restore = netns.command("iptables-restore");
        restore.arg("-w");
        run(restore, Some(&rules))?;
        Ok(Self {
            netns,
            state: Mutex::new(State::default()),
        })
    }

    /// A WAN joining `networks`.
    pub fn connect(networks: &[&ClusterNetwork]) -> Result<Self, NetError> {
        let wan = Self::create()?;
        for network in networks {
            wan.join(network)?;
        }
        Ok(wan)
    }

    /// Links `network`'s LAN to the WAN. Gateways already exposed in other
    /// clusters become reachable from its nodes.
    pub fn join(&self, network: &ClusterNetwork) -> Result<(), NetError> {
        let lan = network.lan();
        let mut state = self.lock();
        if state.lans.iter().any(|l| l.slot == lan.slot) {
            return Err(NetError::Wan(format!(
                "cluster {} has already joined this WAN",
                lan.cluster
            )));
        }
        let slot = lan.slot;
        let link = link_name(slot);
        self.netns
            .ip(&[
                format!(
                    "link add {link} type veth peer name wan netns {}",
                    lan.netns.pid
                ),
                format!("addr add {}/30 dev {link}", wan_end(slot)),
                format!("link set {link} up"),
                format!("route add {} via {}", cidr(slot), lan_end(slot)),
            ])
            .map_err(|e| {
                NetError::Wan(format!(
                    "cannot link cluster {} to the WAN (is it on another WAN already?): {e}",
                    lan.cluster
                ))
            })?;
        // Best effort, as for the host side of the LAN.
        let _ = lan.netns.sysctl("net.ipv6.conf.wan.disable_ipv6=1");
        lan.netns.ip(&[
            format!("addr add {}/30 dev wan", lan_end(slot)),
            "link set wan up".into(),
        ])?;
        lan.netns.sysctl("net.ipv4.ip_forward=1")?;
        for gateway in &state.gateways {
            route_to_gateway(lan, gateway)?;
        }
        state.lans.push(lan.clone());
        Ok(())
    }

    /// Makes `node`'s address a gateway: nodes and pods of every other joined
    /// cluster reach it on `ports`, TCP and UDP, and nothing else of its cluster.
    pub fn expose_node(&self, node: &NetNode, ports: &[u16]) -> Result<(), NetError> {
        self.expose(node.ip(), node, ports)
    }

    /// As [`Wan::expose_node`], for a pod's address (a gateway pod).
    pub fn expose_pod(&self, pod: &NetPod, ports: &[u16]) -> Result<(), NetError> {
        self.expose(pod.ip(), pod.node(), ports)
    }

    /// Makes `port` of `network`'s LAN router address (`10.S.0.254`) reachable
    /// from every other joined cluster, as a cloud exposes an API server's
    /// endpoint: what listens there (see [`ClusterNetwork::forward_from_router`])
    /// serves other clusters' nodes and pods.
    pub fn expose_router(&self, network: &ClusterNetwork, ports: &[u16]) -> Result<(), NetError> {
        let lan = network.lan().clone();
        self.expose_on(lan.router_ip(), lan, None, ports)
    }

    fn expose(&self, ip: Ipv4Addr, node: &NetNode, ports: &[u16]) -> Result<(), NetError> {
        self.expose_on(ip, node.lan().clone(), Some(node.clone()), ports)
    }

    fn expose_on(
        &self,
        ip: Ipv4Addr,
        home: Arc<Lan>,
        node: Option<NetNode>,
        ports: &[u16],
    ) -> Result<(), NetError> {
        let mut state = self.lock();
        if !state.lans.iter().any(|l| l.slot == home.slot) {
            return Err(NetError::Wan(format!(
                "cannot expose {ip}: cluster {} has not joined this WAN (Wan::join first)",
                home.cluster
            )));
        }
        let mut rules = String::from("*filter\n");
        for port in ports {
            for proto in ["tcp", "udp"] {
                rules.push_str(&format!(
                    "-A FORWARD -d {ip}/32 -p {proto} --dport {port} \
                     -m conntrack --ctstate NEW -j ACCEPT\n"
                ));
            }
        }
        rules.push_str("COMMIT\n");
        let mut restore = self.netns.command("iptables-restore");
        restore.args(["-w", "--noflush"]);
        run(restore, Some(&rules))?;
        let home_slot = home.slot;
        let gateway = Gateway { ip, home, node };
        for lan in state.lans.iter().filter(|l| l.slot != home_slot) {
            route_to_gateway(lan, &gateway)?;
        }
        if !state.gateways.iter().any(|g| g.ip == ip) {
            state.gateways.push(gateway);
        }
        Ok(())
    }

    /// Delays every packet crossing the WAN by `delay` in each direction (so
    /// the round trip grows by twice that) and drops `loss_percent` % of them
    /// in each direction, like `tc netem delay <delay> loss <loss>%` on each
    /// WAN interface (see the module docs for how). Replaces earlier settings.
    pub fn shape(&self, delay: Duration, loss_percent: f64) -> Result<(), NetError> {
        if !(0.0..=100.0).contains(&loss_percent) {
            return Err(NetError::Wan(format!(
                "loss must be a percentage from 0 to 100, not {loss_percent}"
            )));
        }
        let mut state = self.lock();
        self.clear_shape(&mut state)?;
        let mut rules = Vec::new();
        if loss_percent > 0.0 {
            let probability = loss_percent / 100.0;
            rules.push(format!(
                "-A {SHAPE_CHAIN} -m statistic --mode random --probability {probability} -j DROP"
            ));
        }
        if !delay.is_zero() {
            state.delay_line = Some(self.start_delay_line(&mut state, delay)?);
            rules.push(format!(
                "-A {SHAPE_CHAIN} -j NFQUEUE --queue-num {DELAY_QUEUE}"
            ));
        }
        let mut restore = self.netns.command("iptables-restore");
        restore.args(["-w", "--noflush"]);
        run(
            restore,
            Some(&format!("*mangle\n{}\nCOMMIT\n", rules.join("\n"))),
        )
        .map(drop)
    }

    /// Removes [`Wan::shape`]'s delay and loss.
    pub fn unshape(&self) -> Result<(), NetError> {
        let mut state = self.lock();
        self.clear_shape(&mut state)
    }

    fn clear_shape(&self, state: &mut State) -> Result<(), NetError> {
        let mut flush = self.netns.command("iptables");
        flush.args(["-w", "-t", "mangle", "-F", SHAPE_CHAIN]);
        run(flush, None)?;
        if let Some(mut delay_line) = state.delay_line.take() {
            delay_line.stop(Duration::ZERO);
        }
        Ok(())
    }

    /// Starts `strait-wan-delay` on the delay queue and waits until it serves it.
    fn start_delay_line(
        &self,
        state: &mut State,
        delay: Duration,
    ) -> Result<ChildProcess, NetError> {
        let program = crate::find_workspace_binary("strait-wan-delay").map_err(NetError::Wan)?;
        if state.logs.is_none() {
            state.logs = Some(tempfile::tempdir().map_err(|e| {
                NetError::Wan(format!(
                    "cannot make a directory for the delay line's log: {e}"
                ))
            })?);
        }
        let log = state
            .logs
            .as_ref()
            .expect("just made")
            .path()
            .join("strait-wan-delay.log");
        let args = [
            "--queue".to_string(),
            DELAY_QUEUE.to_string(),
            "--delay".into(),
            format!("{}us", delay.as_micros()),
        ];
        let process = self
            .netns
            .spawn("WAN delay line", &program, &args, &[], &log)
            .map_err(|e| NetError::Wan(format!("cannot start {}: {e}", program.display())))?;
        wait_for_log(process, &log, "ready", "strait-wan-delay")
    }

    /// Drops every UDP packet between clusters (QUIC fails, TCP still works).
    pub fn block_udp(&self) -> Result<(), NetError> {
        self.link_rule(true, &["-p", "udp", "-j", "DROP"])
    }

    pub fn unblock_udp(&self) -> Result<(), NetError> {
        self.link_rule(false, &["-p", "udp", "-j", "DROP"])
    }

    /// Cuts the link: every packet between clusters is silently dropped (a
    /// blackhole, as when a real link goes down: connects time out, nothing is
    /// refused). Connections already open resume after [`Wan::restore`] if
    /// their ends have not given up.
    pub fn cut(&self) -> Result<(), NetError> {
        self.link_rule(true, &["-j", "DROP"])
    }

    /// Undoes [`Wan::cut`].
    pub fn restore(&self) -> Result<(), NetError> {
        self.link_rule(false, &["-j", "DROP"])
    }

    /// Adds (`present`) or removes a rule of the link chain; idempotent.
    fn link_rule(&self, present: bool, rule: &[&str]) -> Result<(), NetError> {
        let _state = self.lock();
        let mut check = self.netns.command("iptables");
        check.args(["-w", "-C", LINK_CHAIN]).args(rule);
        // `-C` fails when the rule is absent; any other failure shows up below.
        let exists = run(check, None).is_ok();
        if exists == present {
            return Ok(());
        }
        let mut change = self.netns.command("iptables");
        change
            .args(["-w", if present { "-A" } else { "-D" }, LINK_CHAIN])
            .args(rule);
        run(change, None).map(drop)
    }

    /// Starts capturing every packet on the WAN's links into the pcap file
    /// `path` (tcpdump's log goes next to it, `<path>.log`). Returns once
    /// tcpdump listens; the capture stops when the guard is stopped or dropped.
    pub fn capture(&self, path: &Path) -> Result<WanCapture, NetError> {
        let log = PathBuf::from(format!("{}.log", path.display()));
        let args = [
            "-i",
            "any",
            "-n",
            "-U",
            "--immediate-mode",
            // Keep root: the pcap may be written where the tcpdump user cannot.
            "-Z",
            "root",
            "-w",
        ]
        .into_iter()
        .map(String::from)
        .chain([path.display().to_string()])
        .collect::<Vec<_>>();
        let process = self
            .netns
            .spawn("WAN tcpdump", Path::new("tcpdump"), &args, &[], &log)
            .map_err(|e| NetError::Wan(format!("cannot start tcpdump: {e}")))?;
        let process = wait_for_log(process, &log, "listening on", "tcpdump (APT_PACKAGES)")?;
        Ok(WanCapture {
            process,
            path: path.to_path_buf(),
        })
    }

    /// The WAN-side interface of `network`'s link (`lan<S>`), e.g. for a
    /// tcpdump of one cluster's link through [`Wan::command`].
    pub fn interface(&self, network: &ClusterNetwork) -> String {
        link_name(network.lan().slot)
    }

    /// A command run inside the WAN namespace.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        self.netns.command(program)
    }

    /// `net:[inode]` of the WAN namespace.
    pub fn netns_id(&self) -> String {
        self.netns.id()
    }

    /// Pid of the process holding the WAN namespace.
    pub fn anchor_pid(&self) -> u32 {
        self.netns.pid
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Waits up to 10 s until `process` has written `ready` to its log.
fn wait_for_log(
    mut process: ChildProcess,
    log: &Path,
    ready: &str,
    what: &str,
) -> Result<ChildProcess, NetError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if std::fs::read_to_string(log).is_ok_and(|said| said.contains(ready)) {
            return Ok(process);
        }
        if let Some(status) = process.try_exit_status() {
            return Err(NetError::Wan(format!(
                "{what} in the WAN namespace exited ({status}): {}",
                log_tail(log, 5)
            )));
        }
        if Instant::now() >= deadline {
            return Err(NetError::Wan(format!(
                "{what} in the WAN namespace did not say {ready:?} within 10s: {}",
                log_tail(log, 5)
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Routes `lan`'s nodes to `gateway` (in another cluster) through the WAN,
/// and the gateway's replies back.
fn route_to_gateway(lan: &Lan, gateway: &Gateway) -> Result<(), NetError> {
    let home = &gateway.home;
    let ip = gateway.ip;
    lan.route_nodes_via_router(&format!("{ip}/32"))?;
    lan.netns.ip(&[format!(
        "route replace {ip}/32 via {} dev wan",
        wan_end(lan.slot)
    )])?;
    home.netns.ip(&[format!(
        "route replace {} via {} dev wan",
        cidr(lan.slot),
        wan_end(home.slot)
    )])?;
    match &gateway.node {
        Some(node) => node.netns().ip(&[format!(
            "route replace {} via {} dev eth0",
            cidr(lan.slot),
            home.router_ip()
        )]),
        None => Ok(()),
    }
}

/// A running packet capture on the WAN ([`Wan::capture`]).
#[derive(Debug)]
pub struct WanCapture {
    process: ChildProcess,
    path: PathBuf,
}

impl WanCapture {
    /// The pcap file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pcap written so far (tcpdump writes each packet as it sees it).
    pub fn bytes(&self) -> std::io::Result<Vec<u8>> {
        std::fs::read(&self.path)
    }

    /// Stops tcpdump and returns the whole pcap. Waits first until the file
    /// has not grown for 200 ms (at most 5 s), so packets still on their way
    /// through tcpdump are in it.
    pub fn stop(mut self) -> Result<Vec<u8>, NetError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut size = file_len(&self.path);
        let mut stable_since = Instant::now();
        while Instant::now() < deadline && stable_since.elapsed() < Duration::from_millis(200) {
            std::thread::sleep(Duration::from_millis(20));
            let now = file_len(&self.path);
            if now != size {
                size = now;
                stable_since = Instant::now();
            }
        }
        self.process.stop(Duration::from_secs(5));
        std::fs::read(&self.path).map_err(|e| {
            NetError::Wan(format!(
                "cannot read the capture {}: {e}; tcpdump said: {}",
                self.path.display(),
                log_tail(self.process.log_path(), 5)
            ))
        })
    }
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Whether `haystack` (e.g. a capture) holds `needle` anywhere.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}
