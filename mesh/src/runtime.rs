//! The tokio runtime of the gateway and the node proxy, by thread count.

/// A runtime with `workers` threads: 1 = single-threaded (no cross-thread
/// wake-ups; the thread calling `block_on` is the worker), 0 = one worker per
/// available CPU (tokio's default, cgroup limits included), N = N workers.
pub fn build(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = match workers {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            if n > 1 {
                builder.worker_threads(n);
            }
            builder
        }
    };
    builder.enable_all().build()
}
