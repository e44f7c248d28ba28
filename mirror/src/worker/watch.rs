//! Watch: the remote cluster (a client from the Link's credentials, and
//! reflector stores of its exported Services and their EndpointSlices) and
//! the Link's gateway (its addresses, resolved and probed).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use strait_mesh::kubeconfig::{self, UnsafeKubeconfig};
use strait_mesh::link::Link;
use strait_mesh::mcs::ServiceExport;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;

use crate::config::MirrorConfig;
use crate::probe::{GatewayEndpoint, GatewayProbe, ProbeSettings};
use crate::remote_slices::{Exported, ExportedSlices};
use crate::status::StatusReporter;

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error(
        "Secret {namespace}/{name} not found: create it with `strait link … | kubectl apply -f -`"
    )]
    Missing { namespace: String, name: String },
    #[error("Secret {namespace}/{name} has no `kubeconfig` key")]
    NoKubeconfig { namespace: String, name: String },
    #[error("Secret {namespace}/{name}: kubeconfig is not valid: {message}")]
    Invalid {
        namespace: String,
        name: String,
        message: String,
    },
    /// Names a program to run or a file to read: refused before any client
    /// is built from it, so nothing in it is ever run or read here.
    #[error("Secret {namespace}/{name}: {source}")]
    Unsafe {
        namespace: String,
        name: String,
        source: UnsafeKubeconfig,
    },
    #[error("reading Secret {namespace}/{name}: {source}")]
    Read {
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

impl CredentialsError {
    /// The CredentialsValid condition's reason.
    pub fn reason(&self) -> &'static str {
        match self {
            CredentialsError::Unsafe { .. } => UnsafeKubeconfig::REASON,
            CredentialsError::Missing { .. }
            | CredentialsError::NoKubeconfig { .. }
            | CredentialsError::Invalid { .. }
            | CredentialsError::Read { .. } => "InvalidCredentials",
        }
    }
}

/// Builds a client for the remote cluster from the Link's credentials Secret.
pub async fn remote_client(local: &Client, link: &Link) -> Result<Client, CredentialsError> {
    let namespace = link.namespace().unwrap_or_default();
    let name = link.spec.cluster_credentials_secret.clone();
    let secret = Api::<Secret>::namespaced(local.clone(), &namespace)
        .get_opt(&name)
        .await
        .map_err(|source| CredentialsError::Read {
            namespace: namespace.clone(),
            name: name.clone(),
            source,
        })?
        .ok_or_else(|| CredentialsError::Missing {
            namespace: namespace.clone(),
            name: name.clone(),
        })?;
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get("kubeconfig"))
        .map(|b| b.0.clone())
        .ok_or_else(|| CredentialsError::NoKubeconfig {
            namespace: namespace.clone(),
            name: name.clone(),
        })?;
    let invalid = |message: String| CredentialsError::Invalid {
        namespace: namespace.clone(),
        name: name.clone(),
        message,
    };
    let text = String::from_utf8(bytes).map_err(|e| invalid(e.to_string()))?;
    let kubeconfig =
        kube::config::Kubeconfig::from_yaml(&text).map_err(|e| invalid(e.to_string()))?;
    kubeconfig::inline_only(&kubeconfig).map_err(|source| CredentialsError::Unsafe {
        namespace: namespace.clone(),
        name: name.clone(),
        source,
    })?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| invalid(e.to_string()))?;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(330));
    Client::try_from(config).map_err(|e| invalid(e.to_string()))
}

/// The Link's gateway addresses and whether each is alive (`None` until first known).
pub(crate) type GatewayWatch = watch::Receiver<Option<Vec<GatewayEndpoint>>>;

/// Starts resolving and probing the Link's gateway, in `tasks`.
pub(super) fn gateways(
    link: &Link,
    status: &StatusReporter,
    config: &MirrorConfig,
    key: &str,
    tasks: &mut JoinSet<()>,
) -> GatewayWatch {
    let resolver = match crate::resolve::resolver(&config.dns) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(link = %key, "{e}; gateway hostnames cannot be resolved");
            None
        }
    };
    let (addr_tx, addr_rx) = watch::channel(None);
    let (gw_tx, gw_rx) = watch::channel(None);
    let probe = GatewayProbe {
        link: key.to_string(),
        settings: ProbeSettings::from_spec(&link.spec.probe, link.spec.gateway_port),
        gateway_identity: link.spec.gateway_identity.clone(),
        identity: config.identity.clone(),
        metrics: config.metrics.clone(),
        status: status.clone(),
    };
    tasks.spawn(crate::resolve::keep_resolved(
        resolver,
        link.spec.gateway_addresses.clone(),
        addr_tx,
    ));
    tasks.spawn(probe.run(addr_rx, gw_tx));
    gw_rx
}

/// The remote's exported Services (a reflector store) and only their slices
/// ([`ExportedSlices`]: not every slice of the remote), kept by watches that
/// retry by themselves (with backoff).
pub(super) struct RemoteWatch {
    pub services: Store<Service>,
    pub slices: ExportedSlices,
    /// Woken on every change to either store.
    pub changed: Arc<Notify>,
    /// Each watch event's outcome: whether the remote API answers.
    pub health: mpsc::Receiver<Result<(), String>>,
    _tasks: JoinSet<()>,
}

impl RemoteWatch {
    /// Watches Services matching `selector`, and the slices of those and of
    /// the remote's ServiceExports (`exports`, with the MCS API);
    /// `exports_changed` is woken when `exports` changes.
    pub fn start(
        remote: &Client,
        selector: &str,
        exports: Option<Store<ServiceExport>>,
        exports_changed: Arc<Notify>,
    ) -> Self {
        let (services, svc_writer) = reflector::store::<Service>();
        // Managed fields are never mirrored; dropping them roughly halves what
        // the stores hold (10,000 exported services).
        let service_events = watcher(
            Api::<Service>::all(remote.clone()),
            watcher::Config::default().labels(selector),
        )
        .modify(|s| {
            s.metadata.managed_fields = None;
            if let Some(a) = s.metadata.annotations.as_mut() {
                a.remove("kubectl.kubernetes.io/last-applied-configuration");
            }
        });
        let changed = Arc::new(Notify::new());
        let (health_tx, health) = mpsc::channel(16);
        let exported = Exported {
            services: services.clone(),
            exports,
        };
        // What is exported changes with the Services and the exports.
        let (slices, mut tasks) = ExportedSlices::follow(
            remote,
            exported,
            exports_changed.clone(),
            changed.clone(),
            health_tx.clone(),
        );
        let stream = reflector::reflector(svc_writer, service_events).default_backoff();
        let services_changed = changed.clone();
        tasks.spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(item) = stream.next().await {
                let _ = health_tx.try_send(item.map(|_| ()).map_err(|e| e.to_string()));
                services_changed.notify_one();
                exports_changed.notify_one();
            }
        });
        Self {
            services,
            slices,
            changed,
            health,
            _tasks: tasks,
        }
    }

    /// Resolves once both stores hold a first full list (the slices' waits
    /// for the Services'; borrows nothing, so the health channel can be read
    /// meanwhile).
    pub fn listed(&self) -> impl Future<Output = ()> + use<> {
        let slices = self.slices.clone();
        async move { slices.wait_until_ready().await }
    }
}
