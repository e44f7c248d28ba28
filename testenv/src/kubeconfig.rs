//! Kubeconfig files for test clusters: one context per cluster, named after it.

use kube::config::{
    AuthInfo, Cluster as KubeCluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster,
    NamedContext,
};

/// A kubeconfig with a single context `name` that authenticates with a client certificate.
pub fn with_client_cert(
    name: &str,
    server: &str,
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Kubeconfig {
    let auth = AuthInfo {
        client_certificate_data: Some(b64(cert_pem)),
        client_key_data: Some(b64(key_pem).into()),
        ..Default::default()
    };
    single(name, server, ca_pem, auth)
}

/// A kubeconfig with a single context `name` that authenticates with a bearer token.
pub fn with_token(name: &str, server: &str, ca_pem: &str, token: &str) -> Kubeconfig {
    let auth = AuthInfo {
        token: Some(token.to_string().into()),
        ..Default::default()
    };
    single(name, server, ca_pem, auth)
}

fn single(name: &str, server: &str, ca_pem: &str, auth: AuthInfo) -> Kubeconfig {
    Kubeconfig {
        clusters: vec![NamedCluster {
            name: name.to_string(),
            cluster: Some(KubeCluster {
                server: Some(server.to_string()),
                certificate_authority_data: Some(b64(ca_pem)),
                ..Default::default()
            }),
            other: Default::default(),
        }],
        auth_infos: vec![NamedAuthInfo {
            name: name.to_string(),
            auth_info: Some(auth),
            other: Default::default(),
        }],
        contexts: vec![NamedContext {
            name: name.to_string(),
            context: Some(Context {
                cluster: name.to_string(),
                user: Some(name.to_string()),
                ..Default::default()
            }),
            other: Default::default(),
        }],
        current_context: Some(name.to_string()),
        api_version: Some("v1".into()),
        kind: Some("Config".into()),
        ..Default::default()
    }
}

/// Merges kubeconfigs (their names must differ); the first one's context is current.
pub fn merge(configs: impl IntoIterator<Item = Kubeconfig>) -> Kubeconfig {
    let mut merged = Kubeconfig {
        api_version: Some("v1".into()),
        kind: Some("Config".into()),
        ..Default::default()
    };
    for config in configs {
        if merged.current_context.is_none() {
            merged.current_context = config.current_context.clone();
        }
        merged.clusters.extend(config.clusters);
        merged.auth_infos.extend(config.auth_infos);
        merged.contexts.extend(config.contexts);
    }
    merged
}

/// Serialises a kubeconfig to the YAML that kubectl reads.
pub fn to_yaml(config: &Kubeconfig) -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(config)
}

fn b64(text: &str) -> String {
    // Kubeconfig `*-data` fields hold base64 of the PEM text.
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(b64(input), expected, "{input:?}");
        }
    }

    #[test]
    fn merge_keeps_every_context_and_the_first_as_current() {
        let east = with_token("east", "https://127.0.0.1:1", "ca", "t1");
        let west = with_token("west", "https://127.0.0.1:2", "ca", "t2");
        let merged = merge([east, west]);
        let names: Vec<_> = merged.contexts.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["east", "west"]);
        assert_eq!(merged.current_context.as_deref(), Some("east"));
        let yaml = to_yaml(&merged).unwrap();
        assert!(yaml.contains("current-context: east"), "{yaml}");
    }
}
