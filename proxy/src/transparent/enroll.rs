//! The enrollment protocol: one JSON [`EnrollRequest`] per line on the
//! proxy's Unix socket, answered by one [`EnrollResponse`] line; and its
//! client side, what a CNI plugin does.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// The longest enrollment request line accepted.
pub(super) const MAX_REQUEST: usize = 4096;

/// One request on the enrollment socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum EnrollRequest {
    /// Capture this pod's traffic; `netns` is the path of its network namespace.
    Add {
        namespace: String,
        name: String,
        netns: PathBuf,
    },
    /// Stop capturing: rules removed, sockets closed.
    Remove { namespace: String, name: String },
}

/// The answer to one [`EnrollRequest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnrollResponse {
    pub ok: bool,
    /// For `add`: whether the pod's traffic is now captured (`false`: the pod
    /// did not ask for it, see [`super::TRANSPARENT_ANNOTATION`]).
    #[serde(default)]
    pub captured: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Reads one request line as the socket delivers it (newline included):
/// bounded, one JSON request, pod names that are Kubernetes names. Pure; what
/// the proxy does with a peer's bytes before acting on them, so it is fuzzed
/// (`fuzz/fuzz_targets/enroll.rs`).
pub fn parse_request(line: &str) -> Result<EnrollRequest, EnrollError> {
    if line.len() > MAX_REQUEST || !line.ends_with('\n') {
        return Err(EnrollError::TooLong);
    }
    let request: EnrollRequest = serde_json::from_str(line).map_err(EnrollError::NotARequest)?;
    request.check_names()?;
    Ok(request)
}

impl EnrollRequest {
    /// Both operations name the pod's state file (`<namespace>_<name>.json`):
    /// an unchecked `remove` of `../../x` would delete a file outside it.
    pub(super) fn check_names(&self) -> Result<(), EnrollError> {
        match self {
            EnrollRequest::Add {
                namespace, name, ..
            }
            | EnrollRequest::Remove { namespace, name } => check_names(namespace, name),
        }
    }
}

/// Pod namespace and name are Kubernetes names (they also name the state file).
fn check_names(namespace: &str, name: &str) -> Result<(), EnrollError> {
    let valid = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && !s.starts_with('.')
    };
    if valid(namespace) && valid(name) {
        Ok(())
    } else {
        Err(EnrollError::InvalidName {
            namespace: namespace.to_string(),
            name: name.to_string(),
        })
    }
}

/// Why the proxy refused an enrollment request; its text is the answer's
/// `error`.
#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error("request longer than {MAX_REQUEST} bytes or not ended by a newline")]
    TooLong,
    #[error(
        "not an enrollment request ({0}); send {{\"op\":\"add\",\"namespace\":…,\"name\":…,\"netns\":…}} or {{\"op\":\"remove\",…}}"
    )]
    NotARequest(serde_json::Error),
    #[error(
        "{namespace:?}/{name:?} is not a pod's namespace and name (lower-case letters, digits, '-' and '.')"
    )]
    InvalidName { namespace: String, name: String },
    #[error(
        "pod {namespace}/{name} is not scheduled to node {node} as far as the proxy knows (waited {waited:?}); is the proxy's discovery healthy?"
    )]
    UnknownPod {
        namespace: String,
        name: String,
        node: String,
        waited: std::time::Duration,
    },
    #[error("capturing pod {namespace}/{name}: {source}")]
    Capture {
        namespace: String,
        name: String,
        source: io::Error,
    },
    #[error("releasing pod {namespace}/{name}: {source}")]
    Release {
        namespace: String,
        name: String,
        source: io::Error,
    },
}

/// Why an enrollment (the client side) did not happen.
#[derive(Debug, thiserror::Error)]
pub enum EnrollClientError {
    #[error("connecting to the proxy's enrollment socket {socket}: {source}")]
    Connect { socket: PathBuf, source: io::Error },
    #[error("talking to the proxy: {0}")]
    Io(#[from] io::Error),
    #[error("the proxy answered {answer:?}: {source}")]
    Answer {
        answer: String,
        source: serde_json::Error,
    },
    /// The proxy's `error`, which says what to fix.
    #[error("{0}")]
    Refused(String),
}

/// The client side of enrollment (what a CNI plugin does): one request on
/// the proxy's socket, its answer (for `add`: whether the pod is captured).
pub async fn enroll(socket: &Path, request: &EnrollRequest) -> Result<bool, EnrollClientError> {
    let mut stream =
        UnixStream::connect(socket)
            .await
            .map_err(|source| EnrollClientError::Connect {
                socket: socket.to_path_buf(),
                source,
            })?;
    let mut line = serde_json::to_vec(request).map_err(io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line).await?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).await?;
    let response: EnrollResponse = serde_json::from_str(&answer)
        .map_err(|source| EnrollClientError::Answer { answer, source })?;
    match response {
        EnrollResponse {
            ok: true, captured, ..
        } => Ok(captured),
        EnrollResponse { error, .. } => Err(EnrollClientError::Refused(
            error.unwrap_or_else(|| "refused".into()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_read_as_a_cni_plugin_writes_them() {
        let add: EnrollRequest = serde_json::from_str(
            r#"{"op":"add","namespace":"shop","name":"web-0","netns":"/var/run/netns/cni-1"}"#,
        )
        .unwrap();
        assert_eq!(
            add,
            EnrollRequest::Add {
                namespace: "shop".into(),
                name: "web-0".into(),
                netns: "/var/run/netns/cni-1".into()
            }
        );
        let remove: EnrollRequest =
            serde_json::from_str(r#"{"op":"remove","namespace":"shop","name":"web-0"}"#).unwrap();
        assert!(matches!(remove, EnrollRequest::Remove { .. }));
        assert!(serde_json::from_str::<EnrollRequest>(r#"{"op":"add","name":"x"}"#).is_err());
    }

    /// Found by the `enroll` fuzz target: `remove` took any names, and they
    /// name the state file it deletes.
    #[test]
    fn remove_names_are_checked_like_add_names() {
        for line in [
            "{\"op\":\"remove\",\"namespace\":\"../../etc\",\"name\":\"passwd\"}\n",
            "{\"op\":\"remove\",\"namespace\":\"/tmp/x\",\"name\":\"y\"}\n",
            "{\"op\":\"remove\",\"namespace\":\"}hop\",\"name\":\"web-0\"}\n",
        ] {
            let got = parse_request(line);
            assert!(
                matches!(got, Err(EnrollError::InvalidName { .. })),
                "{line}: {got:?}"
            );
        }
        assert_eq!(
            parse_request("{\"op\":\"remove\",\"namespace\":\"shop\",\"name\":\"web-0\"}\n")
                .unwrap(),
            EnrollRequest::Remove {
                namespace: "shop".into(),
                name: "web-0".into()
            }
        );
    }
}
