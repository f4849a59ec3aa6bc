//! The lease protocol on the owner: agents acquire, renew and return pre-paid batches
//! of units, batched across keys in one call per (agent, owner).
//!
//! - A grant is debited from every level of its chain when made, so leased units can
//!   never be spent twice; the owner's book ([`LeaseBook`]) decides what may come back.
//! - A grant may be spent for `hold` (the route's lease TTL, cut to the end of any
//!   window level's window), counted by the agent from when it sent its request, so
//!   the agent always stops first; the owner writes the lease off at `granted + hold`.
//! - Renewal settles and replaces: the item hands back what the agent took out of the
//!   lease unspent (refunded exactly while the lease is open; what the agent kept to
//!   serve while the call is out counts as spent) and receives a fresh grant.
//! - Size: what the agent wants (about two renewal intervals of its demand), at least
//!   the waiting request's cost, at most the route's `max_batch`, at most what its
//!   demand can spend before the grant ends (a window's end), and at most half of what
//!   is left, so no more than half the remaining budget can be stranded. When what is
//!   left cannot cover what every active agent of the chain asked for, each gets a
//!   part in proportion to its reported demand (to its ask where a holder reported
//!   none; `limiter_core::lease::share`, and the Redis script by the asks); a grant cut short
//!   carries the binding limit, so the agent refuses locally once it is spent, until
//!   its next renewal.
//! - Direct mode: when the chain's tightest capacity is less than two requests' cost
//!   for each active agent (a budget too small to split), or the route asks for exact
//!   mode, the owner grants nothing to hold and decides each waiting request itself.

use limiter_core::Limit;
use limiter_core::algorithm::Algorithm;
use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::lease::{Ask, LeaseRecord, Settled, Shares};
use limiter_core::policy::{Chain, FailurePolicy, Request};
use limiter_proto::limiter::v1 as pb;

use crate::cluster::Cluster;
use crate::cluster::slices::{Remote, is_root};
use crate::convert;
use crate::error::ServerError;
use crate::metrics::Api;
use crate::owner::reload::ActivePolicy;
use crate::owner::shares::Who;
use crate::owner::{Charge, Outcome, Owner, Reach, Report};
use crate::store::{Leased, Renewal, Returned};

mod book;

pub use self::book::Leases;
use self::book::holder;

fn failure_policy(p: FailurePolicy) -> pb::FailurePolicy {
    match p {
        FailurePolicy::FailOpen { emergency_ceiling } => pb::FailurePolicy {
            fail_open: true,
            emergency_amount: emergency_ceiling.amount().get(),
            emergency_period: Some(convert::duration(emergency_ceiling.period().get())),
        },
        FailurePolicy::FailClosed => pb::FailurePolicy::default(),
    }
}

/// What the RLQS service's smallest assignment costs: two tokens of capacity and
/// one of rate.
const RATE_PART_MIN: u64 = 3;

/// What a rate holder's new assignment leaves in the chain's tightest level for
/// the next keeps, in seconds of the level's rate: the holders' new buckets are
/// bought a little after their keeps (`LeaseItem.after_keeps`), and a level they
/// emptied had refilled less than a round's keeps by the next round (a trace of a
/// 12-a-second bucket: the last stream's keeps granted nothing, its Envoy sent
/// `DENY_ALL` and buying again, every few rounds). In a small level it is at least
/// a few units ([`kept_for_keeps`]). A stock beyond it is divided into what the parts
/// may take, and into their rates in part (see [`rate_part`]).
const RATE_STOCK_KEPT: f64 = 0.05;

/// The stock a level keeps for its holders' keeps: [`RATE_STOCK_KEPT`] of its rate,
/// and at least [`RATE_PART_MIN`] units where its capacity holds four times that.
/// A keep pays whole units (a slow rate one unit every few rounds), so in a small
/// level the keeps of one round vary by units about their mean (the level's refill):
/// with a twentieth of a second kept (under a unit at 12 a second), the round whose
/// keeps came out above it left some unpaid, and each sent `DENY_ALL` and bought a
/// full bucket again, which took the next round's refill (a trace of a 12-a-second
/// bucket shared by ten Envoys: four keeps of one round granted nothing).
fn kept_for_keeps(per_sec: f64, capacity: u64) -> f64 {
    let floor = RATE_PART_MIN.min(capacity / 4) as f64;
    (per_sec * RATE_STOCK_KEPT).max(floor)
}

/// Over how many seconds a stock beyond what is kept ([`kept_for_keeps`]) is added
/// to what the parts may take.
const RATE_STOCK_SPENT: f64 = 1.0;

/// How much of that stock the parts hold as rates, at most: this much of the
/// level's rate. The rest is theirs to take once, for what a new bucket or a rise
/// costs at once, never as a rate they keep.
///
/// A stock has two sources. The rounds leave a little each second where held rates
/// run below their parts (within what a change is worth), lasting, which only a rate
/// spends. And a level holds a burst once: full at the start or after a lull, and
/// what the fallers of a swing leave. Added to the rates, a burst raised the parts two
/// and three times their demand shares in the fleet test's first seconds; the rates
/// bought on them outlived it (478 a second held at 2.24 s of a level of 431, each
/// kept within a tenth over its part), and the holders that came last found the
/// level empty: a trace of one run counted 617 of 1,623 new buckets' asks granted
/// nothing for want of units beyond the keeps, and an Envoy whose part had earned its
/// bucket waited 4.4 s at `DENY_ALL`. Given to the grants only, the burst pays such
/// buckets once. With no part of the stock held as rates, the lasting remainder was
/// lost as refill (use before the swing 1.2 to 4.7 points lower by fleet, 15 runs);
/// with a tenth, the bursts' rates came back (two share misses in 15 runs). Measured
/// in BENCHMARKS.md ("limiter-server: Envoy RLQS", twenty-seventh session).
const RATE_STOCK_AS_RATE: f64 = 0.05;

