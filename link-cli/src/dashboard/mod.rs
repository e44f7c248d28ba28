//! `strait dashboard`: a web page on localhost showing the clusters this one
//! links to and how those links stand, the gateways, the exported, mirrored
//! and clusterset Services with their endpoints, and per Service the golden
//! metrics by caller and serving cluster, refreshed live; with a topology of
//! the clusters and the calls between them.
//!
//! One process and no extra server: it watches the Kubernetes API and reads
//! the node proxies' `/metrics` (or a Prometheus server with
//! `--prometheus`). The page polls `/api/state`, which is served from memory:
//! a browser costs the API server nothing.

mod collect;
mod model;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::link::{client_for, load_kubeconfig};
use collect::{MetricsFrom, Stores, Window};

const PAGE: &str = include_str!("page.html");

#[derive(Debug, clap::Args)]
pub struct DashboardArgs {
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the cluster to show (with the clusters it links to).
    #[arg(long)]
    pub context: Option<String>,
    /// Port to serve the page on.
    #[arg(long, default_value_t = 8084)]
    pub port: u16,
    /// Address to serve on. The page shows your clusters' state to whoever
    /// reaches it, with your credentials: keep it on loopback unless you
    /// mean to share it.
    #[arg(long, default_value = "127.0.0.1")]
    pub address: IpAddr,
    /// Read the golden metrics from this Prometheus server (http://host:9090)
    /// instead of the node proxies.
    #[arg(long)]
    pub prometheus: Option<String>,
    /// Time between refreshes of the state the page shows.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub refresh: Duration,
    /// The window rates and latencies are computed over.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub window: Duration,
    /// Time between runs of `strait check` (it reaches every linked cluster).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub check_interval: Duration,
}

pub async fn dashboard(args: DashboardArgs) -> anyhow::Result<()> {
    if let Some(url) = &args.prometheus
        && !url.starts_with("http://")
    {
        anyhow::bail!(
            "--prometheus {url}: give the server's http:// URL, e.g. http://localhost:9090"
        );
    }
    anyhow::ensure!(
        args.refresh >= Duration::from_millis(100) && args.check_interval >= Duration::from_secs(1),
        "--refresh must be at least 100ms and --check-interval at least 1s (they set how often the API and the linked clusters are asked)"
    );
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (client, _) = client_for(&kubeconfig, &args.context).await?;
    let cluster = collect::cluster_name(&client).await?;
    let listener = TcpListener::bind(SocketAddr::new(args.address, args.port))
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "serving on {}:{}: {e} (choose another --port)",
                args.address,
                args.port
            )
        })?;
    let stores = Arc::new(Stores::watch(&client));
    stores.ready(Duration::from_secs(30)).await;
    let checked = collect::check_every(client.clone(), stores.clone(), args.check_interval);
    let from = match &args.prometheus {
        Some(url) => MetricsFrom::Prometheus(url.clone()),
        None => MetricsFrom::Proxies,
    };
    let (publish, state) = watch::channel(Bytes::from_static(b"{}"));
    tokio::spawn(refresh(
        client,
        cluster.clone(),
        stores,
        checked,
        from,
        args.refresh,
        args.window,
        publish,
    ));
    eprintln!(
        "strait dashboard for cluster {cluster}: http://{} (Ctrl-C stops it)",
        listener.local_addr()?
    );
    serve(listener, args.address, state).await
}

