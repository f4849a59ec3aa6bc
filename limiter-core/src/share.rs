//! Fair shares of a shared level (the global ceiling, a route's limit across tenants,
//! a tenant's limit across its routes and keys): classes of requests with a reserved
//! share, a weight, an optional cap on borrowing, a priority and a minimum share.
//!
//! The level itself stays exact: every request is still checked and charged against
//! it. Shares only add, per class, a limit of the level's own algorithm scaled to the
//! class's current allocation, so what one class may take never eats into what is
//! reserved for another's current use. Allocations follow measured demand (units
//! asked for, admitted or not) and are recomputed every [`SLOT`]:
//!
//! 1. each class is first given `min(max(reserved, min_share), demand)`: a
//!    reservation is protected as far as its class uses it; what it leaves unused is
//!    lent to the others;
//! 2. what is left goes to the classes that want more, highest `priority` first, and
//!    within one priority by `weight` (water-filling: nobody gets more than it asks
//!    for, what it does not take is divided among the rest), each at most
//!    `reserved + max_borrow`;
//! 3. what nobody asks for is divided by weight among every class (within its
//!    `max_borrow`), so that a class whose demand appears finds room at once.
//!
//! A reservation is thus never lent past the lease of demand it covers: a class whose
//! demand returns gets its share back within one recomputation plus what the others
//! hold (their class limits shrink at once; units they already spent stay spent).

use std::num::NonZeroU64;
use std::sync::Arc;

use crate::algorithm::{Algorithm, Check, FixedWindow, SlidingCounter, SlidingLog, TokenBucket};
use crate::clock::{NANOS_PER_SEC, Nanos};
use crate::limit::{Limit, LimitState};
use crate::rate::{MAX_PERIOD, Rate};

/// A whole level, in parts per million.
pub const PPM: u64 = 1_000_000;

/// How often allocations are recomputed, and the length of one demand slot.
pub const SLOT: Nanos = 100_000_000;

/// Demand is measured over this many slots (one second).
const SLOTS: usize = 10;

/// The most classes one level may divide into (the implicit catch-all included).
pub const MAX_CLASSES: usize = 16;

/// The name of the catch-all class a policy gets when it defines none.
pub const OTHER: &str = "other";

/// A name a class matches: exact, or a prefix (`abc*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    text: Box<str>,
    prefix: bool,
}

impl Pattern {
    /// `text`, a prefix when it ends with `*`.
    pub fn new(text: &str) -> Self {
        match text.strip_suffix('*') {
            Some(p) => Self { text: p.into(), prefix: true },
            None => Self { text: text.into(), prefix: false },
        }
    }

    /// Whether `name` matches.
    pub fn matches(&self, name: &str) -> bool {
        if self.prefix { name.starts_with(&*self.text) } else { *name == *self.text }
    }

    /// The exact name, when the pattern is not a prefix.
    pub fn exact(&self) -> Option<&str> {
        (!self.prefix).then_some(&*self.text)
    }
}

/// One class of a shared level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareClass {
    /// Its name (policy, metrics label, rejections' detail).
    pub name: Arc<str>,
    /// Tenants it matches (empty: any).
    pub tenants: Vec<Pattern>,
    /// Routes it matches (empty: any).
    pub routes: Vec<Pattern>,
    /// Keys it matches (empty: any, with or without a key).
    pub keys: Vec<Pattern>,
    /// What it can always get, as far as it uses it (ppm of the level).
    pub reserved: u64,
    /// Its weight in dividing what is not reserved.
    pub weight: NonZeroU64,
    /// The most it takes beyond its reservation (ppm; `None`: no cap).
    pub max_borrow: Option<u64>,
    /// Higher borrows first.
    pub priority: u8,
    /// What it gets whatever the priorities, as far as it uses it (ppm).
    pub min_share: u64,
}

impl ShareClass {
    /// A catch-all class with no reservation, weight 1, priority 0.
    pub fn catch_all(name: &str) -> Self {
        Self {
            name: name.into(),
            tenants: Vec::new(),
            routes: Vec::new(),
            keys: Vec::new(),
            reserved: 0,
            weight: NonZeroU64::MIN,
            max_borrow: None,
            priority: 0,
            min_share: 0,
        }
    }

