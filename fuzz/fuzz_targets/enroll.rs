//! Fuzzes the enrollment protocol: what the node proxy does with a line a
//! CNI plugin (or anyone who reaches its socket) writes, before acting on it.
#![no_main]

use std::path::{Component, Path};

use libfuzzer_sys::fuzz_target;
use strait_proxy::transparent::{EnrollError, EnrollRequest, parse_request};

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        // The socket reads lines as UTF-8; anything else ends the session.
        return;
    };
    match parse_request(line) {
        Ok(request) => {
            assert!(line.ends_with('\n') && line.len() <= 4096);
            let (namespace, name) = match &request {
                EnrollRequest::Add {
                    namespace, name, ..
                }
                | EnrollRequest::Remove { namespace, name } => (namespace, name),
            };
            // Both name a file in the proxy's state folder: never a path out of it.
            for part in [namespace, name] {
                assert!(is_kubernetes_name(part), "accepted name {part:?}");
            }
            let file = format!("{namespace}_{name}.json");
            let components: Vec<_> = Path::new(&file).components().collect();
            assert!(
                matches!(components[..], [Component::Normal(_)]),
                "state file {file:?} is not one file in the state folder"
            );
            // What the CNI plugin writes for it reads back as the same request.
            let mut again = serde_json::to_string(&request).expect("serializable");
            again.push('\n');
            assert_eq!(parse_request(&again).expect("own encoding parses"), request);
        }
        Err(e) => {
            assert!(!e.to_string().is_empty());
            if matches!(e, EnrollError::TooLong) {
                assert!(line.len() > 4096 || !line.ends_with('\n'));
            }
        }
    }
});

/// A re-reading of Kubernetes' rule, independent of the proxy's.
fn is_kubernetes_name(s: &str) -> bool {
    (1..=253).contains(&s.len())
        && s.chars()
            .all(|c| matches!(c, 'a'..='z' | '0'..='9' | '-' | '.'))
        && !s.starts_with('.')
}
