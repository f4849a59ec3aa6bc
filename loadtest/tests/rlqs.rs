//! Envoy's Rate Limit Quota Service, measured with simulated Envoys
//! (`loadtest::rlqs`) against a server in this process, on one clock.
//!
//! Ten Envoys share 30 buckets (one route each, token buckets of Zipf-skewed
//! limits), each bucket offered twice its limit, split among the Envoys 1:2:...:10
//! (each Envoy's requests to a bucket evenly spaced, from a seeded phase of their own);
//! half way through, the split is reversed (10:9:...:1). A second fleet moves half
//! of its demand (five Envoys at three parts each and five at one, then the other
//! way round). The reversed fleet runs again with Envoys 1.33 and later (a
//! changed bucket starts with the old one's share of tokens, not full), on a server
//! told so (`rlqs.envoys_carry_tokens`). Judged per
//! bucket by the
//! independent reference (`limiter-reference`) at zero tolerance: every admission
//! may be placed no earlier than when the assignment that admitted it was sent
//! (paid, in the server's round, before it was sent) and no later than when it was
//! admitted. Beside it, the share of what the reference admits of the same arrivals
//! that the fleet admits after a warm-up (target 95%): asserted at the target from
//! the warm-up to the swing and from two reporting intervals after it to the end,
//! reported over the whole run (the swing included), and each Envoy's admitted share
//! against its demand share, before the swing and from two reporting intervals after
//! it (target within 10%, reported: README "Envoy RLQS" says which targets are not
//! met yet).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use limiter_core::clock::{Clock, MonotonicClock, NANOS_PER_SEC, Nanos};
use limiter_reference::judge::{Spend, judge};
use limiter_reference::{Level, Spec};
use loadtest::rlqs::{Blanket, Envoy, EnvoyConfig, bucket_id, bucket_name};

const ENVOYS: usize = 10;
const BUCKETS: usize = 30;
/// All buckets' limits together, per second.
const TOTAL: f64 = 1_500.0;
const RUN: Duration = Duration::from_secs(16);
const SWING_AT: Duration = Duration::from_secs(8);
const WARM_UP: Duration = Duration::from_secs(2);
const REPORTING: Duration = Duration::from_millis(500);
/// Seeds each (bucket, Envoy) stream's phase: where in its first interval its
/// arrivals start.
const PHASE_SEED: u64 = 1;
/// How much earlier than an Envoy received an assignment the server may have paid
/// for it (its round's grant, then the send): generous for loopback.
const DELIVERY: Nanos = 200_000_000;

/// The report's two phases, by their index: before the swing (from the warm-up) and
/// after it (shares from two reporting intervals after it).
const PHASES: [&str; 2] = ["before the swing", "after it"];

/// The buckets by size (their limits fall with their index), for the report.
const SIZES: [(&str, std::ops::Range<usize>); 3] =
    [("three largest", 0..3), ("next seven", 3..10), ("twenty smallest", 10..BUCKETS)];

fn limits() -> Vec<u64> {
    let w: Vec<f64> = (0..BUCKETS).map(|i| 1.0 / ((i + 1) as f64).powf(1.1)).collect();
    let sum: f64 = w.iter().sum();
    w.iter().map(|x| ((TOTAL * x / sum).round() as u64).max(1)).collect()
}

fn policy(limits: &[u64]) -> String {
    let mut p = String::from("version: 1\ntenants:\n  fleet:\n    routes:\n");
    for (i, l) in limits.iter().enumerate() {
        let _ = writeln!(p, "      /b{i}: {{ algorithm: token_bucket, rate: {l}/s, burst: {l} }}");
    }
    p
}

struct Server {
    addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
    _running: limiter_server::Running,
}

