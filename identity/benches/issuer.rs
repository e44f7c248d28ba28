//! Issuer and mTLS benchmarks on a real cluster (testenv) and a real issuer process.
//!
//!     cargo bench -p strait-identity --bench issuer
//!
//! Prints issuance latency (p50/p99, sequential), issuance throughput (16 in
//! flight) and full mTLS handshakes per second with issued certificates.
//! Sizes: STRAIT_BENCH_CERTS (default 500), STRAIT_BENCH_HANDSHAKES (default 3000).

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use strait_mesh::identity::ca;
use strait_mesh::identity::client::{IdentityMetrics, ManagedIdentity, RefreshPolicy, TokenSource};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize)
        .saturating_sub(1)
        .min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` would pass nothing useful.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let certs = env_usize("STRAIT_BENCH_CERTS", 500);
    let handshakes = env_usize("STRAIT_BENCH_HANDSHAKES", 3000);
    let (anchor, issuer) =
        ca::new_anchor_and_issuer("east", None, Duration::from_secs(365 * 24 * 3600)).unwrap();
    let east = strait_testenv::Cluster::start("east")
        .await
        .expect("start cluster");
    let running =
        common::start_issuer(&east, &issuer, &anchor.cert_pem, "east.strait", "24h").await;
    let token = common::workload_token(&east.client(), "shop", "web").await;
    let client = running.client();

    // Warm up (TLS, TokenReview caches in the API server).
    for _ in 0..20 {
        client.issue(&token, None).await.unwrap();
    }
    let mut latencies = Vec::with_capacity(certs);
    for _ in 0..certs {
        let start = Instant::now();
        client.issue(&token, None).await.unwrap();
        latencies.push(start.elapsed());
    }
    latencies.sort();
    println!(
        "issuer latency (sequential, n={certs}, incl. key+CSR generation, TLS, TokenReview): p50 {:.2} ms, p99 {:.2} ms",
        percentile(&latencies, 0.50).as_secs_f64() * 1e3,
        percentile(&latencies, 0.99).as_secs_f64() * 1e3
    );

    let in_flight = 16;
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..in_flight {
        let (client, token) = (client.clone(), token.clone());
        let share = certs / in_flight + usize::from(i < certs % in_flight);
        tasks.spawn(async move {
            for _ in 0..share {
                client.issue(&token, None).await.unwrap();
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let elapsed = start.elapsed();
    println!(
        "issuer throughput ({in_flight} in flight, n={certs}): {:.0} certificates/s",
        certs as f64 / elapsed.as_secs_f64()
    );

    // mTLS handshakes with issued certificates (ECDSA P-256, TLS 1.3), 8 in flight.
    let id = |t: String| async {
        ManagedIdentity::start(
            running.client(),
            TokenSource::Static(t.into()),
            None,
            RefreshPolicy::default(),
            IdentityMetrics::default(),
        )
        .await
        .unwrap()
    };
    let web = id(token.clone()).await;
    let api = id(common::workload_token(&east.client(), "shop", "api").await).await;
    let server = common::spawn_mtls_server(&running.bundle, api.cert()).await;
    let bundle = Arc::new(running.bundle.clone());
    let (web_cert, api_id) = (web.cert(), api.id());
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..8 {
        let (bundle, cert, api_id) = (bundle.clone(), web_cert.clone(), api_id.clone());
        let share = handshakes / 8 + usize::from(i < handshakes % 8);
        tasks.spawn(async move {
            for _ in 0..share {
                common::connect(server, &bundle, cert.clone(), &api_id)
                    .await
                    .unwrap();
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let elapsed = start.elapsed();
    println!(
        "mTLS handshakes (client+server in one process on 2 cores, full handshake + first server line, n={handshakes}): {:.0}/s",
        handshakes as f64 / elapsed.as_secs_f64()
    );
}
