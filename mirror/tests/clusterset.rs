//! The clusterset side of the mirror controller (MCS API, KEP-2149), against a
//! real API server and the real binary.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::{Api, CustomResourceExt};
use strait_mesh::mcs::{CLUSTER_ID_PROPERTY, ClusterProperty};
use strait_testenv::Cluster;
use strait_testenv::wait::eventually;

use common::{WAIT, install_crd};

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
    Api::<CustomResourceDefinition>::all(client.clone())
        .patch(
            "clusterproperties.about.k8s.io",
            &PatchParams::apply("test").force(),
            &Patch::Apply(ClusterProperty::crd()),
        )
        .await
        .unwrap();
    let kubeconfig = cluster.kubeconfig_path().display().to_string();

    let mut east = mirror(&kubeconfig, "east").spawn().unwrap();
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
