//! The destination's half of an end-to-end session: a tunnel from this
//! cluster's gateway whose header said `end_to_end` carries, after the
//! answer, a TLS session opened by the caller's own node proxy with the
//! caller pod's certificate. This side answers as the target pod, requires
//! the caller's certificate, reads the caller's own header (the Service it
//! asked for) and decides on the proven identity: the gateway's claim must
//! match it, the pod must serve that Service, and the Service's
//! `strait.dev/allowed-identities` must admit it. Nothing the gateway says
//! about the caller is believed without that proof.

use std::net::SocketAddr;
use std::sync::Arc;

use strait_mesh::identity::{SpiffeId, tls};
use strait_mesh::tunnel::{
    DEFAULT_READ_TIMEOUT, Protocol, ResponseStatus, Target, TunnelHeader, TunnelResponse,
};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use crate::view::LocalPods;

/// Why an end-to-end session is refused (inside the session: the caller's
/// proxy reads it).
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(
        "the gateway named {claimed} as the caller, but the caller proved to be {proven}: refused"
    )]
    ForgedSource {
        claimed: Box<SpiffeId>,
        proven: Box<SpiffeId>,
    },
    #[error("an end-to-end caller names the Service it calls, not {0}")]
    NotAService(String),
    #[error("no Service {fqdn}:{port} in this cluster")]
    UnknownService { fqdn: String, port: u16 },
    #[error("pod {pod} is not a ready endpoint of Service {service}")]
    NotInService { pod: SocketAddr, service: String },
    #[error("{caller} may not call {service} (strait.dev/allowed-identities)")]
    Policy {
        caller: Box<SpiffeId>,
        service: String,
    },
}

impl Refusal {
    /// The `reason` label of `inbound_refusals_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::ForgedSource { .. } => "forged-source",
            Refusal::NotAService(_) => "end-to-end-target",
            Refusal::UnknownService { .. } => "unknown-service",
            Refusal::NotInService { .. } => "not-in-service",
            Refusal::Policy { .. } => "policy",
        }
    }

    pub fn status(&self) -> ResponseStatus {
        match self {
            Refusal::ForgedSource { .. } | Refusal::Policy { .. } => ResponseStatus::Denied,
            Refusal::NotAService(_) => ResponseStatus::BadHeader,
            Refusal::UnknownService { .. } | Refusal::NotInService { .. } => {
                ResponseStatus::NotFound
            }
        }
    }
}

/// The decision on a proven caller (pure).
pub fn authorize(
    pods: &dyn LocalPods,
    inner: &TunnelHeader,
    claimed: &SpiffeId,
    proven: &SpiffeId,
    pod: SocketAddr,
) -> Result<(), Refusal> {
    if proven != claimed {
        return Err(Refusal::ForgedSource {
            claimed: Box::new(claimed.clone()),
            proven: Box::new(proven.clone()),
        });
    }
    let Target::Service { fqdn, port } = &inner.target else {
        return Err(Refusal::NotAService(inner.target.to_string()));
    };
    let service = pods
        .service_serving(fqdn.as_str(), *port, pod)
        .ok_or_else(|| Refusal::UnknownService {
            fqdn: fqdn.as_str().to_string(),
            port: *port,
        })?;
    if !service.has_pod {
        return Err(Refusal::NotInService {
            pod,
            service: service.name,
        });
    }
    if !strait_mesh::policy::allowed(proven, service.allowed_identities.as_deref()) {
        return Err(Refusal::Policy {
            caller: Box::new(proven.clone()),
            service: service.name,
        });
    }
    Ok(())
}

/// Why a session did not open: refused (answered inside it), or broken.
#[derive(Debug)]
pub enum Failure {
    Refused(Refusal),
    Broken(String),
}

impl From<String> for Failure {
    fn from(e: String) -> Self {
        Failure::Broken(e)
    }
}

