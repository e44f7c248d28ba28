//! What the check tests do again and again: run `strait` and read its
//! JSON, wait for a check to fail, install identity objects, run the real
//! mirror controller, forge an expired token.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use base64::Engine as _;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use strait_mesh::identity::ca::PemPair;
use strait_testenv::fixture as mesh;
use strait_testenv::issuer;
use strait_testenv::process::{ChildProcess, log_tail};
use strait_testenv::wait::eventually;
use strait_testenv::workloads::ensure_namespace;
use strait_testenv::{Cluster, workspace_binary};

use super::WAIT;

pub fn strait(kc: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strait"))
        .args(args)
        .arg("--kubeconfig")
        .arg(kc)
        .output()
        .expect("run strait")
}

pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `strait check -o json`: the exit status and the results by check name.
pub fn check_json(kc: &Path, extra: &[&str]) -> (bool, Vec<serde_json::Value>) {
    let mut args = vec!["check", "--context", "east", "-o", "json"];
    args.extend_from_slice(extra);
    let out = strait(kc, &args);
    let results: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("check -o json is JSON ({e}): {}", text(&out)));
    (out.status.success(), results)
}

pub fn find<'a>(results: &'a [serde_json::Value], check: &str) -> &'a serde_json::Value {
    results
        .iter()
        .find(|r| r["check"] == check)
        .unwrap_or_else(|| panic!("no check {check:?} in {results:#?}"))
}

pub fn failing(results: &[serde_json::Value]) -> Vec<String> {
    results
        .iter()
        .filter(|r| r["ok"] == false)
        .map(|r| format!("{}: {}", r["check"], r["message"]))
        .collect()
}

/// Runs check until `check` fails; returns its message and every failing line.
pub async fn until_check_fails(kc: &Path, check: &str) -> (String, Vec<String>) {
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

pub fn assert_all_pass(kc: &Path, what: &str) -> Vec<serde_json::Value> {
    let (ok, results) = check_json(kc, &["--wait", "90s"]);
    assert!(ok, "{what}: check fails: {:#?}", failing(&results));
    results
}

/// What `strait install` puts in strait-system for the checks: the trust
/// anchors ConfigMap and the issuer Secret.
pub async fn install_identity_objects(client: &Client, anchor_pem: &str, issuer: &PemPair) {
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
pub async fn start_mirror(east: &mesh::Mesh, dir: &Path) -> ChildProcess {
    let cluster = east.topology.cluster();
    let client = cluster.client();
    strait_testenv::kubectl_apply(
        cluster,
        &strait_testenv::stack::deploy_file("mirror/rbac.yaml").to_string_lossy(),
    );
    strait_testenv::workloads::wait_for_service_account(
        &client,
        "strait-multicluster",
        "strait-mirror",
        WAIT,
    )
    .await
    .unwrap();
    strait_testenv::stack::write_credentials(
        cluster,
        dir,
        "strait-multicluster",
        "strait-mirror",
        None,
        &east.anchor.cert_pem,
    )
    .await
    .unwrap();
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
pub fn expired_copy(token: &str, cluster: &Cluster) -> String {
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

/// Prints the controller's log if the test panics.
pub struct LogOnPanic(PathBuf);

/// Whether every endpoint of the mirror `shop/web-west` is ready, as the
/// mirror controller's gateway probe sets them (`None`: no endpoints yet).
pub async fn mirror_endpoints_ready(client: &Client) -> Option<bool> {
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

pub fn scopeguard(path: PathBuf) -> LogOnPanic {
    LogOnPanic(path)
}
impl Drop for LogOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("──── strait-mirror ────\n{}", log_tail(&self.0, 60));
        }
    }
}
