//! What every fault test of a run checks first.

use std::path::PathBuf;

use loadtest::report::Report;
use loadtest::scenario::Scenario;

/// Runs `s` with this package's binary as its servers and gateways, prints the
/// report, and checks what must hold whatever the faults: no process crashed, every
/// fault was done, and every offered request is sent or unsent, every sent one
/// admitted, rejected or failed.
pub(crate) async fn run_checked(s: &Scenario) -> Report {
    loadtest::procs::use_binary(PathBuf::from(env!("CARGO_BIN_EXE_loadtest")));
    let r = loadtest::run::run(s, loadtest::run::Options::default()).await.unwrap();
    println!("{}", r.markdown());
    assert!(r.crashed.is_empty(), "{:?}", r.crashed);
    assert!(r.faults.iter().all(|f| f.done), "{:?}", r.faults);
    let t = &r.totals;
    // Offered is the plan's count: what a killed gateway never got to is missing.
    assert_eq!(t.offered, t.sent + t.unsent + t.missing);
    assert_eq!(t.sent, t.admitted + t.rejected + t.errors);
    r
}
