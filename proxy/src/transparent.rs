//! Transparent mode, the way ztunnel's in-pod mode does it: the node proxy
//! opens listening sockets *inside* a pod's network namespace and redirects
//! the pod's outbound traffic to them there, so the pod's application needs
//! no `http_proxy` and sees nothing but its own connections.
//!
//! For each enrolled pod the proxy, on a thread that has entered the pod's
//! network namespace (`setns`):
//!
//! 1. binds TCP [`OUTBOUND_PORT`] (15001) and UDP [`DNS_PORT`] (15053) there,
//!    on 127.0.0.1 (where `REDIRECT` sends a namespace's own traffic; nobody
//!    outside the pod can connect and pass for it);
//! 2. then installs, with `iptables` in that namespace, chain `STRAIT_OUTPUT`
//!    in the `nat` table, jumped to from `OUTPUT`: UDP to port 53 is
//!    `REDIRECT`ed to the DNS responder ([`crate::dns`]), loopback is left
//!    alone, every other TCP connection is `REDIRECT`ed to 15001.
//!
//! Sockets first, rules second: no moment where traffic is redirected to
//! nothing. The sockets stay in the pod's namespace while the proxy's tasks
//! serve them from the node's; the connections the proxy opens onward are the
//! node's, so nothing loops. The original destination of each redirected
//! connection comes from `SO_ORIGINAL_DST` (conntrack of the pod's
//! namespace), and the caller is the enrolled pod itself: no address lookup.
//!
//! **Which pods.** Those annotated `strait.dev/transparent: enabled`, or in a
//! namespace so annotated (a pod's `disabled` wins); the proxy decides from
//! discovery, so the plugin needs no API access. Others are answered
//! `captured: false` and left alone.
//!
//! **Enrollment.** Whoever sets up pod networking (a CNI plugin on a real
//! node; testenv in tests) tells the proxy about a pod over a Unix socket
//! that only root on the node can open: one JSON object per line,
//! [`EnrollRequest`], answered by one [`EnrollResponse`] line. `add` names the
//! pod and the path of its network namespace (`/var/run/netns/…` or
//! `/proc/<pid>/ns/net`); `remove` undoes everything. `add` of an enrolled
//! pod replaces its enrollment.
//!
//! **Restarts.** Each capture is also written to the state folder (one
//! `<namespace>_<name>.json` per pod, the `add` request itself; on the node's
//! tmpfs next to the socket, so a reboot forgets it with the namespaces).
//! When the proxy stops, the rules stay, so a pod's traffic fails closed
//! (connection refused) rather than leave the mesh; the next proxy on the
//! node ([`Transparent::restore`], before it reports ready) enrolls again
//! every pod of that folder that still runs here, without the pod being
//! recreated. Only an uninstall ([`Transparent::release_all`]) takes the
//! rules out.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::dns::DnsResponder;
use crate::drain::{Drain, serve_connections};
use crate::outbound::Outbound;
pub use strait_mesh::names::TRANSPARENT_ANNOTATION;

/// Where a pod's outbound TCP is redirected, inside its namespace.
pub const OUTBOUND_PORT: u16 = 15001;
/// Where a pod's DNS queries (UDP 53) are redirected, inside its namespace.
pub const DNS_PORT: u16 = 15053;
/// The `nat` chain holding the pod's redirection rules.
pub const CHAIN: &str = "STRAIT_OUTPUT";
/// How long `add` waits for discovery to see a just-scheduled pod.
const POD_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// The longest enrollment request line accepted.
const MAX_REQUEST: usize = 4096;

/// One request on the enrollment socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum EnrollRequest {
    /// Capture this pod's traffic; `netns` is the path of its network namespace.
    Add {
        namespace: String,
        name: String,
        netns: PathBuf,
    },
    /// Stop capturing: rules removed, sockets closed.
    Remove { namespace: String, name: String },
}

/// The answer to one [`EnrollRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnrollResponse {
    pub ok: bool,
    /// For `add`: whether the pod's traffic is now captured (`false`: the pod
    /// did not ask for it, see [`TRANSPARENT_ANNOTATION`]).
    #[serde(default)]
    pub captured: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

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
struct PodSockets {
    tcp: std::net::TcpListener,
    dns: std::net::UdpSocket,
}

