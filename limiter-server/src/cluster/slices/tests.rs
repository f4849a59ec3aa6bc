use super::*;

fn key() -> SliceKey {
    (Scope::Global, "".into(), "".into())
}

#[test]
fn takes_all_or_nothing_and_gives_back() {
    let s = Slices::default();
    let k = [key(), (Scope::Route, "/a".into(), "".into())];
    assert_eq!(s.take(&k, 1, 0), Take::Short(key()));
    s.install(&k[0], 1, 10, 100);
    assert_eq!(s.take(&k, 1, 0), Take::Short(k[1].clone()));
    s.install(&k[1], 2, 3, 100);
    assert_eq!(s.take(&k, 3, 0), Take::Taken);
    assert_eq!(s.take(&k, 1, 0), Take::Short(k[1].clone()));
    s.give_back(&k, 2, 1);
    assert_eq!(s.take(&k, 2, 1), Take::Taken);
    // Past its end a slice is spent, whatever is left.
    assert_eq!(s.take(&k[..1], 1, 100), Take::Short(key()));
}

#[test]
fn a_refusal_stands_briefly_and_returns_credit_only_the_same_lease() {
    let s = Slices::default();
    s.deny(&key(), 0, 5_000_000, false);
    assert!(matches!(s.take(&[key()], 1, 1), Take::Denied(..)));
    assert_eq!(s.take(&[key()], 1, 6_000_000), Take::Short(key()));
    s.install(&key(), 7, 10, 1_000_000_000);
    assert_eq!(s.take_up_to(&[key()], 4, 1, 10, 0), Ok((4, 1_000_000_000)));
    s.funded(99, &[key()], 1_000_000_000);
    s.returned(99, 3, 20);
    assert!(s.has(&key(), 9, 20, 0));
    // Renewed: what agents return from the old slice stays spendable until the
    // old slice's end, and is spent first.
    s.funded(100, &[key()], 500);
    s.install(&key(), 8, 1, 2_000_000_000);
    s.returned(100, 5, 30);
    assert!(s.has(&key(), 6, 30, 0));
    assert_eq!(s.take_up_to(&[key()], 2, 1, 40, 0), Ok((2, 500)), "carried units end first");
    assert!(s.has(&key(), 4, 499, 0));
    assert!(!s.has(&key(), 5, 500, 0), "carried units end with their slice");
}

/// An agent's lease is lent only units still spendable at `from`: units carried
/// from an earlier slice that end sooner stay for this node's own decisions, and a
/// slice that ends sooner is short (refilled, its rest returned with the refill).
#[test]
fn a_lease_is_lent_only_units_it_can_spend_for_a_while() {
    let s = Slices::default();
    s.funded(100, &[key()], 500);
    s.install(&key(), 8, 2, 2_000_000_000);
    s.returned(100, 5, 30);
    // The 5 carried units end at 500: not lent for a lease that must last past 600.
    assert!(!s.has(&key(), 3, 40, 600));
    assert!(s.has(&key(), 2, 40, 600));
    assert_eq!(s.take_up_to(&[key()], 4, 1, 40, 600), Ok((2, 2_000_000_000)), "the slice's own");
    assert_eq!(s.take_up_to(&[key()], 1, 1, 40, 600), Err(Take::Short(key())));
    // The node's own decisions spend them.
    assert_eq!(s.take(&[key()], 5, 40), Take::Taken);
    // A slice that ends before `from` lends nothing.
    s.install(&key(), 9, 10, 1_000);
    assert_eq!(s.take_up_to(&[key()], 1, 1, 40, 1_000), Err(Take::Short(key())));
    assert_eq!(s.take_up_to(&[key()], 1, 1, 40, 999), Ok((1, 1_000)));
}

/// A renewed slice is retired, not settled: what is left of it, and what agents give
/// back from leases it funded, stays spendable until its end; its lease is settled
/// with what is left as the end nears (nothing lapses here unreturned), once.
#[test]
fn a_retired_slice_is_spent_then_settled_with_what_is_left() {
    let s = Slices::default();
    s.install(&key(), 7, 10, 1_000);
    assert_eq!(s.take_up_to(&[key()], 4, 1, 10, 0), Ok((4, 1_000)));
    s.funded(50, &[key()], 1_000);
    s.retire(&key(), 20);
    s.install(&key(), 8, 5, 2_000);
    // The retired slice's 6 units and an agent's 3 given back: spent first.
    s.returned(50, 3, 30);
    assert!(s.has(&key(), 14, 40, 0));
    assert_eq!(s.take(&[key()], 2, 40), Take::Taken);
    assert!(s.settle_due(40, 100).is_empty(), "not yet near its end");
    assert_eq!(s.settle_due(950, 100), vec![(key(), 7, 7)]);
    assert!(s.settle_due(960, 100).is_empty(), "settled once");
    assert!(!s.has(&key(), 6, 960, 0), "no longer spendable here");
    assert!(s.has(&key(), 5, 960, 0), "the new slice's own");
    // Drain: every retired lease, whatever its end; one that lapsed here gives back 0.
    s.retire(&key(), 970);
    s.install(&key(), 9, 1, 3_000);
    assert_eq!(s.settle_due(2_500, Nanos::MAX), vec![(key(), 8, 0)]);
}
