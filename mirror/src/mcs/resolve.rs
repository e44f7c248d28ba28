//! What the clusterset's exports of one service add up to (KEP-1645), as pure
//! functions: whether a local export is valid, what an exporting cluster
//! publishes, and the ServiceImport every cluster derives from all exports,
//! with the conflicts the oldest export wins.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Service, SessionAffinityConfig};
use kube::ResourceExt;
use serde::{Deserialize, Serialize};
use strait_mesh::mcs::{Affinity, ServiceImportType, ServicePort};
use strait_mesh::names::AFFINITY_ANNOTATION;

/// What a cluster exports of one Service: published by the exporting
/// cluster's controller on its ServiceExport (annotation
/// [`EXPORTED_SERVICE_ANNOTATION`]), read by every other cluster.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExportedService {
    #[serde(rename = "type")]
    pub type_: ServiceImportType,
    pub ports: Vec<ServicePort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity_config: Option<SessionAffinityConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub internal_traffic_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_distribution: Option<String>,
    /// The Service's IP families (a headless ServiceImport lists them; a
    /// ClusterSetIP one takes its derived Service's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_families: Vec<String>,
    /// `strait.dev/affinity` of the export, else of the Service, else
    /// `local` for `trafficDistribution: PreferClose`; unset: `local`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "affinity_serde"
    )]
    pub affinity: Option<Affinity>,
}

mod affinity_serde {
    use serde::{Deserialize, Deserializer, Serializer};
    use strait_mesh::mcs::Affinity;

    pub fn serialize<S: Serializer>(a: &Option<Affinity>, s: S) -> Result<S::Ok, S::Error> {
        match a {
            Some(a) => s.serialize_str(a.as_str()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Affinity>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.and_then(|v| Affinity::parse(&v)))
    }
}

/// The annotation on a ServiceExport that carries its [`ExportedService`].
pub const EXPORTED_SERVICE_ANNOTATION: &str = "multicluster.strait.dev/exported-service";

/// Whether a ServiceExport may be exported, and what it exports.
#[derive(Clone, Debug, PartialEq)]
pub enum Validity {
    Valid(ExportedService),
    /// No Service of that name in the namespace.
    NoService,
    /// An ExternalName Service: nothing to route to.
    InvalidServiceType(String),
}

impl Validity {
    /// The Valid condition's (status, reason, message).
    pub fn condition(&self, ns: &str, name: &str) -> (&'static str, &'static str, String) {
        match self {
            Validity::Valid(_) => ("True", "Valid", format!("Service {ns}/{name} is exported")),
            Validity::NoService => (
                "False",
                "NoService",
                format!("no Service {ns}/{name}: create it, or delete this ServiceExport"),
            ),
            Validity::InvalidServiceType(t) => (
                "False",
                "InvalidServiceType",
                format!(
                    "Service {ns}/{name} is of type {t}, which cannot be exported (it has no endpoints): export a ClusterIP or headless Service"
                ),
            ),
        }
    }
}

/// What a local Service exports, if anything (`export_annotations`: the
/// ServiceExport's, which may set the affinity).
pub fn validate(
    service: Option<&Service>,
    export_annotations: &BTreeMap<String, String>,
) -> Validity {
    let Some(spec) = service.and_then(|s| s.spec.as_ref()) else {
        return Validity::NoService;
    };
    if let Some(t) = spec.type_.as_deref()
        && t == "ExternalName"
    {
        return Validity::InvalidServiceType(t.to_string());
    }
    let type_ = if spec.cluster_ip.as_deref() == Some("None") {
        ServiceImportType::Headless
    } else {
        ServiceImportType::ClusterSetIP
    };
    let ports = spec
        .ports
        .iter()
        .flatten()
        .map(|p| ServicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol: Some(p.protocol.clone().unwrap_or_else(|| "TCP".into())),
            app_protocol: p.app_protocol.clone(),
            port: p.port,
        })
        .collect();
    let service_annotations = service
        .map(|s| s.annotations())
        .cloned()
        .unwrap_or_default();
    let affinity = export_annotations
        .get(AFFINITY_ANNOTATION)
        .or_else(|| service_annotations.get(AFFINITY_ANNOTATION))
        .or(spec.traffic_distribution.as_ref())
        .and_then(|v| Affinity::parse(v));
    Validity::Valid(ExportedService {
        affinity,
        type_,
        ports,
        session_affinity: spec.session_affinity.clone(),
        session_affinity_config: spec.session_affinity_config.clone(),
        internal_traffic_policy: spec.internal_traffic_policy.clone(),
        traffic_distribution: spec.traffic_distribution.clone(),
        ip_families: spec.ip_families.clone().unwrap_or_default(),
    })
}

