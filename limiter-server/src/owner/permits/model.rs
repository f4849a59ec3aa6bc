//! Property test of permits at the owner against a model of their holders: random
//! acquisitions, releases (some duplicated), renewals, holders lost (their release
//! never sent) and time passing. After every step, each concurrency level counts
//! every permit still held and within its TTL, and nothing held past its TTL and the
//! expiry grid (a sixteenth of the TTL); so in flight is never above the limit, and a
//! lost holder's permits are back within the TTL plus that grid.

use std::sync::Arc;
use std::time::Duration;

use limiter_core::clock::{Clock, ManualClock, Nanos};
use limiter_core::policy::Request;
use proptest::prelude::*;

use crate::config::ServerConfig;
use crate::metrics::Api;
use crate::owner::reload::PolicyHolder;
use crate::owner::{Charge, Owner, Report};

const POLICY: &str = "version: 1
tenants:
  acme:
    limit: { algorithm: concurrency, limit: 5, permit_ttl: 2s }
    per_key: { algorithm: concurrency, limit: 3, permit_ttl: 1s }
    routes:
      /r: { algorithm: token_bucket, rate: 100000/s }
";
const MS: Nanos = 1_000_000;
const KEYS: [&str; 3] = ["k0", "k1", "k2"];
/// (limit, ttl) of the tenant level and of each key's level.
const TENANT: (u64, Nanos) = (5, 2_000 * MS);
const KEY: (u64, Nanos) = (3, 1_000 * MS);

