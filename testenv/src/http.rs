//! One plain HTTP GET, for admin ports and health endpoints.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one GET may take, connection to the end of the answer.
const TIMEOUT: Duration = Duration::from_secs(5);

/// `GET path` on `addr` (HTTP/1.1, `Connection: close`): the raw answer,
/// status line and headers included (`/ready`, `/metrics`, etcd's `/health`).
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .map_err(|e| format!("GET {path} on {addr}: {e}"))?;
        let mut out = String::new();
        s.read_to_string(&mut out)
            .await
            .map_err(|e| format!("GET {path} on {addr}: {e}"))?;
        Ok(out)
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| format!("GET {path} on {addr}: no answer within {TIMEOUT:?}"))?
}
