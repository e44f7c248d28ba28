//! A real `strait-identity` issuer process for tests: its RBAC applied from
//! deploy/ with the stock kubectl, a kubeconfig holding only its own
//! ServiceAccount's token, its files in a temporary folder.
#![allow(clippy::too_many_arguments)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;
use strait_mesh::identity::ca::PemPair;
use strait_mesh::identity::client::IssuerClient;
use strait_mesh::identity::tls::TrustBundle;
use strait_mesh::names::TOKEN_AUDIENCE;
use tokio::io::AsyncWriteExt;

use crate::Cluster;
use crate::process::{ChildProcess, log_tail};

/// The DNS name in the issuer's serving certificate.
pub const ISSUER_DNS: &str = "strait-identity.strait-system.svc";

pub fn free_addr() -> SocketAddr {
    free_addr_on(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

pub fn free_addr_on(ip: IpAddr) -> SocketAddr {
    TcpListener::bind(SocketAddr::new(ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A running `strait-identity` process for one cluster.
pub struct RunningIssuer {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub bundle: TrustBundle,
    pub trust_domain: String,
    child: ChildProcess,
    binary: PathBuf,
    args: Vec<String>,
    dir: tempfile::TempDir,
}

impl Drop for RunningIssuer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "──── strait-identity log ({}) ────\n{}",
                self.child.log_path().display(),
                log_tail(self.child.log_path(), 40)
            );
        }
    }
}

/// Writes `contents` to `path` as a kubelet updates a mounted file: a new file
/// renamed over the old, so a reader sees one or the other, never half.
pub fn replace_file(path: &Path, contents: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, contents)?;
    std::fs::rename(&tmp, path)
}

impl RunningIssuer {
    /// Replaces the issuer Secret's certificate and key, as a rotation
    /// re-issuing the issuer would (the running issuer picks them up).
    pub fn replace_issuer(&self, issuer: &PemPair) {
        replace_file(&self.dir.path().join("tls.key"), &issuer.key_pem).unwrap();
        replace_file(&self.dir.path().join("tls.crt"), &issuer.cert_pem).unwrap();
    }

    /// Replaces the Secret's trust-anchor bundle (and the one [`Self::client`] verifies with).
    pub fn replace_trust_anchors(&self, bundle_pem: &str) {
        replace_file(&self.dir.path().join("ca.crt"), bundle_pem).unwrap();
        self.bundle.replace_from_pem(bundle_pem.as_bytes()).unwrap();
    }

    /// Kills the issuer process (an outage).
    pub fn stop(&mut self) {
        self.child.stop(Duration::ZERO);
    }

    /// Starts it again on the same ports with the same files.
    pub async fn restart(&mut self) {
        self.child = spawn_issuer(&self.binary, &self.args, self.dir.path());
        wait_ready(&mut self.child, self.admin).await;
    }

    pub fn client(&self) -> IssuerClient {
        IssuerClient::new(&self.addr.to_string(), ISSUER_DNS, &self.bundle).expect("issuer client")
    }

    pub async fn metrics(&self) -> String {
        crate::http_get(self.admin, "/metrics")
            .await
            .expect("the issuer's admin port answers")
    }
}

/// Installs the issuer's RBAC from deploy/ with the stock kubectl, gives the
/// issuer a kubeconfig holding only its own ServiceAccount's token, and starts it.
pub async fn start_issuer(
    binary: &Path,
    cluster: &Cluster,
    issuer: &PemPair,
    bundle_pem: &str,
    trust_domain: &str,
    validity: &str,
) -> RunningIssuer {
    start_issuer_on(
        binary,
        cluster,
        issuer,
        bundle_pem,
        trust_domain,
        validity,
        IpAddr::V4(Ipv4Addr::LOCALHOST),
    )
    .await
}

