//! One HTTP request to a destination: an endpoint picked per request by the
//! balancer, sent over a pooled tunnel in the version the client spoke
//! (HTTP/2 stays HTTP/2 end to end: gRPC), retried elsewhere when it is safe
//! and the destination's retry budget allows, all within the destination's
//! timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::CaptureConnection;
use hyper_util::rt::{TokioExecutor, TokioIo};
use strait_mesh::tunnel::client::TunnelError;
use strait_mesh::tunnel::{Protocol, ResponseStatus};

use super::pool::{EndpointConnector, FallbackTcp, H2Slot, H2Tunnel, is_fallback_tcp};
use super::{Body, Caller, Outbound, POOL_IDLE_TIMEOUT, empty_body, text};
use crate::retry::{BudgetConfig, RetryBudget};
use crate::view::{Endpoint, Resolved};

/// Attempts per request, the first included.
const MAX_ATTEMPTS: u32 = 3;
/// How long a hop that refused a multiplexed HTTP/1 tunnel gets per-connection
/// tunnels before it is asked again (a rollout replaces it within minutes).
const PER_CONNECTION_FOR: std::time::Duration = std::time::Duration::from_secs(300);
/// Answers that mean "this endpoint could not serve it; another may".
const RETRYABLE_STATUSES: [StatusCode; 3] = [
    StatusCode::BAD_GATEWAY,
    StatusCode::SERVICE_UNAVAILABLE,
    StatusCode::GATEWAY_TIMEOUT,
];

/// Why a request got no response, and whether it never left (the log says
/// which).
#[derive(Debug)]
struct SendError {
    connect: bool,
    /// The endpoint did not answer in time while connecting (TCP or TLS
    /// timed out): hung or unreachable, so no attempt of this request goes
    /// there again.
    timed_out: bool,
    message: String,
}

impl SendError {
    fn connect(e: impl std::error::Error + 'static) -> Self {
        Self {
            connect: true,
            timed_out: timed_out(&e),
            message: e.to_string(),
        }
    }
}

/// Whether `e` or an error it was caused by is an I/O time-out.
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        next = e.source();
    }
    false
}

impl From<hyper_util::client::legacy::Error> for SendError {
    fn from(e: hyper_util::client::legacy::Error) -> Self {
        let message =
            std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| format!("{e}: {s}"));
        Self {
            connect: e.is_connect(),
            timed_out: e.is_connect() && timed_out(&e),
            message,
        }
    }
}

/// Why there is no multiplexed tunnel: the hop's answer to opening it (a
/// sender may act on a refusal), or the HTTP/2 handshake over it failed.
enum H2Error {
    Open(TunnelError),
    Handshake(SendError),
}

impl From<H2Error> for SendError {
    fn from(e: H2Error) -> Self {
        match e {
            H2Error::Open(e) => SendError::connect(e),
            H2Error::Handshake(e) => e,
        }
    }
}

fn is_idempotent(method: &http::Method) -> bool {
    use http::Method;
    [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::PUT,
        Method::DELETE,
        Method::TRACE,
    ]
    .contains(method)
}

/// How many retry budgets are kept before idle ones are dropped.
const BUDGETS_PRUNED_AT: usize = 1024;

/// Whether an attempt may be sent again to another endpoint: only a
/// replayable request (idempotent, no body), when it never reached a pod,
/// when its connection was lost before an answer came (a gateway or node that
/// died with it in flight: RFC 9110 §9.2.2 lets an idempotent request be
/// sent again then, since doing it twice means doing it once), or when the
/// answer says the endpoint could not serve it.
fn retryable(replayable: bool, outcome: Result<StatusCode, &SendError>) -> bool {
    replayable
        && match outcome {
            Ok(status) => RETRYABLE_STATUSES.contains(&status),
            Err(_) => true,
        }
}

