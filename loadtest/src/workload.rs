//! What each simulated gateway sends: arrival times and request contents, drawn from
//! a seeded generator so that a scenario always offers the same requests.

use std::time::Duration;

use crate::scenario::{Arrivals, Scenario, Skew};

/// The scenario's seeded generator: SplitMix64, the one the reference's randomised
/// tests use (`limiter_reference::rng`), started from a scenario's seed.
#[derive(Debug, Clone)]
pub struct Rng(limiter_reference::rng::Rng);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(limiter_reference::rng::Rng::new(seed ^ 0x5851_F42D_4C95_7F2D))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    #[allow(clippy::cast_precision_loss)]
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Picks an index by cumulative weights.
#[derive(Debug, Clone)]
pub struct Picker {
    cumulative: Vec<f64>,
}

impl Picker {
    /// From weights (at least one, not all zero).
    pub fn new(weights: &[f64]) -> Self {
        let mut total = 0.0;
        let cumulative = weights
            .iter()
            .map(|w| {
                total += w;
                total
            })
            .collect::<Vec<_>>();
        Self { cumulative: cumulative.into_iter().map(|c| c / total).collect() }
    }

    /// An index, with its weight's probability.
    pub fn pick(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cumulative.partition_point(|&c| c <= u).min(self.cumulative.len() - 1)
    }

    /// Weights of a tenant skew over `n` tenants.
    #[allow(clippy::cast_precision_loss)]
    pub fn skew(n: usize, skew: Skew, zipf_s: f64, hot_share: f64) -> Self {
        let w: Vec<f64> = match skew {
            Skew::Uniform => vec![1.0; n],
            Skew::Zipf => (1..=n).map(|k| 1.0 / (k as f64).powf(zipf_s)).collect(),
            Skew::Hot if n == 1 => vec![1.0],
            Skew::Hot => (0..n)
                .map(|i| if i == 0 { hot_share } else { (1.0 - hot_share) / (n - 1) as f64 })
                .collect(),
        };
        Self::new(&w)
    }
}

/// One request to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    /// When, from the start of the run.
    pub at: Duration,
    /// Tenant index.
    pub tenant: u32,
    /// Route index.
    pub route: u16,
    /// Key index within the tenant (`u32::MAX`: no key).
    pub key: u32,
    /// Units.
    pub cost: u64,
}

/// No key.
pub const NO_KEY: u32 = u32::MAX;

/// The requests of gateway `gateway` of the scenario, in time order. Each gateway
/// offers its share of the rate (1/`gateways`) as an independent stream, so that the
/// gateways together offer the scenario's rate; bursts are split evenly.
pub fn plan(s: &Scenario, gateway: usize) -> Vec<Planned> {
    let mut rng = Rng::new(s.seed.wrapping_mul(1_000_003).wrapping_add(gateway as u64));
    let tenants = s.tenants.list();
    let tenant_pick =
        Picker::skew(tenants.len(), s.tenants.skew, s.tenants.zipf_s, s.tenants.hot_share);
    let route_pick = Picker::new(&s.routes.iter().map(|r| f64::from(r.weight)).collect::<Vec<_>>());
    let n = s.gateways as f64;
    let mut out = Vec::new();
    let mut start = Duration::ZERO;
    let draw = |rng: &mut Rng, at: Duration, out: &mut Vec<Planned>| {
        let route = route_pick.pick(rng);
        let key = if s.tenants.keys == 0 {
            NO_KEY
        } else {
            (rng.next_u64() % s.tenants.keys as u64) as u32
        };
        out.push(Planned {
            at,
            tenant: tenant_pick.pick(rng) as u32,
            route: route as u16,
            key,
            cost: s.routes[route].cost,
        });
    };
    for p in &s.phases {
        if p.burst > 0 {
            let share = p.burst / s.gateways as u64
                + u64::from((gateway as u64) < p.burst % s.gateways as u64);
            for _ in 0..share {
                draw(&mut rng, start, &mut out);
            }
            continue;
        }
        let rate = p.rate / n;
        let end = start + p.length.0;
        let mut t = start.as_secs_f64();
        loop {
            let gap = match s.arrivals {
                Arrivals::Fixed => 1.0 / rate,
                Arrivals::Poisson => -(1.0 - rng.unit()).ln() / rate,
            };
            t += gap;
            let at = Duration::from_secs_f64(t);
            if at >= end {
                break;
            }
            draw(&mut rng, at, &mut out);
        }
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_puts_the_first_tenant_first() {
        let p = Picker::skew(100, Skew::Zipf, 1.1, 0.0);
        let mut rng = Rng::new(3);
        let mut counts = vec![0u32; 100];
        for _ in 0..100_000 {
            counts[p.pick(&mut rng)] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[10] && counts[10] > counts[99]);
        // Zipf(1.1) over 100: the first takes 1/H(100, 1.1) = 23.4%.
        assert!((22_400..24_400).contains(&counts[0]), "{}", counts[0]);
    }

    #[test]
    fn hot_tenant_takes_its_share() {
        let p = Picker::skew(10, Skew::Hot, 0.0, 0.6);
        let mut rng = Rng::new(9);
        let hot = (0..50_000).filter(|_| p.pick(&mut rng) == 0).count();
        assert!((29_000..31_000).contains(&hot), "{hot}");
    }
}
