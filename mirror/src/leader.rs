//! Leader election among the controller's replicas: one `coordination.k8s.io`
//! Lease (`strait-mirror` in the Links' namespace, the same Lease `strait
//! check` reads as the heartbeat). Only the holder runs Link workers, the MCS
//! controller and the CoreDNS keeper; the others wait, Ready, to take over.
//!
//! Like client-go's leader election: a follower counts a holder's lease from
//! when it *saw* the Lease change (its own clock, so clock skew between nodes
//! does not matter) and takes it over with a resourceVersion-guarded replace
//! (two followers cannot both win). The leader renews every retry period and
//! steps down, before any follower may take over, when it could not renew for
//! the renew deadline ([`Leadership::lost`]).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long a lease lasts without renewal, how long the leader keeps trying
/// to renew before it stops acting, and how often everyone tries.
#[derive(Clone, Debug)]
pub struct ElectionTiming {
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl Default for ElectionTiming {
    /// Takeover after a leader dies within `lease_duration + 2 × retry_period`
    /// (7 s + 2 s: under the 10 s the HA goal allows); the 2 s between the renew
    /// deadline and the lease's end is the margin for a slow last request.
    fn default() -> Self {
        Self {
            lease_duration: Duration::from_secs(7),
            renew_deadline: Duration::from_secs(5),
            retry_period: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    #[error(
        "leader election timing: the renew deadline ({renew:?}) must be shorter than the lease duration ({lease:?}) and longer than the retry period ({retry:?})"
    )]
    Timing {
        lease: Duration,
        renew: Duration,
        retry: Duration,
    },
}

impl ElectionTiming {
    pub fn check(&self) -> Result<(), ElectionError> {
        if self.renew_deadline >= self.lease_duration || self.retry_period >= self.renew_deadline {
            return Err(ElectionError::Timing {
                lease: self.lease_duration,
                renew: self.renew_deadline,
                retry: self.retry_period,
            });
        }
        Ok(())
    }
}

/// This replica's view of the election: `true` while it leads.
#[derive(Clone)]
pub struct Leadership(watch::Receiver<bool>);

impl Leadership {
    /// Resolves once this replica leads.
    pub async fn acquired(&mut self) {
        let _ = self.0.wait_for(|leading| *leading).await;
    }

    /// Resolves when this replica, having led, stops leading (it could not
    /// renew in time): every writer must stop at once.
    pub async fn lost(&mut self) {
        self.acquired().await;
        let _ = self.0.wait_for(|leading| !*leading).await;
    }
}

/// Starts the election in the background. `leader` (the `mirror_leader`
/// gauge) is 1 while this replica leads.
pub fn start(
    client: Client,
    namespace: &str,
    lease_name: &str,
    identity: String,
    timing: ElectionTiming,
    leader: Gauge,
) -> Leadership {
    let (tx, rx) = watch::channel(false);
    let elector = Elector {
        api: Api::namespaced(client, namespace),
        lease_name: lease_name.into(),
        identity,
        timing,
        observed: None,
    };
    tokio::spawn(async move {
        elector.run(&tx, &leader).await;
        leader.set(0);
        let _ = tx.send(false);
    });
    Leadership(rx)
}

struct Elector {
    api: Api<Lease>,
    lease_name: String,
    identity: String,
    timing: ElectionTiming,
    /// The other holder's last renewal as seen here, and when it was seen.
    observed: Option<(Option<String>, Option<MicroTime>, Instant)>,
}

impl Elector {
    /// Follows until it acquires, then leads until a renewal misses the
    /// deadline; returns then (leadership is not taken up again by this
    /// process: the caller exits, as kube-controller-manager does).
    async fn run(mut self, tx: &watch::Sender<bool>, leader: &Gauge) {
        let retry = self.timing.retry_period;
        loop {
            let attempt = Instant::now();
            match tokio::time::timeout(retry, self.try_acquire()).await {
                Ok(Ok(true)) => {
                    tracing::info!(identity = %self.identity, lease = %self.lease_name, "leading: this replica mirrors now");
                    leader.set(1);
                    let _ = tx.send(true);
                    self.lead(attempt).await;
                    tracing::error!(identity = %self.identity, "could not renew the leader Lease within {:?}: stopping every writer", self.timing.renew_deadline);
                    return;
                }
                Ok(Ok(false)) => {}
                Ok(Err(e)) => tracing::warn!(
                    "leader election: {e} (RBAC: leases get/create/update in the Links' namespace, deploy/mirror/rbac.yaml)"
                ),
                Err(_) => tracing::debug!(
                    "leader election: the API server did not answer within {retry:?}"
                ),
            }
            tokio::time::sleep_until(attempt + retry).await;
        }
    }

