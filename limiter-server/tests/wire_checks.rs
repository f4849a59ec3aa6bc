//! The fuzz targets' checks (`fuzz/fuzz_targets/common.rs`) in CI, where `cargo fuzz`
//! does not run: on a fresh server per input, every committed seed, mutations of
//! them (bytes flipped, cut, repeated), and random well-formed requests in runs that
//! reach the limits. Each answer must be consistent with its request (remaining
//! within the limit, a rejection naming a level of the request's chain, nothing
//! charged by a rejection) or a short error. A fixed seed and a random one, printed.

#[path = "../../fuzz/fuzz_targets/common.rs"]
mod common;

use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::limiter::v1 as pb;
use limiter_reference::rng::{Rng, seeds};
use prost::Message;

fn seed_files(target: &str) -> Vec<Vec<u8>> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/");
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(format!("{dir}{target}"))
        .unwrap()
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no seeds for {target}");
    out
}

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..rng.range(1, 4) {
        let len = b.len() as u64;
        match rng.range(0, 3) {
            0 if len > 0 => {
                let i = usize::try_from(rng.range(0, len - 1)).unwrap();
                b[i] ^= 1 << rng.range(0, 7);
            }
            1 if len > 0 => b.truncate(usize::try_from(rng.range(0, len - 1)).unwrap()),
            2 => {
                let i = usize::try_from(rng.range(0, len)).unwrap();
                let byte = u8::try_from(rng.range(0, 255)).unwrap();
                b.insert(i, byte);
            }
            _ => b.extend_from_slice(seed),
        }
    }
    b
}

fn pick<'a>(rng: &mut Rng, from: &[&'a str]) -> &'a str {
    from[usize::try_from(rng.range(0, from.len() as u64 - 1)).unwrap()]
}

/// A request a real caller (or a hostile one) might send.
fn request(rng: &mut Rng) -> pb::ShouldAllowRequest {
    let long = "k".repeat(300);
    // Mostly good requests (the limits are reached), some hostile ones.
    let tenant =
        if rng.chance(90) { pick(rng, &["t", "t", "other"]) } else { pick(rng, &["", "t\u{0}x"]) };
    let route = if rng.chance(95) { pick(rng, &["/a", "/a", "/b", "/c"]) } else { "" };
    let key = if rng.chance(95) { pick(rng, &["", "", "u1", "u2"]) } else { &long };
    let cost = match rng.range(0, 19) {
        0 => Some(0),
        1 => Some(u64::MAX),
        2..=5 => None,
        _ => Some(rng.range(1, 12)),
    };
    let (tenant, route, key) = (tenant.to_owned(), route.to_owned(), key.to_owned());
    pb::ShouldAllowRequest {
        tenant,
        route,
        key,
        cost,
        dry_run: rng.chance(10),
        report_later: false,
        permit_block: false,
        // A place in a concurrency level's line: none, asked for, or any number.
        turn: match rng.range(0, 5) {
            0 => Some(0),
            1 => Some(rng.range(1, u64::MAX - 1)),
            _ => None,
        },
    }
}

#[test]
fn every_answer_is_consistent_with_its_request() {
    let mut inputs = 0;
    let (mut admitted, mut rejected, mut errors) = (0, 0, 0);
    let mut codes = std::collections::BTreeMap::new();
    for seed in seeds(18) {
        eprintln!("wire_checks: seed {seed} (replay: REFERENCE_SEED={seed})");
        let mut rng = Rng::new(seed);
        for bytes in seed_files("should_allow") {
            for i in 0..60 {
                let data = if i == 0 { bytes.clone() } else { mutate(&mut rng, &bytes) };
                common::block_on(common::should_allow_input(&common::fresh(), &data));
                inputs += 1;
            }
        }
        for bytes in seed_files("should_rate_limit") {
            for i in 0..60 {
                let data = if i == 0 { bytes.clone() } else { mutate(&mut rng, &bytes) };
                if let Ok(req) = RateLimitRequest::decode(data.as_slice()) {
                    common::block_on(common::should_rate_limit(&common::fresh(), req));
                }
                inputs += 1;
            }
        }
        for bytes in seed_files("lease") {
            for i in 0..60 {
                let data = if i == 0 { bytes.clone() } else { mutate(&mut rng, &bytes) };
                if let Ok(req) = pb::LeaseRequest::decode(data.as_slice()) {
                    common::block_on(common::lease(&common::fresh(), req));
                }
                inputs += 1;
            }
        }
        // Runs of well-formed requests on one fresh server: limits are reached, so
        // rejections (and what they charge) are checked too.
        for _ in 0..20 {
            let s = common::fresh();
            common::block_on(async {
                for _ in 0..100 {
                    match common::should_allow(&s, request(&mut rng)).await {
                        Ok(true) => admitted += 1,
                        Ok(false) => rejected += 1,
                        Err(code) => {
                            errors += 1;
                            *codes.entry(format!("{code:?}")).or_insert(0) += 1;
                        }
                    }
                }
                let batch = pb::ShouldAllowBatchRequest {
                    requests: (0..20).map(|_| request(&mut rng)).collect(),
                };
                common::should_allow_batch(&s, batch).await;
            });
        }
    }
    eprintln!(
        "wire_checks: {inputs} inputs; in runs {admitted} admitted, {rejected} rejected, {errors} errors {codes:?}"
    );
    assert!(inputs > 1_000, "{inputs}");
    assert!(admitted > 500 && rejected > 300 && errors > 100, "{admitted} {rejected} {errors}");
}
