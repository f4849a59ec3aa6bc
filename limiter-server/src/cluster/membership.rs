//! Where the ring's members come from.
//!
//! - Static: the configured peers, each checked every `health_interval` with the
//!   topology call; a peer leaves the ring after `fail_after` consecutive failed (or
//!   draining) answers and comes back after `recover_after` good ones (its first
//!   answer counts at once). The epoch is this node's own count of changes.
//! - Redis registry: every node renews its entry (a sorted set scored by expiry, plus
//!   its address and weight) every `poll` with one script that also drops expired
//!   entries and bumps the shared epoch whenever the member set changes, so every
//!   node derives the same ring at the same epoch, and the epoch only grows. When the
//!   registry cannot be reached, the last good ring keeps serving and
//!   `limiter_membership_view_age_seconds` grows.
//! - DNS: the A and AAAA records of one name (a Kubernetes headless Service) are the
//!   candidates, at this node's gRPC port, looked up every `dns_interval` (or when
//!   their TTL ends, whichever is later, up to [`MAX_TTL_WAIT`]); each candidate is
//!   health-checked with the same hysteresis as static peers, and ids are addresses,
//!   so every node derives the same ring. A failed or empty answer keeps the last
//!   good list (and the view's age grows); a node joins only once the name lists its
//!   own address, so it never decides with a view the others cannot share. A member
//!   whose record goes away leaves the ring when its checks fail (hysteresis as for
//!   any peer); a node that sees its own record gone drains, as on SIGTERM, so that
//!   its tenants are handed over before the others drop it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::dns::Resolver;
use super::ring::{Member, Ring};
use super::{Cluster, LocalState};
use crate::config::Membership;

/// How long a node the records stopped listing still counts as one of the cluster's
/// (its handoff accepted): longer than any drain and handoff.
const KNOWN_AFTER_REMOVAL: Duration = Duration::from_secs(120);

/// Removed nodes remembered at most (oldest forgotten first).
const MAX_REMOVED: usize = 1024;

/// The longest a record's TTL delays the next DNS lookup (Kubernetes' DNS gives 5 s;
/// a longer wait would leave a removed pod in the ring, and the view's age near the
/// stale-view alert).
pub(crate) const MAX_TTL_WAIT: Duration = Duration::from_secs(10);

/// Renews this node's entry, drops expired ones, bumps the epoch on any change and
/// returns `{epoch, id, info, id, info, ...}`. KEYS: members (zset), epoch, info
/// (hash). ARGV: op (`renew`, `leave`, `read`), id, `address*weight`, TTL ms.
const REGISTRY_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local changed = false
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(gone) do
  redis.call('HDEL', KEYS[3], id)
  changed = true
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
if ARGV[1] == 'renew' then
  if redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[2]) == 1 then changed = true end
  if redis.call('HGET', KEYS[3], ARGV[2]) ~= ARGV[3] then
    redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
    changed = true
  end
elseif ARGV[1] == 'leave' then
  if redis.call('ZREM', KEYS[1], ARGV[2]) == 1 then changed = true end
  redis.call('HDEL', KEYS[3], ARGV[2])
end
local epoch
if changed then
  epoch = redis.call('INCR', KEYS[2])
else
  epoch = tonumber(redis.call('GET', KEYS[2]) or '0')
end
local out = {epoch}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  table.insert(out, id)
  table.insert(out, redis.call('HGET', KEYS[3], id) or '')
end
return out
";

/// Keeps `cluster`'s ring current until `cancel`, handing `state` over as it moves.
pub async fn run(cluster: Arc<Cluster>, state: Arc<dyn LocalState>, cancel: CancellationToken) {
    match cluster.config().membership.clone() {
        Membership::Single => {}
        Membership::Static(peers) => {
            let others: Vec<Member> = peers
                .iter()
                .filter(|p| *p.id != *cluster.me().id)
                .map(|p| Member {
                    id: p.id.as_str().into(),
                    address: p.address.as_str().into(),
                    weight: p.weight,
                })
                .collect();
            run_checked(&cluster, &*state, Candidates::Fixed(others), cancel).await;
        }
        Membership::Dns { name, server, port, interval, timeout } => {
            let dns = DnsCandidates {
                resolver: Resolver::new(server, timeout),
                name,
                port,
                interval,
                next: tokio::time::Instant::now(),
                found: None,
                removed: Vec::new(),
                failures: 0,
            };
            run_checked(&cluster, &*state, Candidates::Dns(Box::new(dns)), cancel).await;
        }
        Membership::Registry { url, key, ttl, poll } => {
            run_registry(&cluster, &*state, &url, &key, ttl, poll, cancel).await;
        }
    }
}

