//! A gateway process holding permits of a concurrency level through the agent, for
//! the multi-process permit tests: `permit-holder URL ID N` acquires `N` permits of
//! tenant `t` on route `/work`, prints `held N` once it holds them all, then renews
//! them every 300 ms (well within their TTL) until it is killed.

use std::time::Duration;

use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(url), Some(id), Some(n)) =
        (args.get(1), args.get(2), args.get(3).and_then(|n| n.parse::<usize>().ok()))
    else {
        eprintln!("usage: permit-holder URL ID N");
        return std::process::ExitCode::from(64);
    };
    let config = AgentConfig::new(url, id).with_rpc_timeout(Duration::from_millis(500));
    let Ok(agent) = Agent::new(config) else {
        eprintln!("permit-holder: bad agent settings");
        return std::process::ExitCode::from(64);
    };
    let req = AgentRequest { tenant: "t", route: "/work", key: None, cost: 1 };
    let mut held = Vec::new();
    while held.len() < n {
        match agent.decide(&req).await {
            Ok(o) if o.allowed => held.extend(o.permit),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    println!("held {}", held.len());
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        for p in &held {
            let _ = agent.renew(p).await;
        }
    }
}
