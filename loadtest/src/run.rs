//! One run of a scenario: start what it needs, offer its load open-loop from every
//! gateway, inject its faults, collect every request's record, and report.

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use limiter_core::clock::{Clock as _, MonotonicClock};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::procs::{self, Node, Redis, Relay};
use crate::record::{self, Kind, Record, Source};
use crate::report::{self, FaultEvent, LeaseSample, Report};
use crate::scenario::{Action, FaultTarget, Scenario, Servers, Store, TargetKind};
use crate::target::{Calls, Names, Target};
use crate::workload::{self, Planned};

/// How a run shows itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Draw a progress bar on standard error (only when it is a terminal).
    pub progress: bool,
}

/// Live totals, for the progress bar.
#[derive(Debug, Default)]
pub struct Live {
    /// Records received.
    pub done: AtomicU64,
    /// Admitted.
    pub admitted: AtomicU64,
    /// Rejected.
    pub rejected: AtomicU64,
    /// Errors.
    pub errors: AtomicU64,
    /// Unsent or sent late.
    pub late: AtomicU64,
}

/// The names of a scenario's tenants, routes and keys.
pub fn names(s: &Scenario) -> Names {
    Names {
        tenants: s.tenants.list(),
        routes: s.routes.iter().map(|r| r.name.clone()).collect(),
        keys: (0..s.tenants.keys).map(|i| format!("k{i}")).collect(),
    }
}