/// The rate of a chain's tightest level, units a second (a bucket's refill, a
/// window's limit over its length); `None` where no level limits a rate.
fn chain_rate(chain: &Chain<'_>, now: Nanos) -> Option<f64> {
    let per_sec = chain
        .levels()
        .filter(|l| !l.rule.limit.is_concurrency())
        .map(|l| {
            let (n, w) = l.rule.limit.quota_at(now);
            n as f64 * NANOS_PER_SEC as f64 / w.max(1) as f64
        })
        .fold(f64::INFINITY, f64::min);
    per_sec.is_finite().then_some(per_sec)
}

/// How many times its chain's rate a holder's reported demand counts for at most
/// ([`demand_counted`]).
///
/// Parts follow demand, and a holder's denied requests are its own to report: an
/// Envoy's claim of any demand took nearly every other holder's part (its ask
/// follows its part, and [`book`]'s bound per unit asked grows with it); an agent's,
/// up to 20 a second per unit asked, took all but a few hundredths of what was left
/// from an honest agent beside it wherever the route's batch is large. Capped, one
/// claim among holders whose demand is `d` times the rate takes at most `2 / (2 + d)`
/// of it.
/// Twice the rate, not the rate itself: any one holder's demand in a fleet offered
/// up to twice the limit counts whole, so the parts stay proportional to demand
/// there (two Envoys at 3:1 of twice the limit keep 75% and 25%; capped at the rate,
/// 67% and 33%).
const DEMAND_RATES_COUNTED: f64 = 2.0;

/// The most a holder's reported demand counts for a chain of `per_sec` units a
/// second ([`chain_rate`]), in thousandths of a unit a second
/// ([`DEMAND_RATES_COUNTED`]).
fn demand_counted(per_sec: f64) -> u64 {
    let most = per_sec * DEMAND_RATES_COUNTED * book::DEMAND_SCALE as f64;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let milli = most.ceil().max(1.0) as u64;
    milli
}

/// `x` rounded up to whole units (at least one; saturating).
fn whole_units(x: f64) -> u64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let u = x.ceil().max(1.0) as u64;
    u
}

/// A rate holder's part of the chain's rate, in units over the time its ask pays
/// for (`renews_within`): the rate of the chain's tightest level (a bucket's
/// refill, a window's limit over its length) in proportion to its demand among the
/// chain's holders, where every holder's demand is known (Doorman's proportional
/// share of a rate; a part under [`RATE_PART_MIN`] is paid on average). Its ask is
/// cut to it: dividing
/// what is left instead would pay whoever asks first after a refill, since the
/// holders' rounds do not line up.
///
/// Where a level of token buckets holds a stock (what the holders' rounds leave where
/// held rates run below their parts, within what a change is worth; or its burst)
/// and their demand is above its rate, the stock beyond what is kept
/// ([`kept_for_keeps`]) is divided too, over [`RATE_STOCK_SPENT`]: otherwise it
/// grows each round until the level is full and its refill is lost. The units take
/// all of it; the rate at most [`RATE_STOCK_AS_RATE`] of the level's rate, so that a
/// burst is spent once rather than bought as rates that outlive it. (`stock`, with
/// the level's capacity, is given only then: below the rate it is the level's
/// unused burst, and adding it raised a lone holder's rate above the limit for as
/// long as the burst lasted.)
///
/// `per_sec` is the chain's rate ([`chain_rate`]). Returns the units and the part as
/// a rate, in thousandths of a unit a second.
fn rate_part(
    per_sec: Option<f64>,
    shares: Shares,
    item: &pb::LeaseItem,
    stock: Option<(u64, u64)>,
) -> Option<(u64, u64)> {
    let (mine, all) = shares.demand;
    let period = item.renews_within.as_ref().map_or(0, convert::nanos_of);
    if period == 0 || mine == 0 || all < mine {
        return None;
    }
    let per_sec = per_sec?;
    let spent = stock.map_or(0.0, |(s, capacity)| {
        (s as f64 - kept_for_keeps(per_sec, capacity)).max(0.0) / RATE_STOCK_SPENT
    });
    let share = mine as f64 / all as f64;
    let rate = (per_sec + spent.min(per_sec * RATE_STOCK_AS_RATE)) * share;
    let part = (per_sec + spent) * share * period as f64 / NANOS_PER_SEC as f64;
    // A part smaller than the smallest assignment's cost is that cost with the
    // probability that pays the part on average (a new bucket then lasts that many
    // rounds), else the part rounded up (what keeping a slow bucket costs).
    let min = RATE_PART_MIN as f64;
    let draw = (shares.dice >> 11) as f64 / (1u64 << 53) as f64;
    let part = if part < min && draw * min < part { min } else { part.ceil() };
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let (units, milli) = (part.max(1.0) as u64, (rate * 1_000.0).ceil().max(1.0) as u64);
    Some((units, milli))
}

/// What one lease call granted: the counters it charged and the leases it opened
/// (sent to their replicas before the call is answered).
#[derive(Debug, Default)]
struct Granted {
    keys: Vec<limiter_core::key::LimitKey>,
    leases: Vec<pb::LeaseState>,
}

