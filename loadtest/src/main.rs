//! `loadtest`: run a scenario, or the standard benchmarks.
//!
//! ```text
//! loadtest run <scenario.yaml> [--out DIR]    report to DIR (default loadtest/reports)
//! loadtest bench [--quick] [--out FILE]       the standard scenarios into BENCHMARKS.md
//! loadtest cpu [--rate N] ...                  server CPU per decision against an
//!                                              empty Envoy RLS server
//! loadtest rlqs [--buckets N] [--secs N]      one simulated Envoy's RLQS stream of
//!                                              N buckets: server memory and CPU
//! ```
//!
//! The same binary is the server nodes and gateway processes a run starts
//! (`LOADTEST_ROLE=server|gateway`).

use std::path::PathBuf;
use std::process::ExitCode;

use loadtest::scenario::Scenario;

const USAGE: &str = "usage:
  loadtest run <scenario.yaml> [--out DIR]
  loadtest bench [--quick] [--out FILE] [--charts DIR]
  loadtest cpu [--rate N] [--tenants N] [--secs N] [--rounds N] [--in-flight N]
               [--set LIMITER__KEY=VALUE]...
  loadtest replication [--tenants N] [--secs N] [--rounds N] [--in-flight N]
  loadtest rlqs [--buckets N] [--secs N]";

fn main() -> ExitCode {
    match std::env::var(loadtest::procs::ROLE).as_deref() {
        Ok("server") => return limiter_server::cli::main(),
        Ok(loadtest::cpu::EMPTY_ROLE) => {
            return match loadtest::cpu::empty_main() {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("empty RLS server: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        Ok("gateway") => {
            return match loadtest::gateway::main() {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gateway: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("run") => run(&args[1..]),
        Some("bench") => bench(&args[1..]),
        Some("cpu") => cpu(&args[1..]),
        Some("replication") => replication(&args[1..]),
        Some("rlqs") => rlqs(&args[1..]),
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(64);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loadtest: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

fn run(args: &[String]) -> anyhow::Result<()> {
    let mut file = None;
    let mut out = PathBuf::from("loadtest/reports");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = PathBuf::from(value(it.next(), "--out")?),
            f if file.is_none() && !f.starts_with('-') => file = Some(PathBuf::from(f)),
            other => anyhow::bail!("unexpected argument `{other}`\n{USAGE}"),
        }
    }
    let file = file.ok_or_else(|| anyhow::anyhow!("which scenario?\n{USAGE}"))?;
    let s = Scenario::load(&file)?;
    let report =
        runtime()?.block_on(loadtest::run::run(&s, loadtest::run::Options { progress: true }))?;
    let md = report.markdown();
    println!("{md}");
    std::fs::create_dir_all(&out)?;
    let base = out.join(&s.name);
    std::fs::write(base.with_extension("json"), serde_json::to_string_pretty(&report)?)?;
    std::fs::write(base.with_extension("md"), &md)?;
    std::fs::write(base.with_extension("svg"), loadtest::chart::run_chart(&report))?;
    eprintln!("report: {}.{{json,md,svg}}", base.display());
    let broken: Vec<&str> =
        report.invariants.iter().filter(|i| !i.holds).map(|i| i.name.as_str()).collect();
    anyhow::ensure!(broken.is_empty(), "invariants broken: {}", broken.join("; "));
    Ok(())
}

fn value<'a>(v: Option<&'a String>, flag: &str) -> anyhow::Result<&'a String> {
    v.ok_or_else(|| anyhow::anyhow!("{flag} needs a value\n{USAGE}"))
}

fn bench(args: &[String]) -> anyhow::Result<()> {
    let mut opts = loadtest::bench::Options::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => opts.quick = true,
            "--out" => opts.out = PathBuf::from(value(it.next(), "--out")?),
            "--charts" => opts.charts = PathBuf::from(value(it.next(), "--charts")?),
            other => anyhow::bail!("unexpected argument `{other}`\n{USAGE}"),
        }
    }
    runtime()?.block_on(loadtest::bench::run(&opts))
}

fn replication(args: &[String]) -> anyhow::Result<()> {
    let mut o = loadtest::replication::Options::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let n = |v: Option<&String>| -> anyhow::Result<u64> {
            value(v, a)?.parse().map_err(|_| anyhow::anyhow!("{a}: expected a number"))
        };
        match a.as_str() {
            "--tenants" => o.tenants = usize::try_from(n(it.next())?)?.max(1),
            "--secs" => o.secs = n(it.next())?.max(1),
            "--rounds" => o.rounds = usize::try_from(n(it.next())?)?.max(1),
            "--in-flight" => o.in_flight = usize::try_from(n(it.next())?)?.max(1),
            other => anyhow::bail!("unexpected argument `{other}`\n{USAGE}"),
        }
    }
    let dir = std::env::temp_dir().join(format!("loadtest-replication-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let md = runtime()?.block_on(loadtest::replication::run(&o, &dir));
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}", md?);
    Ok(())
}

fn rlqs(args: &[String]) -> anyhow::Result<()> {
    let (mut buckets, mut secs) = (10_000usize, 10u64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let n = |v: Option<&String>| -> anyhow::Result<u64> {
            value(v, a)?.parse().map_err(|_| anyhow::anyhow!("{a}: expected a number"))
        };
        match a.as_str() {
            "--buckets" => buckets = usize::try_from(n(it.next())?)?.max(1),
            "--secs" => secs = n(it.next())?.max(1),
            other => anyhow::bail!("unexpected argument `{other}`\n{USAGE}"),
        }
    }
    let dir = std::env::temp_dir().join(format!("loadtest-rlqs-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let s = runtime()?.block_on(loadtest::rlqs::scale(buckets, secs, &dir));
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}", s?.markdown());
    Ok(())
}

fn cpu(args: &[String]) -> anyhow::Result<()> {
    let mut o = loadtest::cpu::Options::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let n = |v: Option<&String>| -> anyhow::Result<u64> {
            value(v, a)?.parse().map_err(|_| anyhow::anyhow!("{a}: expected a number"))
        };
        match a.as_str() {
            "--rate" => o.rate = n(it.next())?.max(1),
            "--tenants" => o.tenants = usize::try_from(n(it.next())?)?.max(1),
            "--secs" => o.secs = n(it.next())?.max(1),
            "--rounds" => o.rounds = usize::try_from(n(it.next())?)?.max(1),
            "--in-flight" => o.in_flight = usize::try_from(n(it.next())?)?.max(1),
            "--set" => {
                let kv = value(it.next(), a)?;
                let (k, v) =
                    kv.split_once('=').ok_or_else(|| anyhow::anyhow!("--set KEY=VALUE"))?;
                o.server_env.push((k.to_owned(), v.to_owned()));
            }
            other => anyhow::bail!("unexpected argument `{other}`\n{USAGE}"),
        }
    }
    let dir = std::env::temp_dir().join(format!("loadtest-cpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let md = runtime()?.block_on(loadtest::cpu::run(&o, &dir));
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}", md?);
    Ok(())
}
