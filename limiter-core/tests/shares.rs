//! Fair shares of a divided level: the allocation rule's guarantees (property tests),
//! and a reserved class, a flood and a lower priority decided request by request
//! against a real level, judged in every one-second window.

use std::num::NonZeroU64;

use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::policy::{NameBounds, Policy, Request, from_yaml};
use limiter_core::share::{PPM, Pattern, ShareClass, ShareGate, Shares, allocate};
use limiter_core::{Limiter, Scope};
use proptest::prelude::*;

fn class(
    reserved: u64,
    weight: u64,
    max_borrow: Option<u64>,
    priority: u8,
    min_share: u64,
) -> ShareClass {
    ShareClass {
        name: format!("c{reserved}-{weight}-{priority}").into(),
        tenants: vec![Pattern::new("x")],
        routes: Vec::new(),
        keys: Vec::new(),
        reserved,
        weight: NonZeroU64::new(weight).unwrap(),
        max_borrow,
        priority,
        min_share,
    }
}

fn classes_strategy() -> impl Strategy<Value = (Vec<ShareClass>, Vec<u64>)> {
    prop::collection::vec(
        (
            0u64..400_000,
            1u64..5,
            prop::option::of(0u64..600_000),
            0u8..3,
            0u64..200_000,
            0u64..1_500_000,
        ),
        1..6,
    )
    .prop_filter_map("reservations within the level", |v| {
        let floors: u64 = v.iter().map(|c| c.0.max(c.4)).sum();
        (floors <= PPM).then(|| {
            let classes = v.iter().map(|&(r, w, b, p, m, _)| class(r, w, b, p, m)).collect();
            let demand = v.iter().map(|c| c.5).collect();
            (classes, demand)
        })
    })
}

fn cap(c: &ShareClass) -> u64 {
    c.max_borrow.map_or(PPM, |b| (c.reserved + b).min(PPM))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Never more than the level; nobody above its cap; every class gets its
    /// reservation and minimum share as far as it uses them (whatever the others'
    /// priorities and demand); when demand fits the level, everybody gets what it
    /// asks for; among classes of one priority left wanting, what is above their floor
    /// follows their weights.
    #[test]
    fn allocations_keep_their_promises((classes, demand) in classes_strategy()) {
        let a = allocate(&classes, &demand);
        prop_assert!(a.iter().sum::<u64>() <= PPM);
        for (i, c) in classes.iter().enumerate() {
            prop_assert!(a[i] <= cap(c), "class {i} above its cap: {a:?}");
            let floor = c.reserved.max(c.min_share).min(demand[i]).min(cap(c));
            prop_assert!(a[i] >= floor, "class {i} below its floor {floor}: {a:?}");
        }
        let wants: Vec<u64> = classes.iter().zip(&demand).map(|(c, d)| (*d).min(cap(c))).collect();
        if wants.iter().sum::<u64>() <= PPM {
            for i in 0..classes.len() {
                prop_assert!(a[i] >= wants[i], "class {i} short with room to spare: {a:?}");
            }
        } else {
            // The level is used up to rounding when some class still wants more.
            prop_assert!(a.iter().sum::<u64>() + classes.len() as u64 >= PPM.min(wants.iter().sum()) || a.iter().zip(&classes).all(|(x, c)| *x >= cap(c)));
        }
        // Two wanting classes of one priority, neither capped: their gains above
        // their floors are in proportion to their weights (within rounding).
        for i in 0..classes.len() {
            for j in 0..classes.len() {
                let (ci, cj) = (&classes[i], &classes[j]);
                if i == j || ci.priority != cj.priority || a[i] >= wants[i] || a[j] >= wants[j] {
                    continue;
                }
                let gi = a[i] - ci.reserved.max(ci.min_share).min(wants[i]);
                let gj = a[j] - cj.reserved.max(cj.min_share).min(wants[j]);
                let (wi, wj) = (ci.weight.get(), cj.weight.get());
                // gi / wi == gj / wj, to within a part per class.
                let lhs = i128::from(gi) * i128::from(wj);
                let rhs = i128::from(gj) * i128::from(wi);
                prop_assert!((lhs - rhs).abs() <= 8 * i128::from(wi * wj), "{a:?} {wants:?}");
            }
        }
    }
}

#[test]
fn a_higher_priority_takes_what_is_left_but_never_a_reservation_or_a_minimum() {
    let hi = class(0, 1, None, 2, 0);
    let lo = class(0, 1, None, 0, 100_000);
    let reserved = class(250_000, 1, None, 0, 0);
    let a = allocate(&[hi, lo, reserved], &[PPM * 5, PPM * 5, 200_000]);
    assert_eq!(a, [700_000, 100_000, 200_000]);
    // The reserved class idle: its reservation is lent.
    let a = allocate(&[class(0, 1, None, 2, 0), class(250_000, 1, None, 0, 0)], &[PPM * 5, 0]);
    assert_eq!(a, [PPM, 0]);
    // Nobody asks: everything divided by weight, within each cap.
    let a = allocate(&[class(0, 3, None, 0, 0), class(0, 1, Some(100_000), 0, 0)], &[0, 0]);
    // The second's fair part is above its cap: the rest goes to the first.
    assert_eq!(a, [900_000, 100_000]);
}