/// A server on `policy`; `carry`: told its Envoys carry tokens into a changed bucket
/// (`rlqs.envoys_carry_tokens`).
async fn server(policy: &str, clock: Arc<dyn Clock>, carry: bool) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, policy).unwrap();
    let config = limiter_server::config::ServerConfig::load_with_env(
        None,
        [
            ("LIMITER__POLICY_FILE".to_owned(), path.display().to_string()),
            ("LIMITER__SHUTDOWN__DRAIN_DELAY_MS".to_owned(), "0".to_owned()),
            ("LIMITER__RLQS__ENVOYS_CARRY_TOKENS".to_owned(), carry.to_string()),
        ],
    )
    .unwrap();
    let running =
        limiter_server::Server::with_clock(config, clock).unwrap().spawn_local().await.unwrap();
    Server { addr: running.grpc, _dir: dir, _running: running }
}

/// What [`exactness`] found.
struct Exactness {
    /// Units admitted beyond the limits, all buckets.
    over: u64,
    /// The buckets over, and when.
    worst: String,
    /// Admissions by a blanket rule or a no-assignment behaviour.
    blanket: u64,
    /// Token buckets the Envoys created.
    created: u64,
}

/// Judges each bucket (its label, id, limit a second and the Envoys sharing it) by
/// the reference at zero tolerance: each admission placed between the send of the
/// assignment that admitted it and its own instant.
fn exactness(
    envoys: &[Arc<Envoy>],
    buckets: &[(
        String,
        &limiter_proto::envoy::service::rate_limit_quota::v3::BucketId,
        u64,
        &[usize],
    )],
    start: Nanos,
) -> Exactness {
    let logs: Vec<_> = envoys.iter().map(|e| e.logs()).collect();
    let mut out = Exactness { over: 0, worst: String::new(), blanket: 0, created: 0 };
    for (label, id, l, sharing) in buckets {
        let name = bucket_name(id);
        let mut spends = Vec::new();
        for log in sharing.iter().filter_map(|&e| logs[e].get(&name)) {
            out.blanket += log.admitted_blanket;
            out.created += log.buckets_created;
            spends.extend(log.admitted.iter().map(|a| Spend {
                from: a.bucket_since.saturating_sub(DELIVERY),
                to: a.at,
                cost: 1,
            }));
        }
        let spec = Spec::TokenBucket { amount: *l, period: NANOS_PER_SEC, burst: *l };
        let v = judge(spec, &spends, NANOS_PER_SEC);
        if v.overshoot > 0 {
            let per: Vec<_> =
                v.by_window.iter().map(|&(w, u)| ((w - start) / NANOS_PER_SEC, u)).collect();
            let _ = write!(
                out.worst,
                " {label} (limit {l}/s): {} over, per second {per:?};",
                v.overshoot
            );
        }
        out.over += v.overshoot;
    }
    out
}

/// One decision: bucket, Envoy, when, admitted.
type Arrival = (usize, usize, Nanos, bool);

/// The fleet's demand split reversed half way: Envoy `e` offers `e + 1` parts, then
/// `10 - e`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_envoys_share_zipf_buckets_within_their_limits_by_demand() {
    fleet(reversed, Envoys::StartFull).await;
}

/// Envoy `e` offers `e + 1` parts, then `10 - e`.
fn reversed(e: usize, swung: bool) -> f64 {
    if swung { (ENVOYS - e) as f64 } else { (e + 1) as f64 }
}

/// Envoy `e` offers three parts and the others one, then the other way round.
fn half_moved(e: usize, swung: bool) -> f64 {
    if (e < ENVOYS / 2) != swung { 3.0 } else { 1.0 }
}

/// The reversed fleet of Envoys 1.33 and later, which start a changed token bucket
/// with the old one's share of tokens, on a server told so
/// (`rlqs.envoys_carry_tokens`): a change is paid for only the capacity it adds.
/// (Not told, the server pays for a full bucket at each change, as it must for
/// older Envoys, and the tokens the share leaves behind are paid for and unspent.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_that_carry_their_tokens_share_zipf_buckets_within_their_limits() {
    fleet(reversed, Envoys::Carry).await;
}

/// How the fleet's Envoys start a changed token bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Envoys {
    /// Full (Envoy before 1.33).
    StartFull,
    /// With the old one's share of its tokens (Envoy 1.33 and later).
    Carry,
}

