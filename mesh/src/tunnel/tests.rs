use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::identity::SpiffeId;

/// SplitMix64: deterministic, so a failure names a reproducible case.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn port(&mut self) -> u16 {
        1 + self.below(65535) as u16
    }

    fn label(&mut self, max: u64) -> String {
        const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        let len = 1 + self.below(max);
        (0..len)
            .map(|i| {
                let inner = i > 0 && i + 1 < len;
                if inner && self.below(8) == 0 {
                    '-'
                } else {
                    ALNUM[self.below(26 + 10 * u64::from(i > 0)) as usize] as char
                }
            })
            .collect()
    }

    fn fqdn(&mut self) -> String {
        let labels = 2 + self.below(5);
        let mut name: Vec<String> = (0..labels).map(|_| self.label(20)).collect();
        // A numeric last label is refused; keep generated names valid.
        *name.last_mut().unwrap() = format!("x{}", name.last().unwrap());
        let mut name = name.join(".");
        name.truncate(MAX_FQDN_BYTES);
        while name.ends_with(['.', '-']) {
            name.pop();
        }
        name
    }

    fn header(&mut self) -> TunnelHeader {
        let target = if self.below(2) == 0 {
            let ip: IpAddr = if self.below(2) == 0 {
                Ipv4Addr::from(1 + self.below(u64::from(u32::MAX)) as u32).into()
            } else {
                Ipv6Addr::from(u128::from(self.next()) << 64 | u128::from(self.next())).into()
            };
            Target::pod(SocketAddr::new(ip, self.port())).unwrap()
        } else {
            let fqdn = self.fqdn();
            Target::service(&fqdn, self.port()).unwrap_or_else(|e| panic!("{fqdn}: {e}"))
        };
        let source = (self.below(2) == 0).then(|| {
            SpiffeId::new(
                &format!("{}.local", self.label(30)),
                &self.label(63),
                &self.label(63),
            )
            .unwrap()
        });
        let protocol = [
            Protocol::Opaque,
            Protocol::Http1,
            Protocol::Http2,
            Protocol::Http1Multiplexed,
        ][self.below(4) as usize];
        TunnelHeader {
            target,
            source,
            protocol,
            end_to_end: self.below(2) == 0,
        }
    }
}

fn web() -> TunnelHeader {
    TunnelHeader {
        target: Target::service("web.default.svc.cluster.local", 8080).unwrap(),
        source: Some("spiffe://east.local/ns/shop/sa/web".parse().unwrap()),
        protocol: Protocol::Http2,
        end_to_end: true,
    }
}

fn pod() -> TunnelHeader {
    TunnelHeader::new(
        Target::pod("10.1.2.3:8080".parse().unwrap()).unwrap(),
        Protocol::Http1,
    )
}