    /// Whether the class takes every request.
    pub fn is_catch_all(&self) -> bool {
        self.tenants.is_empty() && self.routes.is_empty() && self.keys.is_empty()
    }

    fn matches(&self, tenant: &str, route: &str, key: Option<&str>) -> bool {
        let any = |ps: &[Pattern], name: &str| ps.is_empty() || ps.iter().any(|p| p.matches(name));
        any(&self.tenants, tenant)
            && any(&self.routes, route)
            && (self.keys.is_empty() || key.is_some_and(|k| any(&self.keys, k)))
    }

    /// The most the class may be given (ppm).
    fn cap(&self) -> u64 {
        self.max_borrow.map_or(PPM, |b| self.reserved.saturating_add(b).min(PPM))
    }
}

/// The classes of one shared level, the catch-all last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shares {
    classes: Vec<ShareClass>,
}

impl Shares {
    /// The classes in the policy's order; an implicit catch-all named [`OTHER`] is
    /// added when none is given (the loader checks the rest: at most one catch-all,
    /// reservations within the level).
    pub fn new(mut classes: Vec<ShareClass>) -> Self {
        match classes.iter().position(ShareClass::is_catch_all) {
            Some(i) => {
                let c = classes.remove(i);
                classes.push(c);
            }
            None => classes.push(ShareClass::catch_all(OTHER)),
        }
        Self { classes }
    }

    /// The classes, the catch-all last.
    pub fn classes(&self) -> &[ShareClass] {
        &self.classes
    }

    /// The class a request falls in: the first that matches (the catch-all at last).
    pub fn class_of(&self, tenant: &str, route: &str, key: Option<&str>) -> usize {
        self.classes
            .iter()
            .position(|c| c.matches(tenant, route, key))
            .unwrap_or(self.classes.len() - 1)
    }
}

/// Divides a level among `classes` given each one's demand (ppm of the level's
/// sustained rate): see the module's rules. The allocations add up to at most
/// [`PPM`].
pub fn allocate(classes: &[ShareClass], demand: &[u64]) -> Vec<u64> {
    let n = classes.len();
    let want: Vec<u64> =
        (0..n).map(|i| demand.get(i).copied().unwrap_or(0).min(classes[i].cap())).collect();
    let mut alloc: Vec<u64> =
        (0..n).map(|i| classes[i].reserved.max(classes[i].min_share).min(want[i])).collect();
    let mut avail = PPM.saturating_sub(alloc.iter().sum());
    let mut priorities: Vec<u8> = classes.iter().map(|c| c.priority).collect();
    priorities.sort_unstable_by(|a, b| b.cmp(a));
    priorities.dedup();
    for p in priorities {
        let group: Vec<usize> = (0..n).filter(|&i| classes[i].priority == p).collect();
        let wants: Vec<u64> = group.iter().map(|&i| want[i] - alloc[i]).collect();
        let weights: Vec<u64> = group.iter().map(|&i| classes[i].weight.get()).collect();
        let given = water_fill(&wants, &weights, avail);
        for (&i, g) in group.iter().zip(given) {
            alloc[i] += g;
            avail -= g;
        }
    }
    let rooms: Vec<u64> = (0..n).map(|i| classes[i].cap().saturating_sub(alloc[i])).collect();
    let weights: Vec<u64> = classes.iter().map(|c| c.weight.get()).collect();
    for (a, g) in alloc.iter_mut().zip(water_fill(&rooms, &weights, avail)) {
        *a += g;
    }
    alloc
}

/// Divides `avail` among claimants by weight, none above its want; returns what each
/// gets (their sum at most `avail`).
fn water_fill(wants: &[u64], weights: &[u64], mut avail: u64) -> Vec<u64> {
    let mut out = vec![0; wants.len()];
    // Ascending want per weight: the smallest are filled whole first.
    let mut order: Vec<usize> = (0..wants.len()).filter(|&i| wants[i] > 0).collect();
    order.sort_by(|&a, &b| {
        (u128::from(wants[a]) * u128::from(weights[b]))
            .cmp(&(u128::from(wants[b]) * u128::from(weights[a])))
    });
    let mut weight: u64 = order.iter().map(|&i| weights[i]).sum();
    for (k, &i) in order.iter().enumerate() {
        let fair =
            u64::try_from(u128::from(avail) * u128::from(weights[i]) / u128::from(weight.max(1)))
                .unwrap_or(u64::MAX);
        if wants[i] <= fair {
            out[i] = wants[i];
            avail -= wants[i];
            weight -= weights[i];
        } else {
            // Every claimant left wants more than its fair part: each gets that part.
            for &j in &order[k..] {
                out[j] = u64::try_from(
                    u128::from(avail) * u128::from(weights[j]) / u128::from(weight.max(1)),
                )
                .unwrap_or(0);
            }
            break;
        }
    }
    out
}