/// One cluster's valid export of the service.
#[derive(Clone, Debug, PartialEq)]
pub struct Export {
    pub cluster: String,
    /// The ServiceExport's creation, seconds since the epoch: the oldest wins.
    pub created: i64,
    pub service: ExportedService,
    pub exported_labels: BTreeMap<String, String>,
    pub exported_annotations: BTreeMap<String, String>,
}

/// The ServiceImport every cluster derives, and the conflicts found.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// The oldest export's properties, ports the union (the oldest export's
    /// definition of a port name wins).
    pub service: ExportedService,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// Clusters whose endpoints back the import (sorted): every export but
    /// those of another type than the oldest's.
    pub clusters: Vec<String>,
    /// Conflict reasons, in the KEP's order (empty: none).
    pub conflicts: Vec<&'static str>,
    /// What conflicts, for the condition's message.
    pub details: Vec<String>,
}

impl Resolved {
    /// The Conflict condition's (status, reason, message).
    pub fn conflict_condition(&self) -> (&'static str, String, String) {
        if self.conflicts.is_empty() {
            return (
                "False",
                "NoConflicts".into(),
                format!("exported by {} consistently", self.clusters.join(", ")),
            );
        }
        (
            "True",
            self.conflicts.join(","),
            format!("{}; the oldest export wins", self.details.join("; ")),
        )
    }
}

