//! `strait link … | kubectl apply -f -` with the stock kubectl, on real clusters,
//! and `strait unlink` taking everything away again.

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, Service, ServiceAccount};
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::json;
use strait_mesh::link::Link;
use strait_testenv::wait::{eventually, until_exists};
use strait_testenv::workloads::ensure_namespace;
use strait_testenv::{Cluster, kubectl};

const WAIT: Duration = Duration::from_secs(30);

fn claims(jwt: &str) -> serde_json::Value {
    use base64::Engine as _;
    let payload = jwt.split('.').nth(1).expect("a JWT");
    serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_output_applied_with_kubectl_mirrors_and_unlink_removes_everything() {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ec, wc) = (east.client(), west.client());
    let (_dir, kc) = strait_testenv::kubeconfig_with_link_crd(&east, &west);

    // Install the committed CRD with kubectl; run the controller on east.
    // The controller runs as its ServiceAccount with the RBAC from deploy/, not as admin.
    let rbac = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/mirror/rbac.yaml");
    kubectl(&kc, &["--context", "east", "apply", "-f", rbac], None);
    strait_testenv::workloads::wait_for_service_account(
        &ec,
        "strait-multicluster",
        "strait-mirror",
        WAIT,
    )
    .await
    .unwrap();
    let request: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(json!({"spec": {"expirationSeconds": 3600}})).unwrap();
    let mirror_token = Api::<ServiceAccount>::namespaced(ec.clone(), "strait-multicluster")
        .create_token_request("strait-mirror", &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
        .unwrap();
    let as_mirror = east.client_with_token(&mirror_token).await.unwrap();
    let controller = tokio::spawn(strait_mirror::run(as_mirror, Default::default()));

    ensure_namespace(&ec, "shop").await.unwrap();
    ensure_namespace(&wc, "shop").await.unwrap();
    Api::<Service>::namespaced(wc.clone(), "shop")
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "web", "labels": {"strait.dev/exported": "true"}},
                "spec": {"ports": [{"name": "http", "port": 80}]}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();

    let out = Command::new(env!("CARGO_BIN_EXE_strait"))
        .arg("link")
        .arg("--kubeconfig")
        .arg(&kc)
        .args([
            "--context",
            "west",
            "--cluster-name",
            "west",
            "--gateway-addresses",
            "10.77.0.1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "strait link: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let manifests = String::from_utf8(out.stdout).unwrap();
    kubectl(
        &kc,
        &["--context", "east", "apply", "-f", "-"],
        Some(&manifests),
    );

    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    until_exists(
        "mirror web-west via strait link",
        WAIT,
        &services,
        "web-west",
    )
    .await;

    // The credentials: an expiring TokenRequest token of a least-privilege ServiceAccount.
    let secret = Api::<Secret>::namespaced(ec.clone(), "strait-multicluster")
        .get("cluster-credentials-west")
        .await
        .unwrap();
    let kubeconfig_text = String::from_utf8(secret.data.unwrap()["kubeconfig"].0.clone()).unwrap();
    let remote_kc: serde_yaml::Value = serde_yaml::from_str(&kubeconfig_text).unwrap();
    let token = remote_kc["users"][0]["user"]["token"]
        .as_str()
        .unwrap()
        .to_string();
    let c = claims(&token);
    let lifetime = c["exp"].as_i64().unwrap() - c["iat"].as_i64().unwrap();
    assert!(
        (23 * 3600..=24 * 3600).contains(&lifetime),
        "token lifetime {lifetime}s, expected 24 h"
    );
    assert_eq!(
        c["sub"],
        "system:serviceaccount:strait-multicluster:strait-link-west"
    );
    let as_link = west.client_with_token(&token).await.unwrap();
    Api::<Service>::all(as_link.clone())
        .list(&ListParams::default())
        .await
        .expect("may list services");
    let secrets = Api::<Secret>::all(as_link.clone())
        .list(&ListParams::default())
        .await;
    assert!(
        matches!(secrets, Err(kube::Error::Api(ref e)) if e.code == 403),
        "must not read secrets: {secrets:?}"
    );
    // No legacy, non-expiring token Secret was made on the target.
    let legacy = Api::<Secret>::namespaced(wc.clone(), "strait-multicluster")
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        legacy
            .items
            .iter()
            .all(|s| s.type_.as_deref() != Some("kubernetes.io/service-account-token"))
    );

    // A user's Service that looks like a mirror (the labels) but was not
    // written by Strait: unlink must leave it.
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "lookalike-west", "labels": {
                    "strait.dev/mirrored-service": "true", "strait.dev/cluster-name": "west"}},
                "spec": {"ports": [{"port": 80}]},
            }))
            .unwrap(),
        )
        .await
        .unwrap();

    // Unlink: the Link, its Secret and mirrors on east; the access objects on west.
    let out = Command::new(env!("CARGO_BIN_EXE_strait"))
        .arg("unlink")
        .arg("--kubeconfig")
        .arg(&kc)
        .args([
            "--context",
            "east",
            "--target-context",
            "west",
            "--cluster-name",
            "west",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "strait unlink: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    assert!(
        links.get_opt("west").await.unwrap().is_none(),
        "the Link is still there: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        services.get_opt("web-west").await.unwrap().is_none(),
        "mirror left after unlink"
    );
    assert!(
        services.get_opt("lookalike-west").await.unwrap().is_some(),
        "unlink deleted a Service Strait did not write"
    );
    assert!(
        Api::<Secret>::namespaced(ec.clone(), "strait-multicluster")
            .get_opt("cluster-credentials-west")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        Api::<ServiceAccount>::namespaced(wc.clone(), "strait-multicluster")
            .get_opt("strait-link-west")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        matches!(
            Api::<Service>::all(as_link).list(&ListParams::default()).await,
            Err(kube::Error::Api(ref e)) if e.code == 401 || e.code == 403
        ),
        "the old token must stop working once its ServiceAccount is gone"
    );
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_renews_the_link_token_before_it_expires() {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ec, wc) = (east.client(), west.client());
    let (_dir, kc) = strait_testenv::kubeconfig_with_link_crd(&east, &west);
    // Renew after 1 % of a 10-minute token (the API server's shortest): ~6 s.
    let controller = tokio::spawn(strait_mirror::run(
        ec.clone(),
        strait_mirror::MirrorConfig {
            token_renew_at: 0.01,
            ..Default::default()
        },
    ));
    ensure_namespace(&ec, "shop").await.unwrap();
    ensure_namespace(&wc, "shop").await.unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strait"))
        .arg("link")
        .arg("--kubeconfig")
        .arg(&kc)
        .args([
            "--context",
            "west",
            "--cluster-name",
            "west",
            "--token-ttl",
            "10m",
            "--gateway-addresses",
            "10.77.0.1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "strait link: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    kubectl(
        &kc,
        &["--context", "east", "apply", "-f", "-"],
        Some(&String::from_utf8(out.stdout).unwrap()),
    );

    let secrets: Api<Secret> = Api::namespaced(ec.clone(), "strait-multicluster");
    let token_now = || async {
        let s = secrets
            .get("cluster-credentials-west")
            .await
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8(s.data.unwrap()["kubeconfig"].0.clone())
            .map_err(|e| e.to_string())?;
        let kc: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| e.to_string())?;
        Ok::<String, String>(
            kc["users"][0]["user"]["token"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    };
    let first = token_now().await.unwrap();
    let renewed = eventually(
        "the controller to renew the token",
        Duration::from_secs(40),
        || async {
            let t = token_now().await?;
            if t != first {
                Ok(t)
            } else {
                Err("same token".into())
            }
        },
    )
    .await;
    let (a, b) = (claims(&first), claims(&renewed));
    assert_eq!(a["sub"], b["sub"], "renewed for the same ServiceAccount");
    assert!(
        b["exp"].as_i64() > a["exp"].as_i64(),
        "the renewed token lives longer"
    );

    // The link works on the renewed token: a service exported now is mirrored.
    Api::<Service>::namespaced(wc.clone(), "shop")
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "late", "labels": {"strait.dev/exported": "true"}},
                "spec": {"ports": [{"port": 81}]}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    until_exists("mirror after renewal", WAIT, &services, "late-west").await;
    controller.abort();
}
