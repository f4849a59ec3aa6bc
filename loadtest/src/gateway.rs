//! The gateway role: this binary started by a run (`LOADTEST_ROLE=gateway`) as one
//! simulated gateway with its own agent, so that it can be killed like a real proxy.
//! It offers its share of the scenario and prints a record per request (flushed as it
//! is made), and its owner calls every second, on standard output.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use limiter_core::clock::MonotonicClock;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::record::Record;
use crate::scenario::Scenario;
use crate::target::Target;

fn var(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| format!("{name} is not set"))
}

/// Runs the gateway described by the `LOADTEST_*` environment.
///
/// # Errors
///
/// When the environment is incomplete or the scenario invalid.
pub fn main() -> anyhow::Result<()> {
    // The agent's warnings (an owner out of reach, its clock's counter found off) go
    // to standard error, which the run passes on to its own.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let mut s = Scenario::from_yaml(&var("LOADTEST_SCENARIO")?)?;
    s.policy = PathBuf::from(var("LOADTEST_POLICY")?);
    let g: usize = var("LOADTEST_GATEWAY")?.parse()?;
    let url = var("LOADTEST_URL")?;
    let start_unix: u64 = var("LOADTEST_START_UNIX")?.parse()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        let clock = MonotonicClock::new();
        // The run's start on this process's monotonic clock, from its anchor (reading
        // both clocks again here could be set off by a wait between the reads).
        let start = clock.instant_of(start_unix).map_or_else(Instant::now, Instant::from_std);
        let target = Target::new(s.target, &url, &format!("gateway-{g}"))?;
        let names = Arc::new(crate::run::names(&s));
        let plan = crate::workload::plan(&s, g);
        let (tx, mut rx) = mpsc::unbounded_channel::<Record>();
        let printer = tokio::spawn({
            let target = target.clone();
            async move {
                let mut out = std::io::BufWriter::new(std::io::stdout());
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tokio::select! {
                        r = rx.recv() => match r {
                            // Flushed per line: a killed gateway keeps every record
                            // it made (a lost second would hide its admissions).
                            Some(r) => {
                                let _ = writeln!(out, "{}", r.to_line());
                                let _ = out.flush();
                            }
                            None => break,
                        },
                        _ = tick.tick() => {
                            let _ = writeln!(out, "{}", target.owner_calls().unwrap_or_default().to_line());
                            let _ = out.flush();
                        }
                    }
                }
                let _ = writeln!(out, "{}", target.owner_calls().unwrap_or_default().to_line());
                let _ = out.flush();
            }
        });
        crate::run::drive(g, plan, target.clone(), names, start, s.max_in_flight, s.timeout, tx)
            .await;
        printer.await?;
        target.shutdown().await;
        Ok(())
    })
}
