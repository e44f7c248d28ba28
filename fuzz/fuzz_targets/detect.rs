//! Fuzzes protocol detection: the first bytes of every connection the node
//! proxy accepts, outbound and inbound, and the opaque-ports annotation parser.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strait_mesh::detect::{
    Detection, H2_PREFACE, MAX_DETECT_BYTES, MAX_METHOD_LEN, Protocol, classify, skip_detection,
};

/// Every prefix up to this length is classified; beyond it, a sample.
const ALL_PREFIXES_UP_TO: usize = 256;

fuzz_target!(|data: &[u8]| {
    check_monotone(data);
    check_bounded(data);
    check_answer(data);
    check_opaque_ports(data);
});

/// A decision never changes when more bytes arrive.
fn check_monotone(data: &[u8]) {
    let mut cuts: Vec<usize> = (0..=data.len().min(ALL_PREFIXES_UP_TO)).collect();
    let mut k = ALL_PREFIXES_UP_TO;
    while k < data.len() {
        cuts.push(k);
        k *= 2;
    }
    cuts.push(data.len());
    let mut decided: Option<(usize, Detection)> = None;
    for cut in cuts {
        let d = classify(&data[..cut]);
        match decided {
            Some((at, first)) => assert_eq!(d, first, "decided {first:?} at {at}, {d:?} at {cut}"),
            None if d != Detection::NeedMore => decided = Some((cut, d)),
            None => {}
        }
    }
}

/// Enough bytes always decide, and only the first MAX_DETECT_BYTES count.
fn check_bounded(data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let long: Vec<u8> = data
        .iter()
        .copied()
        .cycle()
        .take(MAX_DETECT_BYTES + 1)
        .collect();
    let d = classify(&long);
    assert_ne!(
        d,
        Detection::NeedMore,
        "{} bytes and still undecided",
        long.len()
    );
    if data.len() >= MAX_DETECT_BYTES {
        assert_eq!(classify(data), d);
    } else if let Detection::Protocol(p) = classify(data) {
        assert_eq!(d, Detection::Protocol(p));
    }
}

/// What each answer promises, checked against a plain re-reading of the bytes.
fn check_answer(data: &[u8]) {
    let seen = &data[..data.len().min(MAX_DETECT_BYTES)];
    match classify(data) {
        Detection::Protocol(Protocol::Http2) => assert!(data.starts_with(H2_PREFACE)),
        Detection::Protocol(Protocol::Http1) => {
            let end = seen
                .windows(2)
                .position(|w| w == b"\r\n")
                .expect("a line end");
            let line = &seen[..end];
            let parts: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
            let [method, target, version] = parts[..] else {
                panic!("not three parts: {:?}", String::from_utf8_lossy(line));
            };
            assert!(!method.is_empty() && method.len() <= MAX_METHOD_LEN);
            assert!(method[0].is_ascii_uppercase());
            assert!(!target.is_empty() && target.iter().all(u8::is_ascii_graphic));
            assert!(version == b"HTTP/1.1" || version == b"HTTP/1.0");
        }
        Detection::Protocol(Protocol::Opaque) => assert!(!data.starts_with(H2_PREFACE)),
        // Only a sender says this, in a tunnel header; bytes never read as it.
        Detection::Protocol(Protocol::Http1Multiplexed) => {
            panic!("detection answered Http1Multiplexed")
        }
        Detection::NeedMore => {
            assert!(data.len() < MAX_DETECT_BYTES);
            assert!(!seen.windows(2).any(|w| w == b"\r\n") || H2_PREFACE.starts_with(data));
        }
    }
}

/// The annotation parser takes any string; errors say what they skipped.
fn check_opaque_ports(data: &[u8]) {
    let Ok(value) = std::str::from_utf8(data) else {
        return;
    };
    let port = u16::from_le_bytes([
        data.first().copied().unwrap_or(0),
        data.get(1).copied().unwrap_or(0),
    ]);
    let d = skip_detection(port, Some(value), Some(value), None);
    assert_eq!(d.opaque, d.by.is_some());
    for e in &d.errors {
        assert!(!e.to_string().is_empty());
        assert!(e.entry.chars().count() <= 65);
    }
}
