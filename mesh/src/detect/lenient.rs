//! The lenient classifier: bytes a forgiving HTTP/1 server would still read
//! as a request. [`classify`](super::classify) is strict because reading
//! anything else as HTTP breaks it; the inbound proxy needs the opposite
//! mistake to be impossible: on a stream it would otherwise splice, bytes a
//! pod's server reads as HTTP would carry the caller's own `strait-client-id`
//! header. So here anything that may be a request line counts as HTTP/1 and
//! goes through the proxy's own HTTP server, which rewrites it, or refuses it
//! (400) before any byte reaches the pod.

use super::Protocol;
use super::classify::{Detection, H2_PREFACE, MAX_DETECT_BYTES};

const HTTP1: Detection = Detection::Protocol(Protocol::Http1);
const OPAQUE: Detection = Detection::Protocol(Protocol::Opaque);

/// Classifies the first bytes of a connection as a lenient server would:
/// `Http2` iff the bytes start with the HTTP/2 preface (servers require it
/// exactly); `Http1` iff, after any empty lines and blanks (RFC 9112 §2.2
/// lets servers skip them; httparse does), they start a line of request-line
/// bytes (visible ASCII, blanks, obs-text) beginning with a token byte (any
/// case: `get` parses) that ends, at `LF` or `CRLF`, in at least two fields
/// the last of which starts `HTTP/` in any case (multiple blanks between
/// fields, a target with spaces, a bare `LF`: all accepted somewhere), or
/// that is still such a line after [`MAX_DETECT_BYTES`] (servers take longer
/// request lines: hyper's default buffer holds ~400 KiB); else `Opaque`, as
/// soon as a byte rules HTTP out. Total and monotone like `classify`.
pub fn classify_lenient(prefix: &[u8]) -> Detection {
    let bounded = &prefix[..prefix.len().min(MAX_DETECT_BYTES)];
    if bounded.starts_with(H2_PREFACE) {
        return Detection::Protocol(Protocol::Http2);
    }
    if H2_PREFACE.starts_with(bounded) {
        return Detection::NeedMore;
    }
    match request_line(bounded) {
        Detection::NeedMore if bounded.len() == MAX_DETECT_BYTES => HTTP1,
        decided => decided,
    }
}

fn request_line(buf: &[u8]) -> Detection {
    let Some(start) = buf.iter().position(|b| !is_blank(*b) && *b != b'\n') else {
        return Detection::NeedMore;
    };
    let line = &buf[start..];
    if !is_token_byte(line[0]) {
        return OPAQUE;
    }
    let end = line.iter().position(|&b| b == b'\n');
    let text = &line[..end.unwrap_or(line.len())];
    if !text.iter().all(|&b| is_line_byte(b)) {
        return OPAQUE;
    }
    let Some(_) = end else {
        return Detection::NeedMore;
    };
    let mut fields = text
        .split(|&b| is_blank(b))
        .filter(|field| !field.is_empty());
    let count = fields.clone().count();
    let last = fields.next_back().unwrap_or_default();
    if count >= 2 && last.len() >= 5 && last[..5].eq_ignore_ascii_case(b"HTTP/") {
        HTTP1
    } else {
        OPAQUE
    }
}

/// Space, tab and a stray carriage return: what lenient parsers skip
/// between and around the request line's fields.
fn is_blank(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r')
}

/// RFC 9110 `tchar`: what a method is made of.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// What a request line may hold in some server: visible ASCII, blanks and
/// obs-text (bytes ≥ 0x80, which httparse accepts in a target).
fn is_line_byte(b: u8) -> bool {
    b.is_ascii_graphic() || is_blank(b) || b >= 0x80
}

#[cfg(test)]
mod tests {
    use super::super::classify;
    use super::*;

    const H2: Detection = Detection::Protocol(Protocol::Http2);

    #[test]
    fn what_strict_classify_calls_http_is_http_here_too() {
        let requests: [&[u8]; 4] = [
            b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
            b"CONNECT web:80 HTTP/1.1\r\n\r\n",
            b"OPTIONS * HTTP/1.0\r\n",
            H2_PREFACE,
        ];
        for r in requests {
            assert_eq!(classify_lenient(r), classify(r), "{r:?}");
        }
    }

    #[test]
    fn near_http_that_servers_accept_is_http() {
        let long = [b"GET /".as_slice(), &[b'a'; MAX_DETECT_BYTES]].concat();
        let requests: [&[u8]; 9] = [
            b"get / HTTP/1.1\r\n",
            b"\r\n\r\nGET / HTTP/1.1\r\n",
            b"GET / HTTP/1.1\n",
            b"GET  /  HTTP/1.1 \r\n",
            b"GET\t/\thttp/1.1\r\n",
            b"GET /a b HTTP/1.1\r\n",
            "GET /caf\u{e9} HTTP/1.1\r\n".as_bytes(),
            b"GET relative HTTP/1.1\r\n",
            &long,
        ];
        for r in requests {
            assert_eq!(
                classify_lenient(r),
                HTTP1,
                "{:?}",
                String::from_utf8_lossy(r)
            );
            assert_eq!(classify_lenient(&[r, b"\x00\xff"].concat()), HTTP1);
        }
        // Not the exact preface: an HTTP/1 line to the HTTP/1 server, which
        // refuses it.
        assert_eq!(classify_lenient(b"PRI * HTTP/2.0\r\n\r\nXX"), HTTP1);
    }

    #[test]
    fn other_protocols_stay_opaque() {
        let others: [&[u8]; 11] = [
            b"\x16\x03\x01\x02\x00",
            b"EHLO mail.example\r\n",
            b"get key\r\n",
            b"PING\r\n",
            b"a1 LOGIN user pass\r\n",
            b"DESCRIBE rtsp://cam/ RTSP/1.0\r\n",
            b"{\"json\": 1}\n",
            b"GET / HTTP/1.1\x00\r\n",
            b"\r\n\r\n\x00\r\nQUIT\n",
            b"\x00\x00\x00\x08\x04\xd2\x16\x2f",
            b"USER anonymous\r\n",
        ];
        for o in others {
            assert_eq!(
                classify_lenient(o),
                OPAQUE,
                "{:?}",
                String::from_utf8_lossy(o)
            );
        }
    }

    #[test]
    fn every_prefix_of_a_request_waits_and_the_preface_is_h2() {
        let request = b"\r\nget /x HTTP/1.1\r\n";
        for cut in 0..request.len() - 1 {
            assert_eq!(
                classify_lenient(&request[..cut]),
                Detection::NeedMore,
                "{cut}"
            );
        }
        for cut in 0..H2_PREFACE.len() {
            assert_eq!(classify_lenient(&H2_PREFACE[..cut]), Detection::NeedMore);
        }
        assert_eq!(classify_lenient(H2_PREFACE), H2);
    }

    #[test]
    fn decisions_survive_more_bytes() {
        let mut seed = 7u64;
        for _ in 0..2000 {
            let len = (seed % 40) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    b"GET /HTP1.\r\n \x00a"[(seed >> 33) as usize % 15]
                })
                .collect();
            for cut in 0..=bytes.len() {
                let d = classify_lenient(&bytes[..cut]);
                if d != Detection::NeedMore {
                    assert_eq!(classify_lenient(&bytes), d, "{bytes:?} at {cut}");
                }
            }
        }
    }
}
