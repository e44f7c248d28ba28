//! The controller's heartbeat: a `coordination.k8s.io` Lease
//! (`strait-mirror` in the Links' namespace) renewed every
//! [`RENEW_EVERY`] while the process runs. `strait check` reads it to tell a
//! running controller from a dead one wherever it runs (a Deployment's pod,
//! or a plain process as in testenv), without needing to read Pods.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use strait_mesh::link::MIRROR_HEARTBEAT_LEASE;

/// How often the Lease is renewed.
pub const RENEW_EVERY: Duration = Duration::from_secs(10);
/// The Lease's duration: a renewal older than this means the controller is gone.
pub const LEASE_SECONDS: i32 = 30;

/// Who holds the Lease: the pod name when in a pod, else the host name and pid.
pub fn holder() -> String {
    std::env::var("POD_NAME").unwrap_or_else(|_| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "unknown-host".into());
        format!("{host}/pid-{}", std::process::id())
    })
}

/// Renews the Lease until dropped. A failed renewal is logged and retried at
/// the next tick: the heartbeat must never stop the mirroring itself.
pub async fn run(client: Client, namespace: String) {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let holder = holder();
    let mut warned = false;
    let mut ticker = tokio::time::interval(RENEW_EVERY);
    loop {
        ticker.tick().await;
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": MIRROR_HEARTBEAT_LEASE, "namespace": namespace,
                         "labels": {"app.kubernetes.io/part-of": "strait", "app.kubernetes.io/component": "mirror"}},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now},
        });
        match api
            .patch(
                MIRROR_HEARTBEAT_LEASE,
                &PatchParams::apply("strait-mirror").force(),
                &Patch::Apply(lease),
            )
            .await
        {
            Ok(_) => warned = false,
            Err(e) if !warned => {
                warned = true;
                tracing::warn!(
                    "renewing the heartbeat Lease {namespace}/{MIRROR_HEARTBEAT_LEASE} failed: {e}; `strait check` will report the controller as not running (RBAC: leases get/create/patch in {namespace}, deploy/mirror/rbac.yaml)"
                );
            }
            Err(e) => tracing::debug!("renewing the heartbeat Lease: {e}"),
        }
    }
}
