//! The identity issuer on real clusters: two clusters, two issuers, one anchor.

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use strait_mesh::identity::ca::{self, LeafSigner, PemPair};
use strait_mesh::identity::client::{
    IdentityMetrics, IssueError, ManagedIdentity, RefreshPolicy, TokenSource,
};
use strait_mesh::identity::protocol::PodRef;
use strait_mesh::identity::tls::{CertSlot, TrustBundle};
use strait_mesh::identity::{SpiffeId, certs};
use strait_testenv::Cluster;
use strait_testenv::workloads::{TestPod, create_node, create_ready_pod, ensure_namespace};

const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

async fn identity(issuer: &RunningIssuer, token: String) -> ManagedIdentity {
    ManagedIdentity::start(
        issuer.client(),
        TokenSource::Static(token.into()),
        None,
        RefreshPolicy::default(),
        IdentityMetrics::default(),
    )
    .await
    .expect("obtain an identity")
}

fn refused(result: Result<ManagedIdentity, IssueError>) -> (u16, String, String) {
    match result {
        Err(IssueError::Refused {
            status,
            reason,
            message,
        }) => (status, reason, message),
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(id) => panic!("expected a refusal, got identity {}", id.id()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn east_and_west_workloads_complete_mutual_tls_and_see_each_others_spiffe_id() {
    let anchor = ca::new_trust_anchor("strait trust anchor", YEAR).unwrap();
    let (east_issuer, west_issuer) = (
        ca::new_issuer(&anchor, "east", None, YEAR / 2).unwrap(),
        ca::new_issuer(&anchor, "west", None, YEAR / 2).unwrap(),
    );
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ei, wi) = tokio::join!(
        start_issuer(&east, &east_issuer, &anchor.cert_pem, "east.strait", "24h"),
        start_issuer(&west, &west_issuer, &anchor.cert_pem, "west.strait", "24h"),
    );

    let web = identity(&ei, workload_token(&east.client(), "shop", "web").await).await;
    let api = identity(&wi, workload_token(&west.client(), "shop", "api").await).await;
    assert_eq!(web.id().to_string(), "spiffe://east.strait/ns/shop/sa/web");
    assert_eq!(api.id().to_string(), "spiffe://west.strait/ns/shop/sa/api");

    // The issued leaf: only SAN is the SPIFFE ID, ~24 h, chained to the east issuer.
    let chain = web.cert().current().unwrap().cert.clone();
    let info = certs::inspect("leaf", &chain[0]).unwrap();
    assert_eq!(
        info.sans,
        vec!["URI:spiffe://east.strait/ns/shop/sa/web".to_string()]
    );
    let lifetime = info.not_after_unix - info.not_before_unix;
    assert!(
        (24 * 3600..=24 * 3600 + 120).contains(&lifetime),
        "lifetime {lifetime}s"
    );
    assert!(
        certs::inspect("issuer", &chain[1])
            .unwrap()
            .subject
            .contains("strait issuer east")
    );

    // west serves, east calls; each side sees the other's SPIFFE ID.
    let server = spawn_mtls_server(&wi.bundle, api.cert()).await;
    let mut conn = connect(server, &ei.bundle, web.cert(), &api.id())
        .await
        .expect("mTLS east → west");
    assert_eq!(conn.server_id, api.id());
    assert_eq!(conn.seen_by_server, web.id().to_string());
    conn.ping("hello").await.unwrap();

    // Expecting someone else: the client refuses the server.
    let impostor = SpiffeId::new("west.strait", "shop", "billing").unwrap();
    let err = connect(server, &ei.bundle, web.cert(), &impostor)
        .await
        .err()
        .expect("wrong identity refused");
    assert!(
        err.contains("WrongIdentity") && err.contains("billing"),
        "{err}"
    );

    // Metrics: expiry gauge on the issuer; issuance success counted.
    let metrics = ei.metrics().await;
    assert!(
        metrics.contains("identity_issuance_total{result=\"success\",reason=\"\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("identity_issuer_cert_expiration_timestamp_seconds"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_under_a_foreign_anchor_or_with_expired_certificates_are_refused() {
    let anchor = ca::new_trust_anchor("strait trust anchor", YEAR).unwrap();
    let issuer = ca::new_issuer(&anchor, "east", None, YEAR / 2).unwrap();
    let east = Cluster::start("east").await.unwrap();
    let ei = start_issuer(&east, &issuer, &anchor.cert_pem, "east.strait", "24h").await;
    let web = identity(&ei, workload_token(&east.client(), "shop", "web").await).await;
    let server = spawn_mtls_server(&ei.bundle, web.cert()).await;

    // A peer whose chain ends at another anchor, with a plausible identity.
    let (foreign_anchor, foreign_issuer) = ca::new_anchor_and_issuer("east", None, YEAR).unwrap();
    let foreign = LeafSigner::load(&foreign_issuer, &foreign_anchor.cert_pem).unwrap();
    let forged_id = SpiffeId::new("east.strait", "shop", "web").unwrap();
    let forged = slot_with(
        &foreign,
        &foreign_issuer,
        &forged_id,
        Duration::from_secs(3600),
    );
    let foreign_bundle = TrustBundle::from_pem(foreign_anchor.cert_pem.as_bytes()).unwrap();
    let err = connect(server, &foreign_bundle, forged.clone(), &web.id())
        .await
        .err()
        .expect("client side must fail");
    // Same names on both chains, different keys: webpki finds the signature wrong.
    assert!(err.contains("invalid peer certificate"), "{err}");
    // And as a client with the right bundle for the server but a foreign certificate: the server refuses.
    let err = connect(server, &ei.bundle, forged, &web.id())
        .await
        .err()
        .expect("server must refuse a foreign client");
    assert!(
        err.contains("alert"),
        "the server's refusal arrives as a TLS alert: {err}"
    );

    // An expired leaf under the right anchor and issuer.
    let expired = slot_with_window(
        &issuer,
        &SpiffeId::new("east.strait", "shop", "old").unwrap(),
        -7200,
        -3600,
    );
    let err = connect(server, &ei.bundle, expired, &web.id())
        .await
        .err()
        .expect("server must refuse an expired client");
    assert!(
        err.contains("alert"),
        "the server's refusal arrives as a TLS alert: {err}"
    );
    let expired_server = spawn_mtls_server(
        &ei.bundle,
        slot_with_window(
            &issuer,
            &SpiffeId::new("east.strait", "shop", "old").unwrap(),
            -7200,
            -3600,
        ),
    )
    .await;
    let err = connect(
        expired_server,
        &ei.bundle,
        web.cert(),
        &SpiffeId::new("east.strait", "shop", "old").unwrap(),
    )
    .await
    .err()
    .expect("client must refuse an expired server");
    assert!(err.to_lowercase().contains("expired"), "{err}");

    // The good path still works next to all that.
    connect(server, &ei.bundle, web.cert(), &web.id())
        .await
        .expect("valid peers still connect");
}

fn slot_with(
    signer: &LeafSigner,
    issuer: &PemPair,
    id: &SpiffeId,
    validity: Duration,
) -> std::sync::Arc<CertSlot> {
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = signer.sign(&key, id, validity).unwrap();
    let mut chain = vec![leaf.der];
    chain.extend(certs::parse_certs("issuer", issuer.cert_pem.as_bytes()).unwrap());
    let slot = CertSlot::new();
    slot.install(chain, &key.serialize_pem()).unwrap();
    slot
}

/// A leaf valid from now+`from_s` to now+`to_s` (negative: in the past), signed by `issuer`.
fn slot_with_window(
    issuer: &PemPair,
    id: &SpiffeId,
    from_s: i64,
    to_s: i64,
) -> std::sync::Arc<CertSlot> {
    let issuer_key = rcgen::KeyPair::from_pem(&issuer.key_pem).unwrap();
    let signing = rcgen::Issuer::from_ca_cert_pem(&issuer.cert_pem, issuer_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::default();
    params.subject_alt_names = vec![rcgen::SanType::URI(id.to_string().try_into().unwrap())];
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now + time::Duration::seconds(from_s);
    params.not_after = now + time::Duration::seconds(to_s);
    let cert = params.signed_by(&key, &signing).unwrap();
    let mut chain = vec![cert.der().clone()];
    chain.extend(certs::parse_certs("issuer", issuer.cert_pem.as_bytes()).unwrap());
    let slot = CertSlot::new();
    slot.install(chain, &key.serialize_pem()).unwrap();
    slot
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_only_buy_their_own_identity_and_bad_tokens_buy_nothing() {
    let (anchor, issuer) = ca::new_anchor_and_issuer("east", None, YEAR).unwrap();
    let east = Cluster::start("east").await.unwrap();
    let ei = start_issuer(&east, &issuer, &anchor.cert_pem, "east.strait", "24h").await;
    let client = east.client();

    // A's token yields A, never B — even when A names B's pod.
    let token_a = workload_token(&client, "shop", "a").await;
    let _ = workload_token(&client, "shop", "b").await;
    create_node(&client, "node-1", "10.10.0.1".parse().unwrap())
        .await
        .unwrap();
    create_ready_pod(
        &client,
        &TestPod::new("shop", "b-0", "node-1", "10.244.1.2".parse().unwrap())
            .with_service_account("b"),
    )
    .await
    .unwrap();
    assert_eq!(
        identity(&ei, token_a.clone()).await.id().to_string(),
        "spiffe://east.strait/ns/shop/sa/a"
    );
    let pod_b = Some(PodRef {
        namespace: "shop".into(),
        name: "b-0".into(),
    });
    let (status, reason, message) = refused(
        ManagedIdentity::start(
            ei.client(),
            TokenSource::Static(token_a.into()),
            pod_b,
            RefreshPolicy::default(),
            IdentityMetrics::default(),
        )
        .await,
    );
    assert_eq!(
        (status, reason.as_str()),
        (403, "not_node_agent"),
        "{message}"
    );

    // A forged token (well-formed JWT, wrong signature) and garbage.
    let real = workload_token(&client, "shop", "a").await;
    let mut parts: Vec<String> = real.split('.').map(str::to_string).collect();
    parts[2] = parts[2].chars().rev().collect();
    for bad in [parts.join("."), "not-a-token".to_string()] {
        let (status, reason, _) = refused(
            ManagedIdentity::start(
                ei.client(),
                TokenSource::Static(bad.into()),
                None,
                RefreshPolicy::default(),
                IdentityMetrics::default(),
            )
            .await,
        );
        assert_eq!((status, reason.as_str()), (401, "unauthenticated"));
    }
    // A real token with the API server's default audience, not Strait's.
    let wrong_audience = token(&client, "shop", "a", &[], None).await;
    let (status, reason, message) = refused(
        ManagedIdentity::start(
            ei.client(),
            TokenSource::Static(wrong_audience.into()),
            None,
            RefreshPolicy::default(),
            IdentityMetrics::default(),
        )
        .await,
    );
    assert_eq!(
        (status, reason.as_str()),
        (401, "unauthenticated"),
        "{message}"
    );
    assert!(
        message.contains("strait.dev/identity"),
        "the refusal names the audience to use: {message}"
    );

    // The link namespace: `strait link` creates strait-link-<cluster> accounts
    // there whose tokens linked clusters hold, and with them may TokenRequest
    // a token for any audience. A genuine token for Strait's audience, minted
    // by a real TokenRequest, buys nothing; the mirror controller's own
    // account, in the same namespace, still gets its identity.
    let link_token = workload_token(&client, "strait-multicluster", "strait-link-west").await;
    let (status, reason, message) = refused(
        ManagedIdentity::start(
            ei.client(),
            TokenSource::Static(link_token.into()),
            None,
            RefreshPolicy::default(),
            IdentityMetrics::default(),
        )
        .await,
    );
    assert_eq!(
        (status, reason.as_str()),
        (403, "refused_namespace"),
        "{message}"
    );
    assert!(
        message.contains("strait-multicluster/strait-link-west")
            && message.contains("--refuse-namespace")
            && message.contains("another namespace"),
        "the refusal says why and what to do: {message}"
    );
    let mirror_token = workload_token(&client, "strait-multicluster", "strait-mirror").await;
    assert_eq!(
        identity(&ei, mirror_token).await.id().to_string(),
        "spiffe://east.strait/ns/strait-multicluster/sa/strait-mirror"
    );

    let metrics = ei.metrics().await;
    assert!(
        metrics
            .contains("identity_issuance_total{result=\"failure\",reason=\"refused_namespace\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("identity_issuance_total{result=\"failure\",reason=\"unauthenticated\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("identity_issuance_total{result=\"failure\",reason=\"not_node_agent\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_proxy_gets_identities_of_pods_on_its_node_only() {
    let (anchor, issuer) = ca::new_anchor_and_issuer("east", None, YEAR).unwrap();
    let east = Cluster::start("east").await.unwrap();
    let ei = start_issuer(&east, &issuer, &anchor.cert_pem, "east.strait", "24h").await;
    let client = east.client();
    for (node, ip) in [("node-1", "10.10.0.1"), ("node-2", "10.10.0.2")] {
        create_node(&client, node, ip.parse().unwrap())
            .await
            .unwrap();
    }
    ensure_namespace(&client, "strait-system").await.unwrap();
    let _ = workload_token(&client, "strait-system", "strait-proxy").await;
    let _ = workload_token(&client, "shop", "web").await;
    let proxy = create_ready_pod(
        &client,
        &TestPod::new(
            "strait-system",
            "strait-proxy-n1",
            "node-1",
            "10.10.0.1".parse().unwrap(),
        )
        .with_service_account("strait-proxy"),
    )
    .await
    .unwrap();
    for (name, node, ip) in [
        ("web-n1", "node-1", "10.244.1.5"),
        ("web-n2", "node-2", "10.244.2.5"),
    ] {
        create_ready_pod(
            &client,
            &TestPod::new("shop", name, node, ip.parse().unwrap()).with_service_account("web"),
        )
        .await
        .unwrap();
    }
    // The proxy's token is bound to its pod, so TokenReview reports its node.
    let uid = proxy.metadata.uid.clone().unwrap();
    let proxy_token = token(
        &client,
        "strait-system",
        "strait-proxy",
        &["strait.dev/identity"],
        Some(("strait-proxy-n1", &uid)),
    )
    .await;
    let ask = |pod: &str| {
        let pod = Some(PodRef {
            namespace: "shop".into(),
            name: pod.into(),
        });
        ManagedIdentity::start(
            ei.client(),
            TokenSource::Static(proxy_token.clone().into()),
            pod,
            RefreshPolicy::default(),
            IdentityMetrics::default(),
        )
    };
    let local = ask("web-n1").await.expect("a pod on the proxy's own node");
    assert_eq!(
        local.id().to_string(),
        "spiffe://east.strait/ns/shop/sa/web"
    );
    let (status, reason, message) = refused(ask("web-n2").await);
    assert_eq!((status, reason.as_str()), (403, "wrong_node"), "{message}");
    assert!(
        message.contains("node-2") && message.contains("node-1"),
        "{message}"
    );
    let (status, reason, _) = refused(ask("ghost").await);
    assert_eq!((status, reason.as_str()), (403, "pod_not_found"));
    // A pod on its node that runs as a link account: refused all the same.
    let _ = workload_token(&client, "strait-multicluster", "strait-link-west").await;
    create_ready_pod(
        &client,
        &TestPod::new(
            "strait-multicluster",
            "linked-n1",
            "node-1",
            "10.244.1.6".parse().unwrap(),
        )
        .with_service_account("strait-link-west"),
    )
    .await
    .unwrap();
    let (status, reason, message) = refused(
        ManagedIdentity::start(
            ei.client(),
            TokenSource::Static(proxy_token.clone().into()),
            Some(PodRef {
                namespace: "strait-multicluster".into(),
                name: "linked-n1".into(),
            }),
            RefreshPolicy::default(),
            IdentityMetrics::default(),
        )
        .await,
    );
    assert_eq!(
        (status, reason.as_str()),
        (403, "refused_namespace"),
        "{message}"
    );

    // Without a pod-bound token, the issuer falls back to... nothing: it cannot tell the node.
    let unbound = token(
        &client,
        "strait-system",
        "strait-proxy",
        &["strait.dev/identity"],
        None,
    )
    .await;
    let (_, reason, _) = refused(
        ManagedIdentity::start(
            ei.client(),
            TokenSource::Static(unbound.into()),
            Some(PodRef {
                namespace: "shop".into(),
                name: "web-n1".into(),
            }),
            RefreshPolicy::default(),
            IdentityMetrics::default(),
        )
        .await,
    );
    assert_eq!(reason, "caller_node_unknown");
    let _: Api<Pod> = Api::all(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anchor_rotation_peers_under_old_and_new_roots_interoperate() {
    let old = ca::new_trust_anchor("strait anchor 2026", YEAR).unwrap();
    let new = ca::new_trust_anchor("strait anchor 2027", YEAR).unwrap();
    let bundle = format!("{}{}", old.cert_pem, new.cert_pem);
    let (east_issuer, west_issuer) = (
        ca::new_issuer(&old, "east", None, YEAR / 2).unwrap(),
        ca::new_issuer(&new, "west", None, YEAR / 2).unwrap(),
    );
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ei, wi) = tokio::join!(
        start_issuer(&east, &east_issuer, &bundle, "east.strait", "24h"),
        start_issuer(&west, &west_issuer, &bundle, "west.strait", "24h"),
    );
    assert_eq!(ei.bundle.len(), 2);
    let web = identity(&ei, workload_token(&east.client(), "shop", "web").await).await;
    let api = identity(&wi, workload_token(&west.client(), "shop", "api").await).await;
    let east_server = spawn_mtls_server(&ei.bundle, web.cert()).await;
    let west_server = spawn_mtls_server(&wi.bundle, api.cert()).await;
    let mut a = connect(west_server, &ei.bundle, web.cert(), &api.id())
        .await
        .expect("old-root client → new-root server");
    a.ping("x").await.unwrap();
    let mut b = connect(east_server, &wi.bundle, api.cert(), &web.id())
        .await
        .expect("new-root client → old-root server");
    b.ping("y").await.unwrap();
    // With only the old root, the new-root peer is refused: the bundle is what makes rotation work.
    let old_only = TrustBundle::from_pem(old.cert_pem.as_bytes()).unwrap();
    assert!(
        connect(west_server, &old_only, web.cert(), &api.id())
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_lived_connection_pool_keeps_working_across_one_minute_certificate_refreshes() {
    let (anchor, issuer) = ca::new_anchor_and_issuer("east", None, YEAR).unwrap();
    let east = Cluster::start("east").await.unwrap();
    let ei = start_issuer(&east, &issuer, &anchor.cert_pem, "east.strait", "1m").await;
    let web = identity(&ei, workload_token(&east.client(), "shop", "web").await).await;
    let api = identity(&ei, workload_token(&east.client(), "shop", "api").await).await;
    let server = spawn_mtls_server(&ei.bundle, api.cert()).await;

    let mut pool = Vec::new();
    for _ in 0..4 {
        pool.push(
            connect(server, &ei.bundle, web.cert(), &api.id())
                .await
                .expect("initial pool"),
        );
    }
    let (mut web_certs, mut api_certs) = (
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
    let mut round = 0u32;
    // Until both sides have refreshed at least three times (four certificates each).
    loop {
        web_certs.insert(web.expires_at());
        api_certs.insert(api.expires_at());
        if web_certs.len() >= 4 && api_certs.len() >= 4 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "certificates seen in 240 s: web {web_certs:?}, api {api_certs:?}"
        );
        for (i, conn) in pool.iter_mut().enumerate() {
            conn.ping(&format!("round {round} conn {i}"))
                .await
                .unwrap_or_else(|e| panic!("pooled connection {i} failed in round {round}: {e}"));
        }
        // Connections 0 and 1 live through every refresh; 2 and 3 are replaced
        // each round, so new handshakes use the newest certificates.
        let fresh = connect(server, &ei.bundle, web.cert(), &api.id())
            .await
            .unwrap_or_else(|e| panic!("new handshake failed in round {round}: {e}"));
        pool[2 + round as usize % 2] = fresh;
        round += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_an_issuer_outage_the_valid_certificate_stays_and_refresh_retries() {
    let (anchor, issuer) = ca::new_anchor_and_issuer("east", None, YEAR).unwrap();
    let east = Cluster::start("east").await.unwrap();
    let mut ei = start_issuer(&east, &issuer, &anchor.cert_pem, "east.strait", "1m").await;
    let metrics = IdentityMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let policy = RefreshPolicy {
        min_backoff: Duration::from_millis(200),
        max_backoff: Duration::from_secs(2),
        ..Default::default()
    };
    let web = ManagedIdentity::start(
        ei.client(),
        TokenSource::Static(workload_token(&east.client(), "shop", "web").await.into()),
        None,
        policy,
        metrics.clone(),
    )
    .await
    .unwrap();
    let first_expiry = web.expires_at();
    let server = spawn_mtls_server(&ei.bundle, web.cert()).await;

    ei.stop();
    // Past the 70 % refresh point (42 s of 60): refreshes fail, the certificate stays.
    tokio::time::sleep(Duration::from_secs(47)).await;
    assert_eq!(
        web.expires_at(),
        first_expiry,
        "no new certificate can have come"
    );
    connect(server, &ei.bundle, web.cert(), &web.id())
        .await
        .expect("the still-valid certificate keeps working");
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("identity_refresh_total{result=\"connect\"}"),
        "failed refreshes are counted: {text}"
    );
    assert!(
        text.contains(&format!(
            "identity_cert_expiration_timestamp_seconds{{identity=\"{}\"}} {first_expiry}",
            web.id()
        )),
        "{text}"
    );

    ei.restart().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while web.expires_at() == first_expiry {
        assert!(
            tokio::time::Instant::now() < deadline,
            "refresh did not recover after the issuer came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    connect(server, &ei.bundle, web.cert(), &web.id())
        .await
        .expect("the refreshed certificate works");
}
