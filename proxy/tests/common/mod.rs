//! The proxy tests' world is `strait_testenv::fixture` (shared with every
//! crate's tests and benchmarks); this adds what needs the proxy crate itself.
#![allow(dead_code)]

use strait_mesh::names::TRANSPARENT_ANNOTATION;
use strait_testenv::NetPod;
pub use strait_testenv::fixture::*;
use strait_testenv::wait::eventually;

/// A pod on `node` (index) in `namespace`, running as ServiceAccount `sa`,
/// annotated `strait.dev/transparent: enabled` and enrolled with its node's
/// proxy as the CNI plugin would (retried until the proxy's discovery has
/// seen the pod and it is captured).
pub async fn add_transparent_pod(
    mesh: &Mesh,
    node: usize,
    namespace: &str,
    name: &str,
    sa: &str,
) -> NetPod {
    use strait_proxy::transparent::{EnrollRequest, enroll};
    let pod = mesh
        .topology
        .add_pod(node, namespace, name, |p| {
            p.with_service_account(sa)
                .with_annotation(TRANSPARENT_ANNOTATION, "enabled")
        })
        .await
        .unwrap();
    let socket = enroll_socket(mesh, pod.node());
    let netns = std::path::PathBuf::from(format!("/proc/{}/ns/net", pod.anchor_pid()));
    eventually(&format!("{namespace}/{name} is enrolled"), WAIT, || async {
        let request = EnrollRequest::Add {
            namespace: namespace.into(),
            name: name.into(),
            netns: netns.clone(),
        };
        match enroll(&socket, &request).await {
            Ok(true) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    pod
}

/// Two nodes: `client` on node 1; `web-1` (prompt) and `lazy-1` (answers HTTP
/// after `lazy_delay`, Service without a timeout) on node 2.
pub async fn small_mesh(lazy_delay: &str) -> Option<Mesh> {
    if !strait_testenv::net::root_or_skip("proxy robustness tests") {
        return None;
    }
    let mut mesh = start_mesh(2, std::path::Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await;
    let client = mesh.topology.cluster().client();
    backend(&mut mesh, 1, "web-1", "web", &[]).await;
    backend(
        &mut mesh,
        1,
        "lazy-1",
        "lazy",
        &[&format!("--delay={lazy_delay}")],
    )
    .await;
    add_client(&mut mesh, 0).await;
    for name in ["web", "lazy"] {
        service(&client, name).await;
    }
    eventually("web answers through the proxies", WAIT, || async {
        answered_by(&curl(&mesh, &["http://web.shop/"]))
    })
    .await;
    Some(mesh)
}

/// A TLS client as `cert` to `addr` (TCP) expecting `server`: whether the
/// server let it through (TLS 1.3: a refused client learns it on its first read).
pub async fn tls_accepted(
    addr: std::net::SocketAddr,
    bundle: &strait_mesh::identity::tls::TrustBundle,
    cert: std::sync::Arc<strait_mesh::identity::tls::CertSlot>,
    server: &strait_mesh::identity::SpiffeId,
    sni: &str,
) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = strait_mesh::identity::tls::client_config(
        bundle,
        cert,
        vec![server.clone()],
        &[strait_mesh::tunnel::TUNNEL_ALPN],
    )
    .unwrap();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let Ok(mut stream) = connector.connect(name, tcp).await else {
        return false;
    };
    // A probe header: answered by a gateway, refused (but answered) by a node proxy.
    let header = strait_mesh::tunnel::quic::probe_header();
    if header.write_to(&mut stream).await.is_err() || stream.flush().await.is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut buf)).await,
        Ok(Ok(n)) if n > 0
    )
}
