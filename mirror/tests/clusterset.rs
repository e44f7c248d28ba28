//! The clusterset side of the mirror controller (MCS API, KEP-2149), against a
//! real API server and the real binary.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use strait_mesh::link::Link;
use strait_mesh::mcs::{
    CLUSTER_ID_PROPERTY, ClusterProperty, ServiceExport, ServiceImport, ServiceImportType,
};
use strait_mirror::mcs::{ClustersetFeed, derived_name};
use strait_testenv::Cluster;
use strait_testenv::wait::eventually;
use strait_testenv::workloads::{TestPod, create_node, create_ready_pod, ensure_namespace};

use common::{
    WAIT, admin_kubeconfig, apply_crd, condition, from_json, install_crd, link, link_with,
};

/// The MCS CRDs, as `strait install` applies them.
async fn install_mcs_crds(client: &Client) {
    for crd in strait_mesh::mcs::crds() {
        apply_crd(client, crd).await;
    }
}

/// One cluster's controllers (mirror + MCS), in-process, for cluster `name`.
fn start_controllers(client: &Client, name: &str) -> Vec<tokio::task::JoinHandle<()>> {
    let feed = ClustersetFeed::default();
    let config = strait_mirror::MirrorConfig {
        clusterset: Some((name.to_string(), feed.clone())),
        ..Default::default()
    };
    vec![
        tokio::spawn(strait_mirror::mcs::run(client.clone(), name.into(), feed)),
        tokio::spawn(strait_mirror::run(client.clone(), config)),
    ]
}

async fn create_service(client: &Client, ns: &str, spec: serde_json::Value) {
    Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &from_json(spec))
        .await
        .unwrap();
}

async fn export(client: &Client, ns: &str, name: &str) {
    Api::<ServiceExport>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &ServiceExport::new(name, Default::default()),
        )
        .await
        .unwrap();
}

