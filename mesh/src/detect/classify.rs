//! The pure classifier: bytes in, [`Detection`] out. No I/O, no allocation.

use super::Protocol;

/// The most bytes detection looks at (and buffers per connection). Linkerd's
/// detect buffer is the same size; real request lines are far shorter.
pub const MAX_DETECT_BYTES: usize = 8 * 1024;
/// Longest method accepted. The longest registered method
/// (`UPDATEREDIRECTREF`) has 17 bytes; a longer run of capitals is not HTTP.
pub const MAX_METHOD_LEN: usize = 32;
/// What an HTTP/2 client with prior knowledge sends first (RFC 9113 §3.4).
pub const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What the first bytes of a connection say so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Detection {
    /// Decided; more bytes would not change it.
    Protocol(Protocol),
    /// Every byte so far fits HTTP/1 or HTTP/2: read more.
    NeedMore,
}

const OPAQUE: Detection = Detection::Protocol(Protocol::Opaque);

/// Classifies the first bytes of a connection. Total (any input, no panic) and
/// monotone: once it answers [`Detection::Protocol`], appending bytes never
/// changes the answer. Looks at most at [`MAX_DETECT_BYTES`]; a prefix that
/// long and still undecided is [`Protocol::Opaque`].
pub fn classify(prefix: &[u8]) -> Detection {
    let bounded = &prefix[..prefix.len().min(MAX_DETECT_BYTES)];
    match classify_bounded(bounded) {
        Detection::NeedMore if bounded.len() == MAX_DETECT_BYTES => OPAQUE,
        decided => decided,
    }
}

fn classify_bounded(buf: &[u8]) -> Detection {
    if buf.is_empty() {
        return Detection::NeedMore;
    }
    if buf.starts_with(H2_PREFACE) {
        return Detection::Protocol(Protocol::Http2);
    }
    if H2_PREFACE.starts_with(buf) {
        // Part of the preface: only the rest of it can settle this.
        return Detection::NeedMore;
    }
    http1_request_line(buf)
}

/// Walks `METHOD SP target SP HTTP/1.x CRLF`, answering `NeedMore` when the
/// bytes end inside it and `Opaque` at the first byte that cannot belong.
fn http1_request_line(buf: &[u8]) -> Detection {
    // Method: a capital letter, then method bytes.
    match buf.first() {
        None => return Detection::NeedMore,
        Some(b) if !b.is_ascii_uppercase() => return OPAQUE,
        Some(_) => {}
    }
    let method_len = buf
        .iter()
        .position(|&b| !is_method_byte(b))
        .unwrap_or(buf.len());
    if method_len > MAX_METHOD_LEN {
        return OPAQUE;
    }
    if method_len == buf.len() {
        return Detection::NeedMore;
    }
    if buf[method_len] != b' ' {
        return OPAQUE;
    }
    let method = &buf[..method_len];
    let rest = &buf[method_len + 1..];

    // Request target: visible ASCII only (raw UTF-8 in a path is not valid
    // HTTP, and opaque is the safe reading).
    let target_len = rest
        .iter()
        .position(|&b| !is_target_byte(b))
        .unwrap_or(rest.len());
    if target_len == rest.len() {
        return Detection::NeedMore;
    }
    if target_len == 0 || rest[target_len] != b' ' {
        return OPAQUE;
    }
    if !target_fits_method(method, &rest[..target_len]) {
        return OPAQUE;
    }
    let rest = &rest[target_len + 1..];

    // Version and line end, compared byte by byte as far as they have arrived.
    const VERSION: &[u8] = b"HTTP/1.";
    let n = rest.len().min(VERSION.len());
    if rest[..n] != VERSION[..n] {
        return OPAQUE;
    }
    let tail = &rest[n..];
    match tail {
        [] => Detection::NeedMore,
        [b'0' | b'1'] | [b'0' | b'1', b'\r'] => Detection::NeedMore,
        [b'0' | b'1', b'\r', b'\n', ..] => Detection::Protocol(Protocol::Http1),
        _ => OPAQUE,
    }
}