#[derive(Debug, Default)]
struct Health {
    live: Option<bool>,
    streak: u32,
}

/// The nodes that may be members, each to be health-checked.
enum Candidates {
    /// Static peers (without this node).
    Fixed(Vec<Member>),
    /// What a DNS name lists.
    Dns(Box<DnsCandidates>),
}

/// How long after a lookup the next one is made: the interval, or the records' TTL
/// when that is longer (an answer is good until then), at most [`MAX_TTL_WAIT`]; a
/// failed or empty answer is tried again after the interval.
fn next_lookup(interval: Duration, ttl: Option<Duration>) -> Duration {
    ttl.map_or(interval, |t| interval.max(t.min(MAX_TTL_WAIT)))
}

struct DnsCandidates {
    resolver: Resolver,
    name: String,
    port: u16,
    interval: Duration,
    /// When the name is looked up next.
    next: tokio::time::Instant,
    /// The last good list (every address, this node's too), sorted by id.
    found: Option<Vec<Member>>,
    /// Addresses the records listed before, and when they stopped (oldest first).
    removed: Vec<(Arc<str>, tokio::time::Instant)>,
    failures: u32,
}

impl DnsCandidates {
    /// Looks the name up when due; keeps the last good list on a failed or empty
    /// answer. Whether a good answer came in this call.
    async fn refresh(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        if now < self.next {
            return false;
        }
        let answer = self.resolver.lookup(&self.name).await;
        let ttl = match &answer {
            Ok(a) if !a.addresses.is_empty() => Some(a.ttl),
            _ => None,
        };
        self.next = now + next_lookup(self.interval, ttl);
        match answer {
            Ok(a) if !a.addresses.is_empty() => {
                let mut members: Vec<Member> = a
                    .addresses
                    .iter()
                    .map(|ip| {
                        let id: Arc<str> =
                            std::net::SocketAddr::new(*ip, self.port).to_string().into();
                        Member { id: id.clone(), address: id, weight: 1 }
                    })
                    .collect();
                members.sort_by(|a, b| a.id.cmp(&b.id));
                if self.found.as_ref() != Some(&members) {
                    tracing::info!(name = %self.name, members = members.len(), "membership records changed");
                    // Those no longer listed stay known for a while: a pod leaves the
                    // records as it stops, and its handoff must still be accepted.
                    for gone in self.found.iter().flatten().filter(|m| !members.contains(m)) {
                        self.removed.push((gone.id.clone(), now));
                    }
                }
                self.removed.retain(|(id, at)| {
                    now.duration_since(*at) < KNOWN_AFTER_REMOVAL
                        && !members.iter().any(|m| m.id == *id)
                });
                if self.removed.len() > MAX_REMOVED {
                    let extra = self.removed.len() - MAX_REMOVED;
                    self.removed.drain(..extra);
                }
                self.failures = 0;
                self.found = Some(members);
                true
            }
            other => {
                self.failures += 1;
                if self.failures == 1 || self.failures.is_power_of_two() {
                    match other {
                        Ok(_) => tracing::warn!(
                            name = %self.name,
                            failures = self.failures,
                            "membership name has no address records: the last list keeps serving"
                        ),
                        Err(e) => tracing::warn!(
                            name = %self.name,
                            failures = self.failures,
                            "membership lookup failed ({e}): the last list keeps serving"
                        ),
                    }
                }
                false
            }
        }
    }
}