impl Owner {
    /// The answer for a lease item's waiting request when its owner cannot decide it
    /// (out of reach, or fenced after a loss): its route's failure policy.
    ///
    /// # Errors
    ///
    /// A request that can never succeed (names, costs).
    pub async fn fallback_decision(
        &self,
        req: &Request<'_>,
    ) -> Result<Option<pb::ShouldAllowResponse>, ServerError> {
        let o = self
            .decide_with(
                Api::Lease,
                std::slice::from_ref(req),
                Charge::Each,
                Report::Now,
                Reach::Unreachable,
            )
            .await
            .map_err(|(_, e)| e)?;
        Ok(o.first().map(Outcome::response))
    }

    /// Handles one lease call: every item settles its previous lease (if any) and
    /// receives a new grant, a direct decision, or the reason it got nothing.
    ///
    /// # Errors
    ///
    /// An item that can never succeed (names, costs), by index.
    pub async fn lease(
        &self,
        agent: &str,
        items: &[pb::LeaseItem],
    ) -> Result<Vec<pb::LeaseGrant>, (usize, ServerError)> {
        if agent.is_empty() {
            return Err((0, ServerError::invalid("agent_id", "must not be empty")));
        }
        let holder = holder(agent);
        let policy = self.policies().current();
        let mut grants = Vec::with_capacity(items.len());
        let mut granted = Granted::default();
        for (i, item) in items.iter().enumerate() {
            let grant = self.lease_item(holder, &policy, item, &mut granted).await;
            grants.push(grant.map_err(|e| (i, e))?);
        }
        // Grants are pre-paid and may be spent for a whole hold: the replica has them
        // before their holders do, so that a take-over after this node's death never
        // grants the same units again.
        if let (Some(c), Some(l)) = (self.shared(), self.store().limiter())
            && !granted.keys.is_empty()
        {
            c.replication().send_grants(c, l.table(), &granted.keys, granted.leases).await;
        }
        Ok(grants)
    }