/// Runs the session's server side over `outer` (already answered OK): the
/// handshake as the pod (`config`), the caller's header, the decision and
/// its answer. Returns the session, the proven caller and the protocol the
/// caller declared.
pub async fn accept<S>(
    outer: S,
    config: Arc<rustls::ServerConfig>,
    pods: &dyn LocalPods,
    claimed: &SpiffeId,
    pod: SocketAddr,
) -> Result<Accepted<S>, Failure>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut inner = tokio::time::timeout(
        super::HANDSHAKE_TIMEOUT,
        tokio_rustls::TlsAcceptor::from(config).accept(outer),
    )
    .await
    .map_err(|_| "end-to-end TLS handshake timed out".to_string())?
    .map_err(|e| format!("end-to-end TLS handshake (claimed caller {claimed}): {e}"))?;
    let proven = tls::peer_identity(inner.get_ref().1.peer_certificates())
        .map_err(|e| format!("end-to-end peer: {e}"))?;
    let header = match TunnelHeader::read_from(&mut inner, DEFAULT_READ_TIMEOUT).await {
        Ok(h) => h,
        Err(e) => {
            if let Some(answer) = TunnelResponse::for_header_error(&e) {
                let _ = answer.write_to(&mut inner).await;
            }
            return Err(format!("end-to-end header from {proven}: {e}").into());
        }
    };
    if let Err(refusal) = authorize(pods, &header, claimed, &proven, pod) {
        let _ = TunnelResponse::refused(refusal.status(), refusal.to_string())
            .write_to(&mut inner)
            .await;
        let _ = inner.shutdown().await;
        return Err(Failure::Refused(refusal));
    }
    TunnelResponse::ok()
        .write_to(&mut inner)
        .await
        .map_err(|e| format!("answering {proven}: {e}"))?;
    let service = match header.target {
        Target::Service { fqdn, .. } => Some(fqdn.as_str().to_string()),
        Target::Pod { .. } => None,
    };
    Ok(Accepted {
        inner,
        proven,
        protocol: header.protocol,
        service,
    })
}

/// An end-to-end session the destination admitted.
pub struct Accepted<S> {
    /// The session inside the stream, as the target pod.
    pub inner: tokio_rustls::server::TlsStream<S>,
    /// The caller, proven by its certificate.
    pub proven: SpiffeId,
    pub protocol: Protocol,
    /// The Service the caller named (its FQDN).
    pub service: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::{LocalPod, ServiceCheck};
    use std::net::IpAddr;

    struct OneService(Option<ServiceCheck>);

    impl LocalPods for OneService {
        fn local_pod(&self, _: IpAddr) -> Option<LocalPod> {
            None
        }
        fn local_pod_running_as(&self, _: &str, _: &str) -> Option<LocalPod> {
            None
        }
        fn service_serving(&self, _: &str, _: u16, _: SocketAddr) -> Option<ServiceCheck> {
            self.0.clone()
        }
    }

    fn id(s: &str) -> SpiffeId {
        s.parse().unwrap()
    }

    #[test]
    fn only_the_proven_caller_allowed_by_the_service_gets_through() {
        let pod: SocketAddr = "10.0.0.5:8080".parse().unwrap();
        let inner = TunnelHeader::new(
            Target::service("web.shop.svc.cluster.local", 80).unwrap(),
            Protocol::Http1,
        );
        let caller = id("spiffe://east.cs/ns/shop/sa/client");
        let check = |has_pod, allowed: Option<&str>| {
            OneService(Some(ServiceCheck {
                name: "shop/web".into(),
                has_pod,
                allowed_identities: allowed.map(Arc::from),
            }))
        };
        let open = check(true, None);
        assert!(authorize(&open, &inner, &caller, &caller, pod).is_ok());
        let other = id("spiffe://east.cs/ns/shop/sa/admin");
        assert!(matches!(
            authorize(&open, &inner, &other, &caller, pod),
            Err(Refusal::ForgedSource { .. })
        ));
        assert!(matches!(
            authorize(&check(false, None), &inner, &caller, &caller, pod),
            Err(Refusal::NotInService { .. })
        ));
        assert!(matches!(
            authorize(&OneService(None), &inner, &caller, &caller, pod),
            Err(Refusal::UnknownService { .. })
        ));
        let only_admin = check(true, Some("spiffe://east.cs/ns/shop/sa/admin"));
        assert!(matches!(
            authorize(&only_admin, &inner, &caller, &caller, pod),
            Err(Refusal::Policy { .. })
        ));
        let to_pod = TunnelHeader::new(Target::pod(pod).unwrap(), Protocol::Http1);
        assert_eq!(
            authorize(&open, &to_pod, &caller, &caller, pod)
                .unwrap_err()
                .status(),
            ResponseStatus::BadHeader
        );
    }
}
