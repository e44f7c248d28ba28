//! The demo's workloads as manifests: west's sample service and east's caller.

use super::{CALLER_SA, NAMESPACE, SERVICE};
use crate::images;

/// West's sample service: a strait-backend pod on each node, and its Service.
pub(super) fn web_manifests() -> String {
    let pod = |name: &str, node: &str| {
        format!(
            r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NAMESPACE}, labels: {{app: {SERVICE}}}}}
spec:
  serviceAccountName: {SERVICE}
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  containers:
    - name: web
      image: {image}
      args: ["--name={name}", "--http=0.0.0.0:8080"]
      ports: [{{name: http, containerPort: 8080}}]
      readinessProbe: {{httpGet: {{path: /, port: 8080}}, periodSeconds: 1}}
"#,
            image = images::BACKEND_IMAGE
        )
    };
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NAMESPACE}}}\n---\n\
         apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {SERVICE}, namespace: {NAMESPACE}}}\n---\n\
         {}---\n{}---\n\
         apiVersion: v1\nkind: Service\nmetadata: {{name: {SERVICE}, namespace: {NAMESPACE}}}\n\
         spec:\n  selector: {{app: {SERVICE}}}\n  ports: [{{name: http, port: 80, targetPort: http}}]\n",
        pod("web-1", "west-node-1"),
        pod("web-2", "west-node-2"),
    )
}

/// East's caller: a pod of ServiceAccount `client` whose app uses its node
/// proxy through the strait-proxy Service.
pub(super) fn caller_manifests() -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: {NAMESPACE}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: {CALLER_SA}, namespace: {NAMESPACE}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: {CALLER_SA}, namespace: {NAMESPACE}}}
spec:
  serviceAccountName: {CALLER_SA}
  nodeSelector: {{kubernetes.io/hostname: east-node-1}}
  containers:
    - name: app
      image: {image}
      args: ["--name={CALLER_SA}", "--http=0.0.0.0:8080"]
      env:
        - name: http_proxy
          value: http://strait-proxy.strait-system.svc.cluster.local:4140
"#,
        image = images::BACKEND_IMAGE
    )
}
