//! Starting the control plane's components: etcd, the API server, the
//! controller manager and, for real nodes, the scheduler and CoreDNS.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use kube::Api;

use super::{CONTROLLERS, Cluster, ClusterError, wait_ready};
use crate::http_get;
use crate::process::ChildProcess;

impl Cluster {
    pub(super) fn spawn(
        &self,
        component: &'static str,
        args: Vec<String>,
    ) -> Result<ChildProcess, ClusterError> {
        let log = self.root.join("logs").join(format!("{component}.log"));
        let mut full = vec![component.to_string()];
        full.extend(args);
        ChildProcess::spawn(component, &self.binary, &full, &log).map_err(|source| {
            ClusterError::Spawn {
                cluster: self.config.name.clone(),
                component,
                source,
            }
        })
    }

    pub(super) async fn start_etcd(&mut self) -> Result<(), ClusterError> {
        let client_url = format!("http://127.0.0.1:{}", self.ports.etcd_client);
        let peer_url = format!("http://127.0.0.1:{}", self.ports.etcd_peer);
        let args = vec![
            "--name=testenv".into(),
            format!("--data-dir={}", self.root.join("etcd").display()),
            format!("--listen-client-urls={client_url}"),
            format!("--advertise-client-urls={client_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=testenv={peer_url}"),
            // Test data is thrown away: skip fsync, it is most of etcd's latency.
            "--unsafe-no-fsync=true".into(),
            "--log-level=warn".into(),
        ];
        let mut child = self.spawn("etcd", args)?;
        let addr = SocketAddr::from(([127, 0, 0, 1], self.ports.etcd_client));
        wait_ready(&self.config.name, "etcd", &mut child, || async {
            match http_get(addr, "/health").await {
                Ok(body) if body.contains("\"health\":\"true\"") => Ok(()),
                Ok(body) => Err(format!("/health said {body}")),
                Err(e) => Err(format!("/health: {e}")),
            }
        })
        .await?;
        self.etcd = Some(child);
        Ok(())
    }