/// As [`start_issuer`], listening on `ip` (a node network's host address, so
/// that processes in node namespaces reach it).
pub async fn start_issuer_on(
    binary: &Path,
    cluster: &Cluster,
    issuer: &PemPair,
    bundle_pem: &str,
    trust_domain: &str,
    validity: &str,
    ip: IpAddr,
) -> RunningIssuer {
    let rbac = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/identity/rbac.yaml");
    crate::kubectl_apply(cluster, rbac);
    crate::workloads::wait_for_service_account(
        &cluster.client(),
        "strait-system",
        "strait-identity",
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let token = token(
        &cluster.client(),
        "strait-system",
        "strait-identity",
        &[],
        None,
    )
    .await;

    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n);
    let kubeconfig = crate::kubeconfig::with_token(
        cluster.name(),
        &cluster.server_url(),
        cluster.ca_pem(),
        &token,
    );
    std::fs::write(
        path("kubeconfig"),
        crate::kubeconfig::to_yaml(&kubeconfig).unwrap(),
    )
    .unwrap();
    std::fs::write(path("tls.crt"), &issuer.cert_pem).unwrap();
    std::fs::write(path("tls.key"), &issuer.key_pem).unwrap();
    std::fs::write(path("ca.crt"), bundle_pem).unwrap();
    let (addr, admin) = (free_addr_on(ip), free_addr());
    let s = |p: PathBuf| p.to_string_lossy().into_owned();
    let args = vec![
        format!("--listen={addr}"),
        format!("--admin-addr={admin}"),
        format!("--issuer-cert={}", s(path("tls.crt"))),
        format!("--issuer-key={}", s(path("tls.key"))),
        format!("--trust-anchors={}", s(path("ca.crt"))),
        format!("--trust-domain={trust_domain}"),
        format!("--leaf-validity={validity}"),
        format!("--dns-name={ISSUER_DNS}"),
    ];
    let child = spawn_issuer(binary, &args, dir.path());
    let mut running = RunningIssuer {
        addr,
        admin,
        bundle: TrustBundle::from_pem(bundle_pem.as_bytes()).unwrap(),
        trust_domain: trust_domain.to_string(),
        child,
        binary: binary.to_path_buf(),
        args,
        dir,
    };
    wait_ready(&mut running.child, admin).await;
    running
}

fn spawn_issuer(binary: &Path, args: &[String], dir: &Path) -> ChildProcess {
    let kubeconfig_path = dir.join("kubeconfig");
    ChildProcess::spawn_with_env(
        "strait-identity",
        binary,
        args,
        &[
            ("KUBECONFIG", kubeconfig_path.as_os_str()),
            ("RUST_LOG", std::ffi::OsStr::new("info")),
        ],
        &dir.join("identity.log"),
    )
    .expect("spawn strait-identity")
}

async fn wait_ready(child: &mut ChildProcess, admin: SocketAddr) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_exit_status() {
            panic!(
                "strait-identity exited ({status}):\n{}",
                log_tail(child.log_path(), 30)
            );
        }
        if let Ok(Ok(mut s)) = tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::TcpStream::connect(admin),
        )
        .await
        {
            use tokio::io::AsyncReadExt;
            let _ = s
                .write_all(b"GET /ready HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
                .await;
            let mut out = String::new();
            let _ = s.read_to_string(&mut out).await;
            if out.starts_with("HTTP/1.1 200") {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "strait-identity not ready:\n{}",
            log_tail(child.log_path(), 30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A token from the TokenRequest API; `audiences` empty means the API server's default.
pub async fn token(
    client: &Client,
    ns: &str,
    sa: &str,
    audiences: &[&str],
    bound_pod: Option<(&str, &str)>,
) -> String {
    request_token(
        client,
        ns,
        sa,
        audiences,
        bound_pod,
        Duration::from_secs(3600),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
}

/// A TokenRequest for `ns/sa` valid for `ttl`, for `audiences` (none: the
/// API server's), bound to a Pod (`(name, uid)`) when given.
pub async fn request_token(
    client: &Client,
    ns: &str,
    sa: &str,
    audiences: &[&str],
    bound_pod: Option<(&str, &str)>,
    ttl: Duration,
) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let mut spec = json!({"expirationSeconds": ttl.as_secs()});
    if !audiences.is_empty() {
        spec["audiences"] = json!(audiences);
    }
    if let Some((name, uid)) = bound_pod {
        spec["boundObjectRef"] =
            json!({"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid});
    }
    let request: TokenRequest = serde_json::from_value(json!({"spec": spec}))?;
    Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .create_token_request(sa, &PostParams::default(), &request)
        .await
        .with_context(|| format!("TokenRequest for {ns}/{sa}"))?
        .status
        .and_then(|s| s.token)
        .context("TokenRequest answered without a token")
}

/// A Strait-audience token for `ns/sa`, creating the ServiceAccount if needed.
pub async fn workload_token(client: &Client, ns: &str, sa: &str) -> String {
    crate::workloads::ensure_namespace(client, ns)
        .await
        .unwrap();
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let _ = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": sa}})).unwrap(),
        )
        .await;
    token(client, ns, sa, &[TOKEN_AUDIENCE], None).await
}
