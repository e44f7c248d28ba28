//! Polling helpers for tests: wait for the real controllers to converge.

use std::future::Future;
use std::time::Duration;

/// Polls `check` until it returns `Ok(value)` or `timeout` passes; then panics
/// with `what` and the last error, so a failing test says what it waited for.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match check().await {
            Ok(value) => return value,
            Err(e) => e,
        };
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}; last check said: {last}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the object `name` exists in `api` and returns it.
pub async fn until_exists<K>(what: &str, timeout: Duration, api: &kube::Api<K>, name: &str) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    eventually(what, timeout, || async {
        api.get(name).await.map_err(|e| e.to_string())
    })
    .await
}
