//! The one rule on which kubeconfigs Strait accepts from a Link's credentials
//! Secret: inline credentials only. A kubeconfig can name a program to run
//! (`exec`, `auth-provider`) or a file to read (`tokenFile`,
//! `client-certificate`, `client-key`, `certificate-authority`); whoever may
//! write that Secret would make the mirror controller run or read it in its
//! pod (its own ServiceAccount token, sent to a server of their choosing), and
//! `strait check` on the operator's workstation. Both check with
//! [`inline_only`] before building a client from it.

use std::fmt;

use kube::config::Kubeconfig;

/// A kubeconfig field that points outside the kubeconfig.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnsafeField {
    /// `user "<name>"` or `cluster "<name>"`.
    pub place: String,
    /// The field as the kubeconfig spells it (`exec`, `tokenFile`, …).
    pub field: &'static str,
    /// What it would do: the command, provider or path it names.
    pub would: String,
    /// What to write instead.
    pub instead: &'static str,
}

impl fmt::Display for UnsafeField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} has `{}` ({}); use {} instead",
            self.place, self.field, self.would, self.instead
        )
    }
}

/// A kubeconfig refused because it names something to run or read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the kubeconfig names something to run or read, which Strait never does with a link's credentials: {}; \
     a link kubeconfig carries only inline data (token, client-certificate-data, client-key-data, \
     certificate-authority-data): re-create it with `strait link`",
    .fields.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
)]
pub struct UnsafeKubeconfig {
    pub fields: Vec<UnsafeField>,
}

impl UnsafeKubeconfig {
    /// The status reason a Link's CredentialsValid condition carries.
    pub const REASON: &'static str = "UnsafeKubeconfig";
}

/// Accepts `kubeconfig` only if no user and no cluster in it names a program
/// to run or a file to read. Pure: reads nothing, runs nothing.
pub fn inline_only(kubeconfig: &Kubeconfig) -> Result<(), UnsafeKubeconfig> {
    let mut fields = Vec::new();
    for named in &kubeconfig.auth_infos {
        let Some(user) = &named.auth_info else {
            continue;
        };
        let place = format!("user {:?}", named.name);
        let mut refuse = |field, would: String, instead| {
            fields.push(UnsafeField {
                place: place.clone(),
                field,
                would,
                instead,
            })
        };
        if let Some(exec) = &user.exec {
            let command = exec.command.as_deref().unwrap_or("");
            refuse("exec", format!("would run {command:?}"), "`token`");
        }
        if let Some(provider) = &user.auth_provider {
            refuse(
                "auth-provider",
                format!("would run the {:?} auth provider", provider.name),
                "`token`",
            );
        }
        if let Some(path) = &user.token_file {
            refuse("tokenFile", format!("would read {path:?}"), "`token`");
        }
        if let Some(path) = &user.client_certificate {
            refuse(
                "client-certificate",
                format!("would read {path:?}"),
                "`client-certificate-data`",
            );
        }
        if let Some(path) = &user.client_key {
            refuse(
                "client-key",
                format!("would read {path:?}"),
                "`client-key-data`",
            );
        }
    }
    for named in &kubeconfig.clusters {
        let Some(cluster) = &named.cluster else {
            continue;
        };
        if let Some(path) = &cluster.certificate_authority {
            fields.push(UnsafeField {
                place: format!("cluster {:?}", named.name),
                field: "certificate-authority",
                would: format!("would read {path:?}"),
                instead: "`certificate-authority-data`",
            });
        }
    }
    if fields.is_empty() {
        Ok(())
    } else {
        Err(UnsafeKubeconfig { fields })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Kubeconfig {
        Kubeconfig::from_yaml(yaml).unwrap()
    }

    const INLINE: &str = r#"
apiVersion: v1
kind: Config
clusters:
- name: west
  cluster: {server: "https://10.0.0.1:6443", certificate-authority-data: "Q0E="}
users:
- name: strait-link-west
  user: {token: "abc", client-certificate-data: "Q0VSVA==", client-key-data: "S0VZ"}
contexts:
- name: west
  context: {cluster: west, user: strait-link-west}
current-context: west
"#;

    #[test]
    fn inline_credentials_are_accepted() {
        assert_eq!(inline_only(&parse(INLINE)), Ok(()));
        assert_eq!(inline_only(&Kubeconfig::default()), Ok(()));
    }

    fn refused(yaml: &str) -> UnsafeKubeconfig {
        inline_only(&parse(yaml)).expect_err("refused")
    }

    #[test]
    fn each_field_that_runs_or_reads_something_is_refused_by_name_with_its_fix() {
        for (user, field, instead, named) in [
            (
                "exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/touch, args: [/tmp/x]}",
                "exec",
                "`token`",
                "/bin/touch",
            ),
            (
                "auth-provider: {name: gcp, config: {}}",
                "auth-provider",
                "`token`",
                "gcp",
            ),
            (
                "tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token",
                "tokenFile",
                "`token`",
                "/var/run/secrets/kubernetes.io/serviceaccount/token",
            ),
            (
                "client-certificate: /etc/cert.pem",
                "client-certificate",
                "`client-certificate-data`",
                "/etc/cert.pem",
            ),
            (
                "client-key: /etc/key.pem",
                "client-key",
                "`client-key-data`",
                "/etc/key.pem",
            ),
        ] {
            let yaml = INLINE.replace(
                "user: {token: \"abc\", client-certificate-data: \"Q0VSVA==\", client-key-data: \"S0VZ\"}",
                &format!("user: {{{user}}}"),
            );
            let e = refused(&yaml);
            assert_eq!(e.fields.len(), 1, "{e}");
            assert_eq!(e.fields[0].field, field);
            assert_eq!(e.fields[0].instead, instead);
            let message = e.to_string();
            for part in [
                "user \"strait-link-west\"",
                &format!("`{field}`"),
                named,
                instead,
                "strait link",
            ] {
                assert!(message.contains(part), "{part:?} missing from: {message}");
            }
        }
    }

    #[test]
    fn a_certificate_authority_file_is_refused_and_every_offence_is_listed() {
        let yaml = INLINE
            .replace(
                "certificate-authority-data: \"Q0E=\"",
                "certificate-authority: /etc/ca.pem",
            )
            .replace("token: \"abc\"", "tokenFile: /tmp/t");
        let e = refused(&yaml);
        let fields: Vec<_> = e.fields.iter().map(|f| f.field).collect();
        assert_eq!(fields, ["tokenFile", "certificate-authority"]);
        let message = e.to_string();
        assert!(
            message.contains("cluster \"west\" has `certificate-authority`")
                && message.contains("`certificate-authority-data`")
                && message.contains("/etc/ca.pem"),
            "{message}"
        );
    }

    #[test]
    fn users_outside_the_current_context_are_checked_too() {
        let yaml = INLINE.replace(
            "contexts:",
            "- name: other\n  user: {exec: {apiVersion: client.authentication.k8s.io/v1, command: sh}}\ncontexts:",
        );
        let e = refused(&yaml);
        assert_eq!(e.fields[0].place, "user \"other\"");
    }
}
