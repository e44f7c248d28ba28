//! Real Kubernetes clusters for Strait's tests, without Docker.
//!
//! Each [`Cluster`] is etcd, kube-apiserver and kube-controller-manager built
//! from Go modules (see `testenv/controlplane/`) and run as separate processes
//! on free ports, with RBAC on and a service-account issuer, so TokenRequest and
//! TokenReview behave as in production. Pods need no kubelet: [`workloads`]
//! marks them Running/Ready through the status subresource and the real
//! EndpointSlice controller publishes them. With [`ClusterTopology`] nodes and
//! pods are also real network namespaces ([`net`]) running real processes, and
//! a [`Wan`] joins cluster LANs through their exposed gateways only.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let east = strait_testenv::Cluster::start("east").await?;
//! let west = strait_testenv::Cluster::start("west").await?;
//! let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(east.client());
//! # Ok(()) }
//! ```

pub mod apimetrics;
pub mod cluster;
pub mod conformance;
pub mod controlplane;
pub mod demo;
pub mod dns;
pub mod files;
pub mod fixture;
pub mod http;
pub mod images;
pub mod installed;
pub mod issuer;
pub mod kube_proxy;
pub mod kubeconfig;
pub mod net;
pub mod pki;
pub mod process;
pub mod prometheus;
pub mod realnode;
pub mod stack;
pub mod topology;
pub mod wait;
pub mod wan;
pub mod workloads;

pub use cluster::{Cluster, ClusterConfig, ClusterError};
pub use http::http_get;
pub use net::{ClusterNetwork, NetNode, NetPod};
pub use topology::ClusterTopology;
pub use wan::Wan;

/// A binary of this workspace built next to the running test executable
/// (`cargo test --workspace` builds every one first), or from the folder
/// [`BIN_DIR_ENV`] names when it holds one of that name. Panics with the
/// command that builds it when it is missing.
pub fn workspace_binary(name: &str) -> std::path::PathBuf {
    find_workspace_binary(name).unwrap_or_else(|e| panic!("{e}"))
}

/// A folder whose binaries replace the workspace's own of the same name
/// (the others still come from the build): how `scripts/pgo.sh` runs the
/// benchmarks with instrumented builds of the proxy and gateway.
pub const BIN_DIR_ENV: &str = "STRAIT_BIN_DIR";

/// As [`workspace_binary`], with an error saying how to build it.
pub fn find_workspace_binary(name: &str) -> Result<std::path::PathBuf, String> {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV) {
        let path = std::path::Path::new(&dir).join(name);
        if path.exists() {
            return Ok(path);
        }
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test executable lives in target/<profile>/deps");
    let path = dir.join(name);
    if !path.exists() {
        return Err(format!(
            "{} is not built: run `cargo build --bin {name}` (or the whole workspace's tests)",
            path.display()
        ));
    }
    Ok(path)
}

/// Runs the stock kubectl (what a user runs) with `kubeconfig`, writing
/// `stdin` to it; returns its output whatever its exit status.
pub fn kubectl_output(
    kubeconfig: &std::path::Path,
    args: &[&str],
    stdin: Option<&str>,
) -> std::process::Output {
    use std::io::Write as _;
    use std::process::Stdio;
    let mut child = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl (it ships with machines of this kind)");
    let mut pipe = child.stdin.take().expect("stdin is piped");
    if let Some(input) = stdin {
        pipe.write_all(input.as_bytes())
            .expect("write kubectl's standard input");
    }
    drop(pipe);
    child.wait_with_output().expect("wait for kubectl")
}

/// [`kubectl_output`] that panics with kubectl's error unless it succeeded;
/// returns its standard output.
pub fn kubectl(kubeconfig: &std::path::Path, args: &[&str], stdin: Option<&str>) -> String {
    let out = kubectl_output(kubeconfig, args, stdin);
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `kubectl apply -f <file>` against `cluster`; panics with kubectl's error.
pub fn kubectl_apply(cluster: &Cluster, file: &str) {
    kubectl(&cluster.kubeconfig_path(), &["apply", "-f", file], None);
}

/// One kubeconfig with contexts `east` and `west` (in a new temporary
/// folder, returned with it), and the committed Link CRD
/// (`deploy/mirror/crd.yaml`) installed in east with the stock kubectl.
pub fn kubeconfig_with_link_crd(
    east: &Cluster,
    west: &Cluster,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let kc = dir.path().join("kubeconfig");
    let merged = kubeconfig::merge([east.kubeconfig().clone(), west.kubeconfig().clone()]);
    std::fs::write(
        &kc,
        kubeconfig::to_yaml(&merged).expect("kubeconfig as YAML"),
    )
    .expect("write the kubeconfig");
    let crd = stack::deploy_file("mirror/crd.yaml");
    kubectl(
        &kc,
        &["--context", "east", "apply", "-f", &crd.to_string_lossy()],
        None,
    );
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
    (dir, kc)
}
