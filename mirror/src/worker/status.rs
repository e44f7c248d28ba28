//! Status: each remote Service's outcome, as the Link's status reports it.

use strait_mesh::link::ServiceMirrorStatus;

use super::diff::Key;

/// Why a remote Service is not mirrored here. Its `Display` says what to do;
/// [`Refusal::reason`] is the status's machine-readable reason.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refusal {
    #[error(
        "the local {kind} {namespace}/{name} is not Strait's mirror of this cluster ({owner}): it is left alone; rename it or exclude the remote Service"
    )]
    NameConflict {
        kind: &'static str,
        namespace: String,
        name: String,
        /// Who it belongs to, as far as its labels and managers tell.
        owner: String,
    },
    #[error("namespace {namespace} does not exist here; create it to receive the mirror")]
    NamespaceMissing { namespace: String },
    #[error("applying {kind} {namespace}/{name}: {source}")]
    Api {
        kind: &'static str,
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

impl Refusal {
    pub fn name_conflict(
        kind: &'static str,
        (namespace, name): &Key,
        existing: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ) -> Self {
        use strait_mesh::names::{CLUSTER_NAME_LABEL, MIRRORED_LABEL};
        let label = |k: &str| existing.labels.as_ref().and_then(|l| l.get(k)).cloned();
        let managers: Vec<String> = existing
            .managed_fields
            .iter()
            .flatten()
            .filter_map(|m| m.manager.clone())
            .collect();
        let mut owner = match (label(MIRRORED_LABEL).as_deref(), label(CLUSTER_NAME_LABEL)) {
            (Some("true"), Some(cluster)) => format!("labelled a mirror of cluster {cluster}"),
            _ => "no strait.dev/mirrored-service=true label".to_string(),
        };
        if !managers.is_empty() {
            owner.push_str(&format!("; written by {}", managers.join(", ")));
        }
        Refusal::NameConflict {
            kind,
            namespace: namespace.clone(),
            name: name.clone(),
            owner,
        }
    }

    pub fn api(kind: &'static str, (namespace, name): &Key, source: kube::Error) -> Self {
        Refusal::Api {
            kind,
            namespace: namespace.clone(),
            name: name.clone(),
            source,
        }
    }

    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::NameConflict { .. } => "NameConflict",
            Refusal::NamespaceMissing { .. } => "NamespaceMissing",
            Refusal::Api { .. } => "ApiError",
        }
    }
}

/// One remote Service's line in the Link's status.
pub(super) fn service_status(
    cluster: &str,
    (namespace, name): Key,
    result: Result<(), Refusal>,
) -> ServiceMirrorStatus {
    match result {
        Ok(()) => ServiceMirrorStatus {
            namespace,
            name,
            mirrored: true,
            reason: String::new(),
            message: String::new(),
        },
        Err(refusal) => {
            tracing::warn!(%cluster, service = %format!("{namespace}/{name}"), "{refusal}");
            ServiceMirrorStatus {
                namespace,
                name,
                mirrored: false,
                reason: refusal.reason().into(),
                message: refusal.to_string(),
            }
        }
    }
}