/// Half of the fleet's demand moves: the first five Envoys offer three parts each
/// and the last five one, then the other way round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swing_of_half_the_demand_is_rebalanced_within_the_limits() {
    fleet(half_moved, Envoys::StartFull).await;
}

/// One of this file's tests at a time: each runs a server and a fleet (the drain
/// test three server processes), and two at once share the machine's two cores. A
/// fleet measured beside the drain test (the suite's default) once put an Envoy's
/// share 31% and 43% off its demand share, where alone it is within 14%.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs the fleet with Envoy `e` offered `weight(e, swung)` parts of each bucket's
/// twice its limit, and judges it (see the module's documentation).
async fn fleet(weight: fn(usize, bool) -> f64, envoys_are: Envoys) {
    let _one = ONE_AT_A_TIME.lock().await;
    let limits = limits();
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let carrying = envoys_are == Envoys::Carry;
    let server = server(&policy(&limits), clock.clone(), carrying).await;
    let envoys: Vec<Arc<Envoy>> = (0..ENVOYS)
        .map(|_| {
            let config = EnvoyConfig {
                urls: vec![format!("http://{}", server.addr)],
                domain: "fleet".into(),
                reporting_interval: REPORTING,
                no_assignment: Blanket::Deny,
                expired: None,
                carries_tokens: carrying,
            };
            Envoy::start(config, clock.clone()).unwrap()
        })
        .collect();
    let ids: Vec<_> = (0..BUCKETS).map(|b| bucket_id(&[("route", &format!("/b{b}"))])).collect();
    let all = |swung: bool| (0..ENVOYS).map(|e| weight(e, swung)).sum::<f64>();

    // Open loop: every millisecond each (bucket, Envoy) stream offers what it owes,
    // from a phase of its own (seeded). Started together at 0, the streams of whole
    // limits and weights fell into step: every slow bucket of the Envoy whose demand
    // fell tenfold offered its first request after the swing in the same
    // millisecond, 2.5 s after it, which no fleet of independent clients does.
    let mut phases = loadtest::workload::Rng::new(PHASE_SEED);
    let mut owed: Vec<f64> = (0..BUCKETS * ENVOYS).map(|_| phases.unit()).collect();
    let mut arrivals: Vec<Arrival> = Vec::new();
    let start = clock.now();
    let mut last = start;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    while clock.now() - start < RUN.as_nanos() as u64 {
        tick.tick().await;
        let now = clock.now();
        let dt = (now - last) as f64 / NANOS_PER_SEC as f64;
        last = now;
        let swung = now - start >= SWING_AT.as_nanos() as u64;
        for b in 0..BUCKETS {
            for e in 0..ENVOYS {
                let o = &mut owed[b * ENVOYS + e];
                *o += 2.0 * limits[b] as f64 * weight(e, swung) / all(swung) * dt;
                while *o >= 1.0 {
                    *o -= 1.0;
                    let at = clock.now();
                    arrivals.push((b, e, at, envoys[e].decide(&ids[b])));
                }
            }
        }
    }
    for e in &envoys {
        e.stop();
    }

    let all_envoys: Vec<usize> = (0..ENVOYS).collect();
    let buckets: Vec<_> =
        (0..BUCKETS).map(|b| (format!("/b{b}"), &ids[b], limits[b], &all_envoys[..])).collect();
    let exact = exactness(&envoys, &buckets, start);
    let (over, worst, created) = (exact.over, &exact.worst, exact.created);
    let mut report = String::new();
    assert_eq!(exact.blanket, 0, "every admission is under an assignment (no-assignment: deny)");

    // Use of the limits after the warm-up, against the reference deciding the same
    // arrivals one by one.
    let warm = start + WARM_UP.as_nanos() as u64;
    let mut levels: HashMap<usize, Level> = HashMap::new();
    let (mut ideal, mut got) = (0u64, 0u64);
    // Use before the swing, in the four reporting intervals after it (while the
    // Envoys' reports show it and their buckets change) and after those, apart:
    // (the reference's, the fleet's).
    let mut use_by_phase = [(0u64, 0u64); 3];
    let transition = 4 * REPORTING;
    let steady = start + (SWING_AT + transition).as_nanos() as u64;
    let mut by_bucket = vec![(0u64, 0u64); BUCKETS];
    // Each Envoy's (offered, admitted), before the swing and after it.
    let mut by_envoy = [[(0u64, 0u64); ENVOYS]; 2];
    // Before the swing and after it, by the size of the bucket: (offered, admitted)
    // per Envoy.
    let mut by_size = [[[(0u64, 0u64); ENVOYS]; SIZES.len()]; 2];
    // Shares are judged from two reporting intervals after the swing.
    let settled = start + (SWING_AT + 2 * REPORTING).as_nanos() as u64;
    let swing = start + SWING_AT.as_nanos() as u64;
    // Use from then to the end (the swing re-balanced).
    let mut rebalanced = (0u64, 0u64);
    for &(b, e, at, ok) in &arrivals {
        let spec = Spec::TokenBucket { amount: limits[b], period: NANOS_PER_SEC, burst: limits[b] };
        let fits = levels.entry(b).or_insert_with(|| Level::new(spec)).try_take(at, 1);
        if at >= warm {
            ideal += u64::from(fits);
            got += u64::from(ok);
            let p = usize::from(at >= swing) + usize::from(at >= steady);
            use_by_phase[p].0 += u64::from(fits);
            use_by_phase[p].1 += u64::from(ok);
            by_bucket[b].0 += u64::from(fits);
            by_bucket[b].1 += u64::from(ok);
        }
        if at >= settled {
            rebalanced.0 += u64::from(fits);
            rebalanced.1 += u64::from(ok);
        }
        let phase = match at {
            t if t >= warm && t < swing => Some(0),
            t if t >= settled => Some(1),
            _ => None,
        };
        if let Some(p) = phase {
            by_envoy[p][e].0 += 1;
            by_envoy[p][e].1 += u64::from(ok);
            let g = SIZES.iter().position(|(_, r)| r.contains(&b)).unwrap();
            by_size[p][g][e].0 += 1;
            by_size[p][g][e].1 += u64::from(ok);
        }
    }
    let used = got as f64 / ideal as f64;
    let (reports, streams) =
        envoys.iter().map(|e| e.counts()).fold((0, 0), |a, c| (a.0 + c.0, a.1 + c.1));
    let _ = writeln!(
        report,
        "decisions {}, admitted after warm-up {got} of the reference's {ideal} ({:.1}%), units \
         over the limits {over}; token buckets created {created}; reports {reports}, streams {streams}",
        arrivals.len(),
        used * 100.0
    );
    let pct = |(i, g): (u64, u64)| g as f64 * 100.0 / i.max(1) as f64;
    let _ = writeln!(
        report,
        "use from the warm-up to the swing {:.1}%, in the {} s after it {:.1}%, after those \
         {:.1}%; from two reporting intervals after the swing {:.1}%",
        pct(use_by_phase[0]),
        transition.as_secs_f64(),
        pct(use_by_phase[1]),
        pct(use_by_phase[2]),
        pct(rebalanced)
    );
    let per: Vec<String> = by_bucket
        .iter()
        .zip(&limits)
        .map(|((i, g), l)| format!("{l}/s {:.0}%", *g as f64 * 100.0 / (*i).max(1) as f64))
        .collect();
    let _ = writeln!(report, "use per bucket: {}", per.join(", "));
    // Where the units paid for went unspent at the Envoys, after the warm-up, by the
    // size of the bucket: refill a full bucket could not hold, tokens left in buckets
    // an assignment replaced, and requests refused under `DENY_ALL` (all of an
    // Envoy's demand while it held nothing), each in units of the limits.
    let logs: Vec<_> = envoys.iter().map(|e| e.logs()).collect();
    let end = start + RUN.as_nanos() as u64;
    for (phase, (from, to)) in PHASES.into_iter().zip([(warm, swing), (swing, end)]) {
        let secs = (to - from) as f64 / NANOS_PER_SEC as f64;
        let within = |at: Nanos| at >= from && at < to;
        let mut lost = String::new();
        for (label, range) in SIZES {
            let (mut refill, mut left, mut denied) = (0.0, 0.0, 0usize);
            for b in range.clone() {
                for log in logs.iter().filter_map(|l| l.get(&bucket_name(&ids[b]))) {
                    refill +=
                        log.refill_lost.iter().filter(|x| within(x.0)).map(|x| x.1).sum::<f64>();
                    left += log.discarded.iter().filter(|x| within(x.0)).map(|x| x.1).sum::<f64>();
                    denied += log.denied_blanket.iter().filter(|&&at| within(at)).count();
                }
            }
            let limit = range.map(|b| limits[b] as f64).sum::<f64>() * secs / 100.0;
            let _ = write!(
                lost,
                " {label} {:.1}% / {:.1}% / {:.1}%;",
                refill / limit,
                left / limit,
                denied as f64 / limit
            );
        }
        let _ = writeln!(
            report,
            "unspent at the Envoys {phase} (refill while full / left in replaced buckets / \
             refused under DENY_ALL, of the limits):{lost}"
        );
    }
    let mut off_by = [0.0f64; 2];
    let percents = |offs: &[f64]| -> String {
        offs.iter().map(|d| format!("{:+.1}%", d * 100.0)).collect::<Vec<_>>().join(" ")
    };
    for (p, phase) in PHASES.iter().enumerate() {
        let offs = shares_off(&by_envoy[p]);
        off_by[p] = offs.iter().fold(0.0, |m, d| m.max(d.abs()));
        let line = percents(&offs);
        let _ = writeln!(report, "each Envoy's share against its demand share, {phase}: {line}");
    }
    for (p, phase) in PHASES.iter().enumerate() {
        for (g, (label, _)) in SIZES.iter().enumerate() {
            let line = percents(&shares_off(&by_size[p][g]));
            let _ = writeln!(report, "  {phase}, in the {label}: {line}");
        }
    }
    let _ = writeln!(
        report,
        "targets (README \"Envoy RLQS\"): use at least 95% over the run, each share within \
         10%; measured {:.1}%, worst {:.1}% before the swing and {:.1}% after",
        used * 100.0,
        off_by[0] * 100.0,
        off_by[1] * 100.0
    );
    println!("{report}");
    // What the design promises exactly: nothing admitted beyond the limits.
    assert_eq!(over, 0, "{worst}\n{report}");
    // And the fleet is served at all (every Envoy admits under its assignments),
    // its use and shares no worse than this design has shown (floors against
    // regressions; the targets over the run, 95% and 10%, are reported above).
    for (e, (before, after)) in by_envoy[0].iter().zip(&by_envoy[1]).enumerate() {
        let a = [before.1, after.1];
        assert!(a[0] > 0 && a[1] > 0, "Envoy {e} admitted nothing in a phase\n{report}");
    }
    assert!(used >= USE_FLOOR, "use below {USE_FLOOR}\n{report}");
    // The design's target for a fleet at twice its limits, met before the swing and
    // again from two reporting intervals after it (the swing re-balanced).
    let before_swing = pct(use_by_phase[0]) / 100.0;
    assert!(before_swing >= STEADY_USE, "use before the swing below {STEADY_USE}\n{report}");
    let after_swing = pct(rebalanced) / 100.0;
    assert!(
        after_swing >= STEADY_USE,
        "use from two reporting intervals after the swing below {STEADY_USE}\n{report}"
    );
    assert!(
        off_by.iter().all(|&o| o <= SHARE_BOUND),
        "a share more than {SHARE_BOUND} off its demand share\n{report}"
    );
}

