//! x
#![allow(missing_docs)]
fn main() {}