const POLICY: &str = "
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 1000/s, burst: 1000 }
  shares:
    critical: { tenants: [acme], reserved: 30% }
    best_effort: { weight: 1 }
tenants:
  default: {}
unknown_tenants: use_default
";

/// One simulated run: `load(t)` gives each tenant's rate (per second) from second
/// `t`; requests are spread evenly within each second. Returns per tenant, per
/// second, (admitted, asked).
fn run(
    policy: &Policy,
    tenants: &[&str],
    seconds: u64,
    load: impl Fn(u64, usize) -> u64,
) -> Vec<Vec<(u64, u64)>> {
    let limiter = Limiter::new(10_000);
    let rule = policy.global.as_ref().unwrap();
    let shares: &Shares = rule.shares.as_deref().unwrap();
    let mut gate = ShareGate::new(*rule.limit, shares);
    let mut out = vec![vec![(0, 0); seconds as usize]; tenants.len()];
    for s in 0..seconds {
        // Every request of this second, in time order.
        let mut arrivals: Vec<(Nanos, usize)> = Vec::new();
        for (i, _) in tenants.iter().enumerate() {
            let n = load(s, i);
            for k in 0..n {
                // Offsets differ per tenant so that arrivals interleave.
                let at = s * NANOS_PER_SEC + (k * NANOS_PER_SEC + (i as u64 * 7_919)) / n.max(1);
                arrivals.push((at, i));
            }
        }
        arrivals.sort_unstable();
        for (at, i) in arrivals {
            let req = Request::new(tenants[i], "/r");
            let chain = policy.resolve(&req, &NameBounds::default()).unwrap();
            let class = shares.class_of(req.tenant, req.route, req.key);
            out[i][s as usize].1 += 1;
            if gate.take(shares, class, 1, true, at).is_err() {
                continue;
            }
            if limiter.decide(&chain, at).admitted() {
                out[i][s as usize].0 += 1;
            } else {
                gate.give_back(class, 1, at, at);
            }
        }
    }
    out
}

#[test]
fn a_reserved_class_keeps_its_share_under_a_flood_lends_it_when_idle_and_gets_it_back() {
    let policy = from_yaml(POLICY, "p.yaml").unwrap();
    // acme: 200/s, idle in seconds 8 to 13; two flooders at 2500/s each (5x the level).
    let load = |s: u64, i: usize| match i {
        0 if (8..14).contains(&s) => 0,
        0 => 200,
        _ => 2_500,
    };
    let out = run(&policy, &["acme", "f1", "f2"], 20, load);
    let ttl = 2;
    for s in 0..20usize {
        let total: u64 = out.iter().map(|t| t[s].0).sum();
        // Never over the level: a bucket of 1000 refilling 1000/s.
        let bound = if s == 0 { 2_000 } else { 1_000 + 1 };
        assert!(total <= bound, "second {s}: {total} admitted");
        let acme = out[0][s];
        let flood = out[1][s].0 + out[2][s].0;
        let settled = |from: usize| s >= from + ttl;
        if settled(0) && !(8..14 + ttl).contains(&s) {
            // min(reserved, demand) = 200: every request of acme admitted.
            assert_eq!(acme.0, acme.1, "second {s}: acme {acme:?}, flood {flood}");
            // The flood gets the rest, less what is kept for acme: its measured
            // demand (which reads up to 5% high over slots of 100 ms) and a quarter.
            assert!(flood >= 1_000 - 200 * 105 / 100 * 5 / 4 - 1, "second {s}: flood {flood}");
        }
        if (8 + ttl..14).contains(&s) {
            // acme idle: its reservation lent to the flood.
            assert!(flood >= 990, "second {s}: flood {flood} while acme is idle");
        }
    }
}

const PRIORITIES: &str = "
version: 1
global:
  ceiling: { algorithm: fixed_window, limit: 1000, window: 1s }
  shares:
    gold: { tenants: [gold], priority: 10 }
    bronze: { tenants: [bronze], min_share: 10% }
tenants:
  default: {}
unknown_tenants: use_default
";

#[test]
fn a_lower_priority_gets_its_minimum_share_in_every_window() {
    let policy = from_yaml(PRIORITIES, "p.yaml").unwrap();
    let out = run(&policy, &["gold", "bronze"], 12, |_, _| 5_000);
    for (s, (g, b)) in out[0].iter().zip(&out[1]).enumerate().skip(1) {
        let (gold, bronze) = (g.0, b.0);
        assert!(gold + bronze <= 1_000, "second {s}: {gold} + {bronze}");
        assert!(bronze >= 100, "second {s}: bronze {bronze} below 10%");
        assert!(gold >= 850, "second {s}: gold {gold}: priority takes the rest");
    }
}

#[test]
fn shares_are_validated_with_line_and_field() {
    let bad = "
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100/s }
  shares:
    a: { tenants: [acme], reserved: 60% }
    b: { tenants: [nobody], reserved: 50%, weight: 0 }
    c: { priority: 101 }
    d: { min_share: 12.34567% }
    'bad name': {}