    /// Renews every retry period; returns once the last successful renewal
    /// (counted from when its request was sent) is older than the deadline.
    async fn lead(&mut self, mut renewed: Instant) {
        let retry = self.timing.retry_period;
        let mut next = renewed + retry;
        loop {
            let deadline = renewed + self.timing.renew_deadline;
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return,
                _ = tokio::time::sleep_until(next) => {}
            }
            let sent = Instant::now();
            next = sent + retry;
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return,
                r = self.renew() => match r {
                    Ok(true) => renewed = sent,
                    Ok(false) => return,
                    Err(e) => tracing::warn!("renewing the leader Lease: {e}"),
                },
            }
        }
    }

    fn lease(&self, transitions: i32, acquired: Option<MicroTime>) -> LeaseSpec {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.timing.lease_duration.as_secs().max(1) as i32),
            acquire_time: Some(acquired.unwrap_or_else(|| now.clone())),
            renew_time: Some(now),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// One attempt: create the Lease, or take it over when its holder let it
    /// expire (as seen from here). True when this replica now holds it.
    async fn try_acquire(&mut self) -> kube::Result<bool> {
        let Some(mut lease) = self.api.get_opt(&self.lease_name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.lease_name.clone()),
                    labels: Some(
                        [
                            ("app.kubernetes.io/part-of", "strait"),
                            ("app.kubernetes.io/component", "mirror"),
                        ]
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    ),
                    ..Default::default()
                },
                spec: Some(self.lease(0, None)),
            };
            return won(self.api.create(&PostParams::default(), &lease).await);
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        if holder.as_deref() == Some(self.identity.as_str()) {
            // Ours already (a restart with the same pod name): renew it.
            return self.renew().await;
        }
        let now = Instant::now();
        let seen = (holder.clone(), spec.renew_time.clone());
        let since = match &self.observed {
            Some((h, r, at)) if (h, r) == (&seen.0, &seen.1) => *at,
            _ => {
                self.observed = Some((seen.0, seen.1, now));
                now
            }
        };
        let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(0) as u64);
        if holder.is_some() && now.duration_since(since) < duration {
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(holder.is_some());
        lease.spec = Some(self.lease(transitions, None));
        // The resourceVersion read above guards the replace: of two
        // followers, one wins and the other gets a conflict.
        let result = self
            .api
            .replace(&self.lease_name, &PostParams::default(), &lease)
            .await;
        if result.is_ok() {
            tracing::info!(previous = ?holder, "took over the leader Lease");
        }
        won(result)
    }

    /// Renews this replica's Lease. `Ok(false)`: someone else holds it now.
    async fn renew(&mut self) -> kube::Result<bool> {
        let mut lease = self.api.get(&self.lease_name).await?;
        let spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(false);
        }
        lease.spec = Some(self.lease(
            spec.lease_transitions.unwrap_or(0),
            spec.acquire_time.clone(),
        ));
        won(self
            .api
            .replace(&self.lease_name, &PostParams::default(), &lease)
            .await)
    }
}

/// Gives the Lease up on a graceful shutdown (SIGTERM, a rollout): the other
/// replica takes over within a retry period instead of waiting out the lease.
/// Call it only once this process writes nothing more (it exits right after).
pub async fn release(client: Client, namespace: &str, lease_name: &str, identity: &str) {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let Ok(mut lease) = api.get(lease_name).await else {
        return;
    };
    let mut spec = lease.spec.clone().unwrap_or_default();
    if spec.holder_identity.as_deref() != Some(identity) {
        return;
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
    lease.spec = Some(spec);
    match api
        .replace(lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => tracing::info!("leader Lease released"),
        Err(e) => tracing::warn!(
            "releasing the leader Lease: {e} (the other replica takes over when it expires)"
        ),
    }
}

/// A write that lost a race (409 Conflict) is `false`, not an error.
fn won(result: kube::Result<Lease>) -> kube::Result<bool> {
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_take_over_within_ten_seconds_and_bad_timings_are_refused() {
        let t = ElectionTiming::default();
        t.check().unwrap();
        assert!(t.lease_duration + 2 * t.retry_period <= Duration::from_secs(10));
        let bad = ElectionTiming {
            renew_deadline: Duration::from_secs(8),
            ..ElectionTiming::default()
        };
        let e = bad.check().unwrap_err().to_string();
        assert!(e.contains("must be shorter than the lease duration"), "{e}");
    }
}
