//! The background tasks: the renewer (one call per owner carrying every due key) and the topology watcher.

use super::*;
use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_proto::limiter::v1 as pb;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The background renewer: one call in flight to the owner at a time, carrying
/// every key that is due (low on units, near its grant's end, rationed, or idle).
/// A round comes every half `renew_interval` (jittered) and takes every key due
/// before the next (`Schedule`), so the keys of a round share one call; a key that
/// must not be renewed early gets a round at its own time.
pub(super) async fn renew_loop(inner: Weak<Inner>, cancel: CancellationToken) {
    let mut jitter: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next_due: Option<Nanos> = None;
    loop {
        // Held only while planning: the agent stops once its last clone is dropped.
        let Some(strong) = inner.upgrade() else { return };
        let (interval, now) = (nanos(strong.config.renew_interval), strong.clock.now());
        // xorshift: ±10% jitter without a random-number dependency.
        jitter ^= jitter << 13;
        jitter ^= jitter >> 7;
        jitter ^= jitter << 17;
        let half = interval / 2;
        let mut wait = half - half / 10 + jitter % (half / 5).max(1);
        if let Some(due) = next_due {
            wait = wait.min(due.saturating_sub(now).max(1_000_000));
        }
        // A key given an earlier time meanwhile (a refusal that lapses before the
        // planned round, say) wakes the loop, which plans again.
        let sooner = strong.schedule.plan(now + wait);
        drop(strong);
        let woken = tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(Duration::from_nanos(wait)) => false,
            () = sooner.notified() => true,
        };
        let Some(inner) = inner.upgrade() else { return };
        if woken {
            next_due = inner.schedule.next(inner.clock.now(), interval / 2);
            continue;
        }
        inner.schedule.plan(Nanos::MAX);
        inner.clock.check();
        next_due = renew_due(&inner).await;
    }
}

/// Runs futures concurrently and collects their outputs in order.
pub(super) async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futures.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.expect("every future finished")).collect()
}

/// Keeps the ring current (ring routing): every `topology_interval`, and at once
/// after a redirect.
pub(super) async fn topology_loop(
    inner: Weak<Inner>,
    stale: Arc<tokio::sync::Notify>,
    cancel: CancellationToken,
) {
    loop {
        let Some(every) = inner.upgrade().map(|i| i.config.topology_interval) else { return };
        if let Some(i) = inner.upgrade() {
            i.refresh_ring().await;
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(every) => {}
            () = stale.notified() => {}
        }
    }
}

/// The most keys one round takes from the schedule (the rest wait for the next).
const MOST_PER_ROUND: usize = 5_000;