tenants:
  acme:
    limit: { algorithm: fixed_window, limit: 10, window: 1s }
    shares:
      x: { tenants: [acme] }
  default:
    limit: { algorithm: fixed_window, limit: 10, window: 1s }
    shares:
      y: { keys: [k] }
routes:
  /c:
    limit: { algorithm: concurrency, limit: 5, permit_ttl: 10s }
    shares:
      z: {}
  /n:
    shares:
      z: {}
unknown_tenants: use_default
";
    let e = from_yaml(bad, "p.yaml").unwrap_err().to_string();
    for want in [
        "p.yaml:7:",
        "global.shares.b.weight: must be greater than zero",
        "global.shares.c.priority: expected an integer from 0 to 100",
        "global.shares.d.min_share: expected a percentage",
        "global.shares.bad name: a class name is 1 to 64",
        "tenants.acme.shares.x.tenants: this level is one tenant's",
        "tenants.default.shares: the `default` tenant's limits",
        "routes./c.shares: shares divide a rate",
        "routes./n.shares: shares divide a limit",
    ] {
        assert!(e.contains(want), "missing {want:?} in:\n{e}");
    }
    let over = "
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100/s }
  shares:
    a: { tenants: [acme], reserved: 60 }
    b: { tenants: [beta], reserved: 50% }
unknown_tenants: reject
tenants:
  acme: {}
  beta: {}
";
    let e = from_yaml(over, "p.yaml").unwrap_err().to_string();
    assert!(e.contains("p.yaml:6:") && e.contains("reservations add up to 110%"), "{e}");
    let stray = over.replace("reserved: 60", "reserved: 10").replace("[beta]", "[gamma]");
    let e = from_yaml(&stray, "p.yaml").unwrap_err().to_string();
    assert!(e.contains("global.shares.b.tenants: matches nothing: `gamma`"), "{e}");
    // The same classes, well formed, load, with the implicit catch-all last.
    let good = over.replace("reserved: 60", "reserved: 10");
    let p = from_yaml(&good, "p.yaml").unwrap();
    let shares = p.global.as_ref().unwrap().shares.as_ref().unwrap();
    let names: Vec<&str> = shares.classes().iter().map(|c| &*c.name).collect();
    assert_eq!(names, ["a", "b", "other"]);
    assert_eq!(shares.classes()[0].reserved, 100_000);
    assert_eq!(shares.class_of("beta", "/r", None), 1);
    assert_eq!(shares.class_of("zed", "/r", None), 2);
    assert_eq!(Scope::Global, Scope::ALL[0]);
}

/// Leases report what their holders spent at each call, in lumps: a class's demand is
/// what it spent over the time it spent it. Two holders of `acme` each spend 40 a
/// second and report every 250 ms, 90 ms apart, beside two flooding holders at twice
/// the level; `acme`'s allocation must follow its demand with its quarter of headroom
/// in every slot once its first second (refused while its demand was unmeasured:
/// counted at once then) has passed, not jump when two reports fall in the meter's last
/// two slots (read at the call, they did: up to 131,000 ppm).
#[test]
fn a_class_whose_holders_report_in_lumps_is_allocated_by_its_rate() {
    let policy = from_yaml(POLICY, "p.yaml").unwrap();
    let rule = policy.global.as_ref().unwrap();
    let shares: &Shares = rule.shares.as_deref().unwrap();
    let mut gate = ShareGate::new(*rule.limit, shares);
    let (acme, flood) = (shares.class_of("acme", "/r", None), shares.class_of("f", "/r", None));
    let ms = 1_000_000;
    // (class, per second, first report, every): two of acme's holders, two floods.
    let holders = [(acme, 40, 5 * ms, 250 * ms), (acme, 40, 95 * ms, 250 * ms)];
    let floods = [(flood, 1_000, 60 * ms, 250 * ms), (flood, 1_000, 190 * ms, 250 * ms)];
    let mut reports: Vec<(Nanos, usize, u64, Nanos)> = Vec::new();
    for &(class, rate, first, every) in holders.iter().chain(&floods) {
        let mut at = first + every;
        while at < 5 * NANOS_PER_SEC {
            reports.push((at, class, rate * every / NANOS_PER_SEC, at - every));
            at += every;
        }
    }
    reports.sort_unstable();
    let (mut least, mut most) = (u64::MAX, 0);
    for (at, class, spent, since) in reports {
        gate.spent(class, spent, since, at);
        let _ = gate.room(shares, class, 0, at);
        if at >= 2 * NANOS_PER_SEC + 250 * ms {
            let ppm = gate.view(shares, at)[acme].ppm;
            (least, most) = (least.min(ppm), most.max(ppm));
        }
    }
    println!("acme allocated {least}-{most} ppm of the level");
    // 80 a second with a quarter more: 100, a tenth of the level (the meter reads up
    // to 5% high over its slots); never below the 80 it spends.
    assert!(most <= 100_000 + 5_000, "acme allocated up to {most} ppm of the level");
    assert!(least >= 80_000, "acme allocated {least} ppm of the level, below its demand");
}