    pub(super) fn apiserver_args(&self) -> Vec<String> {
        let f = &self.pki_files;
        let mut args = vec![
            format!("--etcd-servers=http://127.0.0.1:{}", self.ports.etcd_client),
            format!("--bind-address={}", self.config.bind_address),
            format!("--advertise-address={}", self.config.bind_address),
            format!("--secure-port={}", self.ports.apiserver),
            format!("--cert-dir={}", self.root.join("pki").display()),
            format!("--tls-cert-file={}", f.apiserver_cert.display()),
            format!("--tls-private-key-file={}", f.apiserver_key.display()),
            format!("--client-ca-file={}", f.ca_cert.display()),
            if self.config.real_nodes {
                "--authorization-mode=Node,RBAC".into()
            } else {
                "--authorization-mode=RBAC".into()
            },
            format!(
                "--service-account-issuer={}",
                self.config.service_account_issuer
            ),
            format!(
                "--service-account-key-file={}",
                f.service_account_pub.display()
            ),
            format!(
                "--service-account-signing-key-file={}",
                f.service_account_key.display()
            ),
            format!("--service-cluster-ip-range={}", self.config.service_cidr),
            // The `kubernetes` Service's endpoints would be a loopback address,
            // which EndpointSlice validation rejects; only real pods need them.
            if self.config.real_nodes {
                "--endpoint-reconciler-type=lease".into()
            } else {
                "--endpoint-reconciler-type=none".into()
            },
            // Flow control costs start-up time and matters only under real load.
            "--enable-priority-and-fairness=false".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        if self.config.real_nodes {
            let kubelet_client = self.root.join("pki").join("kubelet-client");
            args.extend([
                "--enable-admission-plugins=NodeRestriction".into(),
                // Nodes have no DNS names here: logs and exec dial the node IP.
                "--kubelet-preferred-address-types=InternalIP".into(),
                format!(
                    "--kubelet-client-certificate={}",
                    kubelet_client.with_extension("crt").display()
                ),
                format!(
                    "--kubelet-client-key={}",
                    kubelet_client.with_extension("key").display()
                ),
            ]);
        }
        args.extend(self.config.extra_apiserver_args.iter().cloned());
        args
    }

    /// Starts (or restarts, after [`Cluster::stop_apiserver`]) the API server on
    /// its same port, and waits until `/readyz` answers ok.
    pub async fn start_apiserver(&mut self) -> Result<(), ClusterError> {
        let mut child = self.spawn("kube-apiserver", self.apiserver_args())?;
        let client = self.client.clone();
        wait_ready(&self.config.name, "kube-apiserver", &mut child, || {
            let client = client.clone();
            async move {
                let req = http::Request::get("/readyz")
                    .body(Vec::new())
                    .map_err(|e| e.to_string())?;
                client
                    .request_text(req)
                    .await
                    .map(|_| ())
                    .map_err(|e| format!("/readyz: {e}"))
            }
        })
        .await?;
        self.apiserver = Some(child);
        Ok(())
    }

    /// Stops the API server (SIGTERM, then SIGKILL): clients see the remote
    /// cluster go away while etcd keeps its data for [`Cluster::start_apiserver`].
    pub fn stop_apiserver(&mut self) {
        if let Some(mut child) = self.apiserver.take() {
            child.stop(Duration::from_secs(5));
        }
    }

    pub(super) async fn start_controller_manager(&mut self) -> Result<(), ClusterError> {
        let mut args = vec![
            format!(
                "--kubeconfig={}",
                self.root.join("controller-manager.kubeconfig").display()
            ),
            if self.config.real_nodes {
                // Kubelets run pods: Deployments, DaemonSets, node lifecycle… all of them.
                "--controllers=*".into()
            } else {
                format!("--controllers={}", CONTROLLERS.join(","))
            },
            format!("--cluster-name={}", self.config.name),
            format!("--root-ca-file={}", self.pki_files.ca_cert.display()),
            format!(
                "--service-account-private-key-file={}",
                self.pki_files.service_account_key.display()
            ),
            format!(
                "--cluster-signing-cert-file={}",
                self.pki_files.ca_cert.display()
            ),
            format!(
                "--cluster-signing-key-file={}",
                self.pki_files.ca_key.display()
            ),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", self.ports.controller_manager),
            format!(
                "--cert-dir={}",
                self.root.join("pki").join("controller-manager").display()
            ),
            "--leader-elect=false".into(),
            // Each controller acts as its own ServiceAccount with its own RBAC role, as in
            // a real cluster (the root-CA publisher may not write ConfigMaps otherwise).
            "--use-service-account-credentials=true".into(),
            "--kube-api-qps=200".into(),
            "--kube-api-burst=400".into(),
            "--v=1".into(),
        ];
        if self.config.real_nodes {
            // A node whose kubelet stops renewing its lease shows NotReady
            // after 20 s instead of 40 s (kubelets renew every 10 s).
            args.push("--node-monitor-grace-period=20s".into());
        }
        let mut child = self.spawn("kube-controller-manager", args)?;
        // Ready when its controllers have visibly run: the serviceaccount controller
        // made `default`, the root-CA publisher wrote `kube-root-ca.crt`.
        let client = self.client.clone();
        wait_ready(
            &self.config.name,
            "kube-controller-manager",
            &mut child,
            || {
                let client = client.clone();
                async move {
                    Api::<ServiceAccount>::namespaced(client.clone(), "default")
                        .get("default")
                        .await
                        .map_err(|e| format!("ServiceAccount default/default: {e}"))?;
                    Api::<ConfigMap>::namespaced(client, "default")
                        .get("kube-root-ca.crt")
                        .await
                        .map_err(|e| format!("ConfigMap default/kube-root-ca.crt: {e}"))?;
                    Ok(())
                }
            },
        )
        .await?;
        self.controller_manager = Some(child);
        Ok(())
    }

    /// The scheduler of a real-node cluster (bootstrap RBAC grants its user).
    pub(super) fn start_scheduler(&mut self) -> Result<(), ClusterError> {
        let kubeconfig =
            self.write_client_kubeconfig("scheduler.kubeconfig", "system:kube-scheduler", None)?;
        let args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", self.ports.scheduler),
            format!(
                "--cert-dir={}",
                self.root.join("pki").join("scheduler").display()
            ),
            "--v=1".into(),
        ];
        self.scheduler = Some(self.spawn("kube-scheduler", args)?);
        Ok(())
    }