/// Resolves the valid exports of one service (in any order); `None` without any.
pub fn resolve(exports: &[Export]) -> Option<Resolved> {
    let mut exports: Vec<&Export> = exports.iter().collect();
    exports.sort_by(|a, b| (a.created, &a.cluster).cmp(&(b.created, &b.cluster)));
    let oldest = *exports.first()?;
    let mut out = Resolved {
        service: oldest.service.clone(),
        labels: oldest.exported_labels.clone(),
        annotations: oldest.exported_annotations.clone(),
        clusters: Vec::new(),
        conflicts: Vec::new(),
        details: Vec::new(),
    };
    let conflict = |reason: &'static str, detail: String, out: &mut Resolved| {
        if !out.conflicts.contains(&reason) {
            out.conflicts.push(reason);
        }
        out.details.push(detail);
    };
    let mut ports: Vec<ServicePort> = Vec::new();
    for e in &exports {
        let s = &e.service;
        if s.type_ != oldest.service.type_ {
            conflict(
                "TypeConflict",
                format!(
                    "{} exports it as {:?}, {} as {:?} (not served from {})",
                    oldest.cluster, oldest.service.type_, e.cluster, s.type_, e.cluster
                ),
                &mut out,
            );
            continue;
        }
        out.clusters.push(e.cluster.clone());
        let mut mine = s.ports.clone();
        mine.sort_by(|a, b| a.name.cmp(&b.name));
        let mut theirs = oldest.service.ports.clone();
        theirs.sort_by(|a, b| a.name.cmp(&b.name));
        if mine != theirs {
            conflict(
                "PortConflict",
                format!(
                    "{} and {} export different ports",
                    oldest.cluster, e.cluster
                ),
                &mut out,
            );
        }
        for family in &s.ip_families {
            if !out.service.ip_families.contains(family) {
                out.service.ip_families.push(family.clone());
            }
        }
        for p in &s.ports {
            match ports.iter().find(|q| q.name == p.name) {
                None => ports.push(p.clone()),
                Some(q) if q != p => {} // the older definition stays
                Some(_) => {}
            }
        }
        let differs = |what: &'static str, reason: &'static str, same: bool, out: &mut Resolved| {
            if !same {
                conflict(
                    reason,
                    format!("{} and {} differ in {what}", oldest.cluster, e.cluster),
                    out,
                );
            }
        };
        let o = &oldest.service;
        differs(
            "sessionAffinity",
            "SessionAffinityConflict",
            s.session_affinity == o.session_affinity,
            &mut out,
        );
        differs(
            "sessionAffinityConfig",
            "SessionAffinityConfigConflict",
            s.session_affinity_config == o.session_affinity_config,
            &mut out,
        );
        differs(
            "internalTrafficPolicy",
            "InternalTrafficPolicyConflict",
            s.internal_traffic_policy == o.internal_traffic_policy,
            &mut out,
        );
        differs(
            "trafficDistribution",
            "TrafficDistributionConflict",
            s.traffic_distribution == o.traffic_distribution,
            &mut out,
        );
        differs(
            "exportedLabels",
            "LabelsConflict",
            e.exported_labels == oldest.exported_labels,
            &mut out,
        );
        differs(
            "exportedAnnotations",
            "AnnotationsConflict",
            e.exported_annotations == oldest.exported_annotations,
            &mut out,
        );
    }
    ports.sort_by(|a, b| a.name.cmp(&b.name));
    out.service.ports = ports;
    out.clusters.sort();
    out.clusters.dedup();
    out.details.dedup();
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(name: &str, port: i32, protocol: &str) -> ServicePort {
        ServicePort {
            name: name.into(),
            protocol: Some(protocol.into()),
            app_protocol: None,
            port,
        }
    }

    fn export(cluster: &str, created: i64, ports: Vec<ServicePort>) -> Export {
        Export {
            cluster: cluster.into(),
            created,
            service: ExportedService {
                ports,
                ..Default::default()
            },
            exported_labels: Default::default(),
            exported_annotations: Default::default(),
        }
    }

    fn service(json: serde_json::Value) -> Service {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn validity_follows_the_service() {
        assert_eq!(validate(None, &Default::default()), Validity::NoService);
        let ext = service(
            serde_json::json!({"spec": {"type": "ExternalName", "externalName": "example.com"}}),
        );
        assert!(
            matches!(validate(Some(&ext), &Default::default()), Validity::InvalidServiceType(t) if t == "ExternalName")
        );
        let headless =
            service(serde_json::json!({"spec": {"clusterIP": "None", "ports": [{"port": 80}]}}));
        let Validity::Valid(s) = validate(Some(&headless), &Default::default()) else {
            panic!()
        };
        assert_eq!(s.type_, ServiceImportType::Headless);
        assert_eq!(s.ports, vec![port("", 80, "TCP")]);
        let web = service(
            serde_json::json!({"spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP", "appProtocol": "http"}],
            "sessionAffinity": "ClientIP", "internalTrafficPolicy": "Cluster", "trafficDistribution": "PreferClose"}}),
        );
        let Validity::Valid(s) = validate(Some(&web), &Default::default()) else {
            panic!()
        };
        assert_eq!(s.type_, ServiceImportType::ClusterSetIP);
        assert_eq!(s.ports[0].app_protocol.as_deref(), Some("http"));
        assert_eq!(s.session_affinity.as_deref(), Some("ClientIP"));
        assert_eq!(s.traffic_distribution.as_deref(), Some("PreferClose"));
        assert_eq!(s.affinity, Some(Affinity::Local), "PreferClose");
        let export = BTreeMap::from([(AFFINITY_ANNOTATION.to_string(), "remote".to_string())]);
        let Validity::Valid(s) = validate(Some(&web), &export) else {
            panic!()
        };
        assert_eq!(
            s.affinity,
            Some(Affinity::Remote),
            "the export's annotation first"
        );
        let (status, reason, message) = Validity::NoService.condition("shop", "web");
        assert_eq!((status, reason), ("False", "NoService"));
        assert!(message.contains("shop/web"));
    }

    #[test]
    fn identical_exports_do_not_conflict() {
        let a = export("east", 10, vec![port("http", 80, "TCP")]);
        let b = export("west", 20, vec![port("http", 80, "TCP")]);
        let r = resolve(&[b, a]).unwrap();
        assert_eq!(r.clusters, ["east", "west"]);
        assert!(r.conflicts.is_empty());
        assert_eq!(r.conflict_condition().0, "False");
        assert_eq!(r.conflict_condition().1, "NoConflicts");
        assert!(resolve(&[]).is_none());
    }

    /// The suite's "union of the constituent service ports and raise a conflict".
    #[test]
    fn different_ports_are_merged_and_conflict() {
        let a = export("east", 10, vec![port("tcp", 42, "TCP")]);
        let b = export(
            "west",
            20,
            vec![port("tcp", 42, "TCP"), port("stcp", 142, "SCTP")],
        );
        let r = resolve(&[a, b]).unwrap();
        assert_eq!(
            r.service.ports,
            vec![port("stcp", 142, "SCTP"), port("tcp", 42, "TCP")]
        );
        assert_eq!(r.conflicts, ["PortConflict"]);
        assert_eq!(r.clusters, ["east", "west"]);
    }

    /// The suite's "conflicting ports": the same name, another number; the oldest wins.
    #[test]
    fn a_port_redefined_keeps_the_oldest_definition() {
        let a = export("west", 10, vec![port("tcp", 42, "TCP")]);
        let b = export("east", 20, vec![port("tcp", 43, "TCP")]);
        let r = resolve(&[b, a]).unwrap();
        assert_eq!(r.service.ports, vec![port("tcp", 42, "TCP")]);
        assert_eq!(r.conflicts, ["PortConflict"]);
        let (status, reason, message) = r.conflict_condition();
        assert_eq!((status, reason.as_str()), ("True", "PortConflict"));
        assert!(message.contains("west and east"), "{message}");
    }

    #[test]
    fn another_type_conflicts_and_is_not_served() {
        let a = export("east", 10, vec![port("http", 80, "TCP")]);
        let mut b = export("west", 20, vec![port("http", 80, "TCP")]);
        b.service.type_ = ServiceImportType::Headless;
        b.service.session_affinity = Some("ClientIP".into());
        let r = resolve(&[a, b]).unwrap();
        assert_eq!(r.service.type_, ServiceImportType::ClusterSetIP);
        assert_eq!(r.clusters, ["east"]);
        assert_eq!(r.conflicts, ["TypeConflict"]);
    }

    #[test]
    fn properties_come_from_the_oldest_and_each_difference_is_named() {
        let mut a = export("east", 10, vec![port("http", 80, "TCP")]);
        a.service.session_affinity = Some("None".into());
        a.exported_labels.insert("team".into(), "a".into());
        let mut b = a.clone();
        b.cluster = "west".into();
        b.created = 5;
        b.service.session_affinity = Some("ClientIP".into());
        b.service.traffic_distribution = Some("PreferClose".into());
        b.exported_labels.insert("team".into(), "b".into());
        let r = resolve(&[a, b]).unwrap();
        assert_eq!(
            r.service.session_affinity.as_deref(),
            Some("ClientIP"),
            "west is older"
        );
        assert_eq!(r.labels["team"], "b");
        assert_eq!(
            r.conflicts,
            [
                "SessionAffinityConflict",
                "TrafficDistributionConflict",
                "LabelsConflict"
            ]
        );
        assert_eq!(
            r.conflict_condition().1,
            "SessionAffinityConflict,TrafficDistributionConflict,LabelsConflict"
        );
    }

    #[test]
    fn ties_in_age_go_to_the_first_cluster_name() {
        let a = export("west", 10, vec![port("tcp", 1, "TCP")]);
        let b = export("east", 10, vec![port("tcp", 2, "TCP")]);
        assert_eq!(
            resolve(&[a, b]).unwrap().service.ports,
            vec![port("tcp", 2, "TCP")]
        );
    }

    #[test]
    fn the_published_form_round_trips() {
        let s = ExportedService {
            type_: ServiceImportType::Headless,
            ports: vec![port("http", 80, "TCP")],
            ..Default::default()
        };
        let text = serde_json::to_string(&s).unwrap();
        assert!(text.contains("\"type\":\"Headless\""), "{text}");
        assert_eq!(serde_json::from_str::<ExportedService>(&text).unwrap(), s);
    }
}