/// One round: every key that ran low or falls due before the next round (so that
/// keys due at scattered times share a call; `Schedule`) is renewed (a top-up: its balance keeps
/// serving while the call is out), given back (idle) or forgotten (long idle, holding
/// nothing), in one call per owner. Returns when the schedule's next key is due
/// (`None` while the owner is out of reach: the next round is a whole one away).
pub(super) async fn renew_due(inner: &Inner) -> Option<Nanos> {
    let now = inner.clock.now();
    if !inner.breaker.allow(now) {
        return None;
    }
    let interval = nanos(inner.config.renew_interval);
    let idle_after = nanos(inner.config.idle_after);
    let early = interval / 2;
    let slots = inner.schedule.take_due(now, early, MOST_PER_ROUND);
    let mut forgotten = Vec::new();
    let mut items = Vec::new();
    // Per key: its lease state, the index of its renewal item (if it renews), and
    // the replaced lease that item settles (kept if the call fails).
    let mut work = Vec::new();
    for slot in &slots {
        let Some(mut st) = inner.slots.try_lease(slot) else {
            // Its own call is out: looked at again next round.
            inner.schedule.at(slot, When::by(now + interval));
            continue;
        };
        let unused = slot.balance.idle_for(now);
        // A rationed key holding nothing (its last share was none) asks again while
        // used.
        let rationed = st.cut && st.denied.is_some() && unused <= idle_after;
        if st.lease_id == 0 && !rationed {
            if unused > FORGET_AFTER_IDLE * idle_after
                && slot.balance.units() == 0
                && slot.pool_empty()
            {
                forgotten.push(slot.clone());
            } else {
                inner.schedule.at(slot, inner.next_due(slot, &st, now));
                drop(st);
                shed_if_idle(inner, slot, now);
            }
            continue;
        }
        if unused > idle_after || st.mode == Mode::Direct {
            items.extend(inner.give_back(slot, &mut st));
            work.push((slot, st, None));
            continue;
        }
        let demand = st.demand(now, slot.balance.units(), 0);
        inner.tenant_demand(slot.key.parts().0, demand);
        let want = inner.want(&st, demand, 1);
        let (id, unspent) = if st.lease_id == 0 {
            // No lease to settle (spare units still spendable stay).
            (0, 0)
        } else if now >= slot.balance.deadline() {
            // Lapsed: given back and replaced in one item (requests wait for it).
            inner.take_lease(slot, &mut st)
        } else {
            // A top-up: the units the key spends while the call is out stay here as
            // spare units (settled as spent), the rest go back with the renewal.
            // What the key spends in the call's time, rounded down: a slow key keeps
            // none (a unit it kept and did not spend would be lost, settled as spent),
            // and its rare request while the call is out waits for the answer. Nor
            // does a key unused for a round's interval: its estimate falls by at most
            // half an update, so after a burst (refusals count) it would set aside
            // every unit each renewal granted while it sat idle, and lose them.
            let rtt = inner.rtt.load(Ordering::Relaxed);
            let span = u128::from(4 * rtt + 2_000_000);
            let reserve = if unused > interval {
                0
            } else {
                let r = u128::from(demand) * span / u128::from(NANOS_PER_SEC);
                u64::try_from(r).unwrap_or(u64::MAX)
            };
            let unspent = slot.balance.set_aside(now, reserve);
            st.counted = slot.balance.units();
            (std::mem::take(&mut st.lease_id), unspent)
        };
        items.push(inner.item(slot, id, unspent, want, 0, demand));
        work.push((slot, st, Some((items.len() - 1, want))));
    }
    if !forgotten.is_empty() {
        inner.slots.remove(&forgotten);
    }
    if items.is_empty() {
        return inner.schedule.next(now, early);
    }
    let answer = inner.call(items).await;
    let back = inner.clock.now();
    match answer {
        Ok(grants) => {
            for (slot, mut st, renewal) in work {
                let gave_back = renewal.is_none();
                if let Some((g, want)) = renewal.and_then(|(i, w)| Some((grants.get(i)?, w))) {
                    st.cut = g.units < want;
                    st.held_back = g.held_back;
                    inner.renewed(slot, &mut st, g, now);
                }
                inner.schedule.at(slot, inner.next_due(slot, &st, back));
                drop(st);
                if gave_back {
                    shed_if_idle(inner, slot, back);
                }
            }
        }
        Err(_) => {
            // What was given back is lost with the call (its owner writes it off);
            // the keys ask again next round.
            for (slot, _, _) in work {
                inner.schedule.at(slot, When::by(back + interval));
            }
        }
    }
    inner.schedule.next(now, early)
}

/// Drops the slow-path state of a key that gave its lease back and is idle at `now`
/// (holding nothing, refused nothing): an idle key costs its slot alone until it is
/// used again (a new state then, its first grant sized like a new key's) or forgotten.
fn shed_if_idle(inner: &Inner, slot: &Arc<Slot>, now: Nanos) {
    let idle_after = nanos(inner.config.idle_after);
    if slot.balance.idle_for(now) > idle_after && slot.balance.units() == 0 {
        inner.slots.shed(slot, |st| st.lease_id == 0 && st.denied.is_none());
    }
}

impl Inner {
    /// Applies a renewal's answer: a grant installed, or a share of nothing or a
    /// direct-mode answer (the spare units keep serving), and the limit that cut a
    /// share kept to refuse with.
    fn renewed(&self, slot: &Arc<Slot>, st: &mut LeaseState, g: &pb::LeaseGrant, sent_at: Nanos) {
        self.learn_failure_policy(slot, g);
        let cut = g.decision.as_ref().and_then(|d| self.rationed(&from_owner(d), sent_at));
        if g.mode() == pb::LeaseMode::Direct {
            st.mode = Mode::Direct;
            st.denied = None;
        } else if g.units > 0 {
            self.install(slot, st, g, sent_at, 0);
            st.denied = cut;
        } else {
            st.mode = Mode::Leased;
            st.denied = cut;
        }
    }
}