    /// CoreDNS for a real-node cluster: a process on the host's LAN address
    /// (as the API server is), behind the `kube-system/kube-dns` Service at
    /// the Service range's `.10`, which kube-proxy on every node translates.
    /// As in a kubeadm cluster, its Corefile is the ConfigMap
    /// `kube-system/coredns` (testenv copies it to the file CoreDNS reads, as
    /// the kubelet does for a CoreDNS pod; CoreDNS's `reload` loads changes),
    /// and it authenticates as the ServiceAccount `kube-system/coredns`, so
    /// what `strait install` applies to cluster DNS is applied here as anywhere.
    pub(super) async fn start_coredns(&mut self) -> Result<(), ClusterError> {
        let name = self.config.name.clone();
        let api_error = |what: &str, e: kube::Error| ClusterError::Client {
            cluster: name.clone(),
            message: format!("{what}: {e}"),
        };
        let kubeconfig = self.write_client_kubeconfig(
            "coredns.kubeconfig",
            crate::workloads::COREDNS_USER,
            Some("system:serviceaccounts"),
        )?;
        let corefile = format!(
            r#".:53 {{
    bind {ip}
    errors
    ready 127.0.0.1:{ready}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} {context}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
    reload 2s 1s
    loadbalance
}}
"#,
            ip = self.config.bind_address,
            ready = self.ports.coredns_ready,
            kubeconfig = kubeconfig.display(),
            context = self.config.name,
        );
        crate::workloads::create_cluster_dns(
            &self.client,
            self.config.bind_address,
            self.config.service_ip(10),
            &corefile,
        )
        .await
        .map_err(|e| api_error("cluster DNS objects", e))?;
        let corefile_path = self.root.join("Corefile");
        std::fs::write(&corefile_path, &corefile).map_err(|source| ClusterError::Setup {
            cluster: self.config.name.clone(),
            what: "the Corefile",
            source,
        })?;
        let mut child = self.spawn(
            "coredns",
            vec!["-conf".into(), corefile_path.display().to_string()],
        )?;
        let ready = SocketAddr::from(([127, 0, 0, 1], self.ports.coredns_ready));
        wait_ready(&self.config.name, "coredns", &mut child, || async move {
            match http_get(ready, "/ready").await {
                Ok(answer) if answer.starts_with("HTTP/1.1 200") => Ok(()),
                Ok(answer) => Err(format!("/ready said {answer}")),
                Err(e) => Err(format!("/ready: {e}")),
            }
        })
        .await?;
        self.coredns = Some(child);
        self.corefile_sync = Some(tokio::spawn(sync_corefile(
            self.client.clone(),
            corefile_path,
            corefile,
        )));
        Ok(())
    }
}

/// Copies the Corefile of ConfigMap `kube-system/coredns` to `path` whenever
/// it changes (polled each second), as the kubelet refreshes a ConfigMap
/// volume; runs until aborted with the cluster.
async fn sync_corefile(client: kube::Client, path: std::path::PathBuf, mut written: String) {
    let api: Api<ConfigMap> = Api::namespaced(client, "kube-system");
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Ok(Some(cm)) = api.get_opt(crate::workloads::COREDNS_CONFIGMAP).await else {
            continue;
        };
        let Some(corefile) = cm.data.and_then(|mut d| d.remove("Corefile")) else {
            continue;
        };
        if corefile != written {
            match std::fs::write(&path, &corefile) {
                Ok(()) => written = corefile,
                Err(e) => eprintln!("testenv: writing {}: {e}", path.display()),
            }
        }
    }
}
