//! The control planes testenv starts are real: these tests exercise the
//! Kubernetes behaviour Strait relies on against real kube-apiservers and the
//! real controllers, never a mock.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenReview};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use strait_testenv::wait::eventually;
use strait_testenv::workloads::{TestPod, create_node, create_ready_pod, ensure_namespace};
use strait_testenv::{Cluster, ClusterConfig};

const WAIT: Duration = Duration::from_secs(30);

fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).expect("test manifest matches the Kubernetes type")
}

async fn token_for(client: &Client, ns: &str, sa: &str, audiences: &[&str]) -> String {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let request: TokenRequest = from_json(json!({
        "spec": {"audiences": audiences, "expirationSeconds": 600},
    }));
    let response = api
        .create_token_request(sa, &PostParams::default(), &request)
        .await
        .expect("TokenRequest");
    response
        .status
        .and_then(|s| s.token)
        .expect("TokenRequest returns a token")
}

async fn review(
    client: &Client,
    token: &str,
) -> k8s_openapi::api::authentication::v1::TokenReviewStatus {
    let api: Api<TokenReview> = Api::all(client.clone());
    let review: TokenReview = from_json(json!({"spec": {"token": token}}));
    api.create(&PostParams::default(), &review)
        .await
        .expect("TokenReview call")
        .status
        .expect("TokenReview status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clusters_start_concurrently_and_are_independent() {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.expect("start east"), west.expect("start west"));
    assert_ne!(east.server_url(), west.server_url());

    // /version reports the real release stamped at build time.
    let version = east
        .client()
        .apiserver_version()
        .await
        .expect("GET /version");
    assert_eq!(
        (version.major.as_str(), version.minor.as_str()),
        ("1", "36"),
        "{version:?}"
    );
    assert!(version.git_version.starts_with("v1.36."), "{version:?}");

    ensure_namespace(&east.client(), "only-east")
        .await
        .expect("namespace in east");
    let cms: Api<ConfigMap> = Api::namespaced(east.client(), "only-east");
    cms.create(
        &PostParams::default(),
        &from_json(json!({"metadata": {"name": "marker"}, "data": {"k": "v"}})),
    )
    .await
    .expect("create ConfigMap in east");

    let west_ns: Api<Namespace> = Api::all(west.client());
    assert!(
        west_ns.get_opt("only-east").await.unwrap().is_none(),
        "namespace leaked into west"
    );
    let east_ns: Api<Namespace> = Api::all(east.client());
    assert!(east_ns.get_opt("only-east").await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_pod_behind_a_service_gets_an_endpointslice_from_the_real_controller() {
    let east = Cluster::start("east").await.expect("start east");
    let client = east.client();
    ensure_namespace(&client, "shop").await.unwrap();
    let node_ip: IpAddr = "10.10.0.2".parse().unwrap();
    create_node(&client, "node-1", node_ip)
        .await
        .expect("create node");

    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    services
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "web"},
                "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
            })),
        )
        .await
        .expect("create Service");
    let pod_ip: IpAddr = "10.244.1.7".parse().unwrap();
    let pod = TestPod::new("shop", "web-0", "node-1", pod_ip)
        .with_label("app", "web")
        .with_port("http", 8080);
    let created = create_ready_pod(&client, &pod)
        .await
        .expect("create ready pod");
    let status = created.status.expect("pod status");
    assert_eq!(status.phase.as_deref(), Some("Running"));
    assert_eq!(status.host_ip.as_deref(), Some("10.10.0.2"));

    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "shop");
    let slice = eventually(
        "an EndpointSlice for shop/web with the pod",
        WAIT,
        || async {
            let list = slices
                .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
                .await
                .map_err(|e| e.to_string())?;
            list.items
                .into_iter()
                .find(|s| {
                    s.endpoints
                        .iter()
                        .flatten()
                        .any(|e| e.addresses.contains(&pod_ip.to_string()))
                })
                .ok_or_else(|| "no slice holds the pod address yet".to_string())
        },
    )
    .await;
    let labels = slice.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("endpointslice.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("endpointslice-controller.k8s.io"),
        "written by the real EndpointSlice controller: {labels:?}"
    );
    let endpoint = &slice.endpoints.as_ref().expect("slice endpoints")[0];
    assert_eq!(endpoint.node_name.as_deref(), Some("node-1"));
    assert_eq!(
        endpoint.conditions.as_ref().and_then(|c| c.ready),
        Some(true)
    );
    let port = &slice.ports.as_ref().expect("slice ports")[0];
    assert_eq!(
        (port.name.as_deref(), port.port),
        (Some("http"), Some(8080))
    );

    // A pod that turns unready leaves the ready set, as when a kubelet reports it.
    strait_testenv::workloads::set_pod_ready(
        &client,
        "shop",
        "web-0",
        pod_ip,
        Some(node_ip),
        false,
    )
    .await
    .unwrap();
    eventually("the endpoint to turn not ready", WAIT, || async {
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await
            .map_err(|e| e.to_string())?;
        let ready = list
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .filter_map(|e| e.conditions.as_ref()?.ready)
            .any(|r| r);
        if ready {
            Err("endpoint still ready".into())
        } else {
            Ok(())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_passes_token_review_in_its_own_cluster_only() {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.expect("start east"), west.expect("start west"));
    let token = token_for(&east.client(), "default", "default", &["strait.dev/test"]).await;

    let spec_review = |client: Client, token: String, audiences: Vec<&'static str>| async move {
        let api: Api<TokenReview> = Api::all(client);
        let review: TokenReview =
            from_json(json!({"spec": {"token": token, "audiences": audiences}}));
        api.create(&PostParams::default(), &review)
            .await
            .expect("TokenReview")
            .status
            .expect("status")
    };

    let ok = spec_review(east.client(), token.clone(), vec!["strait.dev/test"]).await;
    assert_eq!(
        ok.authenticated,
        Some(true),
        "east must accept its own token: {ok:?}"
    );
    let user = ok.user.expect("reviewed user");
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:default:default")
    );

    let foreign = spec_review(west.client(), token.clone(), vec!["strait.dev/test"]).await;
    assert_ne!(
        foreign.authenticated,
        Some(true),
        "west must refuse east's token: {foreign:?}"
    );

    let wrong_audience = spec_review(east.client(), token, vec!["someone-else"]).await;
    assert_ne!(
        wrong_audience.authenticated,
        Some(true),
        "audience must be checked: {wrong_audience:?}"
    );

    let garbage = review(&east.client(), "not-a-jwt").await;
    assert_ne!(garbage.authenticated, Some(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_deletion_finishes_and_owner_references_garbage_collect() {
    let east = Cluster::start("east").await.expect("start east");
    let client = east.client();
    ensure_namespace(&client, "doomed").await.unwrap();
    ensure_namespace(&client, "gc").await.unwrap();

    // Owner references: deleting the owner removes the dependent.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "gc");
    let owner = cms
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": "owner"}})),
        )
        .await
        .expect("create owner");
    let uid = owner.metadata.uid.expect("owner uid");
    cms.create(
        &PostParams::default(),
        &from_json(
            json!({"metadata": {"name": "dependent", "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid},
            ]}}),
        ),
    )
    .await
    .expect("create dependent");
    cms.delete("owner", &DeleteParams::default())
        .await
        .expect("delete owner");
    eventually(
        "the garbage collector to delete the dependent",
        WAIT,
        || async {
            match cms.get_opt("dependent").await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(_) => Err("dependent still exists".into()),
            }
        },
    )
    .await;

    // Namespace deletion: the namespace controller empties it and removes the finalizer.
    let in_doomed: Api<ConfigMap> = Api::namespaced(client.clone(), "doomed");
    in_doomed
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": "content"}})),
        )
        .await
        .unwrap();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .delete("doomed", &DeleteParams::default())
        .await
        .expect("delete namespace");
    eventually(
        "namespace doomed to be gone",
        Duration::from_secs(60),
        || async {
            match namespaces
                .get_opt("doomed")
                .await
                .map_err(|e| e.to_string())?
            {
                None => Ok(()),
                Some(ns) => Err(format!(
                    "still there, phase {:?}",
                    ns.status.and_then(|s| s.phase)
                )),
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_denies_a_service_account_without_a_binding_and_allows_it_with_one() {
    let east = Cluster::start("east").await.expect("start east");
    let admin = east.client();
    ensure_namespace(&admin, "team").await.unwrap();
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), "team");
    sas.create(
        &PostParams::default(),
        &from_json(json!({"metadata": {"name": "reader"}})),
    )
    .await
    .unwrap();
    let token = token_for(&admin, "team", "reader", &[]).await;
    let as_reader = east
        .client_with_token(&token)
        .await
        .expect("client with token");
    let reader_view: Api<Service> = Api::namespaced(as_reader, "team");

    match reader_view.list(&ListParams::default()).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "expected Forbidden, got {e:?}"),
        other => panic!("listing without a RoleBinding must be forbidden, got {other:?}"),
    }

    let roles: Api<Role> = Api::namespaced(admin.clone(), "team");
    roles
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": "svc-reader"}, "rules": [
                {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
            ]})),
        )
        .await
        .unwrap();
    let bindings: Api<RoleBinding> = Api::namespaced(admin, "team");
    bindings
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "reader"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "svc-reader"},
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": "team"}],
            })),
        )
        .await
        .unwrap();
    eventually(
        "the RoleBinding to allow listing services",
        WAIT,
        || async {
            reader_view
                .list(&ListParams::default())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await;
    // Still least privilege: the binding grants services, not secrets.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(east.client_with_token(&token).await.unwrap(), "team");
    assert!(
        matches!(secrets.list(&ListParams::default()).await, Err(kube::Error::Api(e)) if e.code == 403)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiserver_restart_keeps_the_data_in_etcd() {
    let mut east = Cluster::start_with(ClusterConfig::new("east"))
        .await
        .expect("start east");
    let cms: Api<ConfigMap> = Api::namespaced(east.client(), "default");
    cms.create(
        &PostParams::default(),
        &from_json(json!({"metadata": {"name": "survivor"}})),
    )
    .await
    .unwrap();
    east.stop_apiserver();
    assert!(
        cms.get("survivor").await.is_err(),
        "the API server should be down"
    );
    east.start_apiserver()
        .await
        .expect("restart the API server");
    cms.get("survivor")
        .await
        .expect("data survives an API server restart");
}