/// A header frame with hand-written fields, for what the encoder never writes.
fn frame(kind: u8, fields: &[F<'_>]) -> Vec<u8> {
    let mut body = BytesMut::new();
    for (ty, value) in fields {
        body.put_u8(*ty);
        body.put_u16(value.len() as u16);
        body.put_slice(value);
    }
    let mut out = MAGIC.to_vec();
    out.push(VERSION);
    out.push(kind);
    out.extend_from_slice(&(body.len() as u16).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// One field as `frame` takes it: type and value.
type F<'a> = (u8, &'a [u8]);

const POD_FIELD: F<'static> = (0x01, &[10, 1, 2, 3, 0x1f, 0x90]);

#[test]
fn the_wire_layout_is_pinned() {
    // Changing these bytes breaks every deployed peer: bump VERSION instead.
    assert_eq!(
        pod().encode().as_ref(),
        [
            0xF5, b'S', b'T', b'R', 1, 1, 0, 13, // prefix: magic, version, kind, length
            0x01, 0, 6, 10, 1, 2, 3, 0x1f, 0x90, // target pod 10.1.2.3:8080
            0x04, 0, 1, 1, // protocol HTTP/1
        ]
    );
    assert_eq!(
        TunnelResponse::refused(ResponseStatus::Denied, "no")
            .encode()
            .as_ref(),
        [
            0xF5, b'S', b'T', b'R', 1, 2, 0, 9, 0x01, 0, 1, 5, 0x02, 0, 2, b'n', b'o'
        ]
    );
}

#[test]
fn generated_headers_round_trip() {
    let mut g = Gen(1);
    for _ in 0..20_000 {
        let header = g.header();
        let bytes = header.encode();
        assert!(bytes.len() <= MAX_HEADER_BYTES);
        let mut with_payload = bytes.to_vec();
        with_payload.extend_from_slice(b"GET / HTTP/1.1\r\n");
        let (decoded, consumed) = TunnelHeader::decode(&with_payload).unwrap();
        assert_eq!((decoded, consumed), (header, bytes.len()));
    }
}

#[test]
fn the_largest_header_fits_well_inside_the_bound() {
    let long = |c: char| std::iter::repeat_n(c, 253).collect::<String>();
    let source = SpiffeId::new(&long('a'), &"b".repeat(63), &long('c')).unwrap();
    let fqdn = [
        "a".repeat(63),
        "b".repeat(63),
        "c".repeat(63),
        "d".repeat(61),
    ]
    .join(".");
    let header = TunnelHeader {
        target: Target::service(&fqdn, 1).unwrap(),
        source: Some(source),
        protocol: Protocol::Opaque,
        end_to_end: true,
    };
    let len = header.encode().len();
    assert!(len < 1024, "{len}");
    assert_eq!(TunnelHeader::decode(&header.encode()).unwrap().0, header);
}

#[test]
fn responses_round_trip() {
    for code in 0..=u8::MAX {
        let response = TunnelResponse::refused(ResponseStatus::from_code(code), "détail ✓");
        let (decoded, consumed) = TunnelResponse::decode(&response.encode()).unwrap();
        assert_eq!(consumed, response.encode().len());
        assert_eq!(decoded, response);
        assert_eq!(decoded.status.code(), code);
    }
    let ok = TunnelResponse::ok();
    assert!(TunnelResponse::decode(&ok.encode()).unwrap().0.is_ok());
    // Long messages are cut at a character boundary, and still decode.
    let long = TunnelResponse::refused(ResponseStatus::Denied, "é".repeat(MAX_MESSAGE_BYTES));
    assert_eq!(long.message.len(), MAX_MESSAGE_BYTES);
    let long = TunnelResponse::refused(ResponseStatus::Denied, format!("x{}", "é".repeat(600)));
    assert_eq!(long.message.len(), MAX_MESSAGE_BYTES - 1);
    assert_eq!(TunnelResponse::decode(&long.encode()).unwrap().0, long);
}

#[test]
fn every_truncation_is_incomplete() {
    let mut g = Gen(2);
    let mut cases = vec![
        web().encode(),
        pod().encode(),
        TunnelResponse::ok().encode(),
    ];
    cases.extend((0..50).map(|_| g.header().encode()));
    for bytes in cases {
        let kind = bytes[5];
        for cut in 0..bytes.len() {
            let err = if kind == 1 {
                TunnelHeader::decode(&bytes[..cut]).unwrap_err()
            } else {
                TunnelResponse::decode(&bytes[..cut]).unwrap_err()
            };
            let HeaderError::Incomplete { have, needed } = err else {
                panic!("cut at {cut}: {err}");
            };
            assert_eq!(have, cut);
            assert!(needed > cut && needed <= bytes.len(), "{needed}");
        }
    }
}

#[test]
fn garbage_and_mutations_never_panic() {
    let mut g = Gen(3);
    for _ in 0..20_000 {
        let len = g.below(64) as usize;
        let mut buf: Vec<u8> = (0..len).map(|_| g.next() as u8).collect();
        // Half the time behind a valid prefix, so the field parsers are reached.
        if g.below(2) == 0 && buf.len() >= 8 {
            buf[..6].copy_from_slice(&[0xF5, b'S', b'T', b'R', 1, 1]);
            buf[6..8].copy_from_slice(&((len - 8) as u16).to_be_bytes());
        }
        if let Ok((header, _)) = TunnelHeader::decode(&buf) {
            assert_eq!(TunnelHeader::decode(&header.encode()).unwrap().0, header);
        }
        let _ = TunnelResponse::decode(&buf);
    }
    // Every single-byte change of valid headers.
    for bytes in [web().encode(), pod().encode()] {
        for i in 0..bytes.len() {
            for v in [0u8, 1, 0x7f, 0x80, 0xff, bytes[i] ^ 1] {
                let mut b = bytes.to_vec();
                b[i] = v;
                if let Ok((header, _)) = TunnelHeader::decode(&b) {
                    assert_eq!(TunnelHeader::decode(&header.encode()).unwrap().0, header);
                }
            }
        }
    }
}

#[test]
fn oversize_is_refused_from_the_prefix_alone() {
    let mut prefix = MAGIC.to_vec();
    prefix.extend_from_slice(&[VERSION, 1]);
    prefix.extend_from_slice(&((MAX_HEADER_BYTES - 8 + 1) as u16).to_be_bytes());
    let err = TunnelHeader::decode(&prefix).unwrap_err();
    assert!(
        matches!(err, HeaderError::TooLarge { len: 4097, .. }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "tunnel header is 4097 bytes, larger than the 4096-byte limit"
    );
    // Exactly at the limit is fine (padding in an unknown optional field).
    let pad = vec![0u8; MAX_HEADER_BYTES - 8 - 9 - 3];
    let bytes = frame(1, &[POD_FIELD, (0x70, &pad)]);
    assert_eq!(bytes.len(), MAX_HEADER_BYTES);
    assert!(TunnelHeader::decode(&bytes).is_ok());
}

#[test]
fn http1_multiplexed_is_http2_with_a_critical_field_and_only_that() {
    let header = TunnelHeader::new(pod().target, Protocol::Http1Multiplexed);
    let bytes = header.encode();
    assert_eq!(
        &bytes[bytes.len() - 7..],
        &[0x04, 0, 1, 2, 0x86, 0, 0],
        "protocol 2, then the empty critical field"
    );
    assert_eq!(TunnelHeader::decode(&bytes).unwrap().0, header);
    assert_eq!(Protocol::Http1Multiplexed.in_tunnel(), Protocol::Http2);
    // A receiver that predates it refuses the critical field, never serving
    // HTTP/2 to an HTTP/1 pod (what this version does with a 0x87 field).
    let mut newer = bytes.to_vec();
    let at = newer.len() - 3;
    newer[at] = 0x87;
    assert!(matches!(
        TunnelHeader::decode(&newer).unwrap_err(),
        HeaderError::UnknownCriticalField { ty: 0x87, .. }
    ));
    // Only beside HTTP/2, once, empty.
    for fields in [
        &[POD_FIELD, (0x04, &[1][..]), (0x86, b"")][..],
        &[POD_FIELD, (0x86, b"")][..],
        &[POD_FIELD, (0x04, &[2][..]), (0x86, b"x")][..],
        &[POD_FIELD, (0x04, &[2][..]), (0x86, b""), (0x86, b"")][..],
    ] {
        assert!(
            TunnelHeader::decode(&frame(1, fields)).is_err(),
            "{fields:?}"
        );
    }
}

#[test]
fn unknown_optional_fields_are_skipped_and_critical_ones_refused() {
    let bytes = frame(
        1,
        &[
            (0x00, b""),
            (0x7e, b"from the future"),
            POD_FIELD,
            (0x05, &[1, 2, 3]),
        ],
    );
    let (header, consumed) = TunnelHeader::decode(&bytes).unwrap();
    assert_eq!(consumed, bytes.len());
    assert_eq!(header.target, pod().target);
    assert_eq!(
        header.protocol,
        Protocol::Opaque,
        "absent protocol means opaque"
    );

    let err = TunnelHeader::decode(&frame(1, &[POD_FIELD, (0x9f, b"")])).unwrap_err();
    assert!(matches!(
        err,
        HeaderError::UnknownCriticalField { ty: 0x9f, .. }
    ));
    assert!(err.to_string().contains("upgrade this proxy"), "{err}");

    // A protocol this version does not know is carried as opaque bytes.
    let (header, _) = TunnelHeader::decode(&frame(1, &[POD_FIELD, (0x04, &[9])])).unwrap();
    assert_eq!(header.protocol, Protocol::Opaque);

    // Responses follow the same rule.
    let (r, _) = TunnelResponse::decode(&frame(2, &[(0x01, &[3]), (0x33, b"x")])).unwrap();
    assert_eq!(r.status, ResponseStatus::NotFound);
    assert!(TunnelResponse::decode(&frame(2, &[(0x01, &[3]), (0xb3, b"x")])).is_err());
}

#[test]
fn wrong_magic_says_what_arrived_instead() {
    let err = TunnelHeader::decode(b"GET / HTTP/1.1\r\n\r\n").unwrap_err();
    assert_eq!(
        err.to_string(),
        "not a Strait tunnel message (first bytes 47 45 54 20): looks like plain text or \
         HTTP/1 sent without a tunnel header: is the peer a Strait proxy or gateway?"
    );
    // One wrong byte is enough to refuse; no need to wait for more.
    assert!(matches!(
        TunnelHeader::decode(&[0x16]).unwrap_err(),
        HeaderError::BadMagic { .. }
    ));
    let err = TunnelHeader::decode(&[0x16, 0x03, 0x01, 0x02, 0x00]).unwrap_err();
    assert!(err.to_string().contains("TLS handshake"), "{err}");
    let err = TunnelHeader::decode(b"PRI * HTTP/2.0").unwrap_err();
    assert!(err.to_string().contains("HTTP/2 preface"), "{err}");
}

#[test]
fn other_versions_and_kinds_are_named() {
    let mut bytes = pod().encode().to_vec();
    bytes[4] = 3;
    let err = TunnelHeader::decode(&bytes[..5]).unwrap_err();
    assert!(matches!(err, HeaderError::UnsupportedVersion { peer: 3 }));
    assert_eq!(
        err.to_string(),
        "peer speaks tunnel version 3, this proxy speaks 1: upgrade this proxy (or roll the \
         peer back) so both speak the same version"
    );
    let answer = TunnelResponse::for_header_error(&err).unwrap();
    assert_eq!(answer.status, ResponseStatus::UnsupportedVersion);
    bytes[4] = 0;
    let err = TunnelHeader::decode(&bytes).unwrap_err();
    assert!(err.to_string().contains("upgrade the peer"), "{err}");

    let err = TunnelHeader::decode(&TunnelResponse::ok().encode()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "expected a tunnel header but the peer sent a tunnel response: is it connecting to the \
         right port?"
    );
    assert!(TunnelResponse::decode(&pod().encode()).is_err());
}

#[test]
fn malformed_fields_are_refused() {
    let cases: &[(&[F<'_>], &str)] = &[
        (&[], "has no target"),
        (&[(0x04, &[1])], "has no target"),
        (&[POD_FIELD, POD_FIELD], "carries a target twice"),
        (
            &[POD_FIELD, (0x02, b"\x00\x50web.default")],
            "carries a target twice",
        ),
        (&[(0x01, &[10, 1, 2, 3, 0])], "expected 6 (IPv4) or 18"),
        (&[(0x01, &[])], "expected 6 (IPv4) or 18"),
        (&[(0x01, &[10, 1, 2, 3, 0, 0])], "port 0"),
        (&[(0x01, &[0, 0, 0, 0, 0, 80])], "unspecified IP"),
        (&[(0x02, b"\x00")], "shorter than its port"),
        (&[(0x02, b"\x00\x50Web.default")], "lower-case"),
        (&[(0x02, b"\x00\x50web")], "at least <service>.<namespace>"),
        (&[(0x02, b"\x00\x50web.default.")], "1 to 63"),
        (&[(0x02, b"\x00\x50web..default")], "1 to 63"),
        (&[(0x02, b"\x00\x50-web.default")], "start and end"),
        (&[(0x02, b"\x00\x5010.0.0.1")], "numeric"),
        (&[(0x02, b"\x00\x50web.d\xffefault")], "not UTF-8"),
        (&[(0x02, b"\x00\x00web.default")], "port 0"),
        (
            &[POD_FIELD, (0x03, b"spiffe://td/ns/a")],
            "invalid source identity",
        ),
        (&[POD_FIELD, (0x03, b"\xff")], "not UTF-8"),
        (&[POD_FIELD, (0x04, &[])], "expected 1"),
        (&[POD_FIELD, (0x04, &[1]), (0x04, &[1])], "protocol twice"),
    ];
    for (fields, expect) in cases {
        let err = TunnelHeader::decode(&frame(1, fields)).unwrap_err();
        assert!(err.to_string().contains(expect), "{fields:?}: {err}");
        assert_eq!(
            TunnelResponse::for_header_error(&err).unwrap().status,
            ResponseStatus::BadHeader
        );
    }
    let long = format!("{}.default", "a".repeat(64));
    assert!(Target::service(&long, 80).is_err());
    let long = vec!["a".repeat(63); 4].join(".");
    assert!(long.len() > MAX_FQDN_BYTES && Target::service(&long, 80).is_err());

    // Framing: a field running past the body, and stray bytes after the last one.
    let mut bytes = frame(1, &[POD_FIELD]);
    bytes[10] = 7;
    let err = TunnelHeader::decode(&bytes).unwrap_err();
    assert!(
        err.to_string().contains("claims 7 bytes but only 6"),
        "{err}"
    );
    let mut bytes = frame(1, &[POD_FIELD]);
    bytes.extend_from_slice(&[0x04, 0]);
    bytes[7] += 2;
    let err = TunnelHeader::decode(&bytes).unwrap_err();
    assert!(err.to_string().contains("2 stray bytes"), "{err}");
}

#[test]
fn pod_addresses_have_one_spelling() {
    let mapped: SocketAddr = "[::ffff:10.1.2.3]:8080".parse().unwrap();
    assert_eq!(Target::pod(mapped).unwrap(), pod().target);
    let v6 = TunnelHeader::new(
        Target::pod("[fd00::1]:443".parse().unwrap()).unwrap(),
        Protocol::Opaque,
    );
    assert_eq!(v6.encode().len(), 8 + 21 + 4);
    assert_eq!(TunnelHeader::decode(&v6.encode()).unwrap().0, v6);
    assert_eq!(
        web().target.to_string(),
        "service web.default.svc.cluster.local:8080"
    );
}

#[test]
fn response_statuses_say_what_to_do() {
    assert!(ResponseStatus::NotFound.retryable());
    assert!(ResponseStatus::TargetUnavailable.retryable());
    assert!(!ResponseStatus::Denied.retryable());
    assert!(!ResponseStatus::NotExported.retryable());
    assert!(!ResponseStatus::Other(200).retryable());
    assert_eq!(
        TunnelResponse::refused(ResponseStatus::Other(200), "new").to_string(),
        "other (200): new"
    );
    assert!(
        TunnelResponse::decode(&frame(2, &[])).is_err(),
        "status is required"
    );
    let err =
        TunnelResponse::decode(&frame(2, &[(0x01, &[0]), (0x02, &[b'x'; 1025])])).unwrap_err();
    assert!(err.to_string().contains("limit is 1024"), "{err}");
}

#[tokio::test]
async fn read_from_stops_at_the_end_of_the_header() {
    // A one-byte pipe: every read returns one byte, the worst case for framing.
    let (mut tx, mut rx) = tokio::io::duplex(1);
    let send = tokio::spawn(async move {
        web().write_to(&mut tx).await.unwrap();
        tx.write_all(b"application bytes").await.unwrap();
        let response = TunnelResponse::read_from(&mut tx, DEFAULT_READ_TIMEOUT)
            .await
            .unwrap();
        let mut reply = Vec::new();
        tx.read_to_end(&mut reply).await.unwrap();
        (response, reply)
    });
    let header = TunnelHeader::read_from(&mut rx, DEFAULT_READ_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(header, web());
    let mut app = [0u8; 17];
    rx.read_exact(&mut app).await.unwrap();
    assert_eq!(&app, b"application bytes");
    TunnelResponse::ok().write_to(&mut rx).await.unwrap();
    rx.write_all(b"reply").await.unwrap();
    drop(rx);
    let (response, reply) = send.await.unwrap();
    assert!(response.is_ok());
    assert_eq!(reply, b"reply");
}

#[tokio::test(start_paused = true)]
async fn read_from_times_out() {
    let (mut tx, mut rx) = tokio::io::duplex(64);
    let err = TunnelHeader::read_from(&mut rx, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "timed out after 5s waiting for the tunnel header: is the peer a Strait proxy?"
    );
    // Also when the peer stalls half-way.
    tx.write_all(&web().encode()[..12]).await.unwrap();
    let err = TunnelHeader::read_from(&mut rx, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, HeaderError::Timeout(..)), "{err}");
    assert!(TunnelResponse::for_header_error(&err).is_none());
}

#[tokio::test(start_paused = true)]
async fn read_from_refuses_a_stranger_without_waiting() {
    let (mut tx, mut rx) = tokio::io::duplex(64);
    tx.write_all(b"GET").await.unwrap();
    let started = tokio::time::Instant::now();
    let err = TunnelHeader::read_from(&mut rx, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, HeaderError::BadMagic { .. }), "{err}");
    assert_eq!(started.elapsed(), Duration::ZERO);
    // And a peer that hangs up early is told apart from a timeout.
    let (mut tx, mut rx) = tokio::io::duplex(64);
    tx.write_all(&web().encode()[..10]).await.unwrap();
    drop(tx);
    let err = TunnelHeader::read_from(&mut rx, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "peer closed the connection after 10 bytes of the tunnel header"
    );
}
