//! The Kubernetes Multi-Cluster Services API (KEP-1645, `multicluster.x-k8s.io`)
//! and the cluster's name (KEP-2149, `about.k8s.io` `ClusterProperty`), as
//! Strait's own Rust types. The CRDs Strait installs are generated from these
//! (`strait-mirror crd`, [`crds`]), storing `v1beta1`, the version
//! sigs.k8s.io/mcs-api v0.5 stores and its conformance suite speaks, and
//! serving the same schema as `v1alpha1` too: CoreDNS's `multicluster` option
//! (1.12.2 and later) still reads ServiceImports as `v1alpha1`, whose fields
//! Strait's are.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::SessionAffinityConfig;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of ServiceExport and ServiceImport.
pub const MCS_GROUP: &str = "multicluster.x-k8s.io";
/// EndpointSlice label: the multi-cluster service a slice belongs to.
pub const LABEL_SERVICE_NAME: &str = "multicluster.kubernetes.io/service-name";
/// EndpointSlice label: the cluster whose endpoints a slice lists.
pub const LABEL_SOURCE_CLUSTER: &str = "multicluster.kubernetes.io/source-cluster";
/// On the ServiceImports, derived Services and slices Strait writes.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "strait-mirror");
/// The ClusterProperty naming this cluster (KEP-2149).
pub const CLUSTER_ID_PROPERTY: &str = "cluster.clusterset.k8s.io";
/// The ClusterProperty naming the clusterset this cluster belongs to.
pub const CLUSTERSET_PROPERTY: &str = "clusterset.k8s.io";

/// Declares that the Service of the same name and namespace is exported to
/// every cluster of the clusterset. Upstream's `spec` is optional (most exports
/// have none): the object's body is this struct, flattened onto the root
/// (`#[kube(no_spec)]`), holding an optional `spec`, so an export without one
/// reads as the default rather than failing.
#[derive(CustomResource, Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[kube(
    group = "multicluster.x-k8s.io",
    version = "v1beta1",
    kind = "ServiceExport",
    namespaced,
    no_spec,
    status = "ServiceExportStatus",
    shortname = "svcex",
    shortname = "svcexport",
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct ServiceExportBody {
    #[serde(default)]
    pub spec: ServiceExportSpec,
}

/// What an export asks beyond the Service itself.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceExportSpec {
    /// Labels put on the ServiceImport in every cluster.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub exported_labels: BTreeMap<String, String>,
    /// Annotations put on the ServiceImport in every cluster.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub exported_annotations: BTreeMap<String, String>,
}

/// Where an export stands: conditions `Valid`, `Ready` and `Conflict`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceExportStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// A service of the clusterset as this cluster sees it: written by the
/// controller in every cluster, the exporting ones included.
#[derive(CustomResource, Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[kube(
    group = "multicluster.x-k8s.io",
    version = "v1beta1",
    kind = "ServiceImport",
    namespaced,
    status = "ServiceImportStatus",
    shortname = "svcim",
    shortname = "svcimport",
    printcolumn = r#"{"name":"Type","type":"string","description":"The type of this ServiceImport","jsonPath":".spec.type"}"#,
    printcolumn = r#"{"name":"IP","type":"string","description":"The VIP for this ServiceImport","jsonPath":".spec.ips"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    no_spec
)]
pub struct ServiceImportBody {
    /// Optional upstream, like the export's: one written by another
    /// controller without it still reads.
    #[serde(default)]
    pub spec: ServiceImportSpec,
}

/// The service's shape across the clusterset.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceImportSpec {
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub ports: Vec<ServicePort>,
    /// The clusterset IP (type `ClusterSetIP` only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 2))]
    pub ips: Vec<String>,
    #[serde(rename = "type")]
    pub type_: ServiceImportType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["None", "ClientIP"]))]
    pub session_affinity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity_config: Option<SessionAffinityConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 2))]
    pub ip_families: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub internal_traffic_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_distribution: Option<String>,
}

/// How a ServiceImport is reached.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
pub enum ServiceImportType {
    /// One virtual IP for the clusterset.
    #[default]
    ClusterSetIP,
    /// The endpoints' own addresses.
    Headless,
}

/// A port of a ServiceImport (the Service port without its target).
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    #[schemars(extend("format" = "int32"))]
    pub port: i32,
}

/// Which clusters back a ServiceImport, and its conditions.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceImportStatus {
    /// `Present` when EndpointSlices of this import exist in this cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_slice_objects: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["cluster"]))]
    pub clusters: Vec<ClusterStatus>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// One cluster that exports the service.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
pub struct ClusterStatus {
    pub cluster: String,
}

/// A property of this cluster (KEP-2149); `cluster.clusterset.k8s.io` holds
/// its name within the clusterset.
#[derive(CustomResource, Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[kube(
    group = "about.k8s.io",
    version = "v1alpha1",
    kind = "ClusterProperty",
    // `*.k8s.io` groups are protected: the API server wants the KEP that approved the API.
    annotation("api-approved.kubernetes.io", "https://github.com/kubernetes/enhancements/pull/3084"),
    printcolumn = r#"{"name":"Value","type":"string","jsonPath":".spec.value"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct ClusterPropertySpec {
    /// The property's value.
    #[schemars(length(min = 1, max = 128000))]
    pub value: String,
}