/// Each Envoy's admitted share against its offered share, less one, from its
/// (offered, admitted) counts.
fn shares_off(counts: &[(u64, u64)]) -> Vec<f64> {
    let offered: u64 = counts.iter().map(|c| c.0).sum();
    let admitted: u64 = counts.iter().map(|c| c.1).sum();
    counts
        .iter()
        .map(|&(o, a)| (a as f64 / admitted as f64) / (o as f64 / offered as f64) - 1.0)
        .collect()
}

/// The least use (admitted of what the reference admits) the fleet tests accept
/// over the whole run, the swing included: below what they measure (95.2-97.5% in 30
/// runs of the three fleets on 2026-12-06's thirteenth session's code; 92.3-93.3% for
/// Envoys 1.33+ on a server not told they carry tokens, on earlier code), above what
/// a broken demand estimate gives (an Envoy reporting less often than every round
/// once read as idle: 28%) or what a smallest bucket of one token gave (81-83%).
const USE_FLOOR: f64 = 0.9;

/// The least use from the warm-up to the swing (the fleet steady at twice its
/// limits), and from two reporting intervals after the swing to the end (the swing
/// re-balanced within two reports): the design's target, 95%. Measured 96.9-101.4%
/// before the swing and 96.3-97.9% after it in 30 runs of the three fleets (ten of
/// each, four of them as the suite runs the file; 2026-12-06's thirteenth session).
/// Over the whole run the 2 s after the swing (78.0-83.6%) bring it to 95.2-97.5%,
/// against [`USE_FLOOR`].
const STEADY_USE: f64 = 0.95;

