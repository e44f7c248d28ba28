//! `strait-cni`: a chained CNI plugin that enrolls pods in the node proxy's
//! transparent mode. The container runtime runs it after the pod's network
//! is set up (`ADD`) and when it is torn down (`DEL`); it passes the previous
//! plugin's result through unchanged and tells the node proxy, over its
//! enrollment socket, the pod's name and network namespace. The proxy decides
//! from the pod's `strait.dev/transparent` annotation whether to capture it.
//!
//! Network configuration (in the node's conflist, after the main plugin):
//!
//! ```json
//! {"type": "strait-cni",
//!  "enrollSocket": "/var/run/strait/enroll.sock",
//!  "excludeNamespaces": ["kube-system", "strait-system"]}
//! ```
//!
//! `ADD` fails (the runtime retries the pod) when the proxy cannot be reached:
//! a pod that asked for the mesh must not start outside it. Excluded
//! namespaces (the proxy's own among them) are never sent.
#![forbid(unsafe_code)]

use std::io::Read;
use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{Value, json};
use strait_mesh::names::SYSTEM_NAMESPACE;
use strait_proxy::transparent::{EnrollRequest, enroll};

const SUPPORTED: [&str; 6] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0", "1.2.0"];

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetConf {
    #[serde(default = "default_version")]
    cni_version: String,
    #[serde(default = "default_socket")]
    enroll_socket: PathBuf,
    #[serde(default = "default_excluded")]
    exclude_namespaces: Vec<String>,
    #[serde(default)]
    prev_result: Option<Value>,
}

fn default_version() -> String {
    "1.0.0".into()
}
fn default_socket() -> PathBuf {
    "/var/run/strait/enroll.sock".into()
}
fn default_excluded() -> Vec<String> {
    vec!["kube-system".into(), SYSTEM_NAMESPACE.into()]
}

/// `K8S_POD_NAMESPACE` and `K8S_POD_NAME` from `CNI_ARGS` (`K=V;K=V`).
fn pod_from_args(args: &str) -> Option<(String, String)> {
    let get = |key: &str| {
        args.split(';')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_string())
            .filter(|v| !v.is_empty())
    };
    Some((get("K8S_POD_NAMESPACE")?, get("K8S_POD_NAME")?))
}

/// A CNI error on stdout, and the exit code that goes with it.
fn fail(version: &str, code: u32, msg: &str, details: String) -> std::process::ExitCode {
    println!(
        "{}",
        json!({"cniVersion": version, "code": code, "msg": msg, "details": details})
    );
    std::process::ExitCode::FAILURE
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    let mut stdin = String::new();
    let _ = std::io::stdin().read_to_string(&mut stdin);
    if command == "VERSION" {
        println!(
            "{}",
            json!({"cniVersion": "1.0.0", "supportedVersions": SUPPORTED})
        );
        return std::process::ExitCode::SUCCESS;
    }
    let conf: NetConf = match serde_json::from_str(&stdin) {
        Ok(c) => c,
        // 6: "failed to decode content" in the CNI spec's error codes.
        Err(e) => return fail("1.0.0", 6, "invalid network configuration", e.to_string()),
    };
    let version = conf.cni_version.clone();
    let pod = pod_from_args(&std::env::var("CNI_ARGS").unwrap_or_default());
    let excluded = |ns: &str| conf.exclude_namespaces.iter().any(|e| e == ns);
    match command.as_str() {
        "ADD" => {
            if let Some((namespace, name)) = pod.filter(|(ns, _)| !excluded(ns)) {
                let netns = match std::env::var("CNI_NETNS") {
                    Ok(n) if !n.is_empty() => PathBuf::from(n),
                    // 4: "invalid necessary environment variables".
                    _ => return fail(&version, 4, "CNI_NETNS is not set", String::new()),
                };
                let request = EnrollRequest::Add {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    netns,
                };
                if let Err(e) = enroll(&conf.enroll_socket, &request).await {
                    return fail(
                        &version,
                        999,
                        "the Strait node proxy did not enroll the pod",
                        format!("{namespace}/{name}: {e}"),
                    );
                }
            }
            // A chained plugin passes the previous result on.
            let mut result = conf.prev_result.unwrap_or_else(|| json!({}));
            if let Value::Object(map) = &mut result {
                map.insert("cniVersion".into(), Value::String(version));
            }
            println!("{result}");
            std::process::ExitCode::SUCCESS
        }
        "DEL" => {
            // Best effort and idempotent: the pod is going either way.
            if let Some((namespace, name)) = pod.filter(|(ns, _)| !excluded(ns)) {
                let _ = enroll(
                    &conf.enroll_socket,
                    &EnrollRequest::Remove { namespace, name },
                )
                .await;
            }
            std::process::ExitCode::SUCCESS
        }
        "CHECK" | "GC" | "STATUS" => std::process::ExitCode::SUCCESS,
        // 4: "invalid necessary environment variables".
        other => fail(
            &version,
            4,
            "unknown CNI_COMMAND",
            format!("{other:?}: expected ADD, DEL, CHECK, GC, STATUS or VERSION"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_names_come_from_cni_args() {
        assert_eq!(
            pod_from_args(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_UID=x"
            ),
            Some(("shop".into(), "web-0".into()))
        );
        assert_eq!(pod_from_args("K8S_POD_NAMESPACE=shop"), None);
        assert_eq!(pod_from_args("K8S_POD_NAMESPACE=;K8S_POD_NAME=a"), None);
        assert_eq!(pod_from_args(""), None);
    }
}