/// Inside the pod's namespace: sockets bound, then the rules (re)installed
/// unless exactly ours are in place. The sockets share their ports
/// (`SO_REUSEPORT`, root's only) with those of the proxy this one replaces,
/// which serves until it stops: during a rollout both take the pod's
/// connections, and the rules are never out, so nothing leaves the mesh.
fn capture(netns: &Path) -> io::Result<PodSockets> {
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

fn release(netns: &Path) -> io::Result<()> {
    in_netns(netns, || {
        for args in remove_rules() {
            let _ = iptables(&args);
        }
        Ok(())
    })
}

struct Enrolled {
    netns: PathBuf,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Enrolled {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The pods this proxy captures, and the socket they are enrolled through.
pub struct Transparent {
    pub outbound: Arc<Outbound>,
    pub dns: Arc<DnsResponder>,
    pub drain: Drain,
    /// Where captures are remembered across restarts (`None`: not at all).
    state: Option<PathBuf>,
    pods: Mutex<HashMap<(String, String), Enrolled>>,
    /// One enrollment at a time: add/remove of the same pod must not interleave.
    changes: tokio::sync::Mutex<()>,
}

impl Transparent {
    pub fn new(
        outbound: Arc<Outbound>,
        dns: Arc<DnsResponder>,
        drain: Drain,
        state: Option<PathBuf>,
    ) -> Arc<Self> {
        Arc::new(Self {
            outbound,
            dns,
            drain,
            state,
            pods: Mutex::new(HashMap::new()),
            changes: tokio::sync::Mutex::new(()),
        })
    }

    /// Binds the enrollment socket at `path` (mode 0600, replacing a stale
    /// one from an earlier run).
    pub fn bind(path: &Path) -> io::Result<UnixListener> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(listener)
    }

    /// Serves enrollment requests until the drain starts.
    pub async fn serve(self: Arc<Self>, listener: UnixListener) {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = self.drain.signaled() => return,
            };
            match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(self.clone().session(stream));
                }
                Err(e) => {
                    tracing::warn!("enrollment socket: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn session(self: Arc<Self>, stream: UnixStream) {
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).take(u64::MAX);
        loop {
            let mut line = String::new();
            lines.set_limit(MAX_REQUEST as u64);
            match lines.read_line(&mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let answer = if !line.ends_with('\n') {
                Err(format!(
                    "request longer than {MAX_REQUEST} bytes or not ended by a newline"
                ))
            } else {
                match serde_json::from_str::<EnrollRequest>(&line) {
                    Ok(request) => self.apply(request).await,
                    Err(e) => Err(format!(
                        "not an enrollment request ({e}); send {{\"op\":\"add\",\"namespace\":…,\"name\":…,\"netns\":…}} or {{\"op\":\"remove\",…}}"
                    )),
                }
            };
            let response = match answer {
                Ok(captured) => EnrollResponse {
                    ok: true,
                    captured,
                    error: None,
                },
                Err(e) => EnrollResponse {
                    ok: false,
                    captured: false,
                    error: Some(e),
                },
            };
            let mut bytes = serde_json::to_vec(&response).expect("serializable");
            bytes.push(b'\n');
            if write.write_all(&bytes).await.is_err() {
                return;
            }
            if !response.ok && !line.ends_with('\n') {
                return;
            }
        }
    }

    /// Applies one request; for `add`, whether the pod is captured.
    pub async fn apply(&self, request: EnrollRequest) -> Result<bool, String> {
        let _one = self.changes.lock().await;
        match request {
            EnrollRequest::Add {
                namespace,
                name,
                netns,
            } => self.add(namespace, name, netns).await,
            EnrollRequest::Remove { namespace, name } => {
                self.remove(&namespace, &name).await.map(|()| false)
            }
        }
    }

    async fn add(&self, namespace: String, name: String, netns: PathBuf) -> Result<bool, String> {
        // Kubernetes names (they also name the state file).
        let valid = |s: &str| {
            !s.is_empty()
                && s.len() <= 253
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
                && !s.starts_with('.')
        };
        if !valid(&namespace) || !valid(&name) {
            return Err(format!(
                "{namespace:?}/{name:?} is not a pod's namespace and name (lower-case letters, digits, '-' and '.')"
            ));
        }
        // The plugin runs when the pod's sandbox is made, moments after the
        // pod was scheduled here: give discovery a little time to see it.
        let deadline = tokio::time::Instant::now() + POD_WAIT;
        let wanted = loop {
            match self
                .outbound
                .destinations
                .transparent_wanted(&namespace, &name)
            {
                Some(wanted) => break wanted,
                None if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                None => {
                    return Err(format!(
                        "pod {namespace}/{name} is not scheduled to node {} as far as the proxy \
                         knows (waited {POD_WAIT:?}); is the proxy's discovery healthy?",
                        self.outbound.node
                    ));
                }
            }
        };
        if !wanted {
            // Not asked for (or turned off): make sure nothing is left.
            self.remove(&namespace, &name).await?;
            tracing::debug!(pod = %format!("{namespace}/{name}"), "not enrolled: {TRANSPARENT_ANNOTATION} is not enabled");
            return Ok(false);
        }
        let key = (namespace.clone(), name.clone());
        // Replacing: close the old sockets first so the ports are free.
        let old = self
            .pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        drop(old);
        let path = netns.clone();
        let sockets = tokio::task::spawn_blocking(move || capture(&path))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("capturing pod {namespace}/{name}: {e}"))?;
        let tcp = tokio::net::TcpListener::from_std(sockets.tcp).map_err(|e| e.to_string())?;
        let dns = tokio::net::UdpSocket::from_std(sockets.dns).map_err(|e| e.to_string())?;
        let outbound = self.outbound.clone();
        let (ns, pod, drain) = (namespace.clone(), name.clone(), self.drain.clone());
        let tcp_task = tokio::spawn(serve_connections(
            tcp,
            self.drain.clone(),
            "transparent",
            move |stream, _peer| {
                outbound
                    .clone()
                    .handle_transparent(stream, ns.clone(), pod.clone(), drain.clone())
            },
        ));
        let dns_task = tokio::spawn(crate::dns::serve_udp(dns, self.dns.clone()));
        tracing::info!(pod = %format!("{namespace}/{name}"), netns = %netns.display(), "transparent mode on");
        if let Some(file) = self.state_file(&namespace, &name) {
            let request = EnrollRequest::Add {
                namespace: namespace.clone(),
                name: name.clone(),
                netns: netns.clone(),
            };
            if let Err(e) = write_state(&file, &request) {
                // Captured now; only a restart of the proxy would miss it.
                tracing::warn!(file = %file.display(), "remembering the capture: {e}");
            }
        }
        self.pods.lock().unwrap_or_else(|e| e.into_inner()).insert(
            key,
            Enrolled {
                netns,
                tasks: vec![tcp_task, dns_task],
            },
        );
        Ok(true)
    }

    /// The state file of a pod; `None` without a state folder.
    fn state_file(&self, namespace: &str, name: &str) -> Option<PathBuf> {
        Some(
            self.state
                .as_ref()?
                .join(format!("{namespace}_{name}.json")),
        )
    }

    /// Enrolls again the pods an earlier proxy on this node captured (its
    /// state folder), those that still run here with their namespace; the
    /// others' files go. Call before reporting ready: until then the
    /// node's transparent pods fail closed. How many were enrolled.
    pub async fn restore(&self) -> usize {
        let Some(dir) = &self.state else { return 0 };
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return 0,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "reading the captured pods: {e}");
                return 0;
            }
        };
        let mut restored = 0;
        for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let request = std::fs::read_to_string(&path)
                .ok()
                .and_then(|text| serde_json::from_str::<EnrollRequest>(&text).ok());
            let Some(EnrollRequest::Add {
                namespace,
                name,
                netns,
            }) = request
            else {
                tracing::warn!(file = %path.display(), "not a capture; removed");
                let _ = std::fs::remove_file(&path);
                continue;
            };
            let pod = format!("{namespace}/{name}");
            // A sandbox's namespace is a bind mount of nsfs: gone (or a
            // plain file left behind) means the pod is gone.
            if !is_netns(&netns) {
                tracing::info!(%pod, netns = %netns.display(), "captured pod's namespace is gone; forgotten");
                let _ = std::fs::remove_file(&path);
                continue;
            }
            match self
                .apply(EnrollRequest::Add {
                    namespace,
                    name,
                    netns,
                })
                .await
            {
                Ok(true) => {
                    tracing::info!(%pod, "enrolled again after the proxy's restart");
                    restored += 1;
                }
                Ok(false) => {
                    tracing::info!(%pod, "no longer asks for transparent mode; released");
                }
                Err(e) => {
                    tracing::warn!(%pod, "not enrolled again: {e}");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        restored
    }

    /// Strait is being uninstalled: every captured pod gets its own
    /// network back (rules out, sockets closed) and the state goes.
    pub async fn release_all(&self) -> usize {
        let keys: Vec<(String, String)> = self
            .pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        let mut released = 0;
        for (namespace, name) in keys {
            let _one = self.changes.lock().await;
            match self.remove(&namespace, &name).await {
                Ok(()) => released += 1,
                Err(e) => tracing::warn!(pod = %format!("{namespace}/{name}"), "releasing: {e}"),
            }
        }
        if let Some(dir) = &self.state {
            let _ = std::fs::remove_dir_all(dir);
        }
        released
    }

    async fn remove(&self, namespace: &str, name: &str) -> Result<(), String> {
        if let Some(file) = self.state_file(namespace, name) {
            match std::fs::remove_file(&file) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    tracing::warn!(file = %file.display(), "forgetting the capture: {e}");
                }
                _ => {}
            }
        }
        let removed = self
            .pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(namespace.to_string(), name.to_string()));
        let Some(enrolled) = removed else {
            return Ok(()); // idempotent: a CNI DEL may come twice
        };
        let netns = enrolled.netns.clone();
        drop(enrolled);
        tracing::info!(pod = %format!("{namespace}/{name}"), "transparent mode off");
        match tokio::task::spawn_blocking(move || release(&netns)).await {
            Ok(Ok(())) => Ok(()),
            // The namespace is gone with its pod: nothing left to clean.
            Ok(Err(e)) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// How many pods are enrolled.
    pub fn enrolled(&self) -> usize {
        self.pods.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Whether `path` is a network namespace (nsfs), not a leftover file.
fn is_netns(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|fs| fs.f_type == NSFS_MAGIC)
}

/// `NSFS_MAGIC` of linux/magic.h.
const NSFS_MAGIC: rustix::fs::FsWord = 0x6e73_6673;

/// One capture, written whole (rename) with mode 0600.
fn write_state(file: &Path, request: &EnrollRequest) -> io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(request).map_err(io::Error::other)?)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&tmp, file)
}

