//! Check-now-charge-later tickets: what a cost report must name to be settled, bound
//! to its tenant, route and key by a keyed MAC, each refunded at most once.

use std::collections::HashMap;
use std::hash::BuildHasher;

use limiter_core::clock::Nanos;
use limiter_core::policy::Request;
use parking_lot::Mutex;

use crate::error::ServerError;
use crate::store::Charged;

pub(super) use super::TICKET_TTL;

/// Tickets of requests admitted on an estimate, until their actual cost is reported.
///
/// A ticket is `v1.<charged_at>.<hold>.<estimate>.<mac>` (hex): when and for how long
/// the store charged the estimate (a batch's grant, for units taken from one), which
/// is what a refund must name; the MAC (SipHash under a key
/// drawn at start) binds it to the tenant, route and key it was issued for. Open
/// tickets are remembered (bounded) so that a refund is paid once; a report for a
/// ticket no longer open (settled, expired or evicted) still charges any excess,
/// never loses it, but refunds nothing.
#[derive(Debug)]
pub(super) struct Tickets {
    pub(super) key: std::hash::RandomState,
    pub(super) open: Mutex<HashMap<u64, Open>>,
    pub(super) max: usize,
}

/// What is remembered of an open ticket.
#[derive(Debug, Clone, Copy)]
pub(super) struct Open {
    admitted_at: Nanos,
    /// A keyed hash of its tenant, route and key (what `Usage` counts by).
    names: u64,
    estimate: u64,
}

pub(super) struct Ticket {
    pub(super) admitted_at: Nanos,
    pub(super) hold: Nanos,
    pub(super) estimate: u64,
    pub(super) mac: u64,
}

impl Tickets {
    fn mac(&self, req: &Request<'_>, at: Charged, estimate: u64) -> u64 {
        let names = (req.tenant, req.route, req.key.unwrap_or(""));
        self.key.hash_one((names, at.at, at.hold, estimate))
    }

    fn names(&self, req: &Request<'_>) -> u64 {
        self.key.hash_one((req.tenant, req.route, req.key.unwrap_or("")))
    }

    pub(super) fn issue(&self, req: &Request<'_>, at: Charged, estimate: u64) -> String {
        let mac = self.mac(req, at, estimate);
        let admitted_at = at.at;
        let names = self.names(req);
        let mut open = self.open.lock();
        if open.len() >= self.max {
            open.retain(|_, o| admitted_at.saturating_sub(o.admitted_at) < TICKET_TTL);
        }
        if open.len() >= self.max {
            // Still full: forget the oldest; its estimate stays charged (never a loss).
            if let Some(oldest) = open.iter().min_by_key(|(_, o)| o.admitted_at).map(|(k, _)| *k) {
                open.remove(&oldest);
            }
        }
        open.insert(mac, Open { admitted_at, names, estimate });
        format!("v1.{admitted_at:x}.{:x}.{estimate:x}.{mac:x}", at.hold)
    }

    pub(super) fn parse(&self, req: &Request<'_>, text: &str) -> Result<Ticket, ServerError> {
        let bad =
            || ServerError::invalid("ticket", "not a ticket issued for this tenant, route and key");
        let mut parts = text.split('.');
        if parts.next() != Some("v1") {
            return Err(bad());
        }
        let mut hex = || parts.next().and_then(|p| u64::from_str_radix(p, 16).ok()).ok_or_else(bad);
        let (admitted_at, hold, estimate, mac) = (hex()?, hex()?, hex()?, hex()?);
        if self.mac(req, Charged { at: admitted_at, hold }, estimate) != mac {
            return Err(bad());
        }
        Ok(Ticket { admitted_at, hold, estimate, mac })
    }

    /// The open tickets of `req`'s tenant, route and key at `now`: how many, and their
    /// estimated units (a scan of the bounded table: for the usage view, not the
    /// decision path).
    pub(super) fn open_for(&self, req: &Request<'_>, now: Nanos) -> (u64, u64) {
        let names = self.names(req);
        self.open
            .lock()
            .values()
            .filter(|o| o.names == names && now.saturating_sub(o.admitted_at) < TICKET_TTL)
            .fold((0, 0), |(n, u), o| (n + 1, u + o.estimate))
    }

    /// Closes an open ticket; false when it was not open.
    pub(super) fn close(&self, t: &Ticket, now: Nanos) -> bool {
        let open = self.open.lock().remove(&t.mac).is_some();
        open && now.saturating_sub(t.admitted_at) < TICKET_TTL
    }
}