/// The CRDs of the MCS API and of ClusterProperty, as installed: ServiceExport
/// and ServiceImport store `v1beta1` and also serve it as `v1alpha1` (same
/// schema, no conversion: the API server only rewrites `apiVersion`).
pub fn crds()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    use kube::CustomResourceExt;
    let mut mcs = [ServiceExport::crd(), ServiceImport::crd()];
    for crd in &mut mcs {
        let mut alpha = crd.spec.versions[0].clone();
        alpha.name = "v1alpha1".into();
        alpha.storage = false;
        crd.spec.versions.push(alpha);
    }
    let [export, import] = mcs;
    vec![export, import, ClusterProperty::crd()]
}

/// Which clusters serve a clusterset service's callers (`strait.dev/affinity`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Affinity {
    /// This cluster's pods while any is ready, else the other clusters.
    #[default]
    Local,
    /// The other clusters while any serves it, else this cluster's pods.
    Remote,
    /// Every ready endpoint of every cluster.
    None,
}

impl Affinity {
    /// `local`, `remote` or `none`; `PreferClose` (a Service's
    /// `trafficDistribution`) means `local`.
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "local" | "preferclose" => Some(Affinity::Local),
            "remote" => Some(Affinity::Remote),
            "none" => Some(Affinity::None),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Affinity::Local => "local",
            Affinity::Remote => "remote",
            Affinity::None => "none",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn crds_are_named_and_scoped_as_upstream() {
        let export = ServiceExport::crd();
        assert_eq!(
            export.metadata.name.as_deref(),
            Some("serviceexports.multicluster.x-k8s.io")
        );
        assert_eq!(export.spec.scope, "Namespaced");
        let import = ServiceImport::crd();
        assert_eq!(
            import.metadata.name.as_deref(),
            Some("serviceimports.multicluster.x-k8s.io")
        );
        assert_eq!(
            import.spec.names.short_names.as_deref(),
            Some(&["svcim".to_string(), "svcimport".to_string()][..])
        );
        let property = ClusterProperty::crd();
        assert_eq!(
            property.metadata.name.as_deref(),
            Some("clusterproperties.about.k8s.io")
        );
        assert_eq!(property.spec.scope, "Cluster");
        for crd in [&export, &import] {
            let status = crd.spec.versions[0].subresources.as_ref().unwrap();
            assert!(status.status.is_some(), "{crd:?}");
        }
        for crd in [export, import, property] {
            let json = serde_json::to_string(&crd).unwrap();
            assert!(!json.contains("\"format\":\"uint"), "{json}");
        }
    }

    #[test]
    fn the_installed_crds_store_v1beta1_and_serve_v1alpha1_too() {
        let crds = crds();
        assert_eq!(crds.len(), 3);
        for crd in &crds[..2] {
            let versions: Vec<_> = crd
                .spec
                .versions
                .iter()
                .map(|v| (v.name.as_str(), v.served, v.storage))
                .collect();
            assert_eq!(
                versions,
                [("v1beta1", true, true), ("v1alpha1", true, false)]
            );
            assert_eq!(crd.spec.versions[0].schema, crd.spec.versions[1].schema);
        }
        assert_eq!(crds[2], ClusterProperty::crd());
    }

    #[test]
    fn a_service_import_reads_as_upstream_writes_it() {
        let import: ServiceImport = serde_json::from_value(serde_json::json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1",
            "kind": "ServiceImport",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"type": "ClusterSetIP", "ips": ["10.96.0.10"],
                     "ports": [{"name": "http", "protocol": "TCP", "port": 80}],
                     "sessionAffinity": "None"},
            "status": {"clusters": [{"cluster": "east"}]}
        }))
        .unwrap();
        assert_eq!(import.spec.spec.type_, ServiceImportType::ClusterSetIP);
        assert_eq!(import.spec.spec.ports[0].port, 80);
        assert_eq!(import.status.unwrap().clusters[0].cluster, "east");
    }

    #[test]
    fn affinities_parse() {
        assert_eq!(Affinity::parse("Local"), Some(Affinity::Local));
        assert_eq!(Affinity::parse("PreferClose"), Some(Affinity::Local));
        assert_eq!(Affinity::parse("remote"), Some(Affinity::Remote));
        assert_eq!(Affinity::parse(" none "), Some(Affinity::None));
        assert_eq!(Affinity::parse("nearest"), None);
        assert_eq!(Affinity::default().as_str(), "local");
    }

    #[test]
    fn an_export_without_spec_is_an_export() {
        let export: ServiceExport = serde_json::from_value(serde_json::json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1",
            "kind": "ServiceExport",
            "metadata": {"name": "web", "namespace": "shop"},
        }))
        .unwrap();
        assert_eq!(export.spec.spec, ServiceExportSpec::default());
        let json = serde_json::to_value(ServiceExport::new("web", Default::default())).unwrap();
        assert_eq!(json["kind"], "ServiceExport");
        assert_eq!(json["apiVersion"], "multicluster.x-k8s.io/v1beta1");
    }
}
