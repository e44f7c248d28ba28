//! Fuzzes the policy parser: `strait.dev/allowed-identities` as any Service
//! owner may write it, read by the gateway and the destination's node proxy.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strait_mesh::identity::SpiffeId;
use strait_mesh::names::{Carrier, may_speak_for};
use strait_mesh::policy::{IdentityPattern, allowed, parse_allowed};

fuzz_target!(|data: &[u8]| {
    let Ok(value) = std::str::from_utf8(data) else {
        return;
    };
    check_allowed(value);
    check_speaking_for(value);
});

fn check_allowed(value: &str) {
    let (patterns, errors) = parse_allowed(value);
    // Every non-empty entry is either a pattern or reported.
    let entries: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    assert_eq!(patterns.len() + errors.len(), entries.len());
    for e in &errors {
        assert!(!e.to_string().is_empty());
    }
    for entry in entries {
        let Ok(pattern) = IdentityPattern::parse(entry) else {
            continue;
        };
        assert!(patterns.contains(&pattern));
        // An exact ID as a pattern admits that ID, and only through the annotation.
        if let Ok(id) = entry.parse::<SpiffeId>() {
            assert!(pattern.matches(&id), "{entry} does not match itself");
            assert!(allowed(&id, Some(value)));
            assert_eq!(id.to_string(), entry);
        }
        // `*` stands for one whole part: filled in, the ID matches; a
        // different literal part does not.
        let filled = entry
            .strip_prefix("spiffe://")
            .unwrap_or(entry)
            .split('/')
            .map(|part| if part == "*" { "x" } else { part })
            .collect::<Vec<_>>()
            .join("/");
        if let Ok(id) = format!("spiffe://{filled}").parse::<SpiffeId>() {
            assert!(pattern.matches(&id), "{entry} does not match {id}");
            let other = SpiffeId::new(id.trust_domain(), id.namespace(), "zz-not-this-one")
                .expect("valid parts");
            let last = entry.rsplit('/').next().unwrap_or_default();
            if last != "*" && last != other.service_account() {
                assert!(!pattern.matches(&other), "{entry} matches {other}");
            }
        }
    }
    // With no valid entry nobody may call, never everybody.
    if patterns.is_empty() {
        let anyone = SpiffeId::new("east.strait", "shop", "web").expect("valid");
        assert!(!allowed(&anyone, Some(value)));
    }
}

/// Who may name another caller: only node proxies to gateways (same trust
/// domain) and gateways to node proxies, whatever the IDs.
fn check_speaking_for(value: &str) {
    let ids: Vec<SpiffeId> = value
        .split(',')
        .filter_map(|e| e.trim().parse().ok())
        .collect();
    for peer in &ids {
        for claimed in &ids {
            let carrier = Carrier::of(peer);
            let to_gateway = may_speak_for(Carrier::Gateway, peer, claimed);
            assert_eq!(
                to_gateway,
                carrier == Some(Carrier::NodeProxy)
                    && peer.trust_domain() == claimed.trust_domain()
            );
            let to_proxy = may_speak_for(Carrier::NodeProxy, peer, claimed);
            assert_eq!(to_proxy, carrier == Some(Carrier::Gateway));
        }
    }
}