    /// One item of a lease call; what it granted is added to `granted`.
    async fn lease_item(
        &self,
        holder: u64,
        policy: &ActivePolicy,
        item: &pb::LeaseItem,
        granted: &mut Granted,
    ) -> Result<pb::LeaseGrant, ServerError> {
        let req = Request {
            tenant: &item.tenant,
            route: &item.route,
            key: (!item.key.is_empty()).then_some(item.key.as_str()),
            cost: Some(item.cost.max(1)),
            dry_run: false,
        };
        let names = &self.limits().names;
        // A node leasing a slice of one root level (no tenant involved), or an agent
        // leasing a chain whose root levels other nodes own (paid from this node's
        // slices).
        let slice_of = convert::scope_from(item.level);
        let full = match slice_of {
            Some(level) if is_root(level) => {
                policy.policy.resolve_root(level, &item.route, item.cost, names)?
            }
            _ => policy.policy.resolve(&req, names)?,
        };
        // An agent holding this chain's permits in its own pool: the grant covers the
        // other levels (a route that decides per request keeps its permits here).
        let pooled = item.local_permits
            && slice_of.is_none()
            && !full.route.lease.exact
            && super::permits::first_level(&full).is_some();
        let full =
            if pooled { full.retain_levels(|l| !l.rule.limit.is_concurrency()) } else { full };
        let (chain, slices) = match slice_of {
            Some(level) => (full.retain_levels(|l| l.scope == level), Remote::default()),
            None => self.split(&full),
        };
        // Whose shares a grant comes out of: the request's classes, or a node's
        // slice's class (a slice of an undivided level has none).
        let who = match slice_of {
            None => Some(Who::Req(&req)),
            Some(_) if !item.share_class.is_empty() => Some(Who::Class(&item.share_class)),
            Some(_) => None,
        };
        let now = self.clock().now();
        let (back, spent) = self.settle(holder, item, now);
        // An agent's spending since its previous grant, counted as its class's demand
        // over that time. A node's slice is settled at its end, long after it was
        // spent: counted as spent now, so that a class coming back from idle is seen
        // at once (spread over the slice's life, the class's rise lagged, and
        // `cluster_shares` refused the reserved class in the second after its
        // return in 3 of 6 runs).
        let since = match (back, slice_of) {
            (Some(b), None) => b.granted_at,
            _ => now,
        };
        // What the previous lease left unspent goes back to its classes' shares too.
        if let (Some(b), Some(who)) = (back, who) {
            self.shares.give_back_units(who, &chain, b.units, b.granted_at, now);
        }
        let mut grant = pb::LeaseGrant {
            mode: pb::LeaseMode::Leased.into(),
            permits: pooled,
            on_failure: Some(failure_policy(full.route.on_limiter_failure)),
            policy_version: policy.version,
            ..Default::default()
        };
        if pooled && full.levels().next().is_none() && !full.unknown_tenant {
            // Nothing but concurrency levels: the agent's pool decides alone.
            self.give_back(&chain, now, back).await?;
            grant.permits_only = true;
            return Ok(grant);
        }
        if item.want == 0 && item.cost == 0 {
            self.leases().shares(self.leases().chain_id(item), holder, (0, 0), 0, now);
            self.give_back(&chain, now, back).await?;
            return Ok(grant);
        }
        // A new key beyond its tenant's cap: nothing granted, the waiting request
        // refused (the agent's other items go on).
        if self.store().admits(&chain).is_err() {
            self.give_back(&chain, now, back).await?;
            let refused = limiter_core::Decision::Rejected {
                reason: limiter_core::Reason::KeyLimit,
                scope: limiter_core::Scope::Key,
                limit: None,
                retry_after: NANOS_PER_SEC,
            };
            grant.decision = Some(self.response(refused, now));
            return Ok(grant);
        }
        // The counters must be here: not fenced after their owner's loss (nothing
        // new is granted then), not moving away. Held until the grant is made.
        let name = crate::cluster::lease_name(item);
        let held = match self.shared() {
            Some(c) => match c.hold(&name).await {
                Ok(guard) => guard,
                Err(_) => {
                    self.give_back(&chain, now, back).await?;
                    grant.mode = pb::LeaseMode::Direct.into();
                    if slice_of.is_some() {
                        grant.decision = Some(self.refusal(&chain, now, 1_000_000));
                    } else if item.cost > 0 {
                        // The waiting request: its route's failure policy.
                        grant.decision = self.fallback_decision(&req).await?;
                    }
                    return Ok(grant);
                }
            },
            None => None,
        };
        // A chain with a concurrency level is decided per request: its permits are
        // held for the request's life, not spent, so a leased batch of them would
        // stay taken until its TTL.
        let exact = (chain.route.lease.exact || super::permits::first_level(&chain).is_some())
            && slice_of.is_none();
        // How long the grant can be spent: the route's TTL (a slice's own TTL), cut
        // by window ends.
        let ttl = match (slice_of, self.cluster()) {
            (Some(_), Some(c)) => {
                u64::try_from(c.config().slice_ttl.as_nanos()).unwrap_or(u64::MAX)
            }
            _ => chain.route.lease.ttl,
        };
        // A rate holder (the RLQS service) pays for a rate until its assignment can
        // expire: its ask is not cut to one hold's demand nor to the batch.
        let rates = item.rates && slice_of.is_none();
        let ask = Ask {
            want: item.want,
            cost: item.cost,
            demand_per_sec: if rates { u64::MAX } else { item.demand_per_sec },
            hold: chain.grant_hold(now, ttl),
            most: if slice_of.is_some() || rates {
                u64::MAX
            } else {
                chain.route.lease.max_batch.get()
            },
            // Only a rate holder's: an agent's grant of any size is spent.
            least: if rates { item.least } else { 0 },
        };
        // A divided level: the grant is no more than the request's class may take; a
        // class with nothing left refuses the waiting request. The class's demand is
        // what its holders spent and what waits, not what they ask to hold (asks run
        // ahead of use: counted as demand, they let a class borrow what it never
        // spends).
        let asked = ask.cap();
        let ask = match who {
            _ if exact => ask,
            None => ask,
            Some(who) => match self.shares.room(who, &chain, (spent, since), ask.cost, now) {
                Ok(room) if room >= ask.cost => Ask { most: ask.most.min(room), ..ask },
                Ok(_) => {
                    // The waiting request does not fit its class's share now.
                    self.give_back(&chain, now, back).await?;
                    let mut dry = chain;
                    dry.dry_run = true;
                    let refused = self.shares.take(who, &dry, now).err();
                    grant.decision = Some(match refused {
                        Some(r) => self.share_refusal(&r, now),
                        None => self.refusal(&chain, now, 1_000_000),
                    });
                    return Ok(grant);
                }
                Err(refused) => {
                    self.give_back(&chain, now, back).await?;
                    grant.decision = Some(self.share_refusal(&refused, now));
                    return Ok(grant);
                }
            },
        };
        // A node's slice never goes direct (the root owner refuses instead) and is
        // not divided with others.
        let cid = self.leases().chain_id(item);
        if let Some(b) = back {
            self.leases().returned(cid, holder, b.units, now);
        }
        let chain_per_sec = chain_rate(&chain, now);
        let per_sec = if rates { chain_per_sec } else { None };
        let shares = match slice_of {
            Some(_) => Shares::default(),
            None => {
                // In thousandths of a unit a second: an Envoy's demand for a bucket
                // is often under a unit a second.
                let demand = match item.demand_milli {
                    0 => item.demand_per_sec.saturating_mul(book::DEMAND_SCALE),
                    milli => milli,
                };
                let demand = chain_per_sec.map_or(demand, |r| demand.min(demand_counted(r)));
                let active_for = active_for(item, ask.hold, rates);
                let asked = (ask.cap().max(ask.cost), demand);
                let mut s = self.leases().shares(cid, holder, asked, active_for, now);
                if rates {
                    // Never direct: a rate is divided however small the budget; and
                    // not held to half of what is left (see `Shares::whole`).
                    s.active = 0;
                    s.whole = true;
                }
                s
            }
        };
        // A stock is known only on the memory store, on chains of token buckets
        // this node holds whole, and kept only while the holders' demand is above
        // the chain's rate (see `rate_part`; below it, no lease book update is
        // spent on it).
        let stock_kept = rates
            && slices.is_empty()
            && self.store().limiter().is_some()
            && chain.levels().all(|l| {
                matches!(*l.rule.limit, Limit::TokenBucket(_)) || l.rule.limit.is_concurrency()
            });
        let contended = stock_kept
            && per_sec.is_some_and(|r| shares.demand.1 as f64 / book::DEMAND_SCALE as f64 >= r);
        // The tightest level's capacity, which sizes what a small level keeps (only
        // a rate holder's call needs it).
        let level = if rates { crate::store::capacity(&chain) } else { 0 };
        let stock =
            if contended { self.leases().stock(cid, now).map(|s| (s, level)) } else { None };
        let part = if rates { rate_part(per_sec, shares, item, stock) } else { None };
        let (ask, shares) = match part {
            // Its part of the rate already divides the chain among its holders:
            // what is left is not divided again, by asks or by demands, only never
            // exceeded (a part of what is left by demand gave each of several
            // buyers a unit that bought no assignment and stayed out of the level
            // until their next round).
            Some((units, _)) => (
                Ask { want: ask.want.min(units), ..ask },
                Shares { others: 0, demand: (0, 0), ..shares },
            ),
            None => (ask, shares),
        };
        (grant.rate_part, grant.rate_part_milli) = part.unwrap_or((0, 0));
        // A rise hands its keep back with its ask (`least`, its keep): that much it
        // may take back whatever the level holds.
        let keep_back = match per_sec {
            Some(r) if stock_kept && item.after_keeps => {
                (whole_units(kept_for_keeps(r, level)), item.least.min(back.map_or(0, |b| b.units)))
            }
            _ => (0, 0),
        };
        let renewal = Renewal { back, ask, shares, keep_back };
        if slice_of.is_none()
            && !exact
            && !rates
            && let Some(wait) = self.held_back(&chain, &renewal, cid, holder, now).await?
        {
            self.give_back(&chain, now, back).await?;
            grant.decision = Some(self.refusal(&chain, now, wait));
            grant.held_back = true;
            return Ok(grant);
        }
        let (leased, slices_until) = if exact {
            self.give_back(&chain, now, back).await?;
            (Leased::Direct, Nanos::MAX)
        } else if ask.cost > ask.most {
            // A request above the route's batch is never granted as a lease: it is
            // decided as a request.
            self.give_back(&chain, now, back).await?;
            (Leased::Short, Nanos::MAX)
        } else if let (false, Some(c)) = (slices.is_empty(), self.shared()) {
            self.give_back(&chain, now, back).await?;
            self.lease_from_slices(c, &full, &chain, &slices, &renewal, now).await?
        } else {
            (self.store().lease(&chain, now, &renewal).await?, Nanos::MAX)
        };
        let g = match leased {
            Leased::Granted(g) => g,
            Leased::Direct | Leased::Short if slice_of.is_some() => {
                grant.decision = Some(self.refusal(&chain, now, 0));
                return Ok(grant);
            }
            Leased::Direct => {
                grant.mode = pb::LeaseMode::Direct.into();
                // Deciding takes the gate itself.
                drop(held);
                if item.cost > 0 {
                    let outcome = self
                        .decide(Api::Lease, std::slice::from_ref(&req), Charge::Each, Report::Now)
                        .await
                        .map_err(|(_, e)| e)?;
                    if let Some(o) = outcome.first() {
                        self.leases().granted(cid, holder, o.charged, now);
                    }
                    grant.decision = outcome.first().map(Outcome::response);
                }
                return Ok(grant);
            }
            Leased::Short if item.cost == 0 => {
                // A renewal whose share is nothing: the binding limit, for the agent
                // to refuse with until its next renewal.
                self.leases().cut(cid, now);
                drop(held);
                grant.decision = self.shortfall(&chain, now, ask.cap());
                return Ok(grant);
            }
            Leased::Short => {
                // Not enough to hold: the waiting request is decided here (charged if
                // it fits), as in direct mode.
                drop(held);
                self.leases().cut(cid, now);
                let probe = Request { dry_run: item.cost == 0, ..req };
                let outcome = self
                    .decide(Api::Lease, &[probe], Charge::Each, Report::Now)
                    .await
                    .map_err(|(_, e)| e)?;
                if let Some(o) = outcome.first() {
                    self.leases().granted(cid, holder, o.charged, now);
                }
                grant.decision = outcome.first().map(Outcome::response);
                return Ok(grant);
            }
        };
        if let Some(who) = who {
            self.shares.charge(who, &chain, g.units, now);
        }
        if let (true, Some(l)) = (contended, self.store().limiter()) {
            let span = item.renews_within.as_ref().map_or(0, convert::nanos_of);
            self.leases().left_after_rates(cid, l.remaining(&chain, now), span, now);
        }
        // Filed under its ring name (a slice: its root key's), so that a move hands
        // it to the next owner of what it was granted from.
        let key = (name.into_boxed_str(), item.route.as_str().into(), req.key.map(Into::into));
        let record =
            LeaseRecord { holder, key, units: g.units, granted_at: g.granted_at, hold: g.hold };
        let id = self.leases().book.lock().open(record.clone());
        self.leases().changed(id, &record.key.0);
        // An agent's grant goes to its replica before it is answered. A slice of a root
        // key (another node's) goes with the next round instead: slices are what other
        // nodes' grants are paid from, and waiting for a replica on that path as well
        // cost the global ceiling a tenth of its use (README: a root owner's death may
        // slice out its last round again).
        if g.units > 0 && slice_of.is_none() {
            granted
                .keys
                .extend(chain.keys().iter().map(limiter_core::key::LimitKeyRef::to_owned_key));
            granted.leases.push(book::wire((id, record)));
        }
        if let (false, Some(c)) = (slices.is_empty(), self.shared()) {
            c.slices().funded(id, &slices.keys, slices_until);
        }
        // Cut short of the ask near the limit: the limit that cut it, for the agent to
        // refuse with once the grant is spent.
        if slice_of.is_none() {
            self.leases().granted(cid, holder, g.units, now);
            if g.units < ask.cap() {
                self.leases().cut(cid, now);
                let missing = ask.cap() - g.units;
                // Not where a level is divided among nodes: what this node holds of
                // it is its slice, topped up from the root owner between rounds, so a
                // grant cut by the slice says little of the level's budget.
                let split = g.units >= ROUND_SHARE && renewal.shares.active > 1;
                grant.decision = if split && slices.is_empty() {
                    self.cut_short(&chain, now, missing, item, g.hold)
                } else {
                    self.shortfall(&chain, now, missing)
                };
            } else if g.units < asked {
                // Cut by its class's share: what the agent refuses with is the class's
                // wait for its next unit (the level's wait for the whole ask would
                // keep the agent away while its class's share refills unused).
                let mut dry = chain;
                (dry.dry_run, dry.cost) = (true, 1);
                grant.decision = self
                    .shares
                    .take(Who::Req(&req), &dry, now)
                    .err()
                    .map(|r| self.share_refusal(&r, now));
            }
        }
        grant.window_end = ends_with_window(&chain, now, g.hold);
        grant.lease_id = id;
        grant.units = g.units;
        grant.hold = Some(convert::duration(g.hold));
        drop(held);
        Ok(grant)
    }

