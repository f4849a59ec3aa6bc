//! Stage one of loading a policy: YAML text into a tree of nodes that remember where
//! they were written. Only YAML syntax can fail here; every rule about what the nodes
//! mean is checked in stage two, which can then report all mistakes at once.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

/// A 1-based line and column in the source text (0 when unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pos {
    /// Line, from 1.
    pub line: u64,
    /// Column, from 1.
    pub column: u64,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// A YAML node with its position.
#[derive(Debug, Clone)]
pub struct Node {
    /// Where the node was written.
    pub pos: Pos,
    /// What it holds.
    pub value: Value,
}

/// The value of a node.
#[derive(Debug, Clone)]
pub enum Value {
    /// `~`, `null` or an empty value.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer (negative ones kept, so they can be refused with a clear message).
    Int(i128),
    /// A floating-point number.
    Float(f64),
    /// Any other scalar.
    Str(String),
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in source order, duplicates kept so they can be reported.
    Map(Vec<(Key, Node)>),
}

/// A mapping key with its position.
#[derive(Debug, Clone)]
pub struct Key {
    /// Where the key was written.
    pub pos: Pos,
    /// The key as text.
    pub text: String,
}

impl Value {
    /// A short name of the kind of value, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Null => "nothing",
            Self::Bool(_) => "a boolean",
            Self::Int(_) => "an integer",
            // The parser reads integers beyond 64 bits as floats.
            Self::Float(f) if f.fract() == 0.0 && f.abs() >= 9.2e18 => {
                "an integer too large (the most is 18446744073709551615)"
            }
            Self::Float(_) => "a decimal number",
            Self::Str(_) => "a string",
            Self::Seq(_) => "a list",
            Self::Map(_) => "a mapping",
        }
    }
}

fn pos(loc: serde_saphyr::Location) -> Pos {
    Pos { line: loc.line(), column: loc.column() }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = Spanned::<Value>::deserialize(d)?;
        Ok(Node { pos: pos(s.referenced), value: s.value })
    }
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = Spanned::<Value>::deserialize(d)?;
        let text = match s.value {
            Value::Str(t) => t,
            Value::Int(i) => i.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Float(f) => f.to_string(),
            Value::Null => String::new(),
            Value::Seq(_) | Value::Map(_) => {
                return Err(de::Error::custom("a mapping key must be a plain scalar"));
            }
        };
        Ok(Key { pos: pos(s.referenced), text })
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Value, E> {
        Ok(Value::Int(v))
    }
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        i128::try_from(v).map(Value::Int).map_err(|_| E::custom("integer too large"))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(n) = seq.next_element::<Node>()? {
            items.push(n);
        }
        Ok(Value::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(k) = map.next_key::<Key>()? {
            let v = map.next_value::<Node>()?;
            entries.push((k, v));
        }
        Ok(Value::Map(entries))
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

/// A YAML syntax error with its position.
#[derive(Debug, Clone)]
pub struct SyntaxError {
    /// Where the parser stopped.
    pub pos: Pos,
    /// What it found.
    pub message: String,
}

/// Parses YAML text into a node tree. Duplicate keys are kept (and reported by stage
/// two with both positions); the parser's budgets guard against alias bombs.
///
/// # Errors
///
/// YAML that does not parse.
pub fn parse(text: &str) -> Result<Node, SyntaxError> {
    // The parser's default budgets (250,000 nodes, 64 MiB of scalars) would cap a
    // policy at about 31,000 tenants. Text already in memory cannot expand beyond its
    // own size except through aliases, which keep their own (default) caps; so the
    // node, event and scalar budgets grow with the text.
    let len = text.len();
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = budget.max_nodes.max(len);
    budget.max_events = budget.max_events.max(len.saturating_mul(2));
    budget.max_total_scalar_bytes = budget.max_total_scalar_bytes.max(len);
    let options = serde_saphyr::options! {
        duplicate_keys: serde_saphyr::options::DuplicateKeyPolicy::PassThrough,
        budget: Some(budget),
    };
    if text.trim().is_empty() {
        return Ok(Node { pos: Pos { line: 1, column: 1 }, value: Value::Null });
    }
    serde_saphyr::from_str_with_options::<Node>(text, options).map_err(|e| SyntaxError {
        pos: e.location().map(pos).unwrap_or_default(),
        message: e.without_snippet().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_positions_and_duplicates() {
        let n = parse("a: 1\nb:\n  c: -2\n  c: x\n").unwrap();
        let Value::Map(m) = n.value else { panic!("map") };
        assert_eq!(m[0].0.text, "a");
        assert_eq!(m[0].0.pos.line, 1);
        let Value::Map(inner) = &m[1].1.value else { panic!("inner map") };
        assert_eq!(inner.len(), 2);
        assert_eq!(inner[1].0.pos.line, 4);
        assert!(matches!(inner[0].1.value, Value::Int(-2)));
    }

    #[test]
    fn reports_syntax_errors_with_a_line() {
        let e = parse("a: [1, 2\nb: 3\n").unwrap_err();
        assert!(e.pos.line >= 1, "{e:?}");
    }
}
