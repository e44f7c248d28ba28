//! Hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection, so a
//! proxy must not pass them on. Above all `Connection: close`: a pod that
//! closes its connection to the proxy must not close the client's connection
//! to the proxy as well (each hop keeps its own connections alive).

use http::HeaderMap;
use http::header::{self, HeaderName};

/// Headers that always belong to one hop.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    HeaderName::from_static("keep-alive"),
];

/// Removes hop-by-hop headers from `headers`: the fixed set, `Proxy-Connection`,
/// any header the `Connection` header names, and `TE` unless it is only
/// `trailers` (which gRPC needs end to end).
pub fn strip(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove("proxy-connection");
    let te_is_trailers = headers
        .get_all(header::TE)
        .iter()
        .all(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
    if !te_is_trailers {
        headers.remove(header::TE);
    }
}

/// Whether the sender of `headers` closes its connection after this message.
pub fn says_close(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("close"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_connection_headers_and_what_they_name_but_keeps_te_trailers() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "close, X-Private".parse().unwrap());
        h.insert("x-private", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("proxy-connection", "keep-alive".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::TE, "trailers".parse().unwrap());
        h.insert(header::CONTENT_TYPE, "application/grpc".parse().unwrap());
        strip(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["te", "content-type"]);
        let mut closing = HeaderMap::new();
        closing.insert(header::CONNECTION, "Keep-Alive, Close".parse().unwrap());
        assert!(says_close(&closing));
        assert!(!says_close(&HeaderMap::new()));
    }

    #[test]
    fn removes_te_other_than_trailers() {
        let mut h = HeaderMap::new();
        h.insert(header::TE, "gzip".parse().unwrap());
        strip(&mut h);
        assert!(h.is_empty());
    }
}
