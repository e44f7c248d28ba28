//! `strait check`, `strait gateways` and `strait export/unexport` on two real
//! testenv clusters under one trust anchor: each has network-namespace nodes
//! with a real `strait-proxy` (Ready) and its own `strait-identity` issuer;
//! west runs a real `strait-gateway` and a `web` pod; east runs the real
//! `strait-mirror` process (as its ServiceAccount, RBAC from deploy/, its own
//! identity from the issuer) and is linked to west with `strait link`. Then
//! faults are injected one at a time and `check` must name each. Needs root.

use strait_testenv::fixture as mesh;

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use strait_mesh::identity::ca::{self};
use strait_mesh::link::Link;
use strait_testenv::net::root_or_skip;
use strait_testenv::wait::eventually;
use strait_testenv::workloads::ensure_namespace;
use strait_testenv::{Cluster, kubeconfig, kubectl, workspace_binary};

const WAIT: Duration = Duration::from_secs(60);

mod support;
use support::*;
const GATEWAY_ID: &str = "spiffe://west.clusterset.local/ns/strait-system/sa/strait-gateway";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_passes_on_a_healthy_pair_and_names_each_injected_fault() {
    if !root_or_skip("strait check across two clusters") {
        return;
    }
    let proxy = workspace_binary("strait-proxy");
    let anchor = ca::new_trust_anchor("strait trust anchor", Duration::from_secs(2 * 86400))
        .expect("a trust anchor");
    let (east, west) = tokio::join!(
        mesh::start_mesh_named("east", 1, &proxy, &anchor),
        mesh::start_mesh_named("west", 1, &proxy, &anchor)
    );
    let mut west = west;
    let (ec, wc) = (
        east.topology.cluster().client(),
        west.topology.cluster().client(),
    );
    install_identity_objects(&ec, &anchor.cert_pem, &east.issuer_pair).await;
    install_identity_objects(&wc, &anchor.cert_pem, &west.issuer_pair).await;

    // West: web (not exported yet) and the gateway.
    mesh::backend(&mut west, 0, "web-1", "web", &[]).await;
    mesh::service(&wc, "web").await;
    let (gw_pod, gw) = mesh::start_gateway(&mut west, 0, &[]).await;
    let mut gw = Some(gw);

    // One kubeconfig with contexts east and west; east: the CRD (the
    // committed file, with kubectl), shop, the controller.
    let (_dir, kc) =
        strait_testenv::kubeconfig_with_link_crd(east.topology.cluster(), west.topology.cluster());
    ensure_namespace(&ec, "shop").await.unwrap();
    let mirror_dir = tempfile::tempdir().unwrap();
    let mut mirror = start_mirror(&east, mirror_dir.path()).await;
    let dump_mirror_log = scopeguard(mirror.log_path().to_path_buf());

    // Link with `strait link`, applied with kubectl; probe fast for the test.
    let gw_ip = gw_pod.ip().to_string();
    let out = strait(
        &kc,
        &[
            "link",
            "--context",
            "west",
            "--cluster-name",
            "west",
            "--gateway-addresses",
            &gw_ip,
            "--gateway-identity",
            GATEWAY_ID,
        ],
    );
    assert!(out.status.success(), "strait link: {}", text(&out));
    kubectl(
        &kc,
        &["--context", "east", "apply", "-f", "-"],
        Some(&String::from_utf8(out.stdout).unwrap()),
    );
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    links
        .patch(
            "west",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"probe": {"period": "500ms", "timeout": "1s", "failureThreshold": 2}}})),
        )
        .await
        .unwrap();

    // Export with the CLI: the mirror appears in east.
    let bad = strait(&kc, &["export", "web", "-n", "shop", "--context", "west"]);
    assert!(
        !bad.status.success() && text(&bad).contains("expected svc/NAME"),
        "{}",
        text(&bad)
    );
    let missing = strait(
        &kc,
        &["export", "svc/nope", "-n", "shop", "--context", "west"],
    );
    assert!(
        !missing.status.success() && text(&missing).contains("no Service shop/nope"),
        "{}",
        text(&missing)
    );
    let out = strait(
        &kc,
        &["export", "svc/web", "-n", "shop", "--context", "west"],
    );
    assert!(out.status.success(), "strait export: {}", text(&out));
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    let web = Api::<Service>::namespaced(wc.clone(), "shop")
        .get("web")
        .await
        .unwrap();
    assert_eq!(
        web.metadata
            .labels
            .unwrap_or_default()
            .get("strait.dev/exported"),
        Some(&"true".to_string())
    );
    strait_testenv::wait::until_exists("mirror web-west after export", WAIT, &services, "web-west")
        .await;

    // Healthy: every check passes.
    let started = std::time::Instant::now();
    let results = assert_all_pass(&kc, "healthy pair");
    eprintln!("healthy pair passed check after {:?}", started.elapsed());
    for name in [
        "Link CRD",
        "trust anchors",
        "issuer certificate",
        "node proxies",
        "link west: spec",
        "link west: credentials",
        "link west: remote API",
        "link west: trust anchors",
        "link west: gateway",
        "mirror controller",
        "mirror endpoints",
        "orphan mirrors",
    ] {
        let r = find(&results, name);
        assert_eq!(r["ok"], true, "{r}");
    }
    assert!(
        find(&results, "link west: gateway")["message"]
            .as_str()
            .unwrap()
            .contains("p50"),
        "the gateway line carries the probe latency: {results:#?}"
    );
    let human = strait(&kc, &["check", "--context", "east"]);
    assert!(human.status.success(), "{}", text(&human));
    let human = text(&human);
    assert!(
        human.contains("✓ link west: gateway: alive") && human.contains("are ✓"),
        "{human}"
    );
    eprintln!("{human}");

    // Gateways: west alive with a measured latency, over several probes (the
    // first one includes the QUIC handshake).
    let samples = eventually("several probes in the latency window", WAIT, || async {
        let l = links.get("west").await.map_err(|e| e.to_string())?;
        let latency = l
            .status
            .and_then(|s| s.gateway_latency)
            .ok_or("no latency yet")?;
        if latency.samples >= 5 {
            Ok(latency)
        } else {
            Err(format!("{latency:?}"))
        }
    })
    .await;
    eprintln!("gateway probe latency in west's Link status: {samples:?}");
    let out = strait(&kc, &["gateways", "--context", "east", "-o", "json"]);
    assert!(out.status.success(), "{}", text(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["cluster"], "west", "{rows}");
    assert_eq!(rows[0]["alive"], "yes", "{rows}");
    assert_eq!(rows[0]["numServices"], 1, "{rows}");
    let p50 = rows[0]["latencyP50Ms"].as_f64().expect("a latency");
    let p99 = rows[0]["latencyP99Ms"].as_f64().expect("a latency");
    assert!(p50 > 0.0 && p99 >= p50 && p99 < 1000.0, "{rows}");
    let table = text(&strait(&kc, &["gateways", "--context", "east"]));
    eprintln!("{table}");
    assert!(
        table.starts_with("CLUSTER") && table.contains("west") && table.contains("ms/"),
        "{table}"
    );

    // Unexport: the mirror goes; export again: it is back.
    let out = strait(
        &kc,
        &["unexport", "svc/web", "-n", "shop", "--context", "west"],
    );
    assert!(out.status.success(), "{}", text(&out));
    eventually("the mirror to go after unexport", WAIT, || async {
        match services.get_opt("web-west").await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let out = strait(
        &kc,
        &["unexport", "svc/web", "-n", "shop", "--context", "west"],
    );
    assert!(
        out.status.success() && text(&out).contains("was not exported"),
        "{}",
        text(&out)
    );
    let out = strait(
        &kc,
        &["export", "svc/web", "-n", "shop", "--context", "west"],
    );
    assert!(out.status.success(), "{}", text(&out));
    strait_testenv::wait::until_exists("mirror back after re-export", WAIT, &services, "web-west")
        .await;
    assert_all_pass(&kc, "after re-export");

    // Fault 1: an orphan mirror (its Link is gone).
    let orphan: Service = serde_json::from_value(json!({
        "metadata": {"name": "web-north", "labels": {"strait.dev/mirrored-service": "true", "strait.dev/cluster-name": "north"},
                     "annotations": {"strait.dev/remote-svc-fq-name": "web.shop.svc.cluster.local"}},
        "spec": {"ports": [{"name": "http", "port": 80}]},
    }))
    .unwrap();
    services
        .create(&PostParams::default(), &orphan)
        .await
        .unwrap();
    let (message, all) = until_check_fails(&kc, "orphan mirrors").await;
    assert!(
        message.contains("shop/web-north") && message.contains("north"),
        "names the orphan: {message}"
    );
    eprintln!("orphan mirror: {all:?}");
    services
        .delete("web-north", &DeleteParams::default())
        .await
        .unwrap();
    assert_all_pass(&kc, "orphan removed");

    // Fault 2: mismatched trust anchors (west installed under another anchor).
    let other = ca::new_trust_anchor("another anchor", Duration::from_secs(86400)).unwrap();
    let west_cms = Api::<ConfigMap>::namespaced(wc.clone(), "strait-system");
    let set_west_anchor = |pem: String| {
        let west_cms = west_cms.clone();
        async move {
            west_cms
                .patch(
                    "strait-trust-anchors",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"data": {"ca.crt": pem}})),
                )
                .await
                .unwrap();
        }
    };
    set_west_anchor(other.cert_pem.clone()).await;
    let (message, all) = until_check_fails(&kc, "link west: trust anchors").await;
    assert!(message.contains("no anchor in common"), "{message}");
    eprintln!("mismatched anchors: {all:?}");
    set_west_anchor(anchor.cert_pem.clone()).await;
    assert_all_pass(&kc, "anchors restored");

    // Fault 3: a dead gateway. The real controller's probe (through the
    // tunnel) marks the mirror's endpoints not ready, and ready again once
    // the gateway is back.
    assert_eq!(mirror_endpoints_ready(&ec).await, Some(true));
    drop(gw.take());
    let (message, all) = until_check_fails(&kc, "link west: gateway").await;
    assert!(message.starts_with("down"), "{message}");
    eventually(
        "the probe marks the mirror's endpoints not ready",
        WAIT,
        || async {
            match mirror_endpoints_ready(&ec).await {
                Some(false) => Ok(()),
                other => Err(format!("endpoints ready: {other:?}")),
            }
        },
    )
    .await;
    eprintln!("dead gateway: {all:?}");
    let out = strait(&kc, &["gateways", "--context", "east"]);
    assert!(
        text(&out).contains("west") && text(&out).contains(" no "),
        "{}",
        text(&out)
    );
    gw = Some(mesh::spawn_gateway(&west, &gw_pod, &[]).await);
    let started = std::time::Instant::now();
    assert_all_pass(&kc, "gateway back");
    eventually("the mirror's endpoints ready again", WAIT, || async {
        match mirror_endpoints_ready(&ec).await {
            Some(true) => Ok(()),
            other => Err(format!("endpoints ready: {other:?}")),
        }
    })
    .await;
    eprintln!(
        "gateway back: check passed again after {:?}",
        started.elapsed()
    );

    // Fault 4: an expired link token (a real token of west, expired).
    let secrets = Api::<Secret>::namespaced(ec.clone(), "strait-multicluster");
    let secret = secrets.get("cluster-credentials-west").await.unwrap();
    let kc_text = String::from_utf8(secret.data.unwrap()["kubeconfig"].0.clone()).unwrap();
    let mut remote_kc: serde_yaml::Value = serde_yaml::from_str(&kc_text).unwrap();
    let live = remote_kc["users"][0]["user"]["token"]
        .as_str()
        .unwrap()
        .to_string();
    let expired = expired_copy(&live, west.topology.cluster());
    remote_kc["users"][0]["user"]["token"] = serde_yaml::Value::String(expired);
    secrets
        .patch(
            "cluster-credentials-west",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"stringData": {"kubeconfig": serde_yaml::to_string(&remote_kc).unwrap()}}),
            ),
        )
        .await
        .unwrap();
    let (message, all) = until_check_fails(&kc, "link west: credentials").await;
    assert!(message.contains("expired 2m"), "{message}");
    let (_, results) = check_json(&kc, &[]);
    let remote = find(&results, "link west: remote API");
    assert_eq!(remote["ok"], false, "{remote}");
    assert!(
        remote["message"].as_str().unwrap().contains("401"),
        "the API server itself refuses it: {remote}"
    );
    eprintln!("expired token: {all:?}");

    drop(dump_mirror_log);
    mirror.stop(Duration::from_secs(1));
    drop(gw);
}