impl Outbound {
    /// [`Self::forward`] within the destination's timeout (`strait.dev/timeout`).
    pub(super) async fn forward_within(
        &self,
        req: Request<Incoming>,
        caller: Caller,
        resolved: Resolved,
        destination: &str,
    ) -> Response<Body> {
        let forward = self.forward(req, caller, resolved.endpoints, destination);
        match resolved.timeout {
            None => forward.await,
            Some(limit) => match tokio::time::timeout(limit, forward).await {
                Ok(response) => response,
                Err(_) => text(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "{destination} did not answer within its timeout of {limit:?} (strait.dev/timeout)"
                    ),
                ),
            },
        }
    }

    /// An HTTP request (absolute-form HTTP/1 from the HTTP proxy, or any
    /// HTTP/1 or HTTP/2 request in transparent mode): pick an endpoint for
    /// this request and send it over a pooled tunnel there. A retryable
    /// failure is sent again to another endpoint while the destination's
    /// retry budget allows.
    async fn forward(
        &self,
        req: Request<Incoming>,
        caller: Caller,
        endpoints: Vec<Endpoint>,
        destination: &str,
    ) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        let http2 = parts.version == http::Version::HTTP_2;
        crate::hop::strip(&mut parts.headers);
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string();
        // Only a request without a body can be sent twice (nothing to buffer).
        let replayable = hyper::body::Body::is_end_stream(&body) && is_idempotent(&parts.method);
        let mut body = Some(body.boxed());
        let budget = self.budget_for(destination);
        budget.deposit(Instant::now());
        let source = caller.identity.id();
        let mut tried: Vec<SocketAddr> = Vec::new();
        // Endpoints that timed out connecting: never tried again by this
        // request (a hung peer would cost the time-out each time).
        let mut hung: Vec<SocketAddr> = Vec::new();
        let mut attempt = 0;
        loop {
            attempt += 1;
            // A retry goes elsewhere if it can, and never to a hung endpoint.
            let candidates: Vec<Endpoint> = if tried.is_empty() {
                Vec::new()
            } else {
                let untried: Vec<Endpoint> = endpoints
                    .iter()
                    .filter(|e| !tried.contains(&e.addr))
                    .cloned()
                    .collect();
                if untried.is_empty() {
                    endpoints
                        .iter()
                        .filter(|e| !hung.contains(&e.addr))
                        .cloned()
                        .collect()
                } else {
                    untried
                }
            };
            let Some(endpoint) = self.balancer.pick(if candidates.is_empty() {
                &endpoints
            } else {
                &candidates
            }) else {
                return text(StatusCode::SERVICE_UNAVAILABLE, "no ready endpoint".into());
            };
            tried.push(endpoint.addr);
            let series = self.metrics.outbound_http(&source, &endpoint);
            // HTTP/2 keeps the client's URI (it carries `:authority`); HTTP/1
            // is sent in origin form to the endpoint's own pool (the Host
            // header still names the service).
            let uri = if http2 && parts.uri.authority().is_some() {
                parts.uri.clone()
            } else {
                match Uri::builder()
                    .scheme("http")
                    .authority(endpoint.addr.to_string())
                    .path_and_query(path.as_str())
                    .build()
                {
                    Ok(u) => u,
                    Err(e) => {
                        return text(StatusCode::BAD_REQUEST, format!("bad request target: {e}"));
                    }
                }
            };
            let mut request = Request::new(body.take().unwrap_or_else(empty_body));
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = uri;
            *request.version_mut() = parts.version;
            // Only a replayable request can be sent again: keep its headers.
            *request.headers_mut() = if replayable {
                parts.headers.clone()
            } else {
                std::mem::take(&mut parts.headers)
            };
            series.request();
            let started = Instant::now();
            let guard = self.balancer.start(&endpoint);
            let result = if http2 {
                self.send_h2(&caller, &endpoint, request).await
            } else if self.multiplexes(&endpoint) {
                self.send_h1_multiplexed(&caller, &endpoint, request).await
            } else {
                self.send_h1(&caller, &endpoint, request).await
            };
            let elapsed = started.elapsed();
            let retry = retryable(replayable, result.as_ref().map(|r| r.status()));
            guard.finish(elapsed, !retry && result.is_ok());
            series.response(
                result.as_ref().ok().map(|r| r.status()),
                elapsed.as_secs_f64(),
            );
            if matches!(&result, Err(e) if e.timed_out) {
                hung.push(endpoint.addr);
            }
            let elsewhere = endpoints.iter().any(|e| !hung.contains(&e.addr));
            if retry && attempt < MAX_ATTEMPTS && elsewhere {
                if budget.withdraw(Instant::now()) {
                    series.retry();
                    tracing::debug!(endpoint = %endpoint.addr, attempt, "retrying on another endpoint");
                    continue;
                }
                series.budget_exhausted();
            }
            return match result {
                Ok(mut response) => {
                    crate::hop::strip(response.headers_mut());
                    response.map(|b| b.boxed())
                }
                Err(e) => {
                    tracing::info!(endpoint = %endpoint.addr, attempt, sent = !e.connect, error = %e.message, "request failed: 502");
                    text(
                        StatusCode::BAD_GATEWAY,
                        format!("to {}: {}", endpoint.addr, e.message),
                    )
                }
            };
        }
    }

    /// Sends an HTTP/1 request over the caller's pool for the endpoint.
    async fn send_h1(
        &self,
        caller: &Caller,
        endpoint: &Endpoint,
        mut request: Request<Body>,
    ) -> Result<Response<Incoming>, SendError> {
        let client = self.http1.get_or_insert(
            &Self::pool_key(caller, endpoint),
            |_| true,
            || {
                let connector = EndpointConnector {
                    source: caller.identity.clone(),
                    endpoint: endpoint.clone(),
                    opener: self.opener.clone(),
                };
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                    .pool_max_idle_per_host(1024)
                    .build(connector)
            },
        );
        // Only a gateway's connection may be a TCP fallback to retire.
        let captured = endpoint
            .is_remote()
            .then(|| hyper_util::client::legacy::connect::capture_connection(&mut request));
        let result = client.request(request).await.map_err(SendError::from);
        if let Some(captured) = captured {
            self.retire_fallback(endpoint, &captured);
        }
        result
    }

    /// A pooled TCP fallback stream to a gateway is not reused once QUIC
    /// works again (asking also starts the background QUIC attempt).
    fn retire_fallback(&self, endpoint: &Endpoint, captured: &CaptureConnection) {
        let metadata = captured.connection_metadata();
        let Some(connected) = metadata.as_ref() else {
            return;
        };
        let mut extras = http::Extensions::new();
        connected.get_extras(&mut extras);
        if extras.get::<FallbackTcp>().is_some() && self.quic_is_back(endpoint) {
            connected.poison();
        }
    }

    /// Sends an HTTP/2 request over the caller's multiplexed tunnel to the
    /// endpoint, opening it (or replacing a closed one) first.
    async fn send_h2(
        &self,
        caller: &Caller,
        endpoint: &Endpoint,
        request: Request<Body>,
    ) -> Result<Response<Incoming>, SendError> {
        let sender = self.h2_sender(caller, endpoint, Protocol::Http2).await?;
        Self::send_on(sender, request).await
    }

    /// Sends an HTTP/1 caller's request as an HTTP/2 stream over the caller's
    /// multiplexed tunnel to the endpoint (HTTP/1 again at the pod); over a
    /// tunnel of its own if the hop there predates multiplexing (it refuses
    /// the header as one it cannot read: remembered for [`PER_CONNECTION_FOR`]).
    async fn send_h1_multiplexed(
        &self,
        caller: &Caller,
        endpoint: &Endpoint,
        mut request: Request<Body>,
    ) -> Result<Response<Incoming>, SendError> {
        match self
            .h2_sender(caller, endpoint, Protocol::Http1Multiplexed)
            .await
        {
            Ok(sender) => {
                *request.version_mut() = http::Version::HTTP_2;
                let mut response = Self::send_on(sender, request).await?;
                // Answered to an HTTP/1 caller (its connection's own version).
                *response.version_mut() = http::Version::HTTP_11;
                Ok(response)
            }
            Err(H2Error::Open(TunnelError::Refused {
                status: ResponseStatus::BadHeader,
                message,
                ..
            })) => {
                tracing::info!(
                    hop = %endpoint.hop(),
                    "HTTP/1 multiplexing refused ({message}): per-connection tunnels there for {PER_CONNECTION_FOR:?}"
                );
                self.per_connection_until
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(endpoint.hop(), Instant::now() + PER_CONNECTION_FOR);
                self.send_h1(caller, endpoint, request).await
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether HTTP/1 requests to `endpoint` go multiplexed: so configured,
    /// and its hop has not refused it lately.
    fn multiplexes(&self, endpoint: &Endpoint) -> bool {
        if self.http1_tunnels != super::Http1Tunnels::Multiplexed {
            return false;
        }
        let hop = endpoint.hop();
        let mut refused = self
            .per_connection_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match refused.get(&hop) {
            Some(until) if Instant::now() < *until => false,
            Some(_) => {
                refused.remove(&hop);
                true
            }
            None => true,
        }
    }

    /// The caller's multiplexed tunnel to the endpoint carrying `protocol`,
    /// opened first if there is none, it closed, or it is a TCP fallback
    /// stream to a gateway that QUIC reaches again (its streams in flight
    /// finish on it).
    async fn h2_sender(
        &self,
        caller: &Caller,
        endpoint: &Endpoint,
        protocol: Protocol,
    ) -> Result<hyper::client::conn::http2::SendRequest<Body>, H2Error> {
        let pools = if protocol == Protocol::Http2 {
            &self.http2
        } else {
            &self.http1_multiplexed
        };
        // One tunnel per key: the first request opens it while the others
        // wait on the slot, then all share it.
        let slot =
            pools.get_or_insert(&Self::pool_key(caller, endpoint), |_| true, H2Slot::default);
        let mut slot = slot.lock().await;
        if let Some(tunnel) = slot.as_ref()
            && !tunnel.sender.is_closed()
            && !(tunnel.fallback && self.quic_is_back(endpoint))
        {
            return Ok(tunnel.sender.clone());
        }
        let tunnel = self
            .opener
            .open(&caller.identity, endpoint, protocol)
            .await
            .map_err(H2Error::Open)?;
        let fallback = is_fallback_tcp(&tunnel);
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(tunnel))
            .await
            .map_err(|e| H2Error::Handshake(SendError::connect(e)))?;
        let pod = endpoint.addr;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%pod, "HTTP/2 tunnel: {e}");
            }
        });
        *slot = Some(H2Tunnel {
            sender: sender.clone(),
            fallback,
        });
        Ok(sender)
    }

    /// Whether QUIC to the gateway in front of `endpoint` works again (asking
    /// also starts the background QUIC attempt).
    fn quic_is_back(&self, endpoint: &Endpoint) -> bool {
        self.opener
            .gateways
            .as_ref()
            .is_some_and(|g| g.prefers_quic(endpoint.addr, &endpoint.identity))
    }

    async fn send_on(
        mut sender: hyper::client::conn::http2::SendRequest<Body>,
        request: Request<Body>,
    ) -> Result<Response<Incoming>, SendError> {
        sender.ready().await.map_err(SendError::connect)?;
        sender.send_request(request).await.map_err(|e| SendError {
            connect: false,
            timed_out: false,
            message: e.to_string(),
        })
    }

    fn budget_for(&self, destination: &str) -> Arc<RetryBudget> {
        let mut budgets = self.budgets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(budget) = budgets.get(destination) {
            return budget.clone();
        }
        // Destinations are named as callers spell them: budgets unused for a
        // whole window (equal to new ones) go before the map grows further.
        if budgets.len() >= BUDGETS_PRUNED_AT {
            let now = Instant::now();
            budgets.retain(|_, b| Arc::strong_count(b) > 1 || !b.is_idle(now));
        }
        budgets
            .entry(destination.to_string())
            .or_insert_with(|| Arc::new(RetryBudget::new(BudgetConfig::default())))
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_replayable_requests_that_got_no_answer_or_were_refused_are_retried() {
        let never_sent =
            SendError::connect(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!never_sent.timed_out);
        assert!(SendError::connect(std::io::Error::from(std::io::ErrorKind::TimedOut)).timed_out);
        let lost = SendError {
            connect: false,
            timed_out: false,
            message: "connection reset mid-response".into(),
        };
        assert!(retryable(true, Err(&never_sent)));
        assert!(
            !retryable(false, Err(&never_sent)),
            "a body or a POST is never resent"
        );
        assert!(
            retryable(true, Err(&lost)),
            "idempotent: sent twice is sent once"
        );
        assert!(!retryable(false, Err(&lost)), "a POST may have been served");
        for status in RETRYABLE_STATUSES {
            assert!(retryable(true, Ok(status)));
            assert!(!retryable(false, Ok(status)));
        }
        for status in [
            StatusCode::OK,
            StatusCode::NOT_FOUND,
            StatusCode::INTERNAL_SERVER_ERROR,
        ] {
            assert!(!retryable(true, Ok(status)), "{status} is the pod's answer");
        }
    }

    #[test]
    fn idempotent_methods_are_the_ones_rfc_9110_names() {
        for method in ["GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"] {
            assert!(is_idempotent(&method.parse().unwrap()), "{method}");
        }
        for method in ["POST", "PATCH", "CONNECT"] {
            assert!(!is_idempotent(&method.parse().unwrap()), "{method}");
        }
    }
}
