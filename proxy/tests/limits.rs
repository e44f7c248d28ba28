//! Bounds on what pods and peers control, on real node proxies (testenv
//! nodes, root): a node proxy's pod identities follow the pods of their
//! ServiceAccount on the node.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::DeleteParams;
use strait_testenv::wait::eventually;

mod common;

use common::*;

/// `identity_refresh_total{result="ok"}` of the proxy on `node`.
async fn refreshes(mesh: &Mesh, node: usize) -> f64 {
    let text = proxy_metrics(&mesh.topology.nodes()[node]).await;
    metric_sum(&text, "identity_refresh_total", &["result=\"ok\""])
}

async fn delete_pod(mesh: &Mesh, name: &str) {
    let pods: Api<Pod> = Api::namespaced(mesh.topology.cluster().client(), "shop");
    pods.delete(name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_identity_follows_the_pods_of_its_account_and_goes_with_the_last() {
    let Some(mut mesh) = small_mesh("0s").await else {
        return;
    };
    // `client` called first: the node proxy fetched the `client` account's
    // identity on its behalf. A second pod of the account on the same node.
    add_client_named(&mut mesh, 0, "client-2").await;
    let proxy = format!("http://{}:4140", mesh.topology.nodes()[0].ip());
    let series = format!(
        "identity=\"spiffe://{}/ns/shop/sa/client\"",
        mesh.trust_domain
    );
    let held = |text: &str| {
        metric_sum(
            text,
            "identity_cert_expiration_timestamp_seconds",
            &[&series],
        )
    };
    let before = refreshes(&mesh, 0).await;
    assert!(held(&proxy_metrics(&mesh.topology.nodes()[0]).await) > 0.0);

    // The pod it was fetched for leaves: the proxy fetches it again at once
    // for the other pod (the issuer would refuse a refresh naming the gone
    // one), instead of failing every refresh until the certificate expires.
    delete_pod(&mesh, "client").await;
    eventually(
        "the identity re-fetched for client-2",
        Duration::from_secs(10),
        || async {
            let now = refreshes(&mesh, 0).await;
            if now > before {
                Ok(())
            } else {
                Err(format!("identity_refresh_total{{result=ok}} still {now}"))
            }
        },
    )
    .await;
    let answered = answered_by(&curl_via(
        pod(&mesh, "client-2"),
        &proxy,
        &["http://web.shop/"],
    ));
    assert_eq!(answered.as_deref(), Ok("web-1"), "client-2 still calls");
    let text = proxy_metrics(&mesh.topology.nodes()[0]).await;
    assert_eq!(
        metric_sum(&text, "identity_refresh_total", &[]),
        metric_sum(&text, "identity_refresh_total", &["result=\"ok\""]),
        "no refresh failed: {text}"
    );

    // The last pod of the account leaves: the identity is dropped.
    delete_pod(&mesh, "client-2").await;
    eventually(
        "the client identity dropped",
        Duration::from_secs(10),
        || async {
            let text = proxy_metrics(&mesh.topology.nodes()[0]).await;
            if held(&text) == 0.0 {
                Ok(())
            } else {
                Err(
                    "identity_cert_expiration_timestamp_seconds still has the client account"
                        .to_string(),
                )
            }
        },
    )
    .await;
}
