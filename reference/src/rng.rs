//! A small seeded generator for randomised tests (SplitMix64), and the seed rule they
//! share: a fixed seed always, plus one from `REFERENCE_SEED` or the time of day,
//! printed so that a failing run can be replayed.

/// SplitMix64: tiny, fast, and good enough to drive test schedules.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi);
        match (hi - lo).checked_add(1) {
            Some(span) => lo + self.next_u64() % span,
            None => self.next_u64(),
        }
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }
}

/// The seeds a randomised test runs: a fixed one, then `REFERENCE_SEED` if set, else
/// one taken from the clock. Each is printed before it runs.
pub fn seeds(fixed: u64) -> Vec<u64> {
    let extra =
        std::env::var("REFERENCE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            #[allow(clippy::disallowed_methods)] // a seed, not a time the code decides on
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            t.map_or(1, |d| u64::from(d.subsec_nanos()) ^ d.as_secs())
        });
    vec![fixed, extra]
}