#[derive(Debug, Clone)]
enum Op {
    Acquire { key: usize, cost: u64 },
    Release { pick: usize, twice: bool },
    Renew { pick: usize },
    Lose { pick: usize },
    Advance { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS.len(), 1..=2u64).prop_map(|(key, cost)| Op::Acquire { key, cost }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(pick, twice)| Op::Release { pick, twice }),
        2 => any::<usize>().prop_map(|pick| Op::Renew { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Lose { pick }),
        3 => (1..700u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// One admitted request as its holder knows it.
#[derive(Debug)]
struct Held {
    key: usize,
    cost: u64,
    /// When its permits were charged or last renewed.
    at: Nanos,
    permit: String,
    /// Released (its units back); else still counted until it expires.
    released: bool,
    /// Its holder is gone: it never calls again.
    lost: bool,
}

/// What a level must count (held and within the TTL) and may count (held, within
/// the TTL and the grid).
fn bounds(held: &[Held], now: Nanos, ttl: Nanos, key: Option<usize>) -> (u64, u64) {
    let mine = held.iter().filter(|h| !h.released && key.is_none_or(|k| h.key == k));
    mine.fold((0, 0), |(must, may), h| {
        let must = must + if now < h.at + ttl { h.cost } else { 0 };
        let may = may + if now < h.at + ttl + ttl / 16 + MS { h.cost } else { 0 };
        (must, may)
    })
}

/// A permit is named (released or renewed) until 15/16 of its shortest TTL.
fn named(h: &Held, now: Nanos) -> bool {
    now < h.at + KEY.1 - KEY.1 / 16
}

fn owner(clock: &ManualClock, dir: &tempfile::TempDir) -> Owner {
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, POLICY).unwrap();
    let clock: Arc<dyn Clock> = Arc::new(clock.clone());
    let policies = Arc::new(PolicyHolder::load(&path, clock.clone()).unwrap());
    let limits = ServerConfig::for_policy(&path).unwrap().limits;
    Owner::in_memory(policies, clock, limits)
}

async fn in_use(owner: &Owner, key: usize) -> (u64, u64) {
    let req = Request::new("acme", "/r").with_key(KEYS[key]);
    let u = owner.usage(&req).await.unwrap();
    let of = |i: usize, limit: u64| limit - u.levels[i].remaining;
    // Levels outermost first: tenant, tenant x route (a rate), key.
    assert_eq!(u.levels.len(), 3);
    (of(0, TENANT.0), of(2, KEY.0))
}

async fn run(ops: Vec<Op>) {
    let clock = ManualClock::new(1_000_000 * MS);
    let dir = tempfile::tempdir().unwrap();
    let owner = owner(&clock, &dir);
    let mut held: Vec<Held> = Vec::new();
    for op in ops {
        let now = clock.now();
        let live: Vec<usize> = (0..held.len()).filter(|&i| !held[i].lost).collect();
        let pick = |p: usize| (!live.is_empty()).then(|| live[p % live.len()]);
        match op {
            Op::Acquire { key, cost } => {
                let req = Request::new("acme", "/r").with_key(KEYS[key]).with_cost(cost);
                let out = owner
                    .decide(Api::Native, &[req], Charge::Each, Report::Now)
                    .await
                    .unwrap()
                    .remove(0);
                let (t_must, t_may) = bounds(&held, now, TENANT.1, None);
                let (k_must, k_may) = bounds(&held, now, KEY.1, Some(key));
                if out.verdict.decision.is_allowed() {
                    assert!(t_must + cost <= TENANT.0, "admitted past the tenant's limit");
                    assert!(k_must + cost <= KEY.0, "admitted past the key's limit");
                    let (permit, _) = out.permit.expect("an admission holds a permit");
                    held.push(Held { key, cost, at: now, permit, released: false, lost: false });
                } else {
                    assert!(
                        t_may + cost > TENANT.0 || k_may + cost > KEY.0,
                        "refused with room: tenant {t_may}, key {k_may}, cost {cost}"
                    );
                    assert!(out.permit.is_none());
                }
            }
            Op::Release { pick: p, twice } => {
                let Some(i) = pick(p) else { continue };
                let h = &mut held[i];
                let req = Request::new("acme", "/r").with_key(KEYS[h.key]);
                let first = owner.release(&req, &h.permit).await.unwrap();
                let expected = !h.released && named(h, now);
                assert_eq!(first.released, expected, "release of {h:?} at {now}");
                h.released |= first.released;
                if twice {
                    let again = owner.release(&req, &h.permit).await.unwrap();
                    assert!(!again.released, "a duplicated release freed a permit");
                }
            }
            Op::Renew { pick: p } => {
                let Some(i) = pick(p) else { continue };
                let h = &mut held[i];
                let req = Request::new("acme", "/r").with_key(KEYS[h.key]);
                let renewed = owner.renew(&req, &h.permit).await;
                if !h.released && named(h, now) {
                    let (left, _) = renewed.expect("a held permit renews");
                    assert_eq!(left, KEY.1 - KEY.1 / 16);
                    h.at = now;
                } else {
                    assert!(renewed.is_err(), "renewed a permit no longer held: {h:?}");
                }
            }
            Op::Lose { pick: p } => {
                if let Some(i) = pick(p) {
                    held[i].lost = true;
                }
            }
            Op::Advance { ms } => clock.advance(Duration::from_millis(ms)),
        }
        let now = clock.now();
        let (t_must, t_may) = bounds(&held, now, TENANT.1, None);
        assert!(t_must <= TENANT.0, "in flight above the tenant's limit: {t_must}");
        for key in 0..KEYS.len() {
            let (tenant, at_key) = in_use(&owner, key).await;
            assert!(
                (t_must..=t_may).contains(&tenant),
                "tenant counts {tenant}, {t_must}..{t_may}"
            );
            let (k_must, k_may) = bounds(&held, now, KEY.1, Some(key));
            assert!(k_must <= KEY.0, "in flight above key {key}'s limit: {k_must}");
            assert!(
                (k_must..=k_may).contains(&at_key),
                "key {key} counts {at_key}, {k_must}..{k_may}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn permits_follow_their_holders(ops in proptest::collection::vec(op(), 1..80)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run(ops));
    }
}