/// `limit` scaled to `ppm` of itself: what a class of that allocation may take.
/// `None` when the scaled limit rounds to nothing (the class is refused); a
/// concurrency limit has no shares (the loader refuses them).
pub fn scaled(limit: &Limit, ppm: u64) -> Option<Limit> {
    if ppm == 0 {
        return None;
    }
    let part = |x: u64| {
        NonZeroU64::new(u64::try_from(u128::from(x) * u128::from(ppm) / u128::from(PPM)).ok()?)
    };
    // Sizes (a bucket's burst, a window's limit) round up: any share holds at least
    // one unit, so a class with a share is never refused outright by rounding.
    let size = |x: u64| {
        let units = (u128::from(x) * u128::from(ppm)).div_ceil(u128::from(PPM));
        NonZeroU64::new(u64::try_from(units).ok()?.max(1))
    };
    Some(match limit {
        Limit::TokenBucket(b) => {
            let (amount, period) = (b.rate().amount().get(), b.rate().period().get());
            // Small rates keep three more digits on a longer period.
            let fine = part(amount.saturating_mul(1_000)).filter(|_| period <= MAX_PERIOD / 1_000);
            let rate = match (part(amount), fine) {
                (Some(a), _) if a.get() >= 1_000 => Rate::try_new(a.get(), period).ok()?,
                (_, Some(a)) => Rate::try_new(a.get(), period * 1_000).ok()?,
                (Some(a), None) => Rate::try_new(a.get(), period).ok()?,
                // Less than a thousandth of a unit a period: the least rate there is.
                (None, None) => {
                    Rate::try_new(1, period.saturating_mul(1_000).min(MAX_PERIOD)).ok()?
                }
            };
            Limit::TokenBucket(TokenBucket::new(rate, size(b.burst().get())?))
        }
        Limit::FixedWindow(w) => {
            Limit::FixedWindow(FixedWindow::with_window(size(w.limit().get())?, w.window()))
        }
        Limit::SlidingCounter(w) => {
            Limit::SlidingCounter(SlidingCounter::with_window(size(w.limit().get())?, w.window()))
        }
        Limit::SlidingLog(w) => {
            Limit::SlidingLog(SlidingLog::new(size(w.limit().get())?, w.window()))
        }
        Limit::Concurrency(_) => return None,
    })
}

/// The state a class keeps when its limit changes from `old` to `new`: the same
/// counts where they mean the same under the new limit, otherwise a fresh state
/// charged with what was used, so that what is left never grows by a change (no
/// change of allocation, which follows callers' demand, is a way to reset a count).
fn carry_over(new: &Limit, old: &Limit, state: LimitState, now: Nanos) -> LimitState {
    match (new, old, &state) {
        (Limit::TokenBucket(n), Limit::TokenBucket(o), LimitState::TokenBucket(s)) => {
            return LimitState::TokenBucket(n.carry(o, s, now));
        }
        // A log of what was charged and when means the same under any limit.
        (Limit::SlidingLog(n), Limit::SlidingLog(o), _) if n.window() == o.window() => {
            return state;
        }
        _ if new.keeps_state_of(old) => return state,
        _ => {}
    }
    let left = old.remaining(&state, now).min(new.capacity());
    let mut fresh = LimitState::Fresh;
    let used = new.capacity() - left;
    if used > 0 {
        new.charge(&mut fresh, now, used);
    }
    fresh
}

/// Units asked for per slot over the last second.
#[derive(Debug, Clone, Default)]
struct DemandMeter {
    slots: [u64; SLOTS],
    /// The slot number (`now / SLOT`) of `slots[0]`... kept as the newest slot's.
    newest: u64,
}

