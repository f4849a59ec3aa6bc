//! Limit keys: which counter a level of a request is charged against.
//!
//! A key is its scope plus the names that scope is about (global: none; route: the
//! route; tenant: the tenant; tenant x route: both; key: tenant, route and key). The
//! borrowed form [`LimitKeyRef`] is what a request builds (no allocation); the owned
//! [`LimitKey`] is stored only when a counter is created.

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};

use crate::decision::Scope;

/// A limit key borrowed from a request and the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitKeyRef<'a> {
    /// The level.
    pub scope: Scope,
    /// The tenant ("" for global and route scopes).
    pub tenant: &'a str,
    /// The route ("" for global and tenant scopes).
    pub route: &'a str,
    /// The key ("" except for the key scope).
    pub key: &'a str,
    /// Which of the level's budgets (0: the first, and the only one of most levels).
    pub budget: u8,
}

impl<'a> LimitKeyRef<'a> {
    /// The key of the global ceiling.
    pub const GLOBAL: LimitKeyRef<'static> =
        LimitKeyRef { scope: Scope::Global, tenant: "", route: "", key: "", budget: 0 };

    /// A key of `scope`, keeping only the names that scope is about.
    pub fn new(scope: Scope, tenant: &'a str, route: &'a str, key: &'a str) -> Self {
        let budget = 0;
        match scope {
            Scope::Global => Self { scope, tenant: "", route: "", key: "", budget },
            Scope::Route => Self { scope, tenant: "", route, key: "", budget },
            Scope::Tenant => Self { scope, tenant, route: "", key: "", budget },
            Scope::TenantRoute => Self { scope, tenant, route, key: "", budget },
            Scope::Key => Self { scope, tenant, route, key, budget },
        }
    }

    /// The same names, for budget `budget` of the level.
    #[must_use]
    pub fn with_budget(self, budget: u8) -> Self {
        Self { budget, ..self }
    }

    /// The 64-bit hash the state table files this key under.
    pub fn hash_with<S: BuildHasher>(&self, build: &S) -> u64 {
        build.hash_one(self)
    }

    /// An owned copy.
    ///
    /// # Panics
    ///
    /// When a name is longer than [`MAX_NAME_LEN`] (requests are checked before).
    pub fn to_owned_key(&self) -> LimitKey {
        let len = |s: &str| u16::try_from(s.len()).ok().filter(|&l| usize::from(l) <= MAX_NAME_LEN);
        let (t, r, k) = (len(self.tenant), len(self.route), len(self.key));
        let (Some(tenant_len), Some(route_len), Some(key_len)) = (t, r, k) else {
            panic!("limit key names are at most {MAX_NAME_LEN} bytes");
        };
        let total = self.tenant.len() + self.route.len() + self.key.len();
        let text = if total <= INLINE {
            let mut buf = [0u8; INLINE];
            buf[..self.tenant.len()].copy_from_slice(self.tenant.as_bytes());
            buf[self.tenant.len()..][..self.route.len()].copy_from_slice(self.route.as_bytes());
            buf[self.tenant.len() + self.route.len()..total].copy_from_slice(self.key.as_bytes());
            Text::Inline(buf)
        } else {
            let mut v = Vec::with_capacity(total);
            v.extend_from_slice(self.tenant.as_bytes());
            v.extend_from_slice(self.route.as_bytes());
            v.extend_from_slice(self.key.as_bytes());
            Text::Heap(v.into_boxed_slice())
        };
        LimitKey { scope: self.scope, budget: self.budget, tenant_len, route_len, key_len, text }
    }

    /// True when `owned` is this key (without building a borrowed view of it).
    #[inline]
    pub fn matches(&self, owned: &LimitKey) -> bool {
        if self.scope != owned.scope
            || self.budget != owned.budget
            || self.tenant.len() != usize::from(owned.tenant_len)
            || self.route.len() != usize::from(owned.route_len)
            || self.key.len() != usize::from(owned.key_len)
        {
            return false;
        }
        let b = owned.bytes();
        let (t, r) = (self.tenant.len(), self.route.len());
        b[..t] == *self.tenant.as_bytes()
            && b[t..t + r] == *self.route.as_bytes()
            && b[t + r..] == *self.key.as_bytes()
    }
}

impl Hash for LimitKeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.scope as u8).hash(state);
        self.budget.hash(state);
        self.tenant.hash(state);
        self.route.hash(state);
        self.key.hash(state);
    }
}

