//! Link status: conditions (CredentialsValid, RemoteReachable, GatewayAlive),
//! per-service mirror state, and Events. Written only when something changed.

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Resource};
use serde_json::json;
use strait_mesh::link::{GatewayLatency, Link, LinkStatus, ServiceMirrorStatus};
use tokio::sync::Mutex;

use crate::metrics::{ErrorLabels, LinkLabels, MirrorMetrics};

/// One condition's wanted state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkHealth {
    pub condition: &'static str,
    /// "True", "False" or "Unknown".
    pub status: &'static str,
    pub reason: String,
    pub message: String,
}

impl LinkHealth {
    pub fn credentials_ok() -> Self {
        Self {
            condition: "CredentialsValid",
            status: "True",
            reason: "Loaded".into(),
            message: "credentials Secret loaded".into(),
        }
    }
    pub fn credentials_invalid(reason: &str, message: &str) -> Self {
        Self {
            condition: "CredentialsValid",
            status: "False",
            reason: reason.into(),
            message: message.into(),
        }
    }
    pub fn remote_ok() -> Self {
        Self {
            condition: "RemoteReachable",
            status: "True",
            reason: "Watching".into(),
            message: "watching the remote API server".into(),
        }
    }
    pub fn remote_unreachable(message: &str) -> Self {
        Self {
            condition: "RemoteReachable",
            status: "False",
            reason: "RemoteUnreachable".into(),
            message: format!("{message}; mirrors are kept as they were, retrying"),
        }
    }
    pub fn gateway_alive(message: &str) -> Self {
        Self {
            condition: "GatewayAlive",
            status: "True",
            reason: "ProbeSucceeded".into(),
            message: message.into(),
        }
    }
    pub fn gateway_down(reason: &str, message: &str) -> Self {
        Self {
            condition: "GatewayAlive",
            status: "False",
            reason: reason.into(),
            message: message.into(),
        }
    }
    pub fn gateway_unknown(reason: &str, message: &str) -> Self {
        Self {
            condition: "GatewayAlive",
            status: "Unknown",
            reason: reason.into(),
            message: message.into(),
        }
    }
    pub fn clusterset_member() -> Self {
        Self {
            condition: "ClustersetMember",
            status: "True",
            reason: "Joined".into(),
            message:
                "the linked cluster's ServiceExports are part of this cluster's ServiceImports"
                    .into(),
        }
    }
    pub fn clusterset_refused(reason: &str, message: &str) -> Self {
        Self {
            condition: "ClustersetMember",
            status: "False",
            reason: reason.into(),
            message: message.into(),
        }
    }
    /// This Link mirrors its cluster (no older Link claims the same name).
    pub fn accepted() -> Self {
        Self {
            condition: "Accepted",
            status: "True",
            reason: "Accepted".into(),
            message: "this Link mirrors its cluster".into(),
        }
    }
    /// An older Link claims the same cluster name: this one mirrors nothing.
    pub fn duplicate_cluster_name(cluster: &str, older: &str) -> Self {
        Self {
            condition: "Accepted",
            status: "False",
            reason: "DuplicateClusterName".into(),
            message: format!(
                "the Link {older} already mirrors cluster {cluster:?} (it is older): this Link is refused and mirrors nothing; delete one of them or give this one another targetClusterName (it takes over within seconds of {older} being deleted)"
            ),
        }
    }
    fn ok(&self) -> bool {
        self.status == "True"
    }
}

struct State {
    conditions: Vec<Condition>,
    services: Vec<ServiceMirrorStatus>,
    gateway_latency: Option<GatewayLatency>,
    last_written: Option<LinkStatus>,
}

/// Reports one Link's status and metrics. Cheap to clone.
#[derive(Clone)]
pub struct StatusReporter {
    metrics: MirrorMetrics,
    api: Api<Link>,
    link: Arc<Link>,
    recorder: Recorder,
    state: Arc<Mutex<State>>,
}

impl StatusReporter {
    pub fn new(
        api: Api<Link>,
        link: Arc<Link>,
        recorder: Recorder,
        metrics: MirrorMetrics,
    ) -> Self {
        let conditions = link
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default();
        let gateway_latency = link.status.as_ref().and_then(|s| s.gateway_latency.clone());
        Self {
            metrics,
            api,
            link,
            recorder,
            state: Arc::new(Mutex::new(State {
                conditions,
                services: Vec::new(),
                gateway_latency,
                last_written: None,
            })),
        }
    }