impl DemandMeter {
    fn roll(&mut self, now: Nanos) {
        let slot = now / SLOT;
        if slot <= self.newest {
            return;
        }
        let shift = usize::try_from(slot - self.newest).unwrap_or(SLOTS).min(SLOTS);
        self.slots.rotate_right(shift);
        self.slots[..shift].fill(0);
        self.newest = slot;
    }

    fn record(&mut self, now: Nanos, units: u64) {
        self.roll(now);
        self.slots[0] = self.slots[0].saturating_add(units);
    }

    /// Records `units` spent evenly over `[from, now]`: what a holder reports at its
    /// call having spent since its last one is demand of that whole time, not a burst
    /// at the call (agents' leases report spending in lumps; counted at the call, a
    /// class's recent rate read two holders' lumps in its last two slots as a surge,
    /// and its allocation jumped). What falls before the meter's second is past
    /// counting.
    fn record_spread(&mut self, from: Nanos, now: Nanos, units: u64) {
        if from >= now {
            return self.record(now, units);
        }
        self.roll(now);
        let span = u128::from(now - from);
        // Of `units`, those spent by `t` (to the nearest).
        let by = |t: Nanos| {
            let part =
                (u128::from(units) * u128::from(t.clamp(from, now) - from) + span / 2) / span;
            u64::try_from(part).unwrap_or(units)
        };
        let oldest = (self.newest + 1).saturating_sub(SLOTS as u64);
        let first = (from / SLOT).max(oldest);
        let mut given = by(first.saturating_mul(SLOT));
        for slot in first..=self.newest {
            let upto = by((slot + 1).saturating_mul(SLOT));
            let i = usize::try_from(self.newest - slot).unwrap_or(SLOTS - 1).min(SLOTS - 1);
            self.slots[i] = self.slots[i].saturating_add(upto - given);
            given = upto;
        }
    }

    /// Units per second: the larger of the last second's and the last two slots'
    /// rates (a class whose demand rises is seen within a slot or two; one whose
    /// demand falls keeps its share for a second).
    fn per_sec(&mut self, now: Nanos) -> u64 {
        self.roll(now);
        let into = now % SLOT;
        let rate = |units: u64, span: Nanos| {
            u64::try_from(u128::from(units) * u128::from(NANOS_PER_SEC) / u128::from(span.max(1)))
                .unwrap_or(u64::MAX)
        };
        let all: u64 = self.slots.iter().sum();
        let recent = self.slots[0] + self.slots[1];
        rate(all, (SLOTS as u64 - 1) * SLOT + into).max(rate(recent, SLOT + into))
    }
}

/// One class's part of a gate.
#[derive(Debug, Clone)]
struct ClassGate {
    /// Its allocation (`None` before the first computation).
    ppm: Option<u64>,
    /// Its limit now (`None`: nothing allocated).
    limit: Option<Limit>,
    /// The limit `state` was kept for (the last one it had).
    last: Option<Limit>,
    state: LimitState,
    demand: DemandMeter,
    /// When its share last refused it (0: never).
    refused_at: Nanos,
}

/// Why a class's request was refused, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareDenied {
    /// The class's index.
    pub class: usize,
    /// How long until it may fit (at least until the next recomputation when the
    /// class's allocation is nothing).
    pub retry_after: Nanos,
    /// The class's limit as it stands, if it has any allocation.
    pub limit: Option<Limit>,
}

/// The state of one shared level's classes: their current allocations and limits,
/// what each has taken, and their demand.
#[derive(Debug, Clone)]
pub struct ShareGate {
    base: Limit,
    classes: Vec<ClassGate>,
    /// When allocations are next recomputed.
    next_at: Nanos,
    /// When they last were.
    computed_at: Nanos,
}

/// A class's allocation as the status page shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassView {
    /// The class.
    pub name: Arc<str>,
    /// Its allocation (ppm of the level).
    pub ppm: u64,
    /// Its demand, units per second.
    pub demand_per_sec: u64,
    /// Units it may take now.
    pub remaining: u64,
}

/// Demand with room for its noise: a quarter more.
fn with_headroom(d: u64) -> u64 {
    d.saturating_add(d / 4)
}

