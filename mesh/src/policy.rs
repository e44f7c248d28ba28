//! Who may call a Service: `strait.dev/allowed-identities` (SPIFFE IDs, `*`
//! matching one whole path segment or the trust domain). Unset: any identity
//! under the trust anchors, which mutual TLS has already checked. Pure; decided
//! by the gateway on the caller its node proxy names (early, for its metrics),
//! and by the destination's node proxy on the caller's own proof.

use crate::identity::SpiffeId;

/// An entry of `strait.dev/allowed-identities` that is not a pattern.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error(
        "{0:?} is not a SPIFFE ID pattern: write spiffe://<trust domain>/ns/<ns>/sa/<sa> (`*` for any one part)"
    )]
    NotSpiffe(String),
    #[error("{0:?} has no path: write spiffe://<trust domain>/ns/<ns>/sa/<sa>")]
    NoPath(String),
    #[error("{0:?} has an empty part")]
    EmptyPart(String),
}

/// One entry of `strait.dev/allowed-identities`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityPattern {
    trust_domain: String,
    /// The path's segments (`ns`, `<ns>`, `sa`, `<sa>`).
    segments: Vec<String>,
}

impl IdentityPattern {
    pub fn parse(text: &str) -> Result<Self, PatternError> {
        let pattern = || text.to_string();
        let rest = text
            .trim()
            .strip_prefix("spiffe://")
            .ok_or_else(|| PatternError::NotSpiffe(pattern()))?;
        let (domain, path) = rest
            .split_once('/')
            .ok_or_else(|| PatternError::NoPath(pattern()))?;
        let segments: Vec<String> = path.split('/').map(str::to_string).collect();
        if domain.is_empty() || segments.iter().any(String::is_empty) {
            return Err(PatternError::EmptyPart(pattern()));
        }
        Ok(Self {
            trust_domain: domain.to_string(),
            segments,
        })
    }

    pub fn matches(&self, id: &SpiffeId) -> bool {
        let text = id.to_string();
        let Some(rest) = text.strip_prefix("spiffe://") else {
            return false;
        };
        let Some((domain, path)) = rest.split_once('/') else {
            return false;
        };
        let segments: Vec<&str> = path.split('/').collect();
        let one = |pattern: &str, value: &str| pattern == "*" || pattern == value;
        one(&self.trust_domain, domain)
            && segments.len() == self.segments.len()
            && self.segments.iter().zip(&segments).all(|(p, v)| one(p, v))
    }
}

/// Parses an `allowed-identities` value; bad entries are reported and left
/// out (a typo must not open the Service to everyone: with bad entries only,
/// nobody matches).
pub fn parse_allowed(value: &str) -> (Vec<IdentityPattern>, Vec<PatternError>) {
    let mut patterns = Vec::new();
    let mut errors = Vec::new();
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match IdentityPattern::parse(entry) {
            Ok(p) => patterns.push(p),
            Err(e) => errors.push(e),
        }
    }
    (patterns, errors)
}

/// Whether `caller` may call a Service whose annotation is `allowed`.
pub fn allowed(caller: &SpiffeId, allowed: Option<&str>) -> bool {
    match allowed {
        None => true,
        Some(value) => parse_allowed(value).0.iter().any(|p| p.matches(caller)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> SpiffeId {
        s.parse().unwrap()
    }

    #[test]
    fn patterns_match_whole_segments() {
        let caller = id("spiffe://east.strait/ns/shop/sa/web");
        assert!(allowed(&caller, None));
        assert!(allowed(
            &caller,
            Some("spiffe://east.strait/ns/shop/sa/web")
        ));
        assert!(allowed(&caller, Some("spiffe://*/ns/shop/sa/*")));
        assert!(allowed(
            &caller,
            Some(" spiffe://west.strait/ns/x/sa/y , spiffe://east.strait/ns/shop/sa/*")
        ));
        assert!(!allowed(
            &caller,
            Some("spiffe://east.strait/ns/shop/sa/api")
        ));
        assert!(!allowed(
            &caller,
            Some("spiffe://west.strait/ns/shop/sa/web")
        ));
        assert!(!allowed(&caller, Some("spiffe://*/ns/shop")));
        assert!(!allowed(&caller, Some("spiffe://*/ns/sh*/sa/web")));
        // Only bad entries: nobody, not everybody.
        assert!(!allowed(&caller, Some("web, shop/web")));
        assert!(!allowed(&caller, Some("")));
        let (ok, errors) = parse_allowed("spiffe://a/ns/b/sa/c, nonsense, spiffe://x");
        assert_eq!(ok.len(), 1);
        assert_eq!(errors.len(), 2, "{errors:?}");
    }
}
