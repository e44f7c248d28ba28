//! What the test world ([`crate::fixture`]) and the demo share about running
//! Strait's components: where the workspace's binaries and `deploy/` files
//! are, the trust domain, what a kubelet would mount for a component
//! ([`write_credentials`]: an API token for its kubeconfig, a projected
//! identity token with audience `strait.dev/identity` bound to its Pod, and
//! the trust anchors), the node proxy's Pod object as the DaemonSet makes it,
//! and reading a component's metrics ([`metric_sum`]). Certificates come from
//! the cluster's `strait-identity` process; nothing here signs one.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use serde_json::json;
use strait_mesh::names::TOKEN_AUDIENCE;

use crate::files::write_private;
use crate::issuer;

/// Lifetime of the identity tokens (a projected token's usual hour); the
/// demo refreshes them at half of it.
pub const IDENTITY_TOKEN_TTL: Duration = Duration::from_secs(3600);
/// Lifetime of the components' API tokens (their kubeconfigs are read once).
const API_TOKEN_TTL: Duration = Duration::from_secs(48 * 3600);

/// The checkout this crate was built from (its `deploy/` manifests are applied).
pub fn repository_root() -> PathBuf {
    let testenv = Path::new(env!("CARGO_MANIFEST_DIR"));
    testenv.parent().unwrap_or(testenv).to_path_buf()
}

/// A file of the repository's `deploy/` (manifests the stack applies).
pub fn deploy_file(relative: &str) -> PathBuf {
    repository_root().join("deploy").join(relative)
}

/// The workspace binaries the stack runs, found in one folder.
#[derive(Clone, Debug)]
pub struct Binaries {
    dir: PathBuf,
}

impl Binaries {
    /// The binaries next to the running executable (`target/<profile>/`, also
    /// from a test's `target/<profile>/deps/`). Fails naming every missing one
    /// and the command that builds them.
    pub fn next_to_this_executable(needed: &[&str]) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("the running executable's path")?;
        let mut dir = exe
            .parent()
            .context("the executable has no folder")?
            .to_path_buf();
        if dir.file_name() == Some(OsStr::new("deps")) {
            dir.pop();
        }
        let missing: Vec<&str> = needed
            .iter()
            .copied()
            .filter(|n| !dir.join(n).exists())
            .collect();
        if !missing.is_empty() {
            bail!(
                "{} not built in {}: run `cargo build --bins` first (scripts/demo.sh does)",
                missing.join(", "),
                dir.display()
            );
        }
        Ok(Self { dir })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The folder holding them (`target/<profile>`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// What the kubelet mounts for a component running as `namespace/sa` in
/// Pod `pod` (`(name, uid)`; `None`: a process outside any pod), written to
/// `dir`: `kubeconfig` (an API token of the ServiceAccount), `token` (the
/// projected identity token, audience `strait.dev/identity`, bound to the
/// Pod) and `ca.crt` (`anchors`).
pub async fn write_credentials(
    cluster: &crate::Cluster,
    dir: &Path,
    namespace: &str,
    sa: &str,
    pod: Option<(&str, &str)>,
    anchors: &str,
) -> anyhow::Result<()> {
    let client = cluster.client();
    let api_token = issuer::request_token(&client, namespace, sa, &[], None, API_TOKEN_TTL).await?;
    let kubeconfig = crate::kubeconfig::with_token(
        cluster.name(),
        &cluster.server_url(),
        cluster.ca_pem(),
        &api_token,
    );
    std::fs::create_dir_all(dir)?;
    write_private(
        &dir.join("kubeconfig"),
        &crate::kubeconfig::to_yaml(&kubeconfig)?,
    )?;
    std::fs::write(dir.join("ca.crt"), anchors)?;
    write_identity_token(&client, &dir.join("token"), namespace, sa, pod).await
}

/// The projected identity token at `path`, replaced atomically (components
/// re-read it on every refresh).
async fn write_identity_token(
    client: &Client,
    path: &Path,
    namespace: &str,
    sa: &str,
    pod: Option<(&str, &str)>,
) -> anyhow::Result<()> {
    let token = issuer::request_token(
        client,
        namespace,
        sa,
        &[TOKEN_AUDIENCE],
        pod,
        IDENTITY_TOKEN_TTL,
    )
    .await?;
    let tmp = path.with_extension("new");
    write_private(&tmp, &token)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Sum of a metric's samples (lines starting with `name`) whose labels
/// contain every one of `having`.
pub fn metric_sum(text: &str, name: &str, having: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| having.iter().all(|h| l.contains(h)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The Pod object of the node proxy on `node` as the DaemonSet (deploy/proxy)
/// would make it: its labels and ports, `strait-proxy-<node>`. The process
/// runs in the node's network namespace, so the Pod says `hostNetwork` (the
/// DaemonSet's pods have their own IP on the node, with hostPorts: the same
/// node either way).
pub fn node_proxy_pod(node: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": format!("strait-proxy-{node}"), "namespace": "strait-system", "labels": {
            "app.kubernetes.io/name": "strait-proxy", "app.kubernetes.io/part-of": "strait"}},
        "spec": {"nodeName": node, "serviceAccountName": "strait-proxy",
                 "hostNetwork": true,
                 "containers": [{"name": "proxy", "image": "strait-proxy", "ports": [
                     {"name": "outbound", "containerPort": 4140, "hostPort": 4140},
                     {"name": "inbound", "containerPort": 4143, "hostPort": 4143},
                     {"name": "admin", "containerPort": 4191}]}]},
    }))
    .expect("a valid Pod")
}

#[cfg(test)]
mod tests {
    use super::metric_sum;

    #[test]
    fn metric_sum_matches_whole_names_and_every_label() {
        let text = "# HELP request_total x\nrequest_total{direction=\"inbound\",src=\"a\"} 2\n\
                    request_total{direction=\"outbound\"} 5\nrequest_total_other{direction=\"inbound\"} 7\n";
        assert_eq!(metric_sum(text, "request_total", &[]), 7.0);
        assert_eq!(
            metric_sum(text, "request_total", &["direction=\"inbound\""]),
            2.0
        );
        assert_eq!(metric_sum(text, "request_total", &["nope"]), 0.0);
    }
}