    /// Whether `holder` is held back near the limit because it is past its fair share
    /// of `chain` (by ask), and for how long: until the others have had theirs (at most
    /// `HELD_BACK_MOST`). On a tenant's own token buckets only (a unit kept back stays
    /// in the bucket, where a window's would be lost at its end; root levels are
    /// shared with other nodes' slices, which the book does not weigh), on budgets
    /// large enough to lease, on the memory store (whose dry runs name the binding
    /// limit; a Redis store's refusal could only say the limiter is unavailable),
    /// and only while what is left cannot cover the asks (units nobody else asks for
    /// are not kept from it).
    async fn held_back(
        &self,
        chain: &Chain<'_>,
        renewal: &Renewal,
        cid: u64,
        holder: u64,
        now: Nanos,
    ) -> Result<Option<Nanos>, ServerError> {
        let own_buckets = chain
            .levels()
            .all(|l| matches!(*l.rule.limit, Limit::TokenBucket(_)) && !is_root(l.scope));
        if !own_buckets || renewal.direct(chain) || self.store().limiter().is_none() {
            return Ok(None);
        }
        let Some(wait) = self.leases().past_share(cid, holder, now) else { return Ok(None) };
        let ask = &renewal.ask;
        let asked = ask.cap().max(ask.cost).saturating_add(renewal.shares.others);
        Ok((self.store().remaining(chain, now).await? < asked).then_some(wait))
    }

