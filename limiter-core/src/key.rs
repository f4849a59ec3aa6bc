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
}

impl<'a> LimitKeyRef<'a> {
    /// The key of the global ceiling.
    pub const GLOBAL: LimitKeyRef<'static> =
        LimitKeyRef { scope: Scope::Global, tenant: "", route: "", key: "" };

    /// A key of `scope`, keeping only the names that scope is about.
    pub fn new(scope: Scope, tenant: &'a str, route: &'a str, key: &'a str) -> Self {
        match scope {
            Scope::Global => Self { scope, tenant: "", route: "", key: "" },
            Scope::Route => Self { scope, tenant: "", route, key: "" },
            Scope::Tenant => Self { scope, tenant, route: "", key: "" },
            Scope::TenantRoute => Self { scope, tenant, route, key: "" },
            Scope::Key => Self { scope, tenant, route, key },
        }
    }

    /// The 64-bit hash the state table files this key under.
    pub fn hash_with<S: BuildHasher>(&self, build: &S) -> u64 {
        build.hash_one(self)
    }

    /// An owned copy.
    pub fn to_owned_key(&self) -> LimitKey {
        let mut text = String::with_capacity(self.tenant.len() + self.route.len() + self.key.len());
        text.push_str(self.tenant);
        text.push_str(self.route);
        text.push_str(self.key);
        LimitKey {
            scope: self.scope,
            tenant_len: u32::try_from(self.tenant.len()).unwrap_or(u32::MAX),
            route_len: u32::try_from(self.route.len()).unwrap_or(u32::MAX),
            text: text.into_boxed_str(),
        }
    }
}

impl Hash for LimitKeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.scope as u8).hash(state);
        self.tenant.hash(state);
        self.route.hash(state);
        self.key.hash(state);
    }
}

/// Escapes `|` and `\` so that the joined form stays unambiguous.
fn write_part(f: &mut fmt::Formatter<'_>, part: &str) -> fmt::Result {
    for c in part.chars() {
        if c == '|' || c == '\\' {
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
        Ok(())
    }
}

/// An owned limit key: one allocation holding the names back to back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitKey {
    scope: Scope,
    tenant_len: u32,
    route_len: u32,
    text: Box<str>,
}

impl LimitKey {
    /// The borrowed view (same hash, same equality).
    pub fn as_ref(&self) -> LimitKeyRef<'_> {
        let t = self.tenant_len as usize;
        let r = t + self.route_len as usize;
        LimitKeyRef {
            scope: self.scope,
            tenant: &self.text[..t],
            route: &self.text[t..r],
            key: &self.text[r..],
        }
    }

    /// Heap bytes held by this key.
    pub fn heap_bytes(&self) -> usize {
        self.text.len()
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
    }
}