/// Polls `probe` until it returns `Ok` (at most [`WAIT`]), panicking with `what`
/// and its last answer.
async fn until<T, F: std::future::Future<Output = Result<T, String>>>(
    what: &str,
    mut probe: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match probe().await {
            Ok(t) => return t,
            Err(e) if tokio::time::Instant::now() > deadline => {
                panic!("timed out waiting for {what}: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The export's condition `type_` as (reason, message), once its status is `status`.
async fn export_condition(
    client: &Client,
    ns: &str,
    name: &str,
    type_: &str,
    status: &str,
) -> (String, String) {
    let api: Api<ServiceExport> = Api::namespaced(client.clone(), ns);
    until(&format!("{ns}/{name} {type_}={status}"), || async {
        let e = api.get(name).await.map_err(|e| e.to_string())?;
        let c = e
            .status
            .unwrap_or_default()
            .conditions
            .into_iter()
            .find(|c| c.type_ == type_)
            .ok_or("no such condition yet")?;
        if c.status != status {
            return Err(format!("{c:?}"));
        }
        Ok((c.reason, c.message))
    })
    .await
}

async fn import_where(
    client: &Client,
    ns: &str,
    name: &str,
    what: &str,
    check: impl Fn(&ServiceImport) -> bool,
) -> ServiceImport {
    let api: Api<ServiceImport> = Api::namespaced(client.clone(), ns);
    until(what, || async {
        let i = api.get(name).await.map_err(|e| e.to_string())?;
        if !check(&i) {
            return Err(format!("{:?} {:?}", i.spec.spec, i.status));
        }
        Ok(i)
    })
    .await
}

fn port_numbers(i: &ServiceImport) -> Vec<(String, i32)> {
    i.spec
        .spec
        .ports
        .iter()
        .map(|p| (p.name.clone(), p.port))
        .collect()
}

fn clusters(i: &ServiceImport) -> Vec<String> {
    i.status
        .as_ref()
        .map(|s| s.clusters.iter().map(|c| c.cluster.clone()).collect())
        .unwrap_or_default()
}

/// Two clusters linked both ways, each running its controllers: an export in
/// either becomes a ServiceImport in both (ClusterSetIP from a derived
/// Service, the clusters that back it in its status), conflicting exports are
/// flagged on both with the oldest winning, invalid exports say why, a
/// ServiceImport Strait did not write is left alone, a second Link to the same
/// cluster name is refused, and unexporting removes the imports everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_become_imports_in_every_cluster_with_conflicts_resolved() {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ec, wc) = (east.client(), west.client());
    for c in [&ec, &wc] {
        install_crd(c).await;
        install_mcs_crds(c).await;
        ensure_namespace(c, "shop").await.unwrap();
    }
    let mut tasks = start_controllers(&ec, "east");
    tasks.extend(start_controllers(&wc, "west"));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    link(&wc, "east", Some(&admin_kubeconfig(&east))).await;

    // 1. West exports web: both clusters import it.
    let web = |port: i32| {
        json!({"metadata": {"name": "web"},
               "spec": {"selector": {"app": "web"}, "sessionAffinity": "ClientIP",
                        "ports": [{"name": "http", "port": port, "targetPort": 8080}]}})
    };
    create_service(&wc, "shop", web(80)).await;
    export(&wc, "shop", "web").await;
    let (reason, _) = export_condition(&wc, "shop", "web", "Valid", "True").await;
    assert_eq!(reason, "Valid");
    for (client, cluster) in [(&wc, "west"), (&ec, "east")] {
        let i = import_where(
            client,
            "shop",
            "web",
            &format!("web imported in {cluster}"),
            |i| !i.spec.spec.ips.is_empty() && clusters(i) == ["west"],
        )
        .await;
        assert_eq!(i.spec.spec.type_, ServiceImportType::ClusterSetIP);
        assert_eq!(port_numbers(&i), [("http".to_string(), 80)]);
        assert_eq!(i.spec.spec.ports[0].protocol.as_deref(), Some("TCP"));
        assert_eq!(i.spec.spec.session_affinity.as_deref(), Some("ClientIP"));
        assert_eq!(i.spec.spec.ips.len(), i.spec.spec.ip_families.len());
        // The ClusterSetIP is the derived Service's, owned by the import.
        let derived = Api::<Service>::namespaced(client.clone(), "shop")
            .get(&derived_name("shop", "web"))
            .await
            .unwrap();
        assert_eq!(
            derived.spec.clone().unwrap().cluster_ips.unwrap(),
            i.spec.spec.ips,
            "{cluster}"
        );
        assert_eq!(derived.owner_references()[0].uid, i.uid().unwrap());
    }
    let marked = |client: &Client, name: &'static str| {
        let api: Api<Service> = Api::namespaced(client.clone(), "shop");
        async move {
            let svc = api.get(name).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(
                svc.annotations()
                    .get("multicluster.strait.dev/exported")
                    .cloned(),
            )
        }
    };
    until(
        "west's web marked exported (the gateway serves it)",
        || async {
            (marked(&wc, "web").await? == Some("true".into()))
                .then_some(())
                .ok_or("not marked".to_string())
        },
    )
    .await;
    let (reason, _) = export_condition(&wc, "shop", "web", "Ready", "True").await;
    assert_eq!(reason, "Ready");
    let (reason, _) = export_condition(&wc, "shop", "web", "Conflict", "False").await;
    assert_eq!(reason, "NoConflicts");

    // Slices: west's own pods in west; in east, west's gateways, ready once
    // web has a ready pod in west.
    let derived = derived_name("shop", "web");
    let slice_name = format!("{derived}-west");
    let remote_slice = |client: &Client| {
        let api: Api<EndpointSlice> = Api::namespaced(client.clone(), "shop");
        let name = slice_name.clone();
        async move { api.get(&name).await.map_err(|e| e.to_string()) }
    };
    let s = until("west's slice in east", || remote_slice(&ec)).await;
    let labels = s.labels();
    // Named for node proxies only: kube-proxy never sends plain TCP to a gateway.
    assert_eq!(labels["multicluster.strait.dev/derived-service"], derived);
    assert!(
        !labels.contains_key("kubernetes.io/service-name"),
        "{labels:?}"
    );
    assert_eq!(labels["multicluster.kubernetes.io/service-name"], "web");
    assert_eq!(labels["multicluster.kubernetes.io/source-cluster"], "west");
    assert_eq!(
        labels["endpointslice.kubernetes.io/managed-by"],
        "mcs.strait.dev"
    );
    assert_eq!(
        s.annotations()["strait.dev/remote-svc-fq-name"],
        "web.shop.svc.cluster.local"
    );
    let addresses: Vec<_> = s
        .endpoints
        .iter()
        .flatten()
        .flat_map(|e| e.addresses.clone())
        .collect();
    assert_eq!(addresses, ["10.77.0.1", "10.77.0.2"], "the Link's gateways");
    create_node(&wc, "w-node-1", "10.20.0.1".parse().unwrap())
        .await
        .unwrap();
    create_ready_pod(
        &wc,
        &TestPod::new("shop", "web-0", "w-node-1", "10.244.9.1".parse().unwrap())
            .with_label("app", "web")
            .with_port("http", 8080),
    )
    .await
    .unwrap();
    until("west's endpoints ready in east", || async {
        let s = remote_slice(&ec).await?;
        let ready = s
            .endpoints
            .iter()
            .flatten()
            .all(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true));
        (s.annotations()
            .get("multicluster.strait.dev/ready-endpoints")
            .map(String::as_str)
            == Some("1")
            && ready)
            .then_some(())
            .ok_or(format!("{:?} {:?}", s.metadata.annotations, s.endpoints))
    })
    .await;
    until("the pod in west's own slice", || async {
        let s = remote_slice(&wc).await?;
        let addresses: Vec<_> = s
            .endpoints
            .iter()
            .flatten()
            .flat_map(|e| e.addresses.clone())
            .collect();
        (addresses == ["10.244.9.1"]
            && s.ports.as_ref().is_some_and(|p| p[0].port == Some(8080))
            && s.labels().get("kubernetes.io/service-name") == Some(&derived))
        .then_some(())
        .ok_or(format!("{s:?}"))
    })
    .await;

    // 2. East exports web on another port, later: both exports conflict, the oldest (west) wins.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    create_service(&ec, "shop", web(81)).await;
    export(&ec, "shop", "web").await;
    for client in [&ec, &wc] {
        let (reason, message) = export_condition(client, "shop", "web", "Conflict", "True").await;
        assert_eq!(reason, "PortConflict", "{message}");
        assert!(message.contains("oldest"), "{message}");
    }
    for client in [&ec, &wc] {
        let i = import_where(client, "shop", "web", "both clusters back web", |i| {
            clusters(i) == ["east", "west"]
        })
        .await;
        assert_eq!(
            port_numbers(&i),
            [("http".to_string(), 80)],
            "west's definition"
        );
    }

    // 3. Exports that cannot be: no Service, an ExternalName Service.
    export(&ec, "shop", "ghost").await;
    let (reason, message) = export_condition(&ec, "shop", "ghost", "Valid", "False").await;
    assert_eq!(reason, "NoService");
    assert!(message.contains("shop/ghost"), "{message}");
    // …and a Warning Event on it says the same.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ec.clone(), "shop");
    eventually("a NoService Event on the ServiceExport", WAIT, || async {
        let list = events
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .iter()
            .find(|e| {
                e.reason.as_deref() == Some("NoService")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("ghost")
                    && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("ServiceExport")
                    && e.type_.as_deref() == Some("Warning")
                    && e.note.as_deref().is_some_and(|n| n.contains("Valid=False"))
            })
            .map(|_| ())
            .ok_or(format!(
                "{:?}",
                list.items
                    .iter()
                    .map(|e| (&e.reason, &e.note))
                    .collect::<Vec<_>>()
            ))
    })
    .await;
    create_service(&ec, "shop", json!({"metadata": {"name": "ext"}, "spec": {"type": "ExternalName", "externalName": "example.com"}})).await;
    export(&ec, "shop", "ext").await;
    let (reason, _) = export_condition(&ec, "shop", "ext", "Valid", "False").await;
    assert_eq!(reason, "InvalidServiceType");
    let imports: Api<ServiceImport> = Api::namespaced(ec.clone(), "shop");
    let west_imports: Api<ServiceImport> = Api::namespaced(wc.clone(), "shop");
    for name in ["ghost", "ext"] {
        assert!(imports.get_opt(name).await.unwrap().is_none(), "{name}");
        assert!(
            west_imports.get_opt(name).await.unwrap().is_none(),
            "{name}"
        );
    }

    // 4. A ServiceImport someone else wrote in east is left alone.
    let foreign = json!({"apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
        "metadata": {"name": "db"}, "spec": {"type": "Headless", "ports": [{"port": 5432, "protocol": "TCP"}]}});
    imports
        .create(&PostParams::default(), &from_json(foreign))
        .await
        .unwrap();
    create_service(
        &wc,
        "shop",
        json!({"metadata": {"name": "db"}, "spec": {"ports": [{"port": 6000}]}}),
    )
    .await;
    export(&wc, "shop", "db").await;
    import_where(&wc, "shop", "db", "db imported in west", |i| {
        !i.spec.spec.ips.is_empty()
    })
    .await;
    // East has seen west's export by now: its own web import backs both clusters,
    // and a pass over db has run; wait one more periodic pass.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let db = imports.get("db").await.unwrap();
    assert_eq!(db.spec.spec.type_, ServiceImportType::Headless, "untouched");
    assert_eq!(port_numbers(&db), [(String::new(), 5432)], "untouched");
    assert!(db.labels().get("app.kubernetes.io/managed-by").is_none());

    // 5. A second Link to a cluster named west is refused with a condition
    //    (by the controller, before it could join the clusterset).
    link_with(
        &ec,
        "west-again",
        Some(&admin_kubeconfig(&west)),
        json!({"targetClusterName": "west"}),
    )
    .await;
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    eventually("the duplicate Link to be refused", WAIT, || async {
        match condition(&links, "west-again", "Accepted").await {
            Some((status, message))
                if status == "False"
                    && message
                        .contains("strait-multicluster/west already mirrors cluster \"west\"") =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        condition(&links, "west", "ClustersetMember")
            .await
            .map(|c| c.0)
            .as_deref(),
        Some("True")
    );

    assert_eq!(
        marked(&ec, "ext").await.unwrap(),
        None,
        "an invalid export marks nothing"
    );

    // A broken Link loses nothing: east keeps west's part of web until the
    // credentials work again.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(ec.clone(), "strait-multicluster");
    let good = secrets.get("cluster-credentials-west").await.unwrap();
    secrets
        .patch(
            "cluster-credentials-west",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"kubeconfig": "not a kubeconfig"}})),
        )
        .await
        .unwrap();
    until("the Link to report its credentials broken", || async {
        match condition(&links, "west", "CredentialsValid").await {
            Some((status, _)) if status == "False" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(11)).await; // a periodic pass, at least
    let web = imports.get("web").await.unwrap();
    assert_eq!(clusters(&web), ["east", "west"], "west's part is kept");
    assert!(
        Api::<EndpointSlice>::namespaced(ec.clone(), "shop")
            .get_opt(&format!("{derived}-west"))
            .await
            .unwrap()
            .is_some(),
        "west's slice is kept"
    );
    secrets
        .patch(
            "cluster-credentials-west",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": good.data})),
        )
        .await
        .unwrap();
    until("the Link to work again", || async {
        match condition(&links, "west", "CredentialsValid").await {
            Some((status, _)) if status == "True" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // 6. Unexported everywhere: the imports and their derived Services go.
    for client in [&ec, &wc] {
        Api::<ServiceExport>::namespaced(client.clone(), "shop")
            .delete("web", &DeleteParams::default())
            .await
            .unwrap();
    }
    for (client, cluster) in [(&ec, "east"), (&wc, "west")] {
        let api: Api<ServiceImport> = Api::namespaced(client.clone(), "shop");
        eventually(
            &format!("web's import gone from {cluster}"),
            WAIT,
            || async {
                match api.get_opt("web").await {
                    Ok(None) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
        until(&format!("web unmarked in {cluster}"), || async {
            (marked(client, "web").await?.is_none())
                .then_some(())
                .ok_or("still marked".to_string())
        })
        .await;
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "shop");
        until(&format!("web's slices gone from {cluster}"), || async {
            let left: Vec<String> = slices
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .filter(|s| {
                    s.labels()
                        .get("multicluster.kubernetes.io/service-name")
                        .map(String::as_str)
                        == Some("web")
                })
                .map(|s| s.name_any())
                .collect();
            left.is_empty().then_some(()).ok_or(format!("{left:?}"))
        })
        .await;
    }
    for t in tasks {
        t.abort();
    }
}

fn mirror(kubeconfig: &str, cluster_name: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strait-mirror"));
    cmd.env("KUBECONFIG", kubeconfig)
        .args([
            "--no-gateway-probe",
            "--admin-addr",
            "127.0.0.1:0",
            "--cluster-name",
            cluster_name,
        ])
        .stdout(Stdio::null());
    cmd
}

/// `--cluster-name` is published as the ClusterProperty naming the cluster,
/// and a controller told another name than the one published refuses to run,
/// saying which and how to fix it.
#[tokio::test(flavor = "multi_thread")]
async fn the_cluster_name_is_published_once_and_never_contradicted() {
    let cluster = Cluster::start("clusterprop").await.unwrap();
    let client = cluster.client();
    install_crd(&client).await;
    let kubeconfig = cluster.kubeconfig_path().display().to_string();

    // Started before the ClusterProperty API exists: it waits for it.
    let mut east = mirror(&kubeconfig, "east").spawn().unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    install_mcs_crds(&client).await;
    let properties: Api<ClusterProperty> = Api::all(client.clone());
    eventually("the ClusterProperty to say east", WAIT, || async {
        match properties.get_opt(CLUSTER_ID_PROPERTY).await {
            Ok(Some(p)) if p.spec.value == "east" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // A restart with the same name is fine (still running after a moment).
    east.kill().unwrap();
    east.wait().unwrap();
    let mut again = mirror(&kubeconfig, "east").spawn().unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        again.try_wait().unwrap().is_none(),
        "restart with the same name"
    );
    again.kill().unwrap();
    again.wait().unwrap();

    let out = mirror(&kubeconfig, "west").output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("says \"east\"")
            && stderr.contains("\"west\"")
            && stderr.contains("strait install --cluster-name east"),
        "{stderr}"
    );
    assert_eq!(
        properties
            .get(CLUSTER_ID_PROPERTY)
            .await
            .unwrap()
            .spec
            .value,
        "east",
        "the published name is left alone"
    );
}
