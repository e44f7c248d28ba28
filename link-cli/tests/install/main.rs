//! deploy/ and `strait install` / `strait uninstall` against real kube-apiservers:
//! every manifest under deploy/ (walked, so new files are covered) and what
//! `install` renders pass server-side dry-run; the pods of every workload pass
//! admission (Pod Security, priority, ServiceAccount); install output applied
//! for real with the stock kubectl; `strait link` reads the gateway Service it
//! made; uninstall refuses while a Link exists.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};
use strait_testenv::Cluster;

mod manifests;
use manifests::*;

fn strait(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strait"))
        .args(args)
        .output()
        .expect("run strait")
}

fn ok_stdout(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A trust anchor and an issuer for `cluster`, made with the CLI: DIR/anchor/ca.{crt,key}
/// and DIR/<cluster>/{issuer.crt,issuer.key,ca.crt}.
fn make_identity(dir: &Path, cluster: &str) -> PathBuf {
    make_identity_with(dir, cluster, &[])
}

/// As [`make_identity`], with more `strait identity issuer` flags.
fn make_identity_with(dir: &Path, cluster: &str, extra: &[&str]) -> PathBuf {
    let anchor = dir.join("anchor");
    if !anchor.join("ca.crt").exists() {
        ok_stdout(
            strait(&[
                "identity",
                "trust-anchor",
                "--out-dir",
                anchor.to_str().unwrap(),
            ]),
            "trust-anchor",
        );
    }
    let out = dir.join(cluster);
    ok_stdout(
        strait(
            &[
                "identity",
                "issuer",
                "--anchor-cert",
                anchor.join("ca.crt").to_str().unwrap(),
                "--anchor-key",
                anchor.join("ca.key").to_str().unwrap(),
                "--cluster",
                cluster,
                "--out-dir",
                out.to_str().unwrap(),
            ]
            .into_iter()
            .chain(extra.iter().copied())
            .collect::<Vec<_>>(),
        ),
        "issuer",
    );
    out
}

fn kubectl(kc: &Path, args: &[&str], stdin: &str) -> Output {
    strait_testenv::kubectl_output(kc, args, Some(stdin))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_manifest_under_deploy_and_the_install_output_pass_server_side_dry_run() {
    let cluster = Cluster::start("manifests").await.unwrap();
    let client = cluster.client();

    let mut objects = Vec::new();
    let mut patches = Vec::new();
    let files = yaml_files(&deploy_dir());
    for path in &files {
        let file = path
            .strip_prefix(deploy_dir())
            .unwrap()
            .display()
            .to_string();
        for o in docs(&std::fs::read_to_string(path).unwrap(), &file) {
            assert!(
                o.get("kind").is_some() && o.get("apiVersion").is_some(),
                "deploy/{file}: a document without apiVersion/kind: {o}"
            );
            if is_patch(path) {
                patches.push((file.clone(), o));
            } else {
                objects.push((file.clone(), o));
            }
        }
    }
    // An object in several files (a folder's Namespace) must be the same in
    // each: `kubectl apply -f deploy/ -R` keeps whichever comes last.
    for (i, (file, o)) in objects.iter().enumerate() {
        for (other_file, other) in &objects[i + 1..] {
            if key(o) == key(other) && o != other {
                panic!(
                    "{} differs between deploy/{file} and deploy/{other_file}: make the copies equal",
                    describe(o)
                );
            }
        }
    }
    assert!(
        files.len() >= 12 && objects.len() >= 25,
        "walked too little of deploy/: {files:?}"
    );
    let mut failures = apply_prerequisites(&client, &objects).await;
    failures.extend(dry_run_all(&client, &objects).await);

    // The kind scripts' Kubernetes manifests (the sample app), not kind's own configs.
    let kind_dir = deploy_dir().join("../testenv/kind");
    let mut kind_objects = Vec::new();
    for path in yaml_files(&kind_dir) {
        let file = format!(
            "testenv/kind/{}",
            path.file_name().unwrap().to_string_lossy()
        );
        for o in docs(&std::fs::read_to_string(&path).unwrap(), &file) {
            if !o["apiVersion"]
                .as_str()
                .is_some_and(|v| v.starts_with("kind.x-k8s.io/"))
            {
                kind_objects.push((file.clone(), o));
            }
        }
    }
    assert!(!kind_objects.is_empty(), "no manifests in testenv/kind");
    failures.extend(apply_prerequisites(&client, &kind_objects).await);
    failures.extend(dry_run_all(&client, &kind_objects).await);

    // A patch needs its target: apply that for real, then dry-run the patch
    // (strategic merge, as `kubectl patch --patch-file`) and admit its pods.
    let mut patched_objects = Vec::new();
    for (file, patch) in &patches {
        let Some((_, target)) = objects.iter().find(|(_, o)| key(o) == key(patch)) else {
            failures.push(format!(
                "{file}: patches {}, which no manifest defines",
                describe(patch)
            ));
            continue;
        };
        if let Err(e) = apply(&client, target, false).await {
            failures.push(format!("{file}: its target {}: {e}", describe(target)));
            continue;
        }
        let api = api_for(&client, patch).await.unwrap();
        let name = patch["metadata"]["name"].as_str().unwrap();
        let params = PatchParams {
            dry_run: true,
            ..Default::default()
        };
        match api.patch(name, &params, &Patch::Strategic(patch)).await {
            Err(e) => failures.push(format!("{file}: patch of {}: {e}", describe(patch))),
            Ok(patched) => {
                let patched = serde_json::to_value(patched).unwrap();
                patched_objects.push(patched.clone());
                if let Err(e) = dry_run_pod_of(&client, &patched).await {
                    failures.push(format!(
                        "{file}: a pod of the patched {}: {e}",
                        describe(patch)
                    ));
                }
            }
        }
    }

    // What `strait install` renders, with both gateway Service types.
    let dir = tempfile::tempdir().unwrap();
    let identity = make_identity(dir.path(), "manifests");
    for service_type in ["LoadBalancer", "NodePort"] {
        let out = ok_stdout(
            strait(&[
                "install",
                "--identity-dir",
                identity.to_str().unwrap(),
                "--gateway-service-type",
                service_type,
                "--registry",
                "registry.example:5000/strait",
                "--tag",
                "v-test",
            ]),
            "strait install",
        );
        let rendered: Vec<(String, Value)> = docs(&out, "install output")
            .into_iter()
            .map(|o| (format!("strait install ({service_type})"), o))
            .collect();
        // install covers deploy/: every object there (patches aside) is in its output.
        for (file, o) in &objects {
            if !rendered.iter().any(|(_, r)| key(r) == key(o)) {
                failures.push(format!(
                    "strait install does not render {} of deploy/{file}: add the file to MANIFESTS in link-cli/src/install.rs",
                    describe(o)
                ));
            }
        }
        failures.extend(apply_prerequisites(&client, &rendered).await);
        failures.extend(dry_run_all(&client, &rendered).await);
    }

    // `--transparent` renders the DaemonSet as the API server merges the
    // transparent patch into it (what a user gets with `kubectl patch`).
    let out = ok_stdout(
        strait(&[
            "install",
            "--identity-dir",
            identity.to_str().unwrap(),
            "--transparent",
        ]),
        "strait install --transparent",
    );
    let rendered: Vec<(String, Value)> = docs(&out, "install --transparent output")
        .into_iter()
        .map(|o| ("strait install --transparent".to_string(), o))
        .collect();
    failures.extend(apply_prerequisites(&client, &rendered).await);
    failures.extend(dry_run_all(&client, &rendered).await);
    let ds = rendered
        .iter()
        .map(|(_, o)| o)
        .find(|o| o["kind"] == "DaemonSet")
        .expect("a DaemonSet");
    let merged = serde_json::to_value(apply(&client, ds, true).await.unwrap()).unwrap();
    let by_api = patched_objects
        .iter()
        .find(|o| o["kind"] == "DaemonSet")
        .expect("the transparent patch was applied above");
    // Strategic merge puts a patch's new list items first, ours last: the
    // same items in another order are the same pod.
    fn by_name(v: &Value) -> Value {
        match v {
            Value::Array(items) => {
                let mut items: Vec<Value> = items.iter().map(by_name).collect();
                items.sort_by_key(|i| i["name"].as_str().unwrap_or("").to_string());
                Value::Array(items)
            }
            Value::Object(map) => map.iter().map(|(k, v)| (k.clone(), by_name(v))).collect(),
            other => other.clone(),
        }
    }
    let pod = |o: &Value| by_name(&o["spec"]["template"]["spec"]);
    let (ours, theirs) = (pod(&merged), pod(by_api));
    for field in ["volumes", "hostNetwork", "securityContext"] {
        assert_eq!(ours[field], theirs[field], "--transparent: pod {field}");
    }
    for field in ["env", "volumeMounts", "securityContext", "ports"] {
        assert_eq!(
            ours["containers"][0][field], theirs["containers"][0][field],
            "--transparent: container {field}"
        );
    }
    assert!(
        ours["containers"][0]["env"]
            .to_string()
            .contains("STRAIT_CNI_CONF_DIR"),
        "{ours}"
    );

    assert!(
        failures.is_empty(),
        "the API server refused {} manifest(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_applied_with_kubectl_then_link_reads_the_gateway_and_uninstall_refuses_while_links_exist()
 {
    let east = Cluster::start("east").await.unwrap();
    let client = east.client();
    let kc = east.kubeconfig_path();
    let kc_s = kc.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let identity = make_identity(dir.path(), "east");

    let manifests = ok_stdout(
        strait(&[
            "install",
            "--identity-dir",
            identity.to_str().unwrap(),
            "--gateway-service-type",
            "NodePort",
            "--gateway-node-port",
            "31443",
            "--tag",
            "dev",
        ]),
        "strait install",
    );
    let applied = kubectl(&kc, &["apply", "-f", "-"], &manifests);
    assert!(
        applied.status.success(),
        "kubectl apply of the install output: {}",
        String::from_utf8_lossy(&applied.stderr)
    );

    // The identity landed where the components read it.
    let secret = Api::<Secret>::namespaced(client.clone(), "strait-system")
        .get("strait-identity-issuer")
        .await
        .unwrap();
    let data = secret.data.unwrap();
    let file = |n: &str| std::fs::read(identity.join(n)).unwrap();
    assert_eq!(data["tls.crt"].0, file("issuer.crt"));
    assert_eq!(data["tls.key"].0, file("issuer.key"));
    assert_eq!(data["ca.crt"].0, file("ca.crt"));
    for ns in ["strait-system", "strait-multicluster"] {
        let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
            .get("strait-trust-anchors")
            .await
            .unwrap();
        assert_eq!(
            cm.data.unwrap()["ca.crt"].as_bytes(),
            file("ca.crt"),
            "trust anchors in {ns}"
        );
    }
    let gateway: Value = serde_json::to_value(
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), "strait-system")
            .get("strait-gateway")
            .await
            .unwrap(),
    )
    .unwrap();
    let container = &gateway["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], "ghcr.io/strait-dev/strait-gateway:dev");
    assert!(
        container["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--cluster-name=east")),
        "{container}"
    );
    let svc = Api::<Service>::namespaced(client.clone(), "strait-system")
        .get("strait-gateway")
        .await
        .unwrap();
    let spec = svc.spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("NodePort"));
    // Only the tunnel port crosses clusters (the admin port stays in-cluster).
    let node_ports: Vec<_> = spec
        .ports
        .unwrap()
        .into_iter()
        .map(|p| (p.protocol.unwrap_or_default(), p.node_port))
        .collect();
    assert_eq!(
        node_ports,
        [
            ("UDP".to_string(), Some(31443)),
            ("TCP".to_string(), Some(31443))
        ]
    );

    // `strait link` against this cluster takes the gateway from that Service.
    strait_testenv::workloads::create_node(&client, "node-1", "10.9.0.7".parse().unwrap())
        .await
        .unwrap();
    let link_out = ok_stdout(
        strait(&[
            "link",
            "--kubeconfig",
            kc_s,
            "--cluster-name",
            "east",
            "-o",
            "json",
        ]),
        "strait link",
    );
    let list: Value = serde_json::from_str(&link_out).unwrap();
    let link = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["kind"] == "Link")
        .unwrap()
        .clone();
    let spec = &link["spec"];
    assert_eq!(spec["gatewayAddresses"], json!(["10.9.0.7"]));
    assert_eq!(spec["gatewayPort"], 31443);
    assert_eq!(
        spec["gatewayIdentity"],
        "spiffe://east.clusterset.local/ns/strait-system/sa/strait-gateway",
        "the gateway's identity is in the trust domain its issuer is constrained to"
    );
    assert_eq!(spec["probe"]["period"], "3s");
    assert_eq!(spec["probe"]["timeout"], "2s");
    assert_eq!(spec["probe"]["failureThreshold"], 3);
    assert!(spec["probe"].get("port").is_none(), "{spec}");

    // A Link exists (applied here, as if another cluster were linked): uninstall refuses.
    let applied = kubectl(&kc, &["apply", "-f", "-"], &link_out);
    assert!(
        applied.status.success(),
        "{}",
        String::from_utf8_lossy(&applied.stderr)
    );
    let refused = strait(&["uninstall", "--kubeconfig", kc_s]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "uninstall went ahead: {stderr}");
    assert!(
        stderr.contains("strait-multicluster/east (cluster east)") && refused.stdout.is_empty(),
        "{stderr}"
    );

    // Without Links: the objects to delete, by name only (no keys, no certificates).
    let deleted = kubectl(
        &kc,
        &["-n", "strait-multicluster", "delete", "link", "east"],
        "",
    );
    assert!(deleted.status.success());
    let out = strait(&["uninstall", "--kubeconfig", kc_s]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let listing = ok_stdout(out, "strait uninstall");
    assert!(
        !listing
            .lines()
            .any(|l| l.starts_with("data:") || l.contains("BEGIN") || l.contains("tls.key")),
        "{listing}"
    );
    assert!(
        stderr.contains("other clusters link to this one as east"),
        "{stderr}"
    );
    let listed = docs(&listing, "uninstall output");
    let rendered = docs(&manifests, "install output");
    // The MCS API is shared with users' exports and other implementations: kept.
    let is_mcs_crd = |o: &Value| {
        o["kind"] == "CustomResourceDefinition"
            && o["metadata"]["name"].as_str().is_some_and(|n| {
                n.ends_with(".multicluster.x-k8s.io") || n.ends_with(".about.k8s.io")
            })
    };
    assert_eq!(rendered.iter().filter(|o| is_mcs_crd(o)).count(), 3);
    for o in &rendered {
        assert_eq!(
            listed.iter().any(|l| key(l) == key(o)),
            !is_mcs_crd(o),
            "uninstall must list {} unless it is an MCS CRD",
            describe(o)
        );
    }
    assert!(stderr.contains("Multi-Cluster Services CRDs"), "{stderr}");
    for extra in [
        "ClusterRole//strait-link-reader",
        "ClusterRoleBinding//strait-link-east",
    ] {
        assert!(
            listed.iter().any(|l| {
                let (k, ns, n) = key(l);
                format!("{k}/{ns}/{n}") == extra
            }),
            "uninstall does not list {extra}"
        );
    }
    let last = listed.last().unwrap();
    assert_eq!(last["kind"], "Namespace", "namespaces go last");

    let deleted = kubectl(&kc, &["delete", "--wait=false", "-f", "-"], &listing);
    assert!(
        deleted.status.success(),
        "kubectl delete of the uninstall output: {}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ns = Api::<Namespace>::all(client.clone())
            .get_opt("strait-system")
            .await
            .unwrap();
        let crd = Api::<CustomResourceDefinition>::all(client.clone())
            .get_opt("links.multicluster.strait.dev")
            .await
            .unwrap();
        if ns.is_none() && crd.is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still there after uninstall: namespace {} CRD {}",
            ns.is_some(),
            crd.is_some()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Writes an issuer for `cluster` signed by the anchor in `anchor_dir`, valid
/// only in the past (rcgen directly: the CLI refuses to make one).
fn write_expired_issuer(anchor_dir: &Path, out: &Path, cluster: &str) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let anchor_key =
        KeyPair::from_pem(&std::fs::read_to_string(anchor_dir.join("ca.key")).unwrap()).unwrap();
    let anchor_pem = std::fs::read_to_string(anchor_dir.join("ca.crt")).unwrap();
    let anchor = rcgen::Issuer::from_ca_cert_pem(&anchor_pem, anchor_key).unwrap();
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("strait issuer {cluster}"));
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(10);
    params.not_after = now - time::Duration::days(1);
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &anchor).unwrap();
    std::fs::create_dir_all(out).unwrap();
    std::fs::write(out.join("issuer.crt"), cert.pem()).unwrap();
    std::fs::write(out.join("issuer.key"), key.serialize_pem()).unwrap();
    std::fs::copy(anchor_dir.join("ca.crt"), out.join("ca.crt")).unwrap();
}