    /// Settles the item's previous lease in the book: what it left unspent, to give
    /// back while the lease is open (nothing for a late or duplicate return).
    /// Also the units the holder spent of it (for a divided level's demand).
    fn settle(&self, holder: u64, item: &pb::LeaseItem, now: Nanos) -> (Option<Returned>, u64) {
        if item.lease_id == 0 {
            return (None, 0);
        }
        let settled = self.leases().book.lock().settle(item.lease_id, holder, now, item.unspent);
        if let Settled::Closed { record, .. } | Settled::Expired(record) = &settled {
            self.leases().changed(item.lease_id, &record.key.0);
        }
        let Settled::Closed { record, refund } = settled else { return (None, 0) };
        if let Some(c) = self.shared() {
            c.slices().returned(item.lease_id, refund, now);
        }
        let back = Returned { units: refund, granted_at: record.granted_at, hold: record.hold };
        (Some(back), record.units.saturating_sub(refund))
    }

    /// Refunds a settled lease's unspent units on a path that grants nothing new.
    async fn give_back(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        back: Option<Returned>,
    ) -> Result<(), ServerError> {
        match back {
            Some(b) => self.store().refund_grant(chain, now, b.granted_at, b.hold, b.units).await,
            None => Ok(()),
        }
    }

    /// A grant for a chain whose root levels other nodes own: sized by the grant rule
    /// from this node's levels, paid out of this node's slices of the root levels
    /// (refilled from their owners as needed), and never outliving them. The grant
    /// and the slices' end.
    async fn lease_from_slices(
        &self,
        cluster: &Cluster,
        full: &Chain<'_>,
        chain: &Chain<'_>,
        slices: &Remote,
        renewal: &Renewal,
        now: Nanos,
    ) -> Result<(Leased, Nanos), ServerError> {
        let ask = renewal.ask;
        let Some(size) = renewal.size(chain, self.store().remaining(chain, now).await?) else {
            return Ok((Leased::Direct, Nanos::MAX));
        };
        // A lease is lent only units it can spend for a quarter of its hold at least,
        // and ends `LEND_LEAD` before the slices that fund it; each at most a quarter
        // of a slice's TTL, so that a fresh slice can always lend.
        let quarter = cluster.slice_ttl() / 4;
        let lend_lead = crate::cluster::slices::LEND_LEAD.min(quarter);
        let lend_until = now.saturating_add((ask.hold / 4).min(quarter)).saturating_add(lend_lead);
        let Some((from_slices, until)) =
            self.take_slices(cluster, full, slices, size, ask.cost, lend_until).await?
        else {
            return Ok((Leased::Short, Nanos::MAX));
        };
        let hold = ask.hold.min(until.saturating_sub(lend_lead).saturating_sub(now));
        let g = self.store().grant(chain, now, from_slices, hold).await?;
        cluster.slices().give_back(&slices.keys, from_slices - g.units.min(from_slices), now);
        if !renewal.covers(g.units) {
            self.store().refund_grant(chain, now, g.granted_at, g.hold, g.units).await?;
            cluster.slices().give_back(&slices.keys, g.units, now);
            return Ok((Leased::Short, Nanos::MAX));
        }
        Ok((Leased::Granted(g), until))
    }