/// After a first capital letter: upper-case letters, digits, `-` and `_`. That
/// covers every registered method and the extension methods seen in practice
/// (WebDAV's `VERSION-CONTROL`). A lower-case or punctuated token is legal HTTP
/// but far likelier another text protocol (memcached's `get`).
fn is_method_byte(b: u8) -> bool {
    b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'-' || b == b'_'
}

fn is_target_byte(b: u8) -> bool {
    b.is_ascii_graphic()
}

/// The request-target forms of RFC 9112 §3.2, checked only as far as telling
/// HTTP from something else needs.
fn target_fits_method(method: &[u8], target: &[u8]) -> bool {
    match method {
        // authority-form: `host:port`, the only form CONNECT takes.
        b"CONNECT" => is_authority_form(target),
        // asterisk-form: only OPTIONS asks about the server as a whole.
        b"OPTIONS" if target == b"*" => true,
        _ => target.starts_with(b"/") || is_absolute_form(target),
    }
}

/// `host:port` with a non-empty host (a name, IPv4 or `[IPv6]`) and a port of
/// 1 to 5 digits; no path, user info or scheme.
fn is_authority_form(target: &[u8]) -> bool {
    let Some(colon) = target.iter().rposition(|&b| b == b':') else {
        return false;
    };
    let (host, port) = (&target[..colon], &target[colon + 1..]);
    let port_ok = (1..=5).contains(&port.len()) && port.iter().all(u8::is_ascii_digit);
    let host_ok = match host {
        [] => false,
        [b'[', inner @ .., b']'] => {
            !inner.is_empty()
                && inner
                    .iter()
                    .all(|&b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        }
        _ => host
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_'),
    };
    port_ok && host_ok
}

/// `scheme://…` with an RFC 3986 scheme: what a client sends to a forward
/// proxy (`GET http://web.shop/ HTTP/1.1`).
fn is_absolute_form(target: &[u8]) -> bool {
    let Some(end) = target.windows(3).position(|w| w == b"://") else {
        return false;
    };
    let scheme = &target[..end];
    matches!(scheme.first(), Some(b) if b.is_ascii_alphabetic())
        && scheme
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-' || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;

    const H1: Detection = Detection::Protocol(Protocol::Http1);
    const H2: Detection = Detection::Protocol(Protocol::Http2);

    /// Every proper prefix is `NeedMore` (the empty one included), the whole
    /// is `want`, and bytes after it do not change the answer.
    fn assert_needs_all_of(bytes: &[u8], want: Detection) {
        for cut in 0..bytes.len() {
            assert_eq!(
                classify(&bytes[..cut]),
                Detection::NeedMore,
                "cut at {cut}: {:?}",
                String::from_utf8_lossy(&bytes[..cut])
            );
        }
        assert_eq!(
            classify(bytes),
            want,
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
        let tails: [&[u8]; 3] = [b"\x00", b"Host: a\r\n\r\n", &[0xff; 100]];
        for tail in tails {
            assert_eq!(classify(&[bytes, tail].concat()), want);
        }
    }

    #[test]
    fn h2_preface_at_every_split_point() {
        assert_needs_all_of(H2_PREFACE, H2);
        // A whole preface followed by a SETTINGS frame.
        let mut with_settings = H2_PREFACE.to_vec();
        with_settings.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        assert_eq!(classify(&with_settings), H2);
    }

    #[test]
    fn http1_request_line_at_every_split_point() {
        assert_needs_all_of(b"GET /index.html?q=1 HTTP/1.1\r\n", H1);
        assert_needs_all_of(b"POST /api HTTP/1.0\r\n", H1);
    }

    #[test]
    fn http1_forms() {
        let lines: &[&[u8]] = &[
            b"GET / HTTP/1.1\r\n",
            b"DELETE /items/7 HTTP/1.1\r\n",
            b"PROPFIND /dav/ HTTP/1.1\r\n",
            b"VERSION-CONTROL /dav/x HTTP/1.1\r\n",
            // To a forward proxy (http_proxy=node:4140).
            b"GET http://web.shop.svc.cluster.local:8080/x HTTP/1.1\r\n",
            b"CONNECT web.shop.svc.cluster.local:443 HTTP/1.1\r\n",
            b"CONNECT 10.1.2.3:443 HTTP/1.1\r\n",
            b"CONNECT [fd00::1]:443 HTTP/1.1\r\n",
            b"OPTIONS * HTTP/1.1\r\n",
            // `PRI` with another target is only a method name.
            b"PRI / HTTP/1.1\r\n",
        ];
        for line in lines {
            assert_eq!(classify(line), H1, "{:?}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn not_http_is_opaque_as_early_as_the_bytes_show() {
        let cases: &[(&[u8], usize, &str)] = &[
            // (bytes, how many it takes to tell, why)
            (b"get / HTTP/1.1\r\n", 1, "lower-case method (memcached)"),
            (
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
                1,
                "TLS ClientHello",
            ),
            (
                b"\x00\x00\x00\x08\x04\xd2\x16\x2f",
                1,
                "Postgres SSLRequest",
            ),
            (b"*1\r\n$4\r\nPING\r\n", 1, "Redis RESP"),
            (b"PING\r\n", 5, "Redis inline: no target"),
            (b"GET  / HTTP/1.1\r\n", 5, "empty target"),
            (b"GET /\x01 HTTP/1.1\r\n", 6, "control byte in the target"),
            (b"GET / HTTP/2.0\r\n", 12, "HTTP/2 is never a request line"),
            (b"GET / HTTP/1.1\n", 15, "bare LF"),
            (b"GET / HTTP/1.12\r\n", 15, "version too long"),
            (b"PRI * HTTP/2.0\r\n\r\nXX", 19, "preface broken at the end"),
            (b"CONNECT /x HTTP/1.1\r\n", 11, "CONNECT needs host:port"),
            (
                b"GET host:80 HTTP/1.1\r\n",
                12,
                "host:port only for CONNECT",
            ),
            (b"GET * HTTP/1.1\r\n", 6, "`*` only for OPTIONS"),
            (b"SSH-2.0-OpenSSH_9.6\r\n", 6, "`.` is not a method byte"),
        ];
        for &(bytes, decided_at, why) in cases {
            let what = format!("{why}: {:?}", String::from_utf8_lossy(bytes));
            assert_eq!(classify(&bytes[..decided_at]), OPAQUE, "{what}");
            assert_eq!(
                classify(&bytes[..decided_at - 1]),
                Detection::NeedMore,
                "{what} decided too early"
            );
            assert_eq!(classify(bytes), OPAQUE, "{what}");
        }
    }

    #[test]
    fn binary_and_empty() {
        assert_eq!(classify(b""), Detection::NeedMore);
        for b in 0..=u8::MAX {
            let one = classify(&[b]);
            assert_eq!(
                one == Detection::NeedMore,
                b.is_ascii_uppercase(),
                "byte {b:#04x}"
            );
        }
        assert_eq!(classify(&[0xff; MAX_DETECT_BYTES * 2]), OPAQUE);
    }

    #[test]
    fn oversized_request_line_is_opaque() {
        let mut line = b"GET /".to_vec();
        line.resize(MAX_DETECT_BYTES - 1, b'a');
        assert_eq!(classify(&line), Detection::NeedMore);
        line.push(b'a');
        assert_eq!(
            classify(&line),
            OPAQUE,
            "{MAX_DETECT_BYTES} bytes without a line end"
        );
        line.extend_from_slice(b" HTTP/1.1\r\n");
        assert_eq!(
            classify(&line),
            OPAQUE,
            "completing it later changes nothing"
        );

        // A line that ends just inside the bound is still HTTP/1.
        let mut fits = b"GET /".to_vec();
        fits.resize(MAX_DETECT_BYTES - b" HTTP/1.1\r\n".len(), b'a');
        fits.extend_from_slice(b" HTTP/1.1\r\n");
        assert_eq!(fits.len(), MAX_DETECT_BYTES);
        assert_eq!(classify(&fits), H1);

        let long_method = vec![b'A'; MAX_METHOD_LEN + 1];
        assert_eq!(
            classify(&long_method[..MAX_METHOD_LEN]),
            Detection::NeedMore
        );
        assert_eq!(classify(&long_method), OPAQUE);
    }
}