/// The most an Envoy's admitted share may be off its demand share (either phase) in the
/// fleet tests (the target, 10%, is reported and judged over many runs in
/// BENCHMARKS.md: a share is a count of whole requests, and the smallest Envoy's varies
/// by 3-4% from run to run, one standard deviation): above what the current code
/// measures (at most 12.1% in 114 runs of the three fleets, within 10% in 113, on
/// 2026-12-07's twenty-seventh and twenty-eighth sessions), what the code before it
/// measured (at most 11.5% in 297 runs, within 10% in 296, and within 10% in 32 of the
/// carrying fleet alone, on the twenty-fifth to twenty-seventh sessions) and the code
/// before that (at most 11.9% in 273 runs, within 10% in 266), below what earlier code
/// gave (16.0% in 24 runs of the sixteenth session's, 22.3% in 108 of the
/// fourteenth's), what dividing without demand would give (an even split leaves the
/// Envoy of ten parts 40% short, the Envoy of one part twice its share) or what a
/// smallest bucket of one token gave (22-65%). 20% until the twenty-sixth session.
const SHARE_BOUND: f64 = 0.15;

/// One Envoy's stream of 10,000 buckets, against a server process: every bucket is
/// assigned within the stream's cap (the default, 10,000), and the server's memory
/// a bucket and CPU a report are printed (the release figures are `loadtest rlqs`'s,
/// in BENCHMARKS.md; this build is a test build).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_ten_thousand_buckets_is_served_whole() {
    let _one = ONE_AT_A_TIME.lock().await;
    loadtest::procs::use_binary(std::path::PathBuf::from(env!("CARGO_BIN_EXE_loadtest")));
    let dir = tempfile::tempdir().unwrap();
    let s = loadtest::rlqs::scale(10_000, 3, dir.path()).await.unwrap();
    println!("{}", s.markdown());
    assert_eq!(s.assigned, 10_000);
    assert!(s.reports >= 2, "the Envoy reported while measured: {s:?}");
}