    fn labels(&self) -> LinkLabels {
        LinkLabels {
            link: format!(
                "{}/{}",
                self.link.metadata.namespace.clone().unwrap_or_default(),
                self.link.metadata.name.clone().unwrap_or_default()
            ),
        }
    }

    /// Records the duration of one sync pass.
    pub fn observe_sync(&self, seconds: f64) {
        self.metrics
            .sync_duration
            .get_or_create(&self.labels())
            .observe(seconds);
    }

    pub async fn set_health(&self, health: LinkHealth) {
        if health.condition == "RemoteReachable" {
            self.metrics
                .remote_reachable
                .get_or_create(&self.labels())
                .set(i64::from(health.ok()));
        }
        let changed = {
            let mut state = self.state.lock().await;
            let status = health.status;
            let existing = state
                .conditions
                .iter_mut()
                .find(|c| c.type_ == health.condition);
            match existing {
                Some(c)
                    if c.status == status
                        && c.reason == health.reason
                        && c.message == health.message =>
                {
                    false
                }
                Some(c) => {
                    if c.status != status {
                        c.last_transition_time = Time(k8s_openapi::jiff::Timestamp::now());
                    }
                    c.status = status.into();
                    c.reason = health.reason.clone();
                    c.message = health.message.clone();
                    c.observed_generation = self.link.metadata.generation;
                    true
                }
                None => {
                    state.conditions.push(Condition {
                        type_: health.condition.into(),
                        status: status.into(),
                        reason: health.reason.clone(),
                        message: health.message.clone(),
                        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
                        observed_generation: self.link.metadata.generation,
                    });
                    true
                }
            }
        };
        if changed && health.status == "False" {
            self.event(EventType::Warning, &health.reason, &health.message)
                .await;
        }
        if changed {
            self.flush().await;
        }
    }

    /// Publishes the gateway's recent probe latency (the caller limits how often).
    pub async fn set_gateway_latency(&self, latency: GatewayLatency) {
        self.state.lock().await.gateway_latency = Some(latency);
        self.flush().await;
    }

    pub async fn set_services(&self, mut services: Vec<ServiceMirrorStatus>) {
        services.sort();
        let labels = self.labels();
        self.metrics
            .mirrored_services
            .get_or_create(&labels)
            .set(services.iter().filter(|s| s.mirrored).count() as i64);
        let new_failures: Vec<ServiceMirrorStatus> = {
            let mut state = self.state.lock().await;
            let fresh = services
                .iter()
                .filter(|s| !s.mirrored && !state.services.contains(s))
                .cloned()
                .collect();
            state.services = services;
            fresh
        };
        for failure in &new_failures {
            self.metrics
                .mirror_errors
                .get_or_create(&ErrorLabels {
                    link: labels.link.clone(),
                    reason: failure.reason.clone(),
                })
                .inc();
        }
        for failure in new_failures {
            let note = format!(
                "{}/{}: {}",
                failure.namespace, failure.name, failure.message
            );
            self.event(EventType::Warning, &failure.reason, &note).await;
        }
        self.flush().await;
    }

    async fn event(&self, type_: EventType, reason: &str, note: &str) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note.chars().take(1000).collect()),
            action: "Mirror".into(),
            secondary: None,
        };
        if let Err(e) = self
            .recorder
            .publish(&event, &self.link.object_ref(&()))
            .await
        {
            tracing::debug!("publishing an Event failed: {e}");
        }
    }

    async fn flush(&self) {
        let mut state = self.state.lock().await;
        let status = LinkStatus {
            conditions: state.conditions.clone(),
            mirrored_services: state.services.iter().filter(|s| s.mirrored).count() as u32,
            // Only the services that need attention; the count covers the rest.
            services: state
                .services
                .iter()
                .filter(|s| !s.mirrored)
                .cloned()
                .collect(),
            observed_generation: self.link.metadata.generation,
            gateway_latency: state.gateway_latency.clone(),
        };
        if state.last_written.as_ref() == Some(&status) {
            return;
        }
        let name = self.link.metadata.name.clone().unwrap_or_default();
        match self
            .api
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
        {
            Ok(_) => state.last_written = Some(status),
            Err(e) => {
                tracing::warn!(link = %name, "writing Link status failed (will retry on next change): {e}")
            }
        }
    }
}
