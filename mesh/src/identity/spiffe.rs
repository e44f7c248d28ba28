//! SPIFFE IDs: `spiffe://<trust-domain>/ns/<namespace>/sa/<serviceaccount>`.

use std::fmt;
use std::str::FromStr;

/// A workload identity as Strait issues it: one Kubernetes ServiceAccount in
/// one trust domain.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId {
    trust_domain: String,
    namespace: String,
    service_account: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpiffeIdError {
    #[error("{0:?} is not a SPIFFE ID: it must start with spiffe://")]
    Scheme(String),
    #[error(
        "{0:?} is not a Strait SPIFFE ID: expected spiffe://<trust-domain>/ns/<namespace>/sa/<serviceaccount>"
    )]
    Shape(String),
    #[error("invalid {what} {value:?} in SPIFFE ID: {why}")]
    Part {
        what: &'static str,
        value: String,
        why: &'static str,
    },
}

/// Kubernetes names are DNS-1123 labels (namespaces) or subdomains (service
/// accounts); trust domains are lower-case DNS names. Checking here keeps a
/// malformed name out of every certificate.
fn check_part(what: &'static str, value: &str, allow_dots: bool) -> Result<(), SpiffeIdError> {
    let err = |why| {
        Err(SpiffeIdError::Part {
            what,
            value: value.to_string(),
            why,
        })
    };
    if value.is_empty() {
        return err("it is empty");
    }
    if value.len() > 253 {
        return err("it is longer than 253 characters");
    }
    if !value.bytes().all(|b| {
        b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || (allow_dots && b == b'.')
    }) {
        return err(
            "only lower-case letters, digits, '-' (and '.' where Kubernetes allows it) may appear",
        );
    }
    if value.starts_with(['-', '.']) || value.ends_with(['-', '.']) {
        return err("it must start and end with a letter or digit");
    }
    Ok(())
}

impl SpiffeId {
    pub fn new(
        trust_domain: &str,
        namespace: &str,
        service_account: &str,
    ) -> Result<Self, SpiffeIdError> {
        check_part("trust domain", trust_domain, true)?;
        check_part("namespace", namespace, false)?;
        check_part("service account", service_account, true)?;
        Ok(Self {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        })
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn service_account(&self) -> &str {
        &self.service_account
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

impl FromStr for SpiffeId {
    type Err = SpiffeIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s
            .strip_prefix("spiffe://")
            .ok_or_else(|| SpiffeIdError::Scheme(s.to_string()))?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [td, "ns", ns, "sa", sa] => Self::new(td, ns, sa),
            _ => Err(SpiffeIdError::Shape(s.to_string())),
        }
    }
}

impl serde::Serialize for SpiffeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for SpiffeId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let id: SpiffeId = "spiffe://east.strait.local/ns/shop/sa/web".parse().unwrap();
        assert_eq!(
            (id.trust_domain(), id.namespace(), id.service_account()),
            ("east.strait.local", "shop", "web")
        );
        assert_eq!(id.to_string(), "spiffe://east.strait.local/ns/shop/sa/web");
    }

    #[test]
    fn rejects_what_is_not_a_strait_identity() {
        for bad in [
            "https://td/ns/a/sa/b",
            "spiffe://td/ns/a",
            "spiffe://td/ns/a/sa/b/extra",
            "spiffe://td/namespace/a/sa/b",
            "spiffe:///ns/a/sa/b",
            "spiffe://TD/ns/a/sa/b",
            "spiffe://td/ns/a.b/sa/c",
            "spiffe://td/ns/-a/sa/b",
            "spiffe://td/ns/a/sa/b%2F",
        ] {
            assert!(bad.parse::<SpiffeId>().is_err(), "{bad} should be refused");
        }
    }
}