/// The client side of enrollment (what a CNI plugin does): one request on
/// the proxy's socket, its answer (for `add`: whether the pod is captured).
pub async fn enroll(socket: &Path, request: &EnrollRequest) -> Result<bool, String> {
    let mut stream = UnixStream::connect(socket).await.map_err(|e| {
        format!(
            "connecting to the proxy's enrollment socket {}: {e}",
            socket.display()
        )
    })?;
    let mut line = serde_json::to_vec(request).map_err(|e| e.to_string())?;
    line.push(b'\n');
    stream.write_all(&line).await.map_err(|e| e.to_string())?;
    let mut answer = String::new();
    BufReader::new(stream)
        .read_line(&mut answer)
        .await
        .map_err(|e| e.to_string())?;
    let response: EnrollResponse =
        serde_json::from_str(&answer).map_err(|e| format!("the proxy answered {answer:?}: {e}"))?;
    match response {
        EnrollResponse {
            ok: true, captured, ..
        } => Ok(captured),
        EnrollResponse { error, .. } => Err(error.unwrap_or_else(|| "refused".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_read_as_a_cni_plugin_writes_them() {
        let add: EnrollRequest = serde_json::from_str(
            r#"{"op":"add","namespace":"shop","name":"web-0","netns":"/var/run/netns/cni-1"}"#,
        )
        .unwrap();
        assert_eq!(
            add,
            EnrollRequest::Add {
                namespace: "shop".into(),
                name: "web-0".into(),
                netns: "/var/run/netns/cni-1".into()
            }
        );
        let remove: EnrollRequest =
            serde_json::from_str(r#"{"op":"remove","namespace":"shop","name":"web-0"}"#).unwrap();
        assert!(matches!(remove, EnrollRequest::Remove { .. }));
        assert!(serde_json::from_str::<EnrollRequest>(r#"{"op":"add","name":"x"}"#).is_err());
    }

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