    /// Takes up to `want` (at least `min`) units from the slices `remote`, of those
    /// still spendable at `from`, refilling them from their owners as needed: the
    /// units and the slices' end, or `None` when an owner refuses.
    async fn take_slices(
        &self,
        cluster: &Cluster,
        chain: &Chain<'_>,
        remote: &Remote,
        want: u64,
        min: u64,
        from: Nanos,
    ) -> Result<Option<(u64, Nanos)>, ServerError> {
        // A refill for an agent asks for the whole grant (never more than the root
        // level can hold): near the limit the owner refuses, and the refusal, kept
        // for a few milliseconds, answers this node's agents at once instead of
        // turning each of their calls into a call to the owner.
        let capacity = chain
            .levels()
            .filter(|l| remote.holds(l))
            .map(|l| l.rule.limit.capacity())
            .min()
            .unwrap_or(u64::MAX);
        let need = want.max(min).min(capacity).max(1);
        for _ in 0..3 {
            let now = self.clock().now();
            match cluster.slices().take_up_to(&remote.keys, want, min, now, from) {
                Ok(got) => return Ok(Some(got)),
                Err(crate::cluster::slices::Take::Short(key)) => {
                    let Some(owner) = remote.owner(&key) else { return Ok(None) };
                    match cluster.refill(&key, owner, need, want, from).await {
                        Ok(()) => {}
                        Err(ServerError::Exhausted(_)) => return Ok(None),
                        Err(e) => return Err(e),
                    }
                }
                Err(_) => return Ok(None),
            }
        }
        Ok(None)
    }

    /// A refusal by `chain`'s levels as they stand (a dry run), for grants that found
    /// nothing; `floor` is the least wait reported.
    fn refusal(
        &self,
        chain: &limiter_core::policy::Chain<'_>,
        now: Nanos,
        floor: Nanos,
    ) -> pb::ShouldAllowResponse {
        let mut probe = *chain;
        probe.dry_run = true;
        let decision = match self.store().limiter() {
            Some(l) => l.decide(&probe, now).decision,
            None => limiter_core::Decision::Rejected {
                reason: limiter_core::Reason::LimiterUnavailable,
                scope: limiter_core::Scope::Global,
                limit: None,
                retry_after: floor,
            },
        };
        let decision = match decision {
            limiter_core::Decision::Rejected { reason, scope, limit, retry_after } => {
                limiter_core::Decision::Rejected {
                    reason,
                    scope,
                    limit,
                    retry_after: retry_after.max(floor),
                }
            }
            // The levels would admit one unit but not the asked cost: wait a little.
            limiter_core::Decision::Allowed { binding, .. } => {
                let level = chain.levels().next();
                limiter_core::Decision::Rejected {
                    reason: level.map_or(limiter_core::Reason::GlobalCeiling, |l| l.scope.reason()),
                    scope: binding.map_or(limiter_core::Scope::Global, |b| b.scope),
                    limit: level.map(|l| *l.rule.limit),
                    retry_after: floor.max(1_000_000),
                }
            }
        };
        self.named(chain, decision, now)
    }

    /// What a grant of at least [`ROUND_SHARE`] units cut `missing` units short of
    /// its ask says: the limit that cut it ([`Self::shortfall`]); and, to a holder
    /// that renews every round (its `renews_within`, at most the grant's `hold`),
    /// that its share is spent until its next renewal, when the owner divides what is
    /// left again (what is left now is the others' shares and the half kept back), so
    /// that it refuses locally until then rather than asking for each request.
    fn cut_short(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        missing: u64,
        item: &pb::LeaseItem,
        hold: Nanos,
    ) -> Option<pb::ShouldAllowResponse> {
        let short = self.shortfall(chain, now, missing);
        if renews_within(item, hold) == 0 {
            return short;
        }
        let d = short.unwrap_or_else(|| self.refusal(chain, now, 0));
        Some(until_renewal(d, item, hold))
    }

    /// Why a grant fell `missing` units short of what its holder asked for near the
    /// limit, once nothing is left: the binding limit and when the missing units would
    /// fit (dry runs), for the holder to refuse with once its grant is spent. Nothing
    /// while a unit is left (the holder's next request may have it), or where no dry
    /// run can tell (Redis).
    fn shortfall(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        missing: u64,
    ) -> Option<pb::ShouldAllowResponse> {
        let limiter = self.store().limiter()?;
        let mut probe = *chain;
        probe.dry_run = true;
        probe.cost = 1;
        if limiter.decide(&probe, now).decision.is_allowed() {
            return None;
        }
        probe.cost = missing.max(1);
        let decision = limiter.decide(&probe, now).decision;
        (!decision.is_allowed()).then(|| self.named(chain, decision, now))
    }

    /// The answer carrying `decision` by one of `chain`'s levels, naming its limit.
    fn named(
        &self,
        chain: &Chain<'_>,
        decision: limiter_core::Decision,
        now: Nanos,
    ) -> pb::ShouldAllowResponse {
        let name = match decision {
            limiter_core::Decision::Rejected { scope, limit, .. } => {
                chain.level_named(scope, limit.as_ref()).map(|l| l.rule.name.clone())
            }
            limiter_core::Decision::Allowed { .. } => None,
        };
        self.outcome(decision, name, now)
    }

