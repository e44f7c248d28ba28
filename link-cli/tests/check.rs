//! `strait check`, `strait gateways` and `strait export/unexport` on two real
//! testenv clusters under one trust anchor: each has network-namespace nodes
//! with a real `strait-proxy` (Ready) and its own `strait-identity` issuer;
//! west runs a real `strait-gateway` and a `web` pod; east runs the real
//! `strait-mirror` process (as its ServiceAccount, RBAC from deploy/, its own
//! identity from the issuer) and is linked to west with `strait link`. Then
//! faults are injected one at a time and `check` must name each. Needs root.

#[path = "../../proxy/tests/common/mod.rs"]
#[allow(unused)]
mod mesh;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use strait_mesh::identity::ca::{self, PemPair};
use strait_mesh::link::Link;
use strait_mesh::names::TOKEN_AUDIENCE;
use strait_testenv::issuer::{self, token};
use strait_testenv::net::root_or_skip;
use strait_testenv::process::{ChildProcess, log_tail};
use strait_testenv::wait::eventually;
use strait_testenv::workloads::ensure_namespace;
use strait_testenv::{Cluster, kubeconfig, kubectl, workspace_binary};

const WAIT: Duration = Duration::from_secs(60);
const GATEWAY_ID: &str = "spiffe://cluster.local/ns/strait-system/sa/strait-gateway";

fn strait(kc: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strait"))
        .args(args)
        .arg("--kubeconfig")
        .arg(kc)
        .output()
        .expect("run strait")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `strait check -o json`: the exit status and the results by check name.
fn check_json(kc: &Path, extra: &[&str]) -> (bool, Vec<serde_json::Value>) {
    let mut args = vec!["check", "--context", "east", "-o", "json"];
    args.extend_from_slice(extra);
    let out = strait(kc, &args);
    let results: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("check -o json is JSON ({e}): {}", text(&out)));
    (out.status.success(), results)
}

fn find<'a>(results: &'a [serde_json::Value], check: &str) -> &'a serde_json::Value {
    results
        .iter()
        .find(|r| r["check"] == check)
        .unwrap_or_else(|| panic!("no check {check:?} in {results:#?}"))
}

fn failing(results: &[serde_json::Value]) -> Vec<String> {
    results
        .iter()
        .filter(|r| r["ok"] == false)
        .map(|r| format!("{}: {}", r["check"], r["message"]))
        .collect()
}

/// Runs check until `check` fails; returns its message and every failing line.
async fn until_check_fails(kc: &Path, check: &str) -> (String, Vec<String>) {
    eventually(&format!("check {check:?} to fail"), WAIT, || async {
        let (ok, results) = check_json(kc, &[]);
        let r = find(&results, check);
        if r["ok"] == false {
            assert!(!ok, "a failing check makes the exit status non-zero");
            assert!(
                r["hint"].as_str().is_some_and(|h| !h.is_empty()),
                "every failure has a hint: {r}"
            );
            Ok((
                r["message"].as_str().unwrap().to_string(),
                failing(&results),
            ))
        } else {
            Err(format!("{check} still passes: {}", r["message"]))
        }
    })
    .await
}

fn assert_all_pass(kc: &Path, what: &str) -> Vec<serde_json::Value> {
    let (ok, results) = check_json(kc, &["--wait", "90s"]);
    assert!(ok, "{what}: check fails: {:#?}", failing(&results));
    results
}

/// What `strait install` puts in strait-system for the checks: the trust
/// anchors ConfigMap and the issuer Secret.
async fn install_identity_objects(client: &Client, anchor_pem: &str, issuer: &PemPair) {
    ensure_namespace(client, "strait-system").await.unwrap();
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "strait-trust-anchors"}, "data": {"ca.crt": anchor_pem}}))
    .unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), "strait-system")
        .patch(
            "strait-trust-anchors",
            &PatchParams::apply("test").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "strait-trust-anchors", "namespace": "strait-system"},
                "data": cm.data})),
        )
        .await
        .unwrap();
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "strait-identity-issuer"}, "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": issuer.cert_pem, "tls.key": issuer.key_pem, "ca.crt": anchor_pem}}))
    .unwrap();
    Api::<Secret>::namespaced(client.clone(), "strait-system")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

