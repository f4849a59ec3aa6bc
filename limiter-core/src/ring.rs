//! The ring: which live node owns a tenant (or a root key), by weighted rendezvous
//! hashing.
//!
//! Every node, agent or gateway that knows the members computes the same owner
//! without asking anyone: the owner of a name is the member with the highest score
//! `weight / -ln(u)`, where `u` in (0, 1) comes from a stable 64-bit hash of the
//! member's id and the name (FNV-1a, then a SplitMix64 finaliser). A member that
//! leaves gives up only its own names, spread over the others in proportion to their
//! weights; a member that joins takes about `weight / total` of every other
//! member's names and nothing moves between the others.

use std::sync::Arc;

/// How owners are derived, as the topology call names it.
pub const HASHING: &str = "rendezvous-fnv1a64-v1";

/// The ring name of the global ceiling's counter.
pub const GLOBAL_ROOT: &str = "\u{0}global";

/// The ring name of route `route`'s route-wide counter. Tenant names cannot hold a
/// control character, so root names never collide with them.
pub fn route_root(route: &str) -> String {
    format!("\u{0}route\u{0}{route}")
}

/// One server node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its id (unique in the cluster).
    pub id: Arc<str>,
    /// Its gRPC address, `host:port`.
    pub address: Arc<str>,
    /// Its share of names relative to the others (at least 1).
    pub weight: u32,
}

/// The live members at one version.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ring {
    /// The version; a registry's only grows.
    pub epoch: u64,
    members: Vec<Member>,
}

/// FNV-1a over `parts` (with a separator between them), finalised by SplitMix64.
pub fn stable_hash(a: &[u8], b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in a.iter().chain(&[0xff]).chain(b) {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

impl Ring {
    /// A ring of `members` (sorted by id; duplicates by id keep the first).
    pub fn new(epoch: u64, mut members: Vec<Member>) -> Self {
        members.sort_by(|a, b| a.id.cmp(&b.id));
        members.dedup_by(|a, b| a.id == b.id);
        Self { epoch, members }
    }

    /// The members, sorted by id.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// Whether there is no member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The member with id `id`.
    pub fn member(&self, id: &str) -> Option<&Member> {
        self.members.iter().find(|m| &*m.id == id)
    }

    /// The same ring without member `id` (what it becomes once `id` has left).
    #[must_use]
    pub fn without(&self, id: &str) -> Self {
        Self {
            epoch: self.epoch,
            members: self.members.iter().filter(|m| &*m.id != id).cloned().collect(),
        }
    }

    /// The owner of `name` (a tenant, or a root key's ring name).
    pub fn owner(&self, name: &str) -> Option<&Member> {
        self.owner_without(name, "")
    }

    /// The owner `name` would have without member `id` (for `id`'s own names: the
    /// member with the next-highest score, which holds their replica), without
    /// building that ring.
    pub fn owner_without(&self, name: &str, id: &str) -> Option<&Member> {
        let mut best: Option<(f64, &Member)> = None;
        for m in self.members.iter().filter(|m| &*m.id != id) {
            let s = score(m, name);
            // Ties (practically never) go to the first by id: the order is sorted.
            if best.is_none_or(|(b, _)| s > b) {
                best = Some((s, m));
            }
        }
        best.map(|(_, m)| m)
    }
}

#[allow(clippy::cast_precision_loss)] // 53 bits of the hash, exactly representable
fn score(m: &Member, name: &str) -> f64 {
    let h = stable_hash(m.id.as_bytes(), name.as_bytes());
    // u in (0, 1): never 0, so -ln(u) > 0.
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    f64::from(m.weight.max(1)) / -u.ln()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn ring(ids: &[&str]) -> Ring {
        Ring::new(
            1,
            ids.iter()
                .map(|id| Member { id: (*id).into(), address: format!("{id}:1").into(), weight: 1 })
                .collect(),
        )
    }

    fn owners(r: &Ring, n: usize) -> Vec<Arc<str>> {
        (0..n).map(|i| r.owner(&format!("tenant-{i}")).unwrap().id.clone()).collect()
    }

    #[test]
    fn the_owner_without_a_member_is_the_owner_once_it_has_left() {
        let r = ring(&["a", "b", "c", "d"]);
        for i in 0..500 {
            let name = format!("tenant-{i}");
            let first = r.owner(&name).unwrap().id.clone();
            let next = r.owner_without(&name, &first).unwrap();
            assert_ne!(next.id, first);
            assert_eq!(next.id, r.without(&first).owner(&name).unwrap().id, "{name}");
            // Leaving out someone else changes nothing.
            let other = r.members().iter().find(|m| m.id != first).unwrap();
            assert_eq!(r.owner_without(&name, &other.id).unwrap().id, first);
        }
    }

    #[test]
    fn ten_thousand_tenants_spread_evenly_over_three() {
        let r = ring(&["a", "b", "c"]);
        let mut count: HashMap<Arc<str>, usize> = HashMap::new();
        for o in owners(&r, 10_000) {
            *count.entry(o).or_default() += 1;
        }
        let max = *count.values().max().unwrap() as f64;
        let spread = max / (10_000.0 / 3.0);
        assert!(spread <= 1.1, "max over mean {spread:.3}: {count:?}");
    }

    #[test]
    fn leaving_moves_only_the_leavers_tenants_and_joining_about_a_quarter() {
        let three = ring(&["a", "b", "c"]);
        let before = owners(&three, 10_000);
        let two = three.without("b");
        for (o, n) in before.iter().zip(owners(&two, 10_000)) {
            if &**o != "b" {
                assert_eq!(*o, n, "a tenant of a staying node moved");
            }
        }
        let four = ring(&["a", "b", "c", "d"]);
        let after = owners(&four, 10_000);
        let moved = before.iter().zip(&after).filter(|(x, y)| x != y).count();
        assert!(before.iter().zip(&after).all(|(x, y)| x == y || &**y == "d"));
        let share = moved as f64 / 10_000.0;
        assert!((0.22..=0.28).contains(&share), "moved {share}");
    }

    #[test]
    fn weights_share_names_in_proportion() {
        let mut r = ring(&["a", "b"]);
        r.members[0].weight = 3;
        let a = owners(&r, 10_000).iter().filter(|o| &***o == "a").count() as f64;
        assert!((0.72..=0.78).contains(&(a / 10_000.0)), "{a}");
    }

    #[test]
    fn the_hash_is_stable_across_builds() {
        // Agents in other languages compute the same owners: the values are a
        // contract (checked against an independent implementation).
        assert_eq!(stable_hash(b"a", b"acme"), 0xed98_5444_b211_2d05);
        assert_eq!(stable_hash(b"node-1", b"tenant-42"), 0x944f_3029_b468_804b);
        assert_eq!(
            ring(&["a", "b", "c"]).owner("acme").unwrap().id,
            ring(&["c", "b", "a"]).owner("acme").unwrap().id
        );
    }
}