/// Offers gateway `g`'s plan through `target`, open-loop: each request goes at its
/// planned time whatever the earlier ones are doing; when `max_in_flight` are already
/// out, the request is recorded as unsent instead of waiting.
#[allow(clippy::too_many_arguments)]
pub async fn drive(
    g: usize,
    plan: Vec<Planned>,
    target: Target,
    names: Arc<Names>,
    start: Instant,
    max_in_flight: usize,
    timeout: Duration,
    tx: mpsc::UnboundedSender<Record>,
) {
    let in_flight = Arc::new(AtomicUsize::new(0));
    let gateway = u16::try_from(g).unwrap_or(u16::MAX);
    for p in plan {
        let due = start + p.at;
        if Instant::now() < due {
            tokio::time::sleep_until(due).await;
        }
        let at = nanos(p.at);
        let base = Record {
            gateway,
            at,
            sent: at,
            latency: 0,
            tenant: p.tenant,
            route: p.route,
            key: p.key,
            cost: p.cost,
            kind: Kind::Unsent,
            label: 0,
            source: Source::Remote,
        };
        if in_flight.load(Ordering::Acquire) >= max_in_flight {
            let _ = tx.send(base);
            continue;
        }
        in_flight.fetch_add(1, Ordering::AcqRel);
        let (target, names, tx, in_flight) =
            (target.clone(), names.clone(), tx.clone(), in_flight.clone());
        tokio::spawn(async move {
            let sent = nanos(start.elapsed());
            let (kind, label, source) =
                match tokio::time::timeout(timeout, target.call(&names, &p)).await {
                    Ok(x) => x,
                    Err(_) => (Kind::Error, record::DEADLINE, Source::Remote),
                };
            let latency = nanos(due.elapsed());
            let _ = tx.send(Record { sent, latency, kind, label, source, ..base });
            in_flight.fetch_sub(1, Ordering::AcqRel);
        });
    }
    // The last answers, or their deadlines.
    let end = Instant::now() + timeout + Duration::from_millis(200);
    while in_flight.load(Ordering::Acquire) > 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The owner calls of every agent so far: the run's own and its gateway processes'.
fn calls_now(in_process: &[Target], procs: &Mutex<Vec<GatewayProc>>) -> Calls {
    let here =
        in_process.iter().filter_map(Target::owner_calls).fold(Calls::default(), |a, b| a + b);
    procs.lock().iter().map(|p| *p.owner_calls.lock()).fold(here, |a, b| a + b)
}

/// Nanoseconds of a duration, saturated.
pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A gateway process and what it said of itself.
struct GatewayProc {
    child: Option<Child>,
    owner_calls: Arc<Mutex<Calls>>,
    /// The first panic its standard error showed.
    panicked: Arc<Mutex<Option<String>>>,
    /// Killed by a fault (its end is not a crash).
    killed: bool,
    /// How it ended on its own.
    status: Option<std::process::ExitStatus>,
}

/// Runs `s` and reports.
///
/// # Errors
///
/// When the policy is invalid, or what the scenario starts cannot be started.
pub async fn run(s: &Scenario, opts: Options) -> anyhow::Result<Report> {
    let policy = crate::model::load_policy(&s.policy)?;
    let names = Arc::new(names(s));

    // Servers.
    let mut redis = None;
    let nodes: Arc<Mutex<Vec<Node>>> = Arc::new(Mutex::new(Vec::new()));
    // Where gateways connect: (the address a relay forwards to, the URL).
    let mut upstreams: Vec<(Option<SocketAddr>, String)> = Vec::new();
    // The admin port of a running server the scenario names, for its metrics.
    let mut external_admin: Option<SocketAddr> = None;
    match &s.servers {
        Servers::Own(own) => {
            let mut env = Vec::new();
            if own.store == Store::Redis {
                let r = Redis::start().await?;
                env.push(("LIMITER__STORE__KIND".to_owned(), "redis".to_owned()));
                env.push(("LIMITER__STORE__REDIS__URL".to_owned(), r.url()));
                redis = Some(r);
            }
            let started = Node::start_all(own.nodes, &s.policy, &env).await?;
            upstreams = started.iter().map(|n| (Some(n.grpc), n.url())).collect();
            *nodes.lock() = started;
        }
        Servers::External { address, admin } => {
            upstreams.push((None, address.clone()));
            if let Some(a) = admin {
                external_admin = Some(a.parse().with_context(|| format!("admin: `{a}`"))?);
            }
        }
    }
    let redis = Arc::new(redis);

    // One relay per gateway that a fault cuts off.
    let mut relays: Vec<Option<Relay>> = vec![None; s.gateways];
    for f in &s.faults {
        if let Action::Cut(t, _) = &f.action
            && let Ok(FaultTarget::Gateway(g)) =
                crate::scenario::target_of(t, &s.servers, s.gateways, s.gateway_processes)
            && relays[g].is_none()
        {
            // Faults are refused for servers the run did not start: these have addresses.
            let upstream = upstreams[g % upstreams.len()].0.context("a cut needs own servers")?;
            relays[g] = Some(Relay::start(upstream).await?);
        }
    }
    let url_of = |g: usize| {
        relays[g].as_ref().map_or_else(|| upstreams[g % upstreams.len()].1.clone(), Relay::url)
    };

    let (tx, mut rx) = mpsc::unbounded_channel::<Record>();
    let lead =
        if s.gateway_processes { Duration::from_millis(1500) } else { Duration::from_millis(300) };
    let clock = MonotonicClock::new();
    let start_unix = clock.now() + nanos(lead);
    // The same instant on the monotonic clock, from the clock's anchor (reading the
    // two clocks again could be set off by a wait between the reads).
    let start =
        clock.instant_of(start_unix).map_or_else(|| Instant::now() + lead, Instant::from_std);

    // Gateways. Each process draws its own plan; the run draws them too, to count.
    let plans: Vec<Vec<Planned>> = (0..s.gateways).map(|g| workload::plan(s, g)).collect();
    let planned: Vec<u64> = plans.iter().map(|p| p.len() as u64).collect();
    let total: u64 = planned.iter().sum();
    let mut tasks = Vec::new();
    let mut in_process = Vec::new();
    let gateway_procs: Arc<Mutex<Vec<GatewayProc>>> = Arc::new(Mutex::new(Vec::new()));
    for (g, plan) in plans.into_iter().enumerate() {
        if s.gateway_processes {
            gateway_procs.lock().push(spawn_gateway(s, g, &url_of(g), start_unix, tx.clone())?);
        } else {
            let target = Target::new(s.target, &url_of(g), &format!("loadtest-{g}"))?;
            in_process.push(target.clone());
            tasks.push(tokio::spawn(drive(
                g,
                plan,
                target,
                names.clone(),
                start,
                s.max_in_flight,
                s.timeout,
                tx.clone(),
            )));
        }
    }
    drop(tx);
    // The agents' owner calls once the warm-up is over.
    let warm = tokio::spawn({
        let (in_process, gateway_procs) = (in_process.clone(), gateway_procs.clone());
        async move {
            tokio::time::sleep_until(start + Duration::from_nanos(report::WARM_UP)).await;
            calls_now(&in_process, &gateway_procs)
        }
    });

    // Faults.
    let events = Arc::new(Mutex::new(Vec::<FaultEvent>::new()));
    let ledger = Arc::new(Mutex::new(report::LeaseLedger::default()));
    let early_crashes = Arc::new(Mutex::new(Vec::<String>::new()));
    for f in s.faults.clone() {
        let (nodes, gateway_procs, relays, redis, events) =
            (nodes.clone(), gateway_procs.clone(), relays.clone(), redis.clone(), events.clone());
        let (early_crashes, ledger) = (early_crashes.clone(), ledger.clone());
        let (servers, gateways, processes) = (s.servers.clone(), s.gateways, s.gateway_processes);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + f.at).await;
            let at = nanos(start.elapsed());
            let target =
                |t: &str| crate::scenario::target_of(t, &servers, gateways, processes).ok();
            let mut done = true;
            // A node's lease totals die with it: read them just before the kill.
            if let Action::Kill(t) = &f.action
                && let Some(FaultTarget::Node(i)) = target(t)
            {
                let admin = nodes.lock()[i].admin;
                if let Some((_, body)) = procs::http_get(admin, "/metrics").await {
                    ledger.lock().note(admin, &body);
                }
            }
            match &f.action {
                Action::Kill(t) => match target(t) {
                    Some(FaultTarget::Node(i)) => {
                        let mut nodes = nodes.lock();
                        // A node that already died on its own crashed: the kill must
                        // not hide it.
                        if let Some(st) = nodes[i].exited() {
                            early_crashes.lock().push(format!("{t} exited on its own: {st}"));
                        }
                        nodes[i].kill();
                    }
                    Some(FaultTarget::Gateway(i)) => {
                        let mut procs = gateway_procs.lock();
                        procs[i].killed = true;
                        if let Some(mut c) = procs[i].child.take() {
                            let _ = c.kill();
                            let _ = c.wait();
                        }
                    }
                    None => done = false,
                },
                Action::Restart(t) => match target(t) {
                    Some(FaultTarget::Node(i)) => done = nodes.lock()[i].restart().is_ok(),
                    _ => done = false,
                },
                Action::Cut(t, d) => match target(t) {
                    Some(FaultTarget::Gateway(i)) => match &relays[i] {
                        Some(r) => r.cut(*d),
                        None => done = false,
                    },
                    _ => done = false,
                },
                Action::StopRedis(d) => match redis.as_ref() {
                    Some(r) => {
                        r.pause(true);
                        tokio::time::sleep(*d).await;
                        r.pause(false);
                    }
                    None => done = false,
                },
            }
            events.lock().push(FaultEvent { fault: f.clone(), at_ns: at, done });
        }));
    }

    // Lease fates, sampled from the servers' metrics.
    let samples = Arc::new(Mutex::new(Vec::<LeaseSample>::new()));
    let sampler = {
        let (nodes, samples, ledger) = (nodes.clone(), samples.clone(), ledger.clone());
        tokio::spawn(async move {
            loop {
                let running =
                    nodes.lock().iter().filter(|n| n.running()).map(|n| n.admin).collect();
                let admins: Vec<_> = external_admin.into_iter().chain::<Vec<_>>(running).collect();
                let mut sample =
                    LeaseSample { t: start.elapsed().as_secs_f64(), ..Default::default() };
                for a in admins {
                    if let Some((_, body)) = procs::http_get(a, "/metrics").await {
                        sample.add(&body);
                        ledger.lock().note(a, &body);
                    }
                }
                samples.lock().push(sample);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };

    // Collect, with a progress bar.
    let live = Arc::new(Live::default());
    let bar = opts.progress.then(|| report::progress_bar(total, live.clone()));
    let late_after = nanos(s.late_after);
    let collector = {
        let live = live.clone();
        tokio::spawn(async move {
            let mut records = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
            while let Some(r) = rx.recv().await {
                live.done.fetch_add(1, Ordering::Relaxed);
                let c = match r.kind {
                    Kind::Admitted => &live.admitted,
                    Kind::Rejected => &live.rejected,
                    Kind::Error => &live.errors,
                    Kind::Unsent => &live.late,
                };
                c.fetch_add(1, Ordering::Relaxed);
                if r.kind != Kind::Unsent && r.sent.saturating_sub(r.at) > late_after {
                    live.late.fetch_add(1, Ordering::Relaxed);
                }
                records.push(r);
            }
            records
        })
    };

    for t in tasks {
        let _ = t.await;
    }
    // Gateway processes end on their own after their plan (or were killed).
    let deadline = Instant::now() + s.duration() + s.timeout + Duration::from_secs(20);
    loop {
        let mut running = 0;
        for p in gateway_procs.lock().iter_mut() {
            match p.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(st))) => {
                    p.status = Some(st);
                    p.child = None;
                }
                Some(_) => running += 1,
                None => {}
            }
        }
        if running == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let owner_calls = if s.target == TargetKind::Agent {
        let end = calls_now(&in_process, &gateway_procs);
        let warm = warm.await.unwrap_or_default();
        Some(report::OwnerCalls { warm_up: report::WARM_UP, at_warm_up: warm, at_end: end })
    } else {
        None
    };
    for t in &in_process {
        t.shutdown().await;
    }
    drop(in_process);
    let mut hung = Vec::new();
    for (g, p) in gateway_procs.lock().iter_mut().enumerate() {
        if let Some(mut c) = p.child.take() {
            hung.push(format!("gateway{g} did not end within its plan and deadline"));
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    // One more sample once returns have settled: servers publish their lease totals
    // every 500 ms.
    tokio::time::sleep(Duration::from_millis(1100) + s.settle).await;
    sampler.abort();
    let records = collector.await.context("collecting records")?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let mut crashed = hung;
    crashed.extend(std::mem::take(&mut *early_crashes.lock()));
    let mut live_admins: Vec<SocketAddr> = external_admin.into_iter().collect();
    for n in nodes.lock().iter_mut() {
        if let Some(st) = n.exited() {
            crashed.push(format!("{} exited on its own: {st}", n.id));
        } else if n.running() {
            live_admins.push(n.admin);
        }
        if let Some(p) = n.panic() {
            crashed.push(format!("{} panicked: {p}", n.id));
        }
    }
    let mut killed_gateways = Vec::new();
    for (g, p) in gateway_procs.lock().iter().enumerate() {
        match p.status {
            Some(st) if !st.success() && !p.killed => {
                crashed.push(format!("gateway{g} ended with {st}"));
            }
            _ => {}
        }
        if let Some(line) = p.panicked.lock().clone() {
            crashed.push(format!("gateway{g} panicked: {line}"));
        }
        if p.killed {
            killed_gateways.push(u16::try_from(g).unwrap_or(u16::MAX));
        }
    }
    let mut server = report::ServerCounts::default();
    let mut final_sample = LeaseSample { t: start.elapsed().as_secs_f64(), ..Default::default() };
    for a in live_admins {
        if let Some((_, body)) = procs::http_get(a, "/metrics").await {
            server.add(&body);
            final_sample.add(&body);
            ledger.lock().note(a, &body);
        }
    }
    samples.lock().push(final_sample);
    #[allow(clippy::cast_precision_loss)]
    let lease_ttl_s =
        names.routes.iter().map(|r| policy.route(r).lease.ttl).max().unwrap_or(0) as f64 / 1e9;
    let fail_open_routes = names
        .routes
        .iter()
        .filter(|r| {
            matches!(
                policy.route(r).on_limiter_failure,
                limiter_core::policy::FailurePolicy::FailOpen { .. }
            )
        })
        .cloned()
        .collect();
    let envoy = s.target == TargetKind::Envoy;
    let ideal = crate::model::decide_all(&policy, &names, &records, envoy, start_unix);
    // Leases and slices may have decided unless one exact server did it all.
    let exact_server = s.target != TargetKind::Agent
        && match &s.servers {
            Servers::Own(o) => o.nodes == 1 && o.store == Store::Memory,
            Servers::External { .. } => true,
        };
    let hold = if exact_server {
        0
    } else {
        names.routes.iter().map(|r| policy.route(r).lease.ttl).max().unwrap_or(0)
    };
    let judgement = crate::judge::judge_run(&policy, &names, &records, envoy, start_unix, hold);
    let ledger = ledger.lock().total();
    let events = std::mem::take(&mut *events.lock());
    let samples = std::mem::take(&mut *samples.lock());
    drop(redis);
    Ok(report::build(
        s,
        &names,
        &records,
        &ideal,
        report::Extras {
            owner_calls,
            events,
            samples,
            server,
            crashed,
            lease_ttl_s,
            judgement,
            planned,
            killed_gateways,
            ledger,
            fail_open_routes,
        },
    ))
}

fn spawn_gateway(
    s: &Scenario,
    g: usize,
    url: &str,
    start_unix: u64,
    tx: mpsc::UnboundedSender<Record>,
) -> anyhow::Result<GatewayProc> {
    let mut child = Command::new(procs::own_binary()?)
        .env(procs::ROLE, "gateway")
        .env("LOADTEST_SCENARIO", &s.source)
        .env("LOADTEST_POLICY", &s.policy)
        .env("LOADTEST_GATEWAY", g.to_string())
        .env("LOADTEST_URL", url)
        .env("LOADTEST_START_UNIX", start_unix.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting a gateway process")?;
    // Its log goes on to ours; a panic in it is a crash even when the process lives on.
    let panicked: Arc<Mutex<Option<String>>> = Arc::default();
    if let Some(err) = child.stderr.take() {
        let panicked = panicked.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                if line.contains("panicked at") {
                    panicked.lock().get_or_insert_with(|| line.clone());
                }
                eprintln!("{line}");
            }
        });
    }
    let out = child.stdout.take().context("gateway stdout")?;
    let owner_calls = Arc::new(Mutex::new(Calls::default()));
    let calls = owner_calls.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(r) = Record::from_line(&line) {
                let _ = tx.send(r);
            } else if let Some(n) = Calls::from_line(&line) {
                *calls.lock() = n;
            }
        }
    });
    Ok(GatewayProc { child: Some(child), owner_calls, panicked, killed: false, status: None })
}