/// The real `strait-mirror` in east, on the host (the host reaches every
/// node network, as a controller pod reaches the gateway's address), as its
/// ServiceAccount with deploy/mirror/rbac.yaml, with its own identity.
async fn start_mirror(east: &mesh::Mesh, dir: &Path) -> ChildProcess {
    let cluster = east.topology.cluster();
    let client = cluster.client();
    strait_testenv::kubectl_apply(
        cluster,
        concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/mirror/rbac.yaml"),
    );
    strait_testenv::workloads::wait_for_service_account(
        &client,
        "strait-multicluster",
        "strait-mirror",
        WAIT,
    )
    .await
    .unwrap();
    let api_token = token(&client, "strait-multicluster", "strait-mirror", &[], None).await;
    let identity_token = token(
        &client,
        "strait-multicluster",
        "strait-mirror",
        &[TOKEN_AUDIENCE],
        None,
    )
    .await;
    let kc = kubeconfig::with_token(
        cluster.name(),
        &cluster.server_url(),
        cluster.ca_pem(),
        &api_token,
    );
    std::fs::write(dir.join("kubeconfig"), kubeconfig::to_yaml(&kc).unwrap()).unwrap();
    std::fs::write(dir.join("token"), identity_token).unwrap();
    std::fs::write(dir.join("ca.crt"), &east.anchor.cert_pem).unwrap();
    let s = |p: PathBuf| p.to_string_lossy().into_owned();
    let args = vec![
        "--admin-addr=127.0.0.1:0".to_string(),
        format!("--issuer-addr={}", east.issuer.addr),
        format!("--issuer-name={}", issuer::ISSUER_DNS),
        format!("--trust-anchors={}", s(dir.join("ca.crt"))),
        format!("--token-file={}", s(dir.join("token"))),
    ];
    ChildProcess::spawn_with_env(
        "strait-mirror",
        &workspace_binary("strait-mirror"),
        &args,
        &[
            ("KUBECONFIG", dir.join("kubeconfig").as_os_str()),
            ("RUST_LOG", std::ffi::OsStr::new("strait_mirror=debug,info")),
        ],
        &dir.join("mirror.log"),
    )
    .expect("spawn strait-mirror")
}

/// `token` re-signed with the cluster's own service-account key, its `exp`
/// two minutes past: a genuine token of that cluster that has expired.
fn expired_copy(token: &str, cluster: &Cluster) -> String {
    use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut parts = token.split('.');
    let header = parts.next().unwrap();
    let mut claims: serde_json::Value =
        serde_json::from_slice(&b64.decode(parts.next().unwrap()).unwrap()).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    claims["iat"] = json!(now - 720);
    claims["nbf"] = json!(now - 720);
    claims["exp"] = json!(now - 120);
    let key_pem = std::fs::read_to_string(cluster.dir().join("pki/sa.key")).unwrap();
    let der = key_pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect::<String>();
    let der = base64::engine::general_purpose::STANDARD
        .decode(der)
        .unwrap();
    let rng = ring::rand::SystemRandom::new();
    let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &der, &rng)
        .expect("the cluster's service-account key is PKCS#8 P-256");
    let signing_input = format!("{header}.{}", b64.encode(claims.to_string()));
    let sig = key.sign(&rng, signing_input.as_bytes()).unwrap();
    format!("{signing_input}.{}", b64.encode(sig.as_ref()))
}

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

    // One kubeconfig with contexts east and west.
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    let merged = kubeconfig::merge([
        east.topology.cluster().kubeconfig().clone(),
        west.topology.cluster().kubeconfig().clone(),
    ]);
    std::fs::write(&kc, kubeconfig::to_yaml(&merged).unwrap()).unwrap();

    // East: the CRD (the committed file, with kubectl), shop, the controller.
    let crd = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/mirror/crd.yaml");
    kubectl(&kc, &["--context", "east", "apply", "-f", crd], None);
    kubectl(
        &kc,
        &[
            "--context",
            "east",
            "wait",
            "--for=condition=Established",
            "crd/links.multicluster.strait.dev",
        ],
        None,
    );
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

/// Prints the controller's log if the test panics.
struct LogOnPanic(PathBuf);

/// Whether every endpoint of the mirror `shop/web-west` is ready, as the
/// mirror controller's gateway probe sets them (`None`: no endpoints yet).
async fn mirror_endpoints_ready(client: &Client) -> Option<bool> {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), "shop")
        .list(&kube::api::ListParams::default().labels("kubernetes.io/service-name=web-west"))
        .await
        .ok()?;
    let ready: Vec<bool> = slices
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .map(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
        .collect();
    (!ready.is_empty()).then(|| ready.iter().all(|r| *r))
}

fn scopeguard(path: PathBuf) -> LogOnPanic {
    LogOnPanic(path)
}
impl Drop for LogOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("──── strait-mirror ────\n{}", log_tail(&self.0, 60));
        }
    }
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