impl ShareGate {
    /// A gate over a level of limit `base` divided as `shares` says, with every class
    /// at the allocation of no demand.
    pub fn new(base: Limit, shares: &Shares) -> Self {
        let mut g = Self { base, classes: Vec::new(), next_at: 0, computed_at: 0 };
        g.classes = shares
            .classes()
            .iter()
            .map(|_| ClassGate {
                ppm: None,
                limit: None,
                last: None,
                state: LimitState::Fresh,
                demand: DemandMeter::default(),
                refused_at: 0,
            })
            .collect();
        g
    }

    /// The same gate for a new policy: classes of the same name keep what they took
    /// and their demand (a reload is no way to reset a class); the level's limit may
    /// have changed.
    pub fn carried(&self, old: &Shares, base: Limit, shares: &Shares, now: Nanos) -> Self {
        let mut g = Self::new(base, shares);
        for (new_class, c) in shares.classes().iter().zip(&mut g.classes) {
            if let Some(i) = old.classes().iter().position(|o| o.name == new_class.name)
                && let Some(prev) = self.classes.get(i)
            {
                c.demand = prev.demand.clone();
                c.refused_at = prev.refused_at;
                c.ppm = prev.ppm;
                c.limit = prev.ppm.and_then(|ppm| scaled(&base, ppm));
                c.last = c.limit.or(prev.last);
                if let (Some(new), Some(old)) = (c.last, prev.last) {
                    c.state = carry_over(&new, &old, prev.state.clone(), now);
                }
            }
        }
        g.recompute(shares, now);
        g
    }

    /// The level's limit the gate divides.
    pub fn base(&self) -> &Limit {
        &self.base
    }

    /// A class's demand with its headroom, in ppm of the level's sustained rate.
    fn demand_ppm(&mut self, class: usize, now: Nanos) -> u64 {
        let (q, span) = self.base.quota();
        let level_per_sec = u128::from(q) * u128::from(NANOS_PER_SEC) / u128::from(span.max(1));
        let Some(c) = self.classes.get_mut(class) else { return 0 };
        let d = u128::from(with_headroom(c.demand.per_sec(now))) * u128::from(PPM);
        u64::try_from(d / level_per_sec.max(1)).unwrap_or(u64::MAX)
    }

    /// Whether `class` is allocated less than its reservation or minimum share would
    /// give it at its demand now.
    fn short_of_floor(&mut self, shares: &Shares, class: usize, now: Nanos) -> bool {
        let Some(s) = shares.classes().get(class) else { return false };
        let floor = s.reserved.max(s.min_share).min(self.demand_ppm(class, now)) / 1_000 * 1_000;
        self.classes.get(class).is_some_and(|c| c.ppm.unwrap_or(0) < floor)
    }

    fn recompute(&mut self, shares: &Shares, now: Nanos) {
        let demand: Vec<u64> = (0..self.classes.len()).map(|i| self.demand_ppm(i, now)).collect();
        let alloc = allocate(shares.classes(), &demand);
        for (c, ppm) in self.classes.iter_mut().zip(alloc) {
            // Whole thousandths: a class's limit changes when its allocation moves by
            // at least 0.1% of the level, not on every wobble of measured demand.
            let ppm = ppm / 1_000 * 1_000;
            if c.ppm == Some(ppm) {
                continue;
            }
            let new = scaled(&self.base, ppm);
            // A class left with nothing keeps its state for when it is given a share
            // again: what it took stays taken. Only a class never given one is fresh.
            if let (Some(n), Some(o)) = (new, c.last) {
                c.state = carry_over(&n, &o, std::mem::take(&mut c.state), now);
            }
            c.ppm = Some(ppm);
            c.limit = new;
            c.last = new.or(c.last);
        }
        self.next_at = (now / SLOT + 1) * SLOT;
        self.computed_at = now;
    }

    fn refresh(&mut self, shares: &Shares, now: Nanos) {
        if now >= self.next_at {
            self.recompute(shares, now);
        }
    }

