//! Manifests as the API server sees them: reading deploy/'s YAML, server-side
//! apply (or its dry run) of any object, and the dry-run pods of workloads.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Scope, pinned_kind};
use kube::{Api, Client};
use serde::Deserialize as _;
use serde_json::{Value, json};

pub const FIELD_MANAGER: &str = "strait-manifest-test";

pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every *.yaml / *.yml under `dir` (but `observability/`), sorted.
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                // Not Kubernetes objects: a Prometheus configuration and a
                // Grafana dashboard (checked against a real Prometheus by
                // tests/cross_cluster_installed.rs).
                if !path.ends_with("observability") {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

pub fn docs(text: &str, what: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{what}: not YAML: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

/// A strategic-merge patch file (e.g. the transparent-mode DaemonSet patch).
pub fn is_patch(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with("-patch.yaml"))
}

pub fn describe(o: &Value) -> String {
    format!(
        "{} {}/{}",
        o["kind"].as_str().unwrap_or("?"),
        o["metadata"]["namespace"].as_str().unwrap_or("-"),
        o["metadata"]["name"].as_str().unwrap_or("?")
    )
}

pub fn key(o: &Value) -> (String, String, String) {
    let s = |v: &Value| v.as_str().unwrap_or("").to_string();
    (
        s(&o["kind"]),
        s(&o["metadata"]["namespace"]),
        s(&o["metadata"]["name"]),
    )
}

/// The dynamic API for an object's kind (discovered, so CRDs work once established).
pub async fn api_for(client: &Client, o: &Value) -> Result<Api<DynamicObject>, String> {
    let api_version = o["apiVersion"].as_str().ok_or("no apiVersion")?;
    let kind = o["kind"].as_str().ok_or("no kind")?;
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let (resource, caps) = pinned_kind(client, &gvk)
        .await
        .map_err(|e| format!("the API server does not serve {api_version} {kind}: {e}"))?;
    Ok(match caps.scope {
        Scope::Namespaced => {
            let ns = o["metadata"]["namespace"]
                .as_str()
                .ok_or("a namespaced object without metadata.namespace")?;
            Api::namespaced_with(client.clone(), ns, &resource)
        }
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    })
}

/// Server-side apply, for real or as a dry run.
pub async fn apply(client: &Client, o: &Value, dry_run: bool) -> Result<DynamicObject, String> {
    let api = api_for(client, o).await?;
    let name = o["metadata"]["name"].as_str().ok_or("no metadata.name")?;
    let mut params = PatchParams::apply(FIELD_MANAGER).force();
    params.dry_run = dry_run;
    api.patch(name, &params, &Patch::Apply(o))
        .await
        .map_err(|e| e.to_string())
}

/// A Pod from a workload's template, created as a dry run: what admission
/// (Pod Security of the namespace, priority class, ServiceAccount) says of the
/// pods the controller would make. Needs the ServiceAccount to exist.
pub async fn dry_run_pod_of(client: &Client, workload: &Value) -> Result<(), String> {
    let ns = workload["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default");
    let template = &workload["spec"]["template"];
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{}-template-check", workload["metadata"]["name"].as_str().unwrap_or("x")),
                     "namespace": ns, "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
    });
    let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    let pod = serde_json::from_value(pod).map_err(|e| e.to_string())?;
    api.create(
        &PostParams {
            dry_run: true,
            field_manager: Some(FIELD_MANAGER.into()),
        },
        &pod,
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

pub async fn wait_established(client: &Client, crd: &Value) {
    let group = crd["spec"]["group"].as_str().unwrap();
    let kind = crd["spec"]["names"]["kind"].as_str().unwrap();
    let version = crd["spec"]["versions"][0]["name"].as_str().unwrap();
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let deadline = Instant::now() + Duration::from_secs(30);
    while pinned_kind(client, &gvk).await.is_err() {
        assert!(Instant::now() < deadline, "CRD {kind} never established");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Namespaces, CRDs and ServiceAccounts must exist for the rest to dry-run
/// (and for pods to be admitted): those are applied for real, in that order.
pub async fn apply_prerequisites(client: &Client, objects: &[(String, Value)]) -> Vec<String> {
    let mut failures = Vec::new();
    for kind in ["Namespace", "CustomResourceDefinition", "ServiceAccount"] {
        for (file, o) in objects.iter().filter(|(_, o)| o["kind"] == kind) {
            if let Err(e) = apply(client, o, false).await {
                failures.push(format!("{file}: {}: {e}", describe(o)));
            } else if kind == "CustomResourceDefinition" {
                wait_established(client, o).await;
            }
        }
    }
    failures
}

/// Dry-runs every object and the pods of every workload; returns the refusals.
pub async fn dry_run_all(client: &Client, objects: &[(String, Value)]) -> Vec<String> {
    let mut failures = Vec::new();
    for (file, o) in objects {
        match apply(client, o, true).await {
            Err(e) => failures.push(format!("{file}: {}: {e}", describe(o))),
            Ok(_) if o["kind"] == "Deployment" || o["kind"] == "DaemonSet" => {
                if let Err(e) = dry_run_pod_of(client, o).await {
                    failures.push(format!("{file}: a pod of {}: {e}", describe(o)));
                }
            }
            Ok(_) => {}
        }
    }
    failures
}
