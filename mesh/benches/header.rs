//! Cost of the tunnel header per connection: encode + decode, ns/op.
//!
//! `CARGO_TARGET_DIR=/work/target-header cargo bench -p strait-mesh --bench header`
//! (std::time, no criterion: the number only needs to show the header is noise
//! next to a TLS handshake.)

use std::hint::black_box;
use std::time::Instant;

use bytes::BytesMut;
use strait_mesh::tunnel::{Protocol, Target, TunnelHeader, TunnelResponse};

const ITERATIONS: u32 = 1_000_000;

fn measure(name: &str, mut op: impl FnMut()) {
    for _ in 0..ITERATIONS / 10 {
        op();
    }
    let started = Instant::now();
    for _ in 0..ITERATIONS {
        op();
    }
    let ns = started.elapsed().as_nanos() as f64 / f64::from(ITERATIONS);
    println!("{name:<40} {ns:>8.1} ns/op");
}

fn main() {
    let pod = TunnelHeader::new(
        Target::pod("10.1.2.3:8080".parse().unwrap()).unwrap(),
        Protocol::Http1,
    );
    let gateway = TunnelHeader {
        target: Target::service("web.default.svc.cluster.local", 8080).unwrap(),
        source: Some("spiffe://east.local/ns/shop/sa/web".parse().unwrap()),
        protocol: Protocol::Http2,
        end_to_end: true,
    };
    let mut buf = BytesMut::with_capacity(256);
    for (name, header) in [("pod", &pod), ("service + source", &gateway)] {
        println!("{name}: {} bytes", header.encode().len());
        measure(&format!("encode_into ({name})"), || {
            buf.clear();
            black_box(header).encode_into(&mut buf);
            black_box(&buf);
        });
        let bytes = header.encode();
        measure(&format!("decode ({name})"), || {
            black_box(TunnelHeader::decode(black_box(&bytes)).unwrap());
        });
        measure(&format!("encode + decode ({name})"), || {
            buf.clear();
            black_box(header).encode_into(&mut buf);
            black_box(TunnelHeader::decode(&buf).unwrap());
        });
    }
    let ok = TunnelResponse::ok().encode();
    measure("decode (response ok)", || {
        black_box(TunnelResponse::decode(black_box(&ok)).unwrap());
    });
}
