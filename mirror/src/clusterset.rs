//! This cluster's place in the clusterset (KEP-2149): its name, published as
//! the ClusterProperty `cluster.clusterset.k8s.io` that `strait link` and the
//! MCS API read.

use std::time::Duration;

use kube::api::PostParams;
use kube::{Api, Client};
use strait_mesh::mcs::{CLUSTER_ID_PROPERTY, ClusterProperty, ClusterPropertySpec};

#[derive(Debug, thiserror::Error)]
pub enum ClusterNameError {
    #[error(
        "this cluster's ClusterProperty {CLUSTER_ID_PROPERTY} says {found:?}, but --cluster-name is {wanted:?}: a cluster has one name in its clusterset; re-run `strait install --cluster-name {found}`, or delete the ClusterProperty if the cluster really was renamed (and re-link it everywhere)"
    )]
    Disagrees { found: String, wanted: String },
}

/// Makes sure the ClusterProperty naming this cluster exists and says `name`;
/// API errors, and a missing ClusterProperty API, are retried with backoff
/// (run it in the background: it returns only once published, or on a
/// contradiction).
pub async fn ensure_cluster_name(client: &Client, name: &str) -> Result<(), ClusterNameError> {
    let api: Api<ClusterProperty> = Api::all(client.clone());
    let mut backoff = Duration::from_millis(500);
    let mut missing_api_logged = false;
    loop {
        let attempt = async {
            match api.get_opt(CLUSTER_ID_PROPERTY).await? {
                Some(p) => Ok(Some(p.spec.value)),
                None => {
                    let property = ClusterProperty::new(
                        CLUSTER_ID_PROPERTY,
                        ClusterPropertySpec {
                            value: name.to_string(),
                        },
                    );
                    api.create(&PostParams::default(), &property).await?;
                    tracing::info!(
                        cluster = name,
                        "published this cluster's name (ClusterProperty {CLUSTER_ID_PROPERTY})"
                    );
                    Ok(None)
                }
            }
        };
        let result: Result<Option<String>, kube::Error> = attempt.await;
        match result {
            Ok(Some(found)) if found != name => {
                return Err(ClusterNameError::Disagrees {
                    found,
                    wanted: name.to_string(),
                });
            }
            Ok(_) => return Ok(()),
            // No ClusterProperty API (yet: a CRD applied with the controller may
            // not be established): said once, retried.
            Err(kube::Error::Api(e)) if e.code == 404 => {
                if !missing_api_logged {
                    tracing::warn!(
                        "no ClusterProperty API (about.k8s.io): this cluster's name is not published until it exists; install the MCS CRDs (deploy/mcs/crds.yaml, part of `strait install`)"
                    );
                    missing_api_logged = true;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
            // Created by someone else between the read and the write: read again.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "cannot publish this cluster's name yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}