fn install_error(args: &[&str]) -> String {
    let mut all = vec!["install"];
    all.extend_from_slice(args);
    let out = strait(&all);
    assert!(
        !out.status.success(),
        "strait {all:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(out.stdout.is_empty(), "printed manifests despite the error");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn install_refuses_a_missing_or_mismatched_identity_saying_what_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let east = make_identity(dir.path(), "east");
    let s = |p: &Path| p.to_str().unwrap().to_string();

    let err = install_error(&[]);
    assert!(err.contains("--identity-dir"), "{err}");

    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = install_error(&["--identity-dir", &s(&empty)]);
    assert!(
        err.contains("issuer.crt") && err.contains("--issuer-cert"),
        "{err}"
    );

    // An issuer under another anchor than the bundle given.
    let other = tempfile::tempdir().unwrap();
    let other_east = make_identity(other.path(), "east");
    let err = install_error(&[
        "--identity-dir",
        &s(&east),
        "--trust-anchors",
        &s(&other_east.join("ca.crt")),
    ]);
    assert!(
        err.contains("not signed by any certificate in the trust-anchor bundle"),
        "{err}"
    );

    // A key that is not the issuer's.
    let err = install_error(&[
        "--identity-dir",
        &s(&east),
        "--issuer-key",
        &s(&other_east.join("issuer.key")),
    ]);
    assert!(err.contains("private key does not belong"), "{err}");

    // The issuer of another cluster.
    let err = install_error(&["--identity-dir", &s(&east), "--cluster-name", "west"]);
    assert!(
        err.contains("made for cluster \"east\", not \"west\"") && err.contains("--cluster west"),
        "{err}"
    );

    // An expired issuer.
    let expired = dir.path().join("expired");
    write_expired_issuer(&dir.path().join("anchor"), &expired, "east");
    let err = install_error(&["--identity-dir", &s(&expired)]);
    assert!(
        err.contains("expired at") && err.contains("strait identity issuer"),
        "{err}"
    );

    // A cluster name that cannot be part of object names (with a trust
    // domain of its own: the default, East_1.clusterset.local, is no name).
    let bad = make_identity_with(dir.path(), "East_1", &["--trust-domain", "east1.example"]);
    let err = install_error(&["--identity-dir", &s(&bad)]);
    assert!(err.contains("not a DNS label"), "{err}");

    // A trust domain the issuer is not constrained to.
    let err = install_error(&[
        "--identity-dir",
        &s(&east),
        "--trust-domain",
        "west.clusterset.local",
    ]);
    assert!(
        err.contains("may only certify trust domain \"east.clusterset.local\""),
        "{err}"
    );

    // And the good one renders, named after the issuer's cluster, in the
    // trust domain its issuer is constrained to.
    let out = ok_stdout(
        strait(&["install", "--identity-dir", &s(&east)]),
        "strait install",
    );
    assert!(out.contains("--cluster-name=east"), "{out}");
    assert!(
        out.contains("--trust-domain=east.clusterset.local"),
        "{out}"
    );
}

/// `strait identity rotate` against a real API server with the install output
/// applied: each step of a rotation lands in both ConfigMaps and the issuer
/// Secret; steps that would break mTLS are refused and write nothing. (The live
/// effect on running components: `cross_cluster_installed`, and
/// `proxy/tests/rotation.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_rotate_moves_a_cluster_one_safe_step_at_a_time() {
    let east = Cluster::start("rotate").await.unwrap();
    let client = east.client();
    let kc = east.kubeconfig_path();
    let dir = tempfile::tempdir().unwrap();
    let identity = make_identity(dir.path(), "east");
    let manifests = ok_stdout(
        strait(&["install", "--identity-dir", identity.to_str().unwrap()]),
        "strait install",
    );
    let applied = kubectl(&kc, &["apply", "-f", "-"], &manifests);
    assert!(
        applied.status.success(),
        "{}",
        String::from_utf8_lossy(&applied.stderr)
    );

    // A second anchor, and east's issuer re-issued under it.
    let new_anchor = dir.path().join("new-anchor");
    ok_stdout(
        strait(&[
            "identity",
            "trust-anchor",
            "--out-dir",
            new_anchor.to_str().unwrap(),
        ]),
        "new anchor",
    );
    let new_issuer = dir.path().join("east-new");
    let new_bundle = std::fs::read_to_string(new_anchor.join("ca.crt")).unwrap();
    let old_bundle = std::fs::read_to_string(dir.path().join("anchor/ca.crt")).unwrap();
    let write_bundle = |name: &str, pems: &[&str]| {
        let path = dir.path().join(name);
        std::fs::write(&path, pems.concat()).unwrap();
        path.to_str().unwrap().to_string()
    };
    ok_stdout(
        strait(&[
            "identity",
            "issuer",
            "--anchor-cert",
            new_anchor.join("ca.crt").to_str().unwrap(),
            "--anchor-key",
            new_anchor.join("ca.key").to_str().unwrap(),
            "--cluster",
            "east",
            "--out-dir",
            new_issuer.to_str().unwrap(),
        ]),
        "issuer under the new anchor",
    );
    let old_new = write_bundle("old-new.pem", &[&old_bundle, &new_bundle]);
    let new_old = write_bundle("new-old.pem", &[&new_bundle, &old_bundle]);
    let new_only = write_bundle("new.pem", &[&new_bundle]);
    let kc_s = kc.to_str().unwrap();
    let rotate = |bundle: &str, extra: &[&str]| {
        let mut args = vec![
            "identity",
            "rotate",
            "--kubeconfig",
            kc_s,
            "--trust-anchors",
            bundle,
        ];
        args.extend_from_slice(extra);
        strait(&args)
    };
    let refused = |out: Output, what: &str| {
        assert!(!out.status.success(), "{what}: accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let state = || async {
        let mut bundles = Vec::new();
        for ns in ["strait-system", "strait-multicluster"] {
            let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
                .get("strait-trust-anchors")
                .await
                .unwrap();
            bundles.push(cm.data.unwrap()["ca.crt"].clone());
        }
        let secret = Api::<Secret>::namespaced(client.clone(), "strait-system")
            .get("strait-identity-issuer")
            .await
            .unwrap()
            .data
            .unwrap();
        let text = |k: &str| String::from_utf8(secret[k].0.clone()).unwrap();
        assert_eq!(bundles[0], bundles[1], "both ConfigMaps carry one bundle");
        assert_eq!(
            bundles[0],
            text("ca.crt"),
            "the issuer's ca.crt is the bundle"
        );
        (bundles.remove(0), text("tls.crt"), text("tls.key"))
    };
    let issuer_file = |d: &Path, n: &str| std::fs::read_to_string(d.join(n)).unwrap();
    let installed = state().await;
    assert_eq!(installed.0, old_bundle);

    // Out of order: refused, and nothing written.
    let e = refused(rotate(&new_only, &[]), "an issuer outside the bundle");
    assert!(e.contains("chains to no anchor"), "{e}");
    let e = refused(
        rotate(&new_old, &["--issuer-dir", new_issuer.to_str().unwrap()]),
        "an issuer under an anchor the cluster does not trust yet",
    );
    assert!(e.contains("does not trust yet"), "{e}");
    let e = refused(
        rotate(&new_old, &[]),
        "the old issuer under a non-active anchor",
    );
    assert!(e.contains("not by the active (first) one"), "{e}");
    let dry = ok_stdout(rotate(&old_new, &["--dry-run"]), "dry run");
    assert!(dry.contains("nothing written"), "{dry}");
    assert_eq!(
        state().await,
        installed,
        "refusals and the dry run wrote nothing"
    );

    // 1. old+new: the bundle everywhere, the issuer untouched.
    let out = ok_stdout(rotate(&old_new, &[]), "step 1");
    assert!(out.contains("next:"), "{out}");
    let after1 = state().await;
    assert_eq!(after1.0, std::fs::read_to_string(&old_new).unwrap());
    assert_eq!((&after1.1, &after1.2), (&installed.1, &installed.2));
    // 2. new+old with the re-issued issuer.
    ok_stdout(
        rotate(&new_old, &["--issuer-dir", new_issuer.to_str().unwrap()]),
        "step 2",
    );
    let after2 = state().await;
    assert_eq!(after2.0, std::fs::read_to_string(&new_old).unwrap());
    assert_eq!(after2.1, issuer_file(&new_issuer, "issuer.crt"));
    assert_eq!(after2.2, issuer_file(&new_issuer, "issuer.key"));
    // 3. new alone.
    let out = ok_stdout(rotate(&new_only, &[]), "step 3");
    assert!(out.contains("finished"), "{out}");
    assert_eq!(state().await.0, new_bundle);
    // The issuer in the cluster verifies under what the cluster now trusts.
    let verify = dir.path().join("verify");
    std::fs::create_dir_all(&verify).unwrap();
    let final_state = state().await;
    std::fs::write(verify.join("issuer.crt"), &final_state.1).unwrap();
    std::fs::write(verify.join("issuer.key"), &final_state.2).unwrap();
    std::fs::write(verify.join("ca.crt"), &final_state.0).unwrap();
    let s = |n: &str| verify.join(n).to_str().unwrap().to_string();
    ok_stdout(
        strait(&[
            "identity",
            "verify",
            "--issuer-cert",
            &s("issuer.crt"),
            "--issuer-key",
            &s("issuer.key"),
            "--trust-anchors",
            &s("ca.crt"),
        ]),
        "the rotated issuer verifies",
    );
}

fn err_of(out: Output) -> String {
    assert!(!out.status.success(), "expected a refusal: {out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The MCS API comes with `strait install`: `strait export --clusterset`
/// makes the ServiceExport (refusing what the API cannot export), an export
/// without spec (as upstream writes them) is accepted, and `strait link` takes
/// the target's name from its ClusterProperty and refuses a contradicting one.
#[tokio::test(flavor = "multi_thread")]
async fn mcs_api_comes_with_install_and_strait_export_clusterset_writes_service_exports() {
    let cluster = Cluster::start("mcs").await.unwrap();
    let client = cluster.client();
    let kc = cluster.kubeconfig_path();
    let kc_s = kc.to_str().unwrap();
    let export = |verb: &str, svc: &str| {
        strait(&[
            verb,
            "--clusterset",
            svc,
            "-n",
            "shop",
            "--kubeconfig",
            kc_s,
        ])
    };
    assert!(
        kubectl(&kc, &["create", "namespace", "shop"], "")
            .status
            .success()
    );
    let services = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {ports: [{name: http, port: 80}], selector: {app: web}}
---
apiVersion: v1
kind: Service
metadata: {name: ext, namespace: shop}
spec: {type: ExternalName, externalName: example.com}
"#;
    assert!(
        kubectl(&kc, &["apply", "-f", "-"], services)
            .status
            .success()
    );

    // Before the CRDs: the error says how to get them.
    let e = err_of(export("export", "svc/web"));
    assert!(
        e.contains("does not serve ServiceExports") && e.contains("strait install"),
        "{e}"
    );

    let dir = tempfile::tempdir().unwrap();
    let identity = make_identity(dir.path(), "east");
    let manifests = ok_stdout(
        strait(&["install", "--identity-dir", identity.to_str().unwrap()]),
        "strait install",
    );
    let applied = kubectl(&kc, &["apply", "-f", "-"], &manifests);
    assert!(
        applied.status.success(),
        "{}",
        String::from_utf8_lossy(&applied.stderr)
    );
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in [
        "serviceexports.multicluster.x-k8s.io",
        "serviceimports.multicluster.x-k8s.io",
        "clusterproperties.about.k8s.io",
    ] {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let crd = crds.get(name).await.unwrap();
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                break;
            }
            assert!(Instant::now() < deadline, "{name} not established");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let out = ok_stdout(export("export", "svc/web"), "strait export --clusterset");
    assert!(out.contains("web.shop.svc.clusterset.local"), "{out}");
    let got = kubectl(
        &kc,
        &["get", "svcex", "web", "-n", "shop", "-o", "json"],
        "",
    );
    let got: Value = serde_json::from_slice(&got.stdout).unwrap();
    assert_eq!(got["apiVersion"], "multicluster.x-k8s.io/v1beta1");
    let again = ok_stdout(export("export", "svc/web"), "export again");
    assert!(again.contains("already exported"), "{again}");
    let e = err_of(export("export", "svc/ext"));
    assert!(e.contains("ExternalName"), "{e}");
    let e = err_of(export("export", "svc/nope"));
    assert!(e.contains("no Service shop/nope"), "{e}");

    // Upstream's exports have no spec; labels and annotations to export are optional.
    let bare = "apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceExport\nmetadata: {name: bare, namespace: shop}\n";
    let applied = kubectl(&kc, &["apply", "-f", "-"], bare);
    assert!(
        applied.status.success(),
        "{}",
        String::from_utf8_lossy(&applied.stderr)
    );
    let exports: Api<strait_mesh::mcs::ServiceExport> = Api::namespaced(client.clone(), "shop");
    assert_eq!(
        exports.get("bare").await.unwrap().spec.spec,
        Default::default()
    );

    let out = ok_stdout(
        export("unexport", "svc/web"),
        "strait unexport --clusterset",
    );
    assert!(out.contains("no longer exported"), "{out}");
    assert!(exports.get_opt("web").await.unwrap().is_none());
    let out = ok_stdout(export("unexport", "svc/web"), "unexport again");
    assert!(out.contains("was not exported"), "{out}");

    // `strait link` reads the target's name (what the mirror controller publishes).
    strait_testenv::workloads::create_node(&client, "node-1", "10.9.0.8".parse().unwrap())
        .await
        .unwrap();
    let property = "apiVersion: about.k8s.io/v1alpha1\nkind: ClusterProperty\nmetadata: {name: cluster.clusterset.k8s.io}\nspec: {value: east}\n";
    assert!(
        kubectl(&kc, &["apply", "-f", "-"], property)
            .status
            .success()
    );
    let linked = ok_stdout(
        strait(&["link", "--kubeconfig", kc_s, "-o", "json"]),
        "strait link without --cluster-name",
    );
    let list: Value = serde_json::from_str(&linked).unwrap();
    let link = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["kind"] == "Link")
        .unwrap();
    assert_eq!(link["spec"]["targetClusterName"], "east");
    let e = err_of(strait(&[
        "link",
        "--kubeconfig",
        kc_s,
        "--cluster-name",
        "west",
    ]));
    assert!(
        e.contains("calls itself \"east\"") && e.contains("--cluster-name east"),
        "{e}"
    );
}
