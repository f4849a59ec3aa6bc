//! The background tasks: the renewer (one call per owner carrying every due key) and the topology watcher.

use super::*;
use limiter_core::clock::Nanos;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The background renewer: one call in flight to the owner at a time, carrying
/// every key that is due (low on units, half way through its lease, or idle).
pub(super) async fn renew_loop(
    inner: Weak<Inner>,
    wake: Arc<tokio::sync::Notify>,
    cancel: CancellationToken,
) {
    let mut jitter: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next_due: Option<Nanos> = None;
    loop {
        let Some((interval, now)) =
            inner.upgrade().map(|i| (nanos(i.config.renew_interval), i.clock.now()))
        else {
            return;
        };
        // xorshift: ±10% jitter without a random-number dependency.
        jitter ^= jitter << 13;
        jitter ^= jitter >> 7;
        jitter ^= jitter << 17;
        let mut wait = interval - interval / 10 + jitter % (interval / 5).max(1);
        // Short leases (a sliding log's, a grant near a window's end) are renewed half
        // way through, before they lapse with units in them.
        if let Some(due) = next_due {
            wait = wait.min(due.saturating_sub(now).max(1_000_000));
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(Duration::from_nanos(wait)) => {}
            () = wake.notified() => {}
        }
        let Some(inner) = inner.upgrade() else { return };
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

/// Renews (or returns) every due key in one call; returns when the next key falls due.
pub(super) async fn renew_due(inner: &Inner) -> Option<Nanos> {
    let now = inner.clock.now();
    if !inner.breaker.allow(now) {
        return None;
    }
    let mut next_due: Option<Nanos> = None;
    let idle_after = nanos(inner.config.idle_after);
    let slots = inner.slots.all();
    let mut batch = Vec::new();
    let mut forgotten = Vec::new();
    for slot in &slots {
        let Ok(mut st) = slot.lease.clone().try_lock_owned() else { continue };
        if st.lease_id == 0 {
            // Long idle and holding nothing: forget the key (bounded memory).
            if now.saturating_sub(slot.balance.last_used()) > FORGET_AFTER_IDLE * idle_after
                && slot.balance.units() == 0
            {
                forgotten.push(slot.clone());
            }
            continue;
        }
        let idle = now.saturating_sub(slot.balance.last_used()) > idle_after;
        let half_way = now.saturating_sub(st.sent_at) > st.hold / 2;
        let expired = now >= slot.balance.deadline();
        if !(idle || half_way || expired || slot.balance.renew_wanted()) {
            let due = st.sent_at + st.hold / 2;
            next_due = Some(next_due.map_or(due, |d| d.min(due)));
            continue;
        }
        let unspent = slot.balance.take();
        let spent = st.installed.saturating_sub(unspent);
        let demand = st.demand(now, spent);
        let want = if idle { 0 } else { inner.want(demand, 1) };
        let item =
            inner.item(slot, st.lease_id, if expired { 0 } else { unspent }, want, 0, demand);
        st.lease_id = 0;
        batch.push((slot.clone(), st, item));
        if batch.len() >= 100 {
            break;
        }
    }
    if !forgotten.is_empty() {
        inner.slots.remove(&forgotten);
    }
    if batch.is_empty() {
        return next_due;
    }
    let items = batch.iter().map(|(_, _, i)| i.clone()).collect();
    if let Ok(grants) = inner.call(items).await {
        for ((slot, mut st, _), g) in batch.into_iter().zip(&grants) {
            inner.install(&slot, &mut st, g, now, 0);
            if st.lease_id != 0 {
                let due = st.sent_at + st.hold / 2;
                next_due = Some(next_due.map_or(due, |d| d.min(due)));
            }
        }
    }
    next_due
}
