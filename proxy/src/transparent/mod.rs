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

mod capture;
mod enroll;

use std::collections::HashMap;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

pub use capture::{CHAIN, DNS_PORT, OUTBOUND_PORT, in_netns, install_rules, remove_rules};
use capture::{capture, is_netns, release};
use enroll::MAX_REQUEST;
pub use enroll::{
    EnrollClientError, EnrollError, EnrollRequest, EnrollResponse, enroll, parse_request,
};

use crate::dns::DnsResponder;
use crate::drain::{Drain, serve_connections};
use crate::outbound::Outbound;
pub use strait_mesh::names::TRANSPARENT_ANNOTATION;

/// How long `add` waits for discovery to see a just-scheduled pod.
const POD_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

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
            let answer = match parse_request(&line) {
                Ok(request) => self.apply(request).await,
                Err(e) => Err(e),
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
                    error: Some(e.to_string()),
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
    pub async fn apply(&self, request: EnrollRequest) -> Result<bool, EnrollError> {
        // Requests from the socket were checked; restored state files come here directly.
        request.check_names()?;
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

    async fn add(
        &self,
        namespace: String,
        name: String,
        netns: PathBuf,
    ) -> Result<bool, EnrollError> {
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
                    return Err(EnrollError::UnknownPod {
                        namespace,
                        name,
                        node: self.outbound.node.clone(),
                        waited: POD_WAIT,
                    });
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
        let captured = async {
            let sockets = tokio::task::spawn_blocking(move || capture(&path))
                .await
                .map_err(io::Error::other)??;
            let tcp = tokio::net::TcpListener::from_std(sockets.tcp)?;
            let dns = tokio::net::UdpSocket::from_std(sockets.dns)?;
            io::Result::Ok((tcp, dns))
        };
        let (tcp, dns) = captured.await.map_err(|source| EnrollError::Capture {
            namespace: namespace.clone(),
            name: name.clone(),
            source,
        })?;
        let outbound = self.outbound.clone();
        let (ns, pod, drain) = (namespace.clone(), name.clone(), self.drain.clone());
        let tcp_task = tokio::spawn(serve_connections(
            tcp,
            self.drain.clone(),
            "transparent",
            // Each captured pod's own cap: one pod cannot exhaust the
            // node's (its connections are refused past it, closed).
            strait_mesh::limits::ConnLimit::new(
                "transparent",
                strait_mesh::limits::DEFAULT_MAX_CONNECTIONS,
                &Default::default(),
            ),
            b"",
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

    async fn remove(&self, namespace: &str, name: &str) -> Result<(), EnrollError> {
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
        let released = tokio::task::spawn_blocking(move || release(&netns))
            .await
            .map_err(io::Error::other)
            .flatten();
        match released {
            Ok(()) => Ok(()),
            // The namespace is gone with its pod: nothing left to clean.
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(EnrollError::Release {
                namespace: namespace.into(),
                name: name.into(),
                source,
            }),
        }
    }

    /// How many pods are enrolled.
    pub fn enrolled(&self) -> usize {
        self.pods.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

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