/// A cluster without the CRD (or anything of Strait): check fails and says how to install it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_without_the_crd_fails_and_says_how_to_install_it() {
    let cluster = Cluster::start("bare").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    std::fs::write(&kc, kubeconfig::to_yaml(cluster.kubeconfig()).unwrap()).unwrap();
    let out = strait(&kc, &["check", "-o", "json"]);
    assert!(!out.status.success(), "{}", text(&out));
    let results: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let crd = find(&results, "Link CRD");
    assert_eq!(crd["ok"], false);
    assert!(
        crd["message"].as_str().unwrap().contains("not installed"),
        "{crd}"
    );
    assert!(
        crd["hint"]
            .as_str()
            .unwrap()
            .contains("deploy/mirror/crd.yaml"),
        "{crd}"
    );
    assert_eq!(find(&results, "trust anchors")["ok"], false);
    // Nothing about Links is claimed when Links cannot exist.
    assert!(
        results
            .iter()
            .all(|r| !r["check"].as_str().unwrap().starts_with("link "))
    );
    let human = text(&strait(&kc, &["check"]));
    assert!(
        human.contains("× Link CRD: links.multicluster.strait.dev is not installed"),
        "{human}"
    );
    assert!(human.contains("    hint: install it"), "{human}");
    // --wait gives up when the time is up, still failing.
    let started = std::time::Instant::now();
    let out = strait(&kc, &["check", "--wait", "3s"]);
    assert!(!out.status.success());
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// A Link whose kubeconfig names a program to run (exec) or a file to read
/// (tokenFile): check fails its credentials with the fix, and never builds a
/// client from it (which would run the plugin here, on the operator's machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_a_link_kubeconfig_that_would_run_or_read_something_and_never_runs_it() {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (_dir, kc) = strait_testenv::kubeconfig_with_link_crd(&east, &west);
    let ec = east.client();
    ensure_namespace(&ec, "strait-multicluster").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("exec-plugin-ran");
    let west_with = |user: serde_json::Value| {
        let mut remote: serde_yaml::Value =
            serde_yaml::from_str(&kubeconfig::to_yaml(west.kubeconfig()).unwrap()).unwrap();
        remote["users"][0]["user"] = serde_yaml::to_value(user).unwrap();
        serde_yaml::to_string(&remote).unwrap()
    };
    let exec = west_with(json!({"exec": {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "/bin/sh",
        "args": ["-c", format!("touch {}; echo '{{\"apiVersion\":\"client.authentication.k8s.io/v1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"t\"}}}}'", marker.display())],
        "interactiveMode": "Never",
    }}));
    let token_file = west_with(json!({"tokenFile": dir.path().join("token")}));
    for (cluster, kubeconfig) in [("exec", exec), ("tokenfile", token_file)] {
        let secret = format!("cluster-credentials-{cluster}");
        Api::<Secret>::namespaced(ec.clone(), "strait-multicluster")
            .create(
                &PostParams::default(),
                &serde_json::from_value(
                    json!({"metadata": {"name": secret}, "stringData": {"kubeconfig": kubeconfig}}),
                )
                .unwrap(),
            )
            .await
            .unwrap();
        Api::<Link>::namespaced(ec.clone(), "strait-multicluster")
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link",
                    "metadata": {"name": cluster},
                    "spec": {"targetClusterName": cluster, "clusterCredentialsSecret": secret,
                             "gatewayAddresses": ["10.77.0.1"], "gatewayIdentity": GATEWAY_ID},
                }))
                .unwrap(),
            )
            .await
            .unwrap();
    }

    let (ok, results) = check_json(&kc, &[]);
    assert!(!ok, "{:#?}", failing(&results));
    for (cluster, field, instead) in [
        ("exec", "`exec`", "`token`"),
        ("tokenfile", "`tokenFile`", "`token`"),
    ] {
        let r = find(&results, &format!("link {cluster}: credentials"));
        assert_eq!(r["ok"], false, "{r}");
        let message = r["message"].as_str().unwrap();
        let secret = format!("strait-multicluster/cluster-credentials-{cluster}");
        for part in [secret.as_str(), field, instead, "inline data"] {
            assert!(message.contains(part), "{part:?} missing: {r}");
        }
        let hint = r["hint"].as_str().unwrap();
        assert!(
            hint.contains("strait link --context") && hint.contains("who changed the Secret"),
            "{r}"
        );
        // No client was built from it: no remote API line, and nothing compared.
        assert!(
            results
                .iter()
                .all(|r| r["check"] != format!("link {cluster}: remote API")),
            "{results:#?}"
        );
    }
    let human = text(&strait(&kc, &["check", "--context", "east"]));
    assert!(
        human.contains("× link exec: credentials: strait-multicluster/cluster-credentials-exec")
            && human.contains("    hint: re-link"),
        "{human}"
    );
    assert!(!marker.exists(), "strait check ran the link's exec plugin");
}