async fn run_checked(
    cluster: &Cluster,
    state: &dyn LocalState,
    mut candidates: Candidates,
    cancel: CancellationToken,
) {
    let me = cluster.me().clone();
    let cfg = cluster.config().clone();
    let mut health: HashMap<Arc<str>, Health> = HashMap::new();
    let mut epoch = 0;
    let mut tick = tokio::time::interval(cfg.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let (others, listed): (Vec<Member>, bool) = match &mut candidates {
            Candidates::Fixed(others) => (others.clone(), true),
            Candidates::Dns(dns) => {
                if dns.refresh().await {
                    cluster.refreshed();
                }
                let Some(found) = &dns.found else {
                    // No answer yet: nothing to join with.
                    cluster.publish();
                    continue;
                };
                let mut others: Vec<Member> =
                    found.iter().filter(|m| m.id != me.id).cloned().collect();
                let listed = others.len() < found.len();
                let ring = cluster.ring();
                // A member whose record went away stays a candidate while it is in
                // the ring: it leaves when its checks say so (it drains as soon as it
                // sees its record gone, and hands its tenants over first), with the
                // hysteresis of any peer.
                for m in ring.members() {
                    if m.id != me.id && !others.iter().any(|o| o.id == m.id) {
                        others.push(m.clone());
                    }
                }
                // Candidates that left both are forgotten with their health and their
                // clients (pods come back under new addresses).
                health.retain(|id, _| others.iter().any(|m| m.id == *id));
                cluster.forget_peers_except(others.iter());
                let known = others.iter().map(|m| m.id.clone());
                cluster
                    .set_candidates(known.chain(dns.removed.iter().map(|r| r.0.clone())).collect());
                if !listed && cluster.joined() && !cluster.draining() {
                    tracing::warn!(
                        node = %me.id,
                        "this node's address left the membership records: draining \
                         (its tenants go to the others; it stays out until restarted)"
                    );
                    cluster.drain(state.counters(), state.leases()).await;
                }
                (others, listed)
            }
        };
        // Every peer at once, each within the interval (at least 200 ms: a check
        // that is merely slow under load is not a failure).
        let timeout = cfg.health_interval.max(Duration::from_millis(200));
        let mut checks = tokio::task::JoinSet::new();
        for (i, m) in others.iter().enumerate() {
            let peer = cluster.peer(m);
            checks.spawn(async move {
                let ok = match peer {
                    Ok(p) => matches!(p.topology(timeout).await, Ok(t) if !t.draining),
                    Err(_) => false,
                };
                (i, ok)
            });
        }
        let mut results = vec![false; others.len()];
        while let Some(r) = checks.join_next().await {
            if let Ok((i, ok)) = r {
                results[i] = ok;
            }
        }
        let mut members = Vec::new();
        if !cluster.draining() && listed {
            members.push(me.clone());
        }
        for (m, ok) in others.iter().zip(results) {
            let h = health.entry(m.id.clone()).or_default();
            match h.live {
                // A first answer counts at once; a first failure must repeat
                // `fail_after` times (a node that joins with a wrong view would take
                // tenants that are not its own).
                None if ok => h.live = Some(true),
                None => {
                    h.streak += 1;
                    if h.streak >= cfg.fail_after {
                        h.live = Some(false);
                        h.streak = 0;
                    }
                }
                Some(live) if live == ok => h.streak = 0,
                Some(live) => {
                    h.streak += 1;
                    let needed = if live { cfg.fail_after } else { cfg.recover_after };
                    if h.streak >= needed {
                        h.live = Some(ok);
                        h.streak = 0;
                        tracing::info!(peer = %m.id, live = ok, "peer health changed");
                    }
                }
            }
            if h.live == Some(true) {
                members.push(m.clone());
            }
        }
        if health.values().any(|h| h.live.is_none()) {
            // Not every peer is known yet: do not join with a partial view.
            continue;
        }
        if !listed && !cluster.joined() {
            // The records do not list this node yet: the others could not see it.
            cluster.publish();
            continue;
        }
        if matches!(candidates, Candidates::Fixed(_)) {
            cluster.refreshed();
        }
        let ring = cluster.ring();
        let mut ids: Vec<&str> = members.iter().map(|m| &*m.id).collect();
        ids.sort_unstable();
        let current: Vec<&str> = ring.members().iter().map(|m| &*m.id).collect();
        if ids != current || !cluster.joined() {
            epoch += 1;
            cluster.install(Ring::new(epoch, members), state).await;
        }
        cluster.publish();
    }
}

