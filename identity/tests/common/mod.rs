//! Shared set-up for identity tests: real clusters (testenv), real issuer
//! processes, real TLS between real sockets.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::ca::PemPair;
use strait_mesh::identity::client::IssuerClient;
use strait_mesh::identity::protocol::TOKEN_AUDIENCE;
use strait_mesh::identity::tls::{self, CertSlot, TrustBundle};
use strait_testenv::Cluster;
use strait_testenv::process::{ChildProcess, log_tail};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

pub const ISSUER_DNS: &str = "strait-identity.strait-system.svc";

pub fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
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

impl RunningIssuer {
    /// Kills the issuer process (an outage).
    pub fn stop(&mut self) {
        self.child.stop(Duration::ZERO);
    }

    /// Starts it again on the same ports with the same files.
    pub async fn restart(&mut self) {
        self.child = spawn_issuer(&self.args, self.dir.path());
        wait_ready(&mut self.child, self.admin).await;
    }

    pub fn client(&self) -> IssuerClient {
        IssuerClient::new(&self.addr.to_string(), ISSUER_DNS, &self.bundle).expect("issuer client")
    }

    pub async fn metrics(&self) -> String {
        http_get(self.admin, "/metrics").await
    }
}

pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::AsyncReadExt;
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect admin");
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// Installs the issuer's RBAC from deploy/ with the stock kubectl, gives the
/// issuer a kubeconfig holding only its own ServiceAccount's token, and starts it.
pub async fn start_issuer(
    cluster: &Cluster,
    issuer: &PemPair,
    bundle_pem: &str,
    trust_domain: &str,
    validity: &str,
) -> RunningIssuer {
    let rbac = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/identity/rbac.yaml");
    let out = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig_path())
        .args(["apply", "-f", rbac])
        .output()
        .expect("run kubectl");
    assert!(
        out.status.success(),
        "kubectl apply rbac: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    strait_testenv::workloads::wait_for_service_account(
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
    let kubeconfig = strait_testenv::kubeconfig::with_token(
        cluster.name(),
        &cluster.server_url(),
        cluster.ca_pem(),
        &token,
    );
    std::fs::write(
        path("kubeconfig"),
        strait_testenv::kubeconfig::to_yaml(&kubeconfig).unwrap(),
    )
    .unwrap();
    std::fs::write(path("tls.crt"), &issuer.cert_pem).unwrap();
    std::fs::write(path("tls.key"), &issuer.key_pem).unwrap();
    std::fs::write(path("ca.crt"), bundle_pem).unwrap();
    let (addr, admin) = (free_addr(), free_addr());
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
    let child = spawn_issuer(&args, dir.path());
    let mut running = RunningIssuer {
        addr,
        admin,
        bundle: TrustBundle::from_pem(bundle_pem.as_bytes()).unwrap(),
        trust_domain: trust_domain.to_string(),
        child,
        args,
        dir,
    };
    wait_ready(&mut running.child, admin).await;
    running
}

fn spawn_issuer(args: &[String], dir: &std::path::Path) -> ChildProcess {
    let kubeconfig_path = dir.join("kubeconfig");
    ChildProcess::spawn_with_env(
        "strait-identity",
        std::path::Path::new(env!("CARGO_BIN_EXE_strait-identity")),
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
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let mut spec = json!({"expirationSeconds": 3600});
    if !audiences.is_empty() {
        spec["audiences"] = json!(audiences);
    }
    if let Some((name, uid)) = bound_pod {
        spec["boundObjectRef"] =
            json!({"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid});
    }
    let request: TokenRequest = serde_json::from_value(json!({"spec": spec})).unwrap();
    api.create_token_request(sa, &PostParams::default(), &request)
        .await
        .unwrap_or_else(|e| panic!("TokenRequest for {ns}/{sa}: {e}"))
        .status
        .and_then(|s| s.token)
        .expect("token")
}

/// A Strait-audience token for `ns/sa`, creating the ServiceAccount if needed.
pub async fn workload_token(client: &Client, ns: &str, sa: &str) -> String {
    strait_testenv::workloads::ensure_namespace(client, ns)
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

pub const ALPN: &[&[u8]] = &[b"strait-test/1"];

/// An mTLS echo server: tells each client the SPIFFE ID it saw, then echoes lines.
pub async fn spawn_mtls_server(bundle: &TrustBundle, cert: Arc<CertSlot>) -> SocketAddr {
    let config = tls::server_config(bundle, cert, ALPN).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            // Small writes must not wait for delayed ACKs (40 ms each).
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let peer = tls::peer_identity(stream.get_ref().1.peer_certificates())
                    .map(|id| id.to_string())
                    .unwrap_or_else(|e| format!("error: {e}"));
                let (r, mut w) = tokio::io::split(stream);
                if w.write_all(format!("{peer}\n").as_bytes()).await.is_err() {
                    return;
                }
                let mut lines = BufReader::new(r).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if w.write_all(format!("{line}\n").as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// An mTLS client connection to `addr` expecting the server to be `expected`.
pub struct MtlsConn {
    pub server_id: SpiffeId,
    pub seen_by_server: String,
    lines: tokio::io::Lines<
        BufReader<tokio::io::ReadHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>,
    >,
    writer: tokio::io::WriteHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
}

pub async fn connect(
    addr: SocketAddr,
    bundle: &TrustBundle,
    cert: Arc<CertSlot>,
    expected: &SpiffeId,
) -> Result<MtlsConn, String> {
    let config = tls::client_config(bundle, cert, vec![expected.clone()], ALPN)
        .map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("strait.peer").unwrap();
    let stream = connector
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let server_id =
        tls::peer_identity(stream.get_ref().1.peer_certificates()).map_err(|e| e.to_string())?;
    let (r, writer) = tokio::io::split(stream);
    let mut lines = BufReader::new(r).lines();
    // TLS 1.3: a server that rejects our certificate says so on first read.
    let seen_by_server = tokio::time::timeout(Duration::from_secs(5), lines.next_line())
        .await
        .map_err(|_| "server said nothing".to_string())?
        .map_err(|e| e.to_string())?
        .ok_or("server closed the connection")?;
    Ok(MtlsConn {
        server_id,
        seen_by_server,
        lines,
        writer,
    })
}

impl MtlsConn {
    pub async fn ping(&mut self, msg: &str) -> Result<(), String> {
        self.writer
            .write_all(format!("{msg}\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let line = tokio::time::timeout(Duration::from_secs(5), self.lines.next_line())
            .await
            .map_err(|_| "no echo".to_string())?
            .map_err(|e| e.to_string())?
            .ok_or("closed")?;
        if line == msg {
            Ok(())
        } else {
            Err(format!("echo {line:?} != {msg:?}"))
        }
    }
}
