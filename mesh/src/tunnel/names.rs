//! TLS names and ALPN of tunnel connections, shared by node proxies, the
//! gateway and the mirror's probe.

use rustls::pki_types::ServerName;

use crate::identity::SpiffeId;

/// ALPN of tunnel connections (node proxy ↔ node proxy, node proxy → gateway
/// over QUIC or TCP): the tunnel protocol, version 1.
pub const TUNNEL_ALPN: &[u8] = b"strait-tunnel/1";

/// Suffix of the TLS server names that carry a destination identity.
const SERVER_NAME_SUFFIX: &str = "identity.strait.internal";

/// The TLS server name a client sends to reach `id`: `<sa>.<ns>.identity.strait.internal`.
/// (Namespaces and ServiceAccount names are DNS labels, so this is a valid DNS name.)
pub fn server_name_for(id: &SpiffeId) -> ServerName<'static> {
    let name = format!(
        "{}.{}.{SERVER_NAME_SUFFIX}",
        id.service_account(),
        id.namespace()
    );
    ServerName::try_from(name).unwrap_or_else(|_| {
        // Unreachable for valid SPIFFE IDs; a name that matches no identity
        // makes the server refuse the handshake, which is the safe outcome.
        ServerName::try_from("invalid.identity.strait.internal").expect("static name is valid")
    })
}

/// (namespace, service account) from a server name made by [`server_name_for`].
pub fn parse_server_name(name: &str) -> Option<(String, String)> {
    let rest = name.strip_suffix(SERVER_NAME_SUFFIX)?.strip_suffix('.')?;
    // The namespace is one DNS label; a ServiceAccount name may contain dots.
    let (sa, ns) = rest.rsplit_once('.')?;
    (!sa.is_empty() && !ns.is_empty()).then(|| (ns.into(), sa.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_carry_the_identity_both_ways() {
        let id: SpiffeId = "spiffe://east.strait/ns/shop/sa/web".parse().unwrap();
        let name = server_name_for(&id);
        let ServerName::DnsName(dns) = &name else {
            panic!("a DNS name: {name:?}")
        };
        assert_eq!(dns.as_ref(), "web.shop.identity.strait.internal");
        assert_eq!(
            parse_server_name(dns.as_ref()),
            Some(("shop".into(), "web".into()))
        );
        assert_eq!(
            parse_server_name("api.v2.shop.identity.strait.internal"),
            Some(("shop".into(), "api.v2".into())),
            "ServiceAccount names may contain dots"
        );
        for bad in [
            "web.shop.example.com",
            "identity.strait.internal",
            ".shop.identity.strait.internal",
            "web.identity.strait.internal",
        ] {
            assert_eq!(parse_server_name(bad), None, "{bad}");
        }
    }
}