    /// The answer to a request its class's share refused.
    fn share_refusal(
        &self,
        refused: &super::shares::Refused,
        now: Nanos,
    ) -> pb::ShouldAllowResponse {
        let mut r = self.response(refused.decision, now);
        r.share_class = refused.class.to_string();
        r
    }

    /// The answer carrying `decision`, decided here at `now`, charging nothing.
    fn response(&self, decision: limiter_core::Decision, now: Nanos) -> pb::ShouldAllowResponse {
        self.outcome(decision, None, now)
    }

    fn outcome(
        &self,
        decision: limiter_core::Decision,
        limit_name: Option<std::sync::Arc<str>>,
        now: Nanos,
    ) -> pb::ShouldAllowResponse {
        let outcome = crate::owner::Outcome {
            verdict: limiter_core::Verdict { decision, shadow: false },
            charged: 0,
            limit_name,
            policy_version: self.policies().current().version,
            charged_at: crate::store::Charged { at: now, hold: 0 },
            ticket: None,
            permit: None,
            share_class: None,
            turn: None,
        };
        outcome.response()
    }
}

/// The smallest share of a round that a cut grant makes a holder refuse with until
/// its next renewal (when the chain has other holders: a sole holder's cut grant is
/// the half of what is left kept back, which it may have for the asking). A smaller
/// share (a limit split among many holders, a few units each a round) is too small
/// to split by rounds: the units one holder leaves unspent in its round are a large
/// part of what the others could have used, so the holder asks again for each request once the owner's wait is over (measured: the
/// agents' accuracy test's token buckets of 150/s among ten agents, two units each a
/// round, used 95.0% of what the reference admits with rounds, under its 97% floor).
const ROUND_SHARE: u64 = 4;

/// How soon `item`'s holder asks again for its key (its `renews_within`), at most
/// `hold`; 0 when it did not say.
fn renews_within(item: &pb::LeaseItem, hold: Nanos) -> Nanos {
    item.renews_within.as_ref().map_or(0, convert::nanos_of).min(hold)
}

/// How long `item`'s holder counts among a chain's active holders after this ask,
/// for a grant held `hold`: an agent renews a used key before its grant ends and
/// asks again within its `renews_within` while refused, so one silent for longer has
/// gone (dropped, or its key idle) and its part goes back to the others (counted for
/// the book's two seconds, a dead agent's part was held back from the live ones for
/// a second past its grant's end). A rate holder's `renews_within` is the period its
/// ask pays for, not when it asks: it, and a holder that says nothing, count for the
/// book's [`book::ACTIVE_FOR`].
fn active_for(item: &pb::LeaseItem, hold: Nanos, rates: bool) -> Nanos {
    match renews_within(item, Nanos::MAX) {
        within if within > 0 && !rates => hold.saturating_add(within),
        _ => book::ACTIVE_FOR,
    }
}

/// A refusal of a holder's share (spent, or past it) made to stand until the holder's
/// next renewal, when the owner divides what is left again.
fn until_renewal(
    mut d: pb::ShouldAllowResponse,
    item: &pb::LeaseItem,
    hold: Nanos,
) -> pb::ShouldAllowResponse {
    let wait = d.retry_after.as_ref().map_or(0, convert::nanos_of).max(renews_within(item, hold));
    d.retry_after = Some(convert::duration(wait));
    d
}

/// Whether a grant held for `hold` from `now` ends with a window of one of `chain`'s
/// levels (a fixed window's or a sliding counter's end cut it).
fn ends_with_window(chain: &Chain<'_>, now: Nanos, hold: Nanos) -> bool {
    chain.levels().any(|l| {
        matches!(*l.rule.limit, Limit::FixedWindow(_) | Limit::SlidingCounter(_))
            && l.rule.limit.grant_hold(now, Nanos::MAX) <= hold
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A holder of a quarter of the demand, asking for a second of its rate.
    fn quarter() -> (Shares, pb::LeaseItem) {
        let shares = Shares { active: 4, others: 0, dice: 0, demand: (1_000, 4_000), whole: true };
        let item = pb::LeaseItem {
            renews_within: Some(convert::duration(NANOS_PER_SEC)),
            rates: true,
            ..Default::default()
        };
        (shares, item)
    }

    /// A level's stock beyond what is kept (a twentieth of a second of its rate) is
    /// the parts' to take, spread over a second; as rates they hold at most a
    /// twentieth of the level's rate of it.
    #[test]
    fn a_levels_stock_is_taken_once_and_held_as_a_rate_only_in_part() {
        let (shares, item) = quarter();
        let part = |stock| rate_part(Some(400.0), shares, &item, stock);
        // No stock: a quarter of 400 a second, as units over the second and as a rate.
        assert_eq!(part(None), Some((100, 100_000)));
        // Within what is kept (20): nothing added.
        assert_eq!(part(Some((20, 400))), Some((100, 100_000)));
        // A small stock (10 beyond what is kept) is held as a rate whole.
        assert_eq!(part(Some((30, 400))), Some((103, 102_500)));
        // A full level, its burst (380 beyond what is kept): a quarter of it to take
        // in the second, but as a rate a quarter of 400 and 20 only.
        assert_eq!(part(Some((400, 400))), Some((195, 105_000)));
    }
}
