//! Heavy hitters: the tenants (and keys within tenants) with the most rejections and
//! the most admitted cost, in bounded memory, for the admin port. Never metric labels.
//!
//! Space-Saving (Metwally et al.): `k` counters; an item not tracked replaces the
//! smallest one and inherits its count as its error. Every item whose true count is
//! above `N / k` (N: the total counted) is tracked, and each reported count is at most
//! `N / k` above the truth (`count - error` is a lower bound).

use std::collections::HashMap;

use parking_lot::Mutex;

/// One tracked item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hitter {
    /// The item (a tenant, or `tenant/key`).
    pub item: String,
    /// Its estimated count (an upper bound).
    pub count: u64,
    /// How much of `count` may belong to items it replaced.
    pub error: u64,
}

/// A Space-Saving summary of at most `k` items.
#[derive(Debug)]
pub struct SpaceSaving {
    k: usize,
    counts: HashMap<Box<str>, (u64, u64)>,
    total: u64,
}

impl SpaceSaving {
    /// A summary tracking at most `k` items (at least one).
    pub fn new(k: usize) -> Self {
        Self { k: k.max(1), counts: HashMap::with_capacity(k.max(1)), total: 0 }
    }

    /// Counts `weight` for `item`.
    pub fn add(&mut self, item: &str, weight: u64) {
        self.total += weight;
        if let Some(c) = self.counts.get_mut(item) {
            c.0 += weight;
            return;
        }
        if self.counts.len() < self.k {
            self.counts.insert(item.into(), (weight, 0));
            return;
        }
        // Replace the smallest counter; the newcomer inherits its count as error.
        let (victim, &(min, _)) =
            self.counts.iter().min_by_key(|(_, c)| c.0).expect("k >= 1 items are tracked");
        let victim = victim.clone();
        self.counts.remove(&victim);
        self.counts.insert(item.into(), (min + weight, min));
    }

    /// The `n` largest, largest first.
    pub fn top(&self, n: usize) -> Vec<Hitter> {
        let mut v: Vec<Hitter> = self
            .counts
            .iter()
            .map(|(k, &(count, error))| Hitter { item: k.to_string(), count, error })
            .collect();
        v.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.item.cmp(&b.item)));
        v.truncate(n);
        v
    }

    /// Total weight counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Items tracked now (at most `k`).
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// True when nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

/// The server's heavy hitters.
#[derive(Debug)]
pub struct HeavyHitters {
    tenants_rejected: Mutex<SpaceSaving>,
    tenants_admitted: Mutex<SpaceSaving>,
    keys_rejected: Mutex<SpaceSaving>,
    keys_admitted: Mutex<SpaceSaving>,
    /// How keys are kept: as written, or as a short keyed hash (the default: an API
    /// key is a secret, and the status page is open to whoever reaches the port).
    keys: KeyDisplay,
}

/// How the heavy hitters keep keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyDisplay {
    /// `tenant/#` and 12 hex digits of a keyed hash (the key drawn at start): keys
    /// can be told apart, not read.
    #[default]
    Hashed,
    /// `tenant/key` as sent (`dashboard.show_keys: true`).
    Shown,
}

impl Default for HeavyHitters {
    fn default() -> Self {
        Self::new(100)
    }
}

impl HeavyHitters {
    /// Summaries of `k` items each.
    pub fn new(k: usize) -> Self {
        Self {
            tenants_rejected: Mutex::new(SpaceSaving::new(k)),
            tenants_admitted: Mutex::new(SpaceSaving::new(k)),
            keys_rejected: Mutex::new(SpaceSaving::new(k)),
            keys_admitted: Mutex::new(SpaceSaving::new(k)),
            keys: KeyDisplay::Hashed,
        }
    }

    /// With keys kept as `display` says.
    #[must_use]
    pub fn with_keys(mut self, display: KeyDisplay) -> Self {
        self.keys = display;
        self
    }

    fn secret() -> &'static std::hash::RandomState {
        static SECRET: std::sync::OnceLock<std::hash::RandomState> = std::sync::OnceLock::new();
        SECRET.get_or_init(std::hash::RandomState::new)
    }

    /// Counts one decision.
    pub fn record(&self, tenant: &str, key: Option<&str>, admitted: bool, cost: u64) {
        let (tenants, keys, weight) = if admitted {
            (&self.tenants_admitted, &self.keys_admitted, cost)
        } else {
            (&self.tenants_rejected, &self.keys_rejected, 1)
        };
        if weight == 0 {
            return;
        }
        tenants.lock().add(tenant, weight);
        if let Some(k) = key {
            // A per-thread buffer: no allocation per decision for the pair's name.
            thread_local!(static PAIR: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) });
            PAIR.with_borrow_mut(|pair| {
                pair.clear();
                pair.push_str(tenant);
                pair.push('/');
                match self.keys {
                    KeyDisplay::Shown => pair.push_str(k),
                    KeyDisplay::Hashed => {
                        use std::fmt::Write as _;
                        let h = std::hash::BuildHasher::hash_one(Self::secret(), k);
                        let _ = write!(pair, "#{:012x}", h >> 16);
                    }
                }
                keys.lock().add(pair, weight);
            });
        }
    }

    /// The top `n` tenants by rejections and by admitted cost.
    pub fn tenants(&self, n: usize) -> (Vec<Hitter>, Vec<Hitter>) {
        (self.tenants_rejected.lock().top(n), self.tenants_admitted.lock().top(n))
    }

    /// The top `n` `tenant/key` pairs by rejections and by admitted cost.
    pub fn keys(&self, n: usize) -> (Vec<Hitter>, Vec<Hitter>) {
        (self.keys_rejected.lock().top(n), self.keys_admitted.lock().top(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_and_memory_bounds_hold_against_an_exact_count() {
        let k = 50;
        let mut ss = SpaceSaving::new(k);
        let mut exact: HashMap<String, u64> = HashMap::new();
        // Zipf-like stream over 5,000 items, plus a long tail of one-offs.
        let mut seed: u64 = 42;
        for i in 0..200_000u64 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let item = if i % 3 == 0 {
                format!("tail-{i}")
            } else {
                let r = (seed % 10_000) as f64 / 10_000.0;
                format!("t{}", (r * r * r * 5_000.0) as u64)
            };
            ss.add(&item, 1);
            *exact.entry(item).or_default() += 1;
            assert!(ss.len() <= k, "memory bound");
        }
        let n = ss.total();
        let bound = n / k as u64;
        for h in ss.top(k) {
            let truth = exact[&h.item];
            assert!(h.count >= truth, "{h:?} below the truth {truth}");
            assert!(h.count - truth <= bound, "{h:?}: error above N/k = {bound}");
            assert!(h.count - h.error <= truth, "{h:?}: lower bound above the truth");
        }
        // Everything more frequent than N/k is tracked.
        let tracked: Vec<String> = ss.top(k).into_iter().map(|h| h.item).collect();
        for (item, &c) in &exact {
            if c > bound {
                assert!(tracked.contains(item), "{item} ({c} > {bound}) missing");
            }
        }
    }
}
