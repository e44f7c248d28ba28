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