/// Domains (tenants) of the drain test, each with these routes' token buckets, a
/// second; each shared by this many Envoys, offered twice its limit split 1:2:3:4.
const DRAIN_DOMAINS: usize = 6;
const DRAIN_LIMITS: [u64; 4] = [40, 60, 90, 150];
const DRAIN_ENVOYS: usize = 4;
const DRAIN_RUN: Duration = Duration::from_secs(10);
const DRAIN_AT: Duration = Duration::from_secs(4);
/// Longer than a round and its slack, so that an Envoy may reconnect well after
/// what the drained node's last round paid for.
const DRAIN_REPORTING: Duration = Duration::from_millis(1_500);

/// Three server processes; each domain's Envoys open their streams on different
/// nodes (the cluster's endpoints in turn), so streams on every node pay for
/// tenants owned here and elsewhere. The owner of the first domain is stopped with
/// SIGTERM while the fleet is at twice its limits: it hands its counters to their
/// next owners, its streams pay their Envoys' assignments until they have
/// reconnected, and its Envoys open their streams on the next endpoint and subscribe
/// again. Judged per bucket by the reference at zero tolerance over the whole run,
/// the drain included; every Envoy is served again after it, and nothing is
/// admitted by a blanket rule (no free pass while it reconnects).
///
/// What this cannot see: the reference finds an admission beyond what was paid
/// only where the fleet uses all of a limit. At this fleet's use (91-95%) a
/// bucket's unspent burst absorbs an Envoy's unpaid time after the drain: with the
/// drained node's last payment taken out, two runs also showed 0 over. That
/// payment (the held rate until the Envoy has reconnected and been assigned again)
/// is exact by construction, not by this measurement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_nodes_envoys_subscribe_elsewhere_with_nothing_over_the_limits() {
    use limiter_proto::limiter::v1 as pb;
    let _one = ONE_AT_A_TIME.lock().await;
    loadtest::procs::use_binary(std::path::PathBuf::from(env!("CARGO_BIN_EXE_loadtest")));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policies.yaml");
    let mut p = String::from("version: 1\non_limiter_failure: { mode: fail_closed }\ntenants:\n");
    for d in 0..DRAIN_DOMAINS {
        let _ = writeln!(p, "  d{d}:\n    routes:");
        for (r, l) in DRAIN_LIMITS.iter().enumerate() {
            let _ =
                writeln!(p, "      /b{r}: {{ algorithm: token_bucket, rate: {l}/s, burst: {l} }}");
        }
    }
    std::fs::write(&path, p).unwrap();
    let mut nodes = loadtest::procs::Node::start_all(3, &path, &[]).await.unwrap();
    let domains: Vec<String> = (0..DRAIN_DOMAINS).map(|d| format!("d{d}")).collect();
    let mut topo = pb::rate_limiter_client::RateLimiterClient::new(
        loadtest::target::channel(&nodes[0].url()).unwrap(),
    );
    let mut owners = Vec::new();
    for _ in 0..200 {
        let t = topo.topology(pb::TopologyRequest { tenants: domains.clone() }).await;
        if let Some(t) = t.ok().map(tonic::Response::into_inner)
            && t.members.len() == 3
            && t.ready
        {
            owners = t.owners;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(owners.len(), DRAIN_DOMAINS, "the ring of three formed");
    let drained = nodes.iter().position(|n| n.id == owners[0]).unwrap();
    let moved: Vec<usize> = (0..DRAIN_DOMAINS).filter(|&d| owners[d] == owners[0]).collect();

    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    // Envoy `d * DRAIN_ENVOYS + e` serves domain d; its stream opens on node
    // (d + e) % 3 first, then the next.
    let mut first = Vec::new();
    let envoys: Vec<Arc<Envoy>> = (0..DRAIN_DOMAINS * DRAIN_ENVOYS)
        .map(|i| {
            let (d, e) = (i / DRAIN_ENVOYS, i % DRAIN_ENVOYS);
            let at = (d + e) % nodes.len();
            first.push(at);
            let urls = (0..nodes.len()).map(|k| nodes[(at + k) % nodes.len()].url()).collect();
            let config = EnvoyConfig {
                urls,
                domain: domains[d].clone(),
                reporting_interval: DRAIN_REPORTING,
                no_assignment: Blanket::Deny,
                expired: None,
                carries_tokens: false,
            };
            Envoy::start(config, clock.clone()).unwrap()
        })
        .collect();
    let ids: Vec<_> =
        (0..DRAIN_LIMITS.len()).map(|r| bucket_id(&[("route", &format!("/b{r}"))])).collect();
    let all: f64 = (1..=DRAIN_ENVOYS).map(|w| w as f64).sum();

    let mut owed = vec![0.0f64; envoys.len() * ids.len()];
    let mut arrivals: Vec<Arrival> = Vec::new();
    let start = clock.now();
    let mut last = start;
    let mut drain_at = None;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    while clock.now() - start < DRAIN_RUN.as_nanos() as u64 {
        tick.tick().await;
        let now = clock.now();
        if drain_at.is_none() && now - start >= DRAIN_AT.as_nanos() as u64 {
            nodes[drained].terminate().unwrap();
            drain_at = Some(now);
        }
        let dt = (now - last) as f64 / NANOS_PER_SEC as f64;
        last = now;
        for (i, envoy) in envoys.iter().enumerate() {
            let share = ((i % DRAIN_ENVOYS) + 1) as f64 / all;
            for (r, id) in ids.iter().enumerate() {
                let o = &mut owed[i * ids.len() + r];
                *o += 2.0 * DRAIN_LIMITS[r] as f64 * share * dt;
                while *o >= 1.0 {
                    *o -= 1.0;
                    // The bucket: domain and route.
                    let b = (i / DRAIN_ENVOYS) * ids.len() + r;
                    arrivals.push((b, i, clock.now(), envoy.decide(id)));
                }
            }
        }
    }
    for e in &envoys {
        e.stop();
    }
    let drain_at = drain_at.unwrap();
    let status = nodes[drained].exited();

    let sharing: Vec<Vec<usize>> =
        (0..DRAIN_DOMAINS).map(|d| (d * DRAIN_ENVOYS..(d + 1) * DRAIN_ENVOYS).collect()).collect();
    let mut buckets = Vec::new();
    for (d, envoys) in sharing.iter().enumerate() {
        for (r, &l) in DRAIN_LIMITS.iter().enumerate() {
            buckets.push((format!("d{d}/b{r}"), &ids[r], l, &envoys[..]));
        }
    }
    let exact = exactness(&envoys, &buckets, start);

    // Use per phase against the reference deciding the same arrivals: before the
    // drain (after a warm-up), the 2 s after it, and the rest.
    let settled = drain_at + 2 * NANOS_PER_SEC;
    let mut levels: HashMap<usize, Level> = HashMap::new();
    let mut ideal = [0u64; 3];
    let mut got = [0u64; 3];
    let mut after = vec![0u64; envoys.len()];
    for &(b, i, at, ok) in &arrivals {
        let l = DRAIN_LIMITS[b % ids.len()];
        let spec = Spec::TokenBucket { amount: l, period: NANOS_PER_SEC, burst: l };
        let fits = levels.entry(b).or_insert_with(|| Level::new(spec)).try_take(at, 1);
        let phase = match at {
            t if t < start + WARM_UP.as_nanos() as u64 => continue,
            t if t < drain_at => 0,
            t if t < settled => 1,
            _ => 2,
        };
        ideal[phase] += u64::from(fits);
        got[phase] += u64::from(ok);
        if phase == 2 {
            after[i] += u64::from(ok);
        }
    }
    let pct = |p: usize| got[p] as f64 * 100.0 / ideal[p].max(1) as f64;
    let streams: Vec<u64> = envoys.iter().map(|e| e.counts().1).collect();
    let report = format!(
        "drained {} (owner of {:?}; {} of {} Envoys' streams opened there), exit {status:?}; \
         units over the limits {}; admitted of the reference's: before the drain {:.1}%, \
         the 2 s after {:.1}%, the rest {:.1}%; streams opened per Envoy {streams:?}; \
         token buckets created {}",
        nodes[drained].id,
        moved.iter().map(|d| &domains[*d]).collect::<Vec<_>>(),
        first.iter().filter(|&&f| f == drained).count(),
        envoys.len(),
        exact.over,
        pct(0),
        pct(1),
        pct(2),
        exact.created,
    );
    println!("{report}");
    assert_eq!(exact.over, 0, "{}\n{report}", exact.worst);
    assert_eq!(exact.blanket, 0, "every admission under an assignment\n{report}");
    assert!(status.is_some_and(|s| s.success()), "the drained node exited cleanly\n{report}");
    for p in [0, 2] {
        assert!(pct(p) >= USE_FLOOR * 100.0, "use below {USE_FLOOR} away from the drain\n{report}");
    }
    for (i, &f) in first.iter().enumerate() {
        if f == drained {
            assert!(streams[i] >= 2, "Envoy {i} opened its stream again elsewhere\n{report}");
        }
        assert!(after[i] > 0, "Envoy {i} is served after the drain\n{report}");
    }
}