fn parse_registry(reply: &[redis::Value]) -> Option<Ring> {
    let int = |v: &redis::Value| match v {
        redis::Value::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    };
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let epoch = int(reply.first()?)?;
    let mut members = Vec::new();
    for pair in reply[1..].chunks(2) {
        let [id, info] = pair else { return None };
        let (id, info) = (text(id)?, text(info)?);
        let (address, weight) = info.split_once('*')?;
        members.push(Member {
            id: id.into(),
            address: address.into(),
            weight: weight.parse().ok()?,
        });
    }
    Some(Ring::new(epoch, members))
}

async fn run_registry(
    cluster: &Cluster,
    state: &dyn LocalState,
    url: &str,
    key: &str,
    ttl: Duration,
    poll: Duration,
    cancel: CancellationToken,
) {
    let me = cluster.me().clone();
    let info = format!("{}*{}", me.address, me.weight);
    let keys =
        [format!("{{{key}}}:members"), format!("{{{key}}}:epoch"), format!("{{{key}}}:info")];
    let script = redis::Script::new(REGISTRY_SCRIPT);
    let client = match redis::Client::open(url) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("cluster.registry_url: {e}");
            return;
        }
    };
    let mut conn: Option<redis::aio::MultiplexedConnection> = None;
    // A call may take up to half the TTL (a loaded machine answers slowly); the entry
    // is renewed in time all the same, since polls come at most every half TTL.
    let deadline = (ttl / 2).max(poll);
    let mut left = false;
    let mut failures = 0u32;
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopping = tokio::select! {
            () = cancel.cancelled() => true,
            _ = tick.tick() => false,
        };
        let op = if stopping || cluster.draining() {
            if left { "read" } else { "leave" }
        } else {
            "renew"
        };
        if conn.is_none() {
            conn = tokio::time::timeout(deadline, client.get_multiplexed_async_connection())
                .await
                .ok()
                .and_then(Result::ok);
        }
        let reply = match conn.as_mut() {
            Some(c) => {
                let mut inv = script.prepare_invoke();
                for k in &keys {
                    inv.key(k);
                }
                inv.arg(op)
                    .arg(&*me.id)
                    .arg(&info)
                    .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
                tokio::time::timeout(deadline, inv.invoke_async::<Vec<redis::Value>>(c))
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
            None => None,
        };
        match reply.as_deref().and_then(parse_registry) {
            Some(ring) => {
                failures = 0;
                if op == "leave" {
                    left = true;
                }
                cluster.refreshed();
                cluster.install(ring, state).await;
            }
            None => {
                conn = None;
                failures += 1;
                if failures == 1 || failures.is_power_of_two() {
                    tracing::warn!(
                        failures,
                        "membership registry unreachable: the last ring keeps serving"
                    );
                }
            }
        }
        cluster.publish();
        if stopping {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_wait_for_the_interval_or_a_longer_ttl() {
        let s = Duration::from_secs;
        assert_eq!(next_lookup(s(2), Some(s(0))), s(2));
        assert_eq!(next_lookup(s(2), Some(s(5))), s(5));
        assert_eq!(next_lookup(s(2), Some(s(3600))), MAX_TTL_WAIT);
        assert_eq!(next_lookup(s(2), None), s(2), "a failure is retried after the interval");
    }

    #[test]
    fn registry_replies_parse_into_a_ring() {
        let b = |s: &str| redis::Value::BulkString(s.as_bytes().to_vec());
        let r = parse_registry(&[
            redis::Value::Int(7),
            b("b"),
            b("127.0.0.1:2*1"),
            b("a"),
            b("127.0.0.1:1*3"),
        ])
        .unwrap();
        assert_eq!(r.epoch, 7);
        assert_eq!(r.members()[0].id.as_ref(), "a");
        assert_eq!(r.members()[0].weight, 3);
        assert!(parse_registry(&[redis::Value::Int(1), b("a")]).is_none());
        assert!(parse_registry(&[redis::Value::Int(1), b("a"), b("no-weight")]).is_none());
    }
}
