//! Owner lease accounting under random interleavings of acquire, spend, return,
//! expiry and message loss or duplication: pre-paid grants are never spent twice, a
//! refund never exceeds what was left unspent, no unit is spent after its lease's end,
//! and `level + outstanding` stays within the bucket's bound plus the documented
//! overdraft of `2 x rate x hold`.

use limiter_core::Limiter;
use limiter_core::lease::{LeaseBook, LeaseRecord, Settled};
use limiter_core::policy::{NameBounds, Request, from_yaml};
use proptest::prelude::*;

const RATE: u64 = 100; // per second
const BURST: u64 = 50;
const HOLD: u64 = 500_000_000; // 0.5 s
const SEC: u64 = 1_000_000_000;

#[derive(Debug, Clone)]
enum Op {
    Acquire { agent: usize, want: u64, lose_reply: bool },
    Spend { agent: usize, cost: u64 },
    Return { agent: usize, lose: bool, duplicate: bool },
    Advance(u64),
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3usize, 1..40u64, prop::bool::weighted(0.1))
            .prop_map(|(agent, want, lose_reply)| Op::Acquire { agent, want, lose_reply }),
        (0..3usize, 1..5u64).prop_map(|(agent, cost)| Op::Spend { agent, cost }),
        (0..3usize, prop::bool::weighted(0.1), prop::bool::weighted(0.1))
            .prop_map(|(agent, lose, duplicate)| Op::Return { agent, lose, duplicate }),
        (0..200_000_000u64).prop_map(Op::Advance),
        Just(Op::Expire),
    ]
}

#[derive(Debug, Default, Clone)]
struct Agent {
    lease: Option<(u64, u64)>, // (id, units granted)
    balance: u64,
    spent_of_lease: u64,
    deadline: u64,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn leases_are_never_spent_twice(ops in prop::collection::vec(op(), 1..300)) {
        let policy = from_yaml(
            &format!("version: 1\ntenants:\n  t:\n    limit: {{ algorithm: token_bucket, rate: {RATE}/s, burst: {BURST} }}\n"),
            "p.yaml",
        ).unwrap();
        let chain = policy.resolve(&Request::new("t", "/r"), &NameBounds::default()).unwrap();
        let limiter = Limiter::new(100);
        let mut book: LeaseBook<()> = LeaseBook::default();
        let mut agents = vec![Agent::default(); 3];
        let mut now = 0u64;
        let mut spends: Vec<(u64, u64)> = Vec::new();
        let mut refunded = 0u64;
        let mut debited = 0u64;
        for op in ops {
            match op {
                Op::Advance(dt) => now += dt,
                Op::Expire => { book.expire(now); }
                Op::Acquire { agent, want, lose_reply } => {
                    // The agent gives back what it holds first (return-and-replace).
                    let a = &mut agents[agent];
                    if let Some((id, _)) = a.lease.take() {
                        let unspent = std::mem::take(&mut a.balance);
                        if let Settled::Closed { record, refund } = book.settle(id, agent as u64, now, unspent) {
                            limiter.refund_grant(&chain, now, record.granted_at, record.hold, refund);
                            refunded += refund;
                        }
                    }
                    let send = now;
                    let g = limiter.grant(&chain, now, want, HOLD);
                    debited += g.units;
                    if g.units > 0 {
                        let id = book.open(LeaseRecord { holder: agent as u64, key: (), units: g.units, granted_at: g.granted_at, hold: g.hold });
                        if !lose_reply {
                            // The agent stops 1% early, counted from when it sent.
                            *a = Agent { lease: Some((id, g.units)), balance: g.units, spent_of_lease: 0, deadline: send + g.hold / 100 * 99 };
                        }
                    }
                }
                Op::Spend { agent, cost } => {
                    let a = &mut agents[agent];
                    if a.lease.is_some() && now < a.deadline && a.balance >= cost {
                        a.balance -= cost;
                        a.spent_of_lease += cost;
                        spends.push((now, cost));
                        let (id, _) = a.lease.expect("checked");
                        // Never spent after the owner's end of the lease.
                        if let Some(r) = book.get(id) {
                            prop_assert!(now < r.expires_at());
                        }
                    }
                }
                Op::Return { agent, lose, duplicate } => {
                    let a = &mut agents[agent];
                    if let Some((id, units)) = a.lease.take() {
                        let unspent = std::mem::take(&mut a.balance);
                        prop_assert_eq!(unspent + a.spent_of_lease, units);
                        if !lose {
                            for _ in 0..if duplicate { 2 } else { 1 } {
                                if let Settled::Closed { record, refund } = book.settle(id, agent as u64, now, unspent) {
                                    prop_assert!(refund <= record.units - a.spent_of_lease);
                                    limiter.refund_grant(&chain, now, record.granted_at, record.hold, refund);
                                    refunded += refund;
                                }
                            }
                        }
                    }
                }
            }
            // level + outstanding <= burst + overdraft. The overdraft is the refill of two
            // lease lifetimes: the bucket refills while a lease's units are out (one), and
            // a lease returned unspent gives back units whose refill it absorbed (two).
            let level = limiter.inspect(&chain, now)[0].remaining;
            let outstanding = book.live_units(now);
            prop_assert!(level + outstanding <= BURST + 2 * RATE * HOLD / SEC, "{level} + {outstanding}");
            let total_spent: u64 = spends.iter().map(|s| s.1).sum();
            prop_assert!(total_spent <= debited - refunded, "spent {total_spent} of net {}", debited - refunded);
        }
        // Over any interval, spends stay within burst + rate x (interval + hold).
        for i in 0..spends.len() {
            let mut sum = 0u128;
            for s in &spends[i..] {
                sum += u128::from(s.1);
                let dt = u128::from(s.0 - spends[i].0);
                prop_assert!(sum * u128::from(SEC) <= u128::from(BURST) * u128::from(SEC) + u128::from(RATE) * (dt + u128::from(HOLD)));
            }
        }
    }
}