/// Rebuilds the state every `every`, publishing it as JSON.
#[allow(clippy::too_many_arguments)]
async fn refresh(
    client: kube::Client,
    cluster: String,
    stores: Arc<Stores>,
    checked: Arc<std::sync::Mutex<collect::Checked>>,
    from: MetricsFrom,
    every: Duration,
    window: Duration,
    publish: watch::Sender<Bytes>,
) {
    let mut reads = Window::new(window);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let started = tokio::time::Instant::now();
        let read = collect::read_metrics(&client, &stores, &from, &cluster).await;
        let (error, proxies_read) = match read {
            Ok((totals, n)) => {
                reads.push(tokio::time::Instant::now(), totals);
                (None, n)
            }
            Err(e) => (Some(format!("{e:#}")), 0),
        };
        let (calls, seconds) = reads.calls();
        let mut state = {
            let checked = checked.lock().unwrap_or_else(|e| e.into_inner());
            collect::state(&cluster, &stores, &calls, seconds, &checked)
        };
        state.metrics.source = match &from {
            MetricsFrom::Proxies => "node proxies".into(),
            MetricsFrom::Prometheus(url) => url.clone(),
        };
        state.metrics.proxies_read = proxies_read;
        state.metrics.error = error;
        state.metrics.refresh_millis = (started.elapsed().as_secs_f64() * 1e5).round() / 100.0;
        match serde_json::to_vec(&state) {
            Ok(json) => {
                publish.send_replace(Bytes::from(json));
            }
            Err(e) => tracing::warn!("the dashboard state does not serialize: {e}"),
        }
    }
}

async fn serve(
    listener: TcpListener,
    bound: IpAddr,
    state: watch::Receiver<Bytes>,
) -> anyhow::Result<()> {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("accepting a dashboard connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(route(&req, bound, &state)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .header_read_timeout(Duration::from_secs(10))
                .timer(hyper_util::rt::TokioTimer::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Whether a request's `Host` names this server as the browser reached it
/// on loopback: a page of another site that rebinds its name to 127.0.0.1
/// (DNS rebinding) sends its own name, and is refused. Served on an
/// unspecified address (`--address 0.0.0.0`), any name is accepted.
fn host_allowed(host: Option<&str>, bound: IpAddr) -> bool {
    if bound.is_unspecified() {
        return true;
    }
    let Some(host) = host else {
        return false;
    };
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => host,
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip == bound)
}

fn route(
    req: &Request<Incoming>,
    bound: IpAddr,
    state: &watch::Receiver<Bytes>,
) -> Response<Full<Bytes>> {
    let respond = |status: StatusCode, kind: &str, body: Bytes| {
        Response::builder()
            .status(status)
            .header(header::CONTENT_TYPE, kind)
            .header(header::CACHE_CONTROL, "no-store")
            // The page is ours alone: no framing, no foreign scripts.
            .header("x-frame-options", "DENY")
            .header(
                "content-security-policy",
                "default-src 'self'; style-src 'self' 'unsafe-inline'; script-src 'self' 'unsafe-inline'",
            )
            .body(Full::new(body))
            .unwrap_or_default()
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok());
    if !host_allowed(host, bound) {
        return respond(
            StatusCode::FORBIDDEN,
            "text/plain",
            Bytes::from(format!(
                "this dashboard answers to localhost or {bound}, not {}\n",
                host.unwrap_or("no Host")
            )),
        );
    }
    if req.method() != Method::GET {
        return respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            Bytes::from_static(b"GET only\n"),
        );
    }
    match req.uri().path() {
        "/" | "/index.html" => respond(
            StatusCode::OK,
            "text/html; charset=utf-8",
            Bytes::from_static(PAGE.as_bytes()),
        ),
        "/api/state" => respond(StatusCode::OK, "application/json", state.borrow().clone()),
        _ => respond(
            StatusCode::NOT_FOUND,
            "text/plain",
            Bytes::from_static(b"not found\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_names_reach_a_loopback_dashboard() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        for ok in [
            "localhost:8084",
            "LOCALHOST",
            "127.0.0.1:8084",
            "[::1]:8084",
            "[::1]",
            "127.0.0.2",
        ] {
            assert!(host_allowed(Some(ok), lo), "{ok}");
        }
        for refused in [
            "evil.example:8084",
            "evil.example",
            "10.0.0.1:8084",
            "localhost.evil.example",
        ] {
            assert!(!host_allowed(Some(refused), lo), "{refused}");
        }
        assert!(!host_allowed(None, lo));
        let lan: IpAddr = "10.0.0.1".parse().unwrap();
        assert!(host_allowed(Some("10.0.0.1:8084"), lan));
        assert!(host_allowed(Some("anything:1"), "0.0.0.0".parse().unwrap()));
    }
}
