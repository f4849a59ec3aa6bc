//! Ask a running server whether requests may go through (no grpcurl needed).
//!
//! ```text
//! cargo run -p limiter-server --example ask -- [--addr URL] [--cost N] [--dry-run] \
//!     [--repeat N] TENANT ROUTE [KEY]
//! ```
//!
//! Prints one line per decision.

use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;

const USAGE: &str = "usage: ask [--addr http://127.0.0.1:50051] [--cost N] [--dry-run] [--repeat N] TENANT ROUTE [KEY]";

fn secs(d: Option<&prost_types::Duration>) -> f64 {
    d.map_or(0.0, |d| d.seconds as f64 + f64::from(d.nanos) / 1e9)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut addr = "http://127.0.0.1:50051".to_owned();
    let mut req = pb::ShouldAllowRequest::default();
    let mut repeat = 1u32;
    let mut positional = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--addr" => addr = args.next().ok_or_else(|| anyhow::anyhow!(USAGE))?,
            "--cost" => {
                req.cost = Some(args.next().ok_or_else(|| anyhow::anyhow!(USAGE))?.parse()?);
            }
            "--repeat" => repeat = args.next().ok_or_else(|| anyhow::anyhow!(USAGE))?.parse()?,
            "--dry-run" => req.dry_run = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            _ => positional.push(a),
        }
    }
    match positional.as_slice() {
        [t, r] => (req.tenant, req.route) = (t.clone(), r.clone()),
        [t, r, k] => (req.tenant, req.route, req.key) = (t.clone(), r.clone(), k.clone()),
        _ => anyhow::bail!(USAGE),
    }
    let mut client = RateLimiterClient::connect(addr).await?;
    for _ in 0..repeat {
        match client.should_allow(req.clone()).await {
            Ok(r) => {
                let r = r.into_inner();
                let limit = r.limit.as_ref().map_or(String::new(), |l| {
                    format!(" limit={}({} per {:.3}s)", l.name, l.quota, secs(l.window.as_ref()))
                });
                if r.reason == 0 {
                    println!(
                        "allowed remaining={} scope={:?}{limit} reset_after={:.3}s policy_version={}",
                        r.remaining,
                        r.scope(),
                        secs(r.reset_after.as_ref()),
                        r.policy_version
                    );
                } else {
                    println!(
                        "{} reason={:?} scope={:?}{limit} retry_after={:.3}s policy_version={}",
                        if r.shadow { "allowed (shadow)" } else { "rejected" },
                        r.reason(),
                        r.scope(),
                        secs(r.retry_after.as_ref()),
                        r.policy_version
                    );
                }
            }
            Err(status) => println!("error {:?}: {}", status.code(), status.message()),
        }
    }
    Ok(())
}
