//! Who may do what at the gateway. Pure functions.
//!
//! - **Speaking for someone else.** A stream's header may name the original
//!   caller (`source`); only a node proxy may do that (it holds the identities
//!   of the pods on its node and has proven its own), and only for callers of
//!   its own trust domain: the rule is [`strait_mesh::names::may_speak_for`],
//!   shared with the node proxies. Anyone else is the caller itself, and a
//!   `source` from it is refused.
//! - **Calling a Service.** `strait.dev/allowed-identities` on the exported
//!   Service ([`strait_mesh::policy`]), checked here on the caller the node
//!   proxy names (early: a refusal costs no tunnel), and again by the
//!   destination's node proxy on the caller's own end-to-end proof.

use strait_mesh::identity::SpiffeId;
use strait_mesh::names::Carrier;
pub use strait_mesh::policy::allowed;

/// Whether `peer` may name `claimed` as the caller in a stream header sent
/// to a gateway.
pub fn may_speak_for(peer: &SpiffeId, claimed: &SpiffeId) -> bool {
    strait_mesh::names::may_speak_for(Carrier::Gateway, peer, claimed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> SpiffeId {
        s.parse().unwrap()
    }

    #[test]
    fn only_node_proxies_speak_for_others_of_their_own_trust_domain() {
        let caller = id("spiffe://east.strait/ns/shop/sa/client");
        let proxy = id("spiffe://east.strait/ns/strait-system/sa/strait-proxy");
        assert!(may_speak_for(&proxy, &caller));
        assert!(!may_speak_for(
            &proxy,
            &id("spiffe://west.strait/ns/shop/sa/client")
        ));
        for other in [
            "spiffe://east.strait/ns/shop/sa/strait-proxy",
            "spiffe://east.strait/ns/strait-system/sa/strait-mirror",
            "spiffe://east.strait/ns/shop/sa/web",
        ] {
            assert!(!may_speak_for(&id(other), &caller), "{other}");
        }
    }
}
