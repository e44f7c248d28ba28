//! Status: each remote Service's outcome, as the Link's status reports it.

use strait_mesh::link::ServiceMirrorStatus;

use super::diff::Key;

/// Why a remote Service is not mirrored here. Its `Display` says what to do;
/// [`Refusal::reason`] is the status's machine-readable reason.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refusal {
    #[error(
        "a local Service {namespace}/{name} that is not a mirror exists; rename it or exclude the remote Service"
    )]
    NameConflict { namespace: String, name: String },
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