    /// Takes `cost` units for `class` (counted as its demand), or says why not. With
    /// `charge` false, checks only (a dry run: no demand, nothing taken).
    ///
    /// # Errors
    ///
    /// The class's share has no room for `cost` now.
    pub fn take(
        &mut self,
        shares: &Shares,
        class: usize,
        cost: u64,
        charge: bool,
        now: Nanos,
    ) -> Result<u64, ShareDenied> {
        if charge && let Some(c) = self.classes.get_mut(class) {
            c.demand.record(now, cost);
        }
        self.refresh(shares, now);
        match self.try_take(class, cost, charge, now) {
            // Refused below what the class is owed (a reserved class back from
            // idle, whose allocation lags its demand): computed afresh at once, at
            // most once a millisecond.
            Err(_)
                if now >= self.computed_at.saturating_add(1_000_000)
                    && self.short_of_floor(shares, class, now) =>
            {
                self.recompute(shares, now);
                self.try_take(class, cost, charge, now)
            }
            r => r,
        }
    }

    fn try_take(
        &mut self,
        class: usize,
        cost: u64,
        charge: bool,
        now: Nanos,
    ) -> Result<u64, ShareDenied> {
        let next_at = self.next_at;
        let Some(c) = self.classes.get_mut(class) else { return Ok(u64::MAX) };
        let Some(limit) = c.limit else {
            c.refused_at = now;
            return Err(ShareDenied {
                class,
                retry_after: next_at.saturating_sub(now).max(1),
                limit: None,
            });
        };
        let check = if charge {
            limit.try_acquire(&mut c.state, now, cost)
        } else {
            limit.check(&c.state, now, cost)
        };
        match check {
            Check::Admit { remaining } => Ok(remaining),
            Check::Deny { retry_after } => {
                c.refused_at = now;
                Err(ShareDenied { class, retry_after: retry_after.max(1), limit: Some(limit) })
            }
        }
    }

    /// Counts `units` that a holder of `class` spent since `since` (its last grant) as
    /// the class's demand: spread over that time as they were spent, or at once when
    /// its share refused it within the last second (a class rising past its allocation,
    /// such as one back from idle, must be seen at once, or it stays capped by what its
    /// allocation let it spend).
    pub fn spent(&mut self, class: usize, units: u64, since: Nanos, now: Nanos) {
        if let Some(c) = self.classes.get_mut(class) {
            let since = if now < c.refused_at.saturating_add(NANOS_PER_SEC) { now } else { since };
            c.demand.record_spread(since, now, units);
        }
    }

    /// Units `class` may take now (a lease's size is cut to it), after counting
    /// `asked` units (what waits now) as its demand. `Err` when its share has none.
    ///
    /// # Errors
    ///
    /// The class's share is used up now.
    pub fn room(
        &mut self,
        shares: &Shares,
        class: usize,
        asked: u64,
        now: Nanos,
    ) -> Result<u64, ShareDenied> {
        // A check of one unit: what it leaves, plus the unit, is the room.
        match self.take(shares, class, 1, false, now) {
            Ok(left) => {
                if let Some(c) = self.classes.get_mut(class) {
                    c.demand.record(now, asked);
                }
                Ok(left.saturating_add(1))
            }
            Err(d) => {
                if let Some(c) = self.classes.get_mut(class) {
                    c.demand.record(now, asked);
                }
                Err(d)
            }
        }
    }

    /// Charges `units` granted to `class` (a lease sized by [`Self::room`]): taken
    /// even past its share, which other grants in flight may have used meanwhile
    /// (the level itself was checked).
    pub fn charge(&mut self, class: usize, units: u64, now: Nanos) {
        if let Some(c) = self.classes.get_mut(class)
            && let Some(limit) = c.limit
        {
            limit.charge(&mut c.state, now, units);
        }
    }

    /// Gives back `units` that `class` took at `taken_at` (the level refused them, or
    /// they were refunded).
    pub fn give_back(&mut self, class: usize, units: u64, taken_at: Nanos, now: Nanos) {
        if let Some(c) = self.classes.get_mut(class)
            && let Some(limit) = c.limit
        {
            limit.refund(&mut c.state, now, taken_at, units);
        }
    }

    /// Every class's allocation, demand and room now.
    pub fn view(&mut self, shares: &Shares, now: Nanos) -> Vec<ClassView> {
        self.refresh(shares, now);
        shares
            .classes()
            .iter()
            .zip(&mut self.classes)
            .map(|(s, c)| ClassView {
                name: s.name.clone(),
                ppm: c.ppm.unwrap_or(0),
                demand_per_sec: c.demand.per_sec(now),
                remaining: c.limit.map_or(0, |l| l.remaining(&c.state, now)),
            })
            .collect()
    }
}