/// Escapes `|`, `#` and `\` so that the joined form stays unambiguous.
fn write_part(f: &mut fmt::Formatter<'_>, part: &str) -> fmt::Result {
    for c in part.chars() {
        if c == '|' || c == '#' || c == '\\' {
            f.write_str("\\")?;
        }
        write!(f, "{c}")?;
    }
    Ok(())
}

/// The stable text form: `scope|names...`, e.g. `tenant_route|acme|/search`.
impl fmt::Display for LimitKeyRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.scope.as_str())?;
        let parts: &[&str] = match self.scope {
            Scope::Global => &[],
            Scope::Route => &[self.route],
            Scope::Tenant => &[self.tenant],
            Scope::TenantRoute => &[self.tenant, self.route],
            Scope::Key => &[self.tenant, self.route, self.key],
        };
        for p in parts {
            f.write_str("|")?;
            write_part(f, p)?;
        }
        if self.budget > 0 {
            // Budgets count from 1 in text; a `#` in a name is escaped.
            write!(f, "#{}", u16::from(self.budget) + 1)?;
        }
        Ok(())
    }
}

/// The longest name a limit key holds, in bytes; requests are checked against a
/// configurable bound at most this large.
pub const MAX_NAME_LEN: usize = 4_096;

/// Names up to this many bytes in all are stored inside the key, with no allocation
/// and no pointer to follow on lookup.
const INLINE: usize = 22;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Text {
    Inline([u8; INLINE]),
    Heap(Box<[u8]>),
}

/// An owned limit key: 32 bytes, the names inline when short, else in one allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitKey {
    scope: Scope,
    budget: u8,
    tenant_len: u16,
    route_len: u16,
    key_len: u16,
    text: Text,
}

impl LimitKey {
    fn bytes(&self) -> &[u8] {
        let total =
            usize::from(self.tenant_len) + usize::from(self.route_len) + usize::from(self.key_len);
        match &self.text {
            Text::Inline(b) => &b[..total],
            Text::Heap(b) => b,
        }
    }

    /// The level.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// The borrowed view (same hash, same equality).
    pub fn as_ref(&self) -> LimitKeyRef<'_> {
        let b = self.bytes();
        let t = usize::from(self.tenant_len);
        let r = t + usize::from(self.route_len);
        // The bytes were copied from `&str`s split at these same boundaries.
        fn part(p: &[u8]) -> &str {
            std::str::from_utf8(p).expect("key parts are UTF-8")
        }
        LimitKeyRef {
            scope: self.scope,
            tenant: part(&b[..t]),
            route: part(&b[t..r]),
            key: part(&b[r..]),
            budget: self.budget,
        }
    }

    /// Heap bytes held by this key.
    pub fn heap_bytes(&self) -> usize {
        match &self.text {
            Text::Inline(_) => 0,
            Text::Heap(b) => b.len(),
        }
    }
}

impl Hash for LimitKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_ref().hash(state);
    }
}

impl fmt::Display for LimitKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_ref().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_and_borrowed_agree_and_text_is_stable() {
        let s = ahash::RandomState::with_seeds(1, 2, 3, 4);
        let k = LimitKeyRef::new(Scope::Key, "acme", "/a|b", "u1");
        let o = k.to_owned_key();
        assert_eq!(o.as_ref(), k);
        assert_eq!(o.as_ref().hash_with(&s), k.hash_with(&s));
        assert_eq!(k.to_string(), "key|acme|/a\\|b|u1");
        assert_eq!(LimitKeyRef::new(Scope::Route, "acme", "/x", "u").to_string(), "route|/x");
        // Same names, other split: different keys.
        let a = LimitKeyRef::new(Scope::TenantRoute, "ab", "c", "");
        let b = LimitKeyRef::new(Scope::TenantRoute, "a", "bc", "");
        assert_ne!(a, b);
        assert_ne!(a.to_owned_key(), b.to_owned_key());
        assert!(!a.matches(&b.to_owned_key()));
        assert!(a.matches(&a.to_owned_key()));
        assert_eq!(size_of::<LimitKey>(), 32);
        // Long names go to the heap and still agree.
        let long = "x".repeat(100);
        let l = LimitKeyRef::new(Scope::Key, "acme", "/r", &long);
        let lo = l.to_owned_key();
        assert!(lo.heap_bytes() > 0 && l.matches(&lo) && lo.as_ref() == l);
        assert_eq!(k.to_owned_key().heap_bytes(), 0);
    }
}
