//! The `cluster` section: where members come from, this node's place, and the
//! timings of forwards, handoffs, fences and slices.

use std::time::Duration;

use serde::Deserialize;

use super::{millis, positive};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    pub(super) membership: String,
    pub(super) node_id: String,
    pub(super) advertise: String,
    pub(super) weight: i64,
    pub(super) peers: String,
    pub(super) health_interval_ms: i64,
    pub(super) fail_after: i64,
    pub(super) recover_after: i64,
    pub(super) registry_url: String,
    pub(super) registry_key: String,
    pub(super) registry_ttl_ms: i64,
    pub(super) registry_poll_ms: i64,
    pub(super) dns_name: String,
    pub(super) dns_server: String,
    pub(super) dns_interval_ms: i64,
    pub(super) dns_timeout_ms: i64,
    pub(super) forward_timeout_ms: i64,
    pub(super) handoff_timeout_ms: i64,
    pub(super) fence_ms: i64,
    pub(super) slice_ttl_ms: i64,
    pub(super) insecure_peers: bool,
    pub(super) replication: bool,
    pub(super) replication_interval_ms: i64,
    pub(super) replication_queue: i64,
    pub(super) replication_timeout_ms: i64,
}

/// Where the ring's members come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// This node alone (`none`, the default).
    Single,
    /// A fixed list of peers, health-checked (`static`, with `cluster.peers`).
    Static(Vec<Peer>),
    /// A Redis registry every node renews its entry in (`redis`).
    Registry {
        /// `redis://` or `rediss://` URL.
        url: String,
        /// The registry's key (a sorted set) and the epoch's key (with `:epoch`).
        key: String,
        /// An entry not renewed for this long leaves the ring.
        ttl: Duration,
        /// How often a node renews its entry and reads the ring.
        poll: Duration,
    },
    /// The A and AAAA records of a name (`dns`): a Kubernetes headless Service lists
    /// every pod's address there. Every address found, at this node's own gRPC port,
    /// is a candidate, health-checked as static peers are; ids are the addresses.
    Dns {
        /// The name (absolute with a trailing dot, or relative to resolv.conf's
        /// search list).
        name: String,
        /// The nameserver asked (default: the first of `/etc/resolv.conf`).
        server: Option<std::net::SocketAddr>,
        /// The members' gRPC port (this node's advertised port).
        port: u16,
        /// How often the name is looked up (longer when its records' TTL is).
        interval: Duration,
        /// Deadline of one query.
        timeout: Duration,
    },
}

/// A statically listed node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its id.
    pub id: String,
    /// Its gRPC `host:port`.
    pub address: String,
    /// Its weight.
    pub weight: u32,
}

/// The `cluster` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// Where members come from.
    pub membership: Membership,
    /// This node's id (default: its advertised address).
    pub node_id: String,
    /// The address peers and agents reach this node's gRPC port at (default: `listen`).
    pub advertise: String,
    /// This node's weight.
    pub weight: u32,
    /// Static membership: how often each peer is checked.
    pub health_interval: Duration,
    /// Consecutive failed checks before a peer leaves the ring.
    pub fail_after: u32,
    /// Consecutive good checks before it comes back.
    pub recover_after: u32,
    /// Deadline of a forwarded call.
    pub forward_timeout: Duration,
    /// How long a new owner waits for the old owner's counters in a planned move.
    pub handoff_timeout: Duration,
    /// How long a dead node's tenants are fenced (0: the longest lease or slice TTL
    /// the policy can issue).
    pub fence: Duration,
    /// How long a slice of a root key leased from its owner lasts.
    pub slice_ttl: Duration,
    /// The operator accepts a cluster whose gRPC port authenticates nobody, where any
    /// client can pass for a peer (hand off counters, send forwarded calls).
    pub insecure_peers: bool,
    /// Memory store: keep each tenant's counters and leases replicated to the member
    /// that would own it next (on by default).
    pub replication: bool,
    /// How often changes are sent to the replicas (lease grants are sent at once).
    pub replication_interval: Duration,
    /// The most changed counters waiting for one replica; past it the replica is
    /// sent a full copy instead, and is behind until it arrives.
    pub replication_queue: usize,
    /// Deadline of one replication message.
    pub replication_timeout: Duration,
}

/// The `dns` membership's settings, with what is wrong in them.
fn dns_membership(
    errors: &mut Vec<String>,
    c: &RawCluster,
    advertise: &str,
    node_id: &str,
) -> Membership {
    let name = c.dns_name.trim().to_owned();
    let valid_name = !name.is_empty()
        && name.len() <= 254
        && name.trim_end_matches('.').split('.').all(|l| {
            (1..=63).contains(&l.len())
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if !valid_name {
        errors.push(format!(
            "cluster.dns_name: expected a DNS name (a headless Service, like \
             `limiter-headless.default.svc.cluster.local.`), found `{}`",
            c.dns_name.chars().take(80).collect::<String>()
        ));
    }
    let server = if c.dns_server.is_empty() {
        None
    } else {
        let parsed =
            c.dns_server.parse::<std::net::SocketAddr>().ok().or_else(|| {
                c.dns_server.parse::<std::net::IpAddr>().ok().map(|ip| (ip, 53).into())
            });
        if parsed.is_none() {
            errors.push(format!(
                "cluster.dns_server: expected an IP address with an optional port, found `{}`",
                c.dns_server.chars().take(80).collect::<String>()
            ));
        }
        parsed
    };
    // Peers find each other by address, so this node's id is its address.
    let port = match advertise.parse::<std::net::SocketAddr>() {
        Ok(a) => a.port(),
        Err(_) => {
            errors.push(format!(
                "cluster.advertise: dns membership needs this node's address as `ip:port` \
                 (the pod IP, as its Service's records give it), found `{advertise}`"
            ));
            0
        }
    };
    if !c.node_id.is_empty() && node_id != advertise {
        errors.push(
            "cluster.node_id: with dns membership a node's id is its advertised address; leave it empty"
                .to_owned(),
        );
    }
    if c.weight != 1 {
        errors.push(
            "cluster.weight: with dns membership every node weighs 1 (records carry no weight)"
                .to_owned(),
        );
    }
    let interval = millis(errors, "cluster.dns_interval_ms", c.dns_interval_ms, false);
    if interval > Duration::from_secs(5) {
        errors.push(format!(
            "cluster.dns_interval_ms: at most 5000 (a removed pod must leave the ring within seconds), found {}",
            interval.as_millis()
        ));
    }
    let timeout = millis(errors, "cluster.dns_timeout_ms", c.dns_timeout_ms, false);
    Membership::Dns { name, server, port, interval, timeout }
}

/// Parses `id=host:port[*weight],...`.
fn parse_peers(errors: &mut Vec<String>, text: &str) -> Vec<Peer> {
    let mut peers = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((id, rest)) = part.split_once('=') else {
            errors.push(format!("cluster.peers: expected `id=host:port[*weight]`, found `{part}`"));
            continue;
        };
        let (address, weight) = match rest.split_once('*') {
            Some((a, w)) => (a, w.parse::<u32>().ok().filter(|w| *w > 0)),
            None => (rest, Some(1)),
        };
        let Some(weight) = weight else {
            errors.push(format!("cluster.peers: `{part}`: the weight must be a positive integer"));
            continue;
        };
        if id.trim().is_empty() || !address.contains(':') {
            errors.push(format!("cluster.peers: `{part}`: expected `id=host:port[*weight]`"));
            continue;
        }
        peers.push(Peer { id: id.trim().to_owned(), address: address.trim().to_owned(), weight });
    }
    peers
}

pub(super) fn cluster_config(
    errors: &mut Vec<String>,
    c: &RawCluster,
    listen: &str,
) -> ClusterConfig {
    let advertise = if c.advertise.is_empty() { listen.to_owned() } else { c.advertise.clone() };
    let node_id = if c.node_id.is_empty() { advertise.clone() } else { c.node_id.clone() };
    let membership = match c.membership.as_str() {
        "none" => Membership::Single,
        "static" => {
            let peers = parse_peers(errors, &c.peers);
            if peers.is_empty() {
                errors.push("cluster.peers: static membership needs at least one peer".to_owned());
            }
            Membership::Static(peers)
        }
        "redis" => {
            if !(c.registry_url.starts_with("redis://") || c.registry_url.starts_with("rediss://"))
            {
                errors.push(format!(
                    "cluster.registry_url: expected redis:// or rediss://, found `{}`",
                    c.registry_url
                ));
            }
            if c.registry_key.is_empty() {
                errors.push("cluster.registry_key: must not be empty".to_owned());
            }
            let ttl = millis(errors, "cluster.registry_ttl_ms", c.registry_ttl_ms, false);
            let poll = millis(errors, "cluster.registry_poll_ms", c.registry_poll_ms, false);
            if poll * 2 > ttl {
                errors.push(format!(
                    "cluster.registry_poll_ms: must be at most half of registry_ttl_ms ({} ms), found {} ms",
                    ttl.as_millis(),
                    poll.as_millis()
                ));
            }
            Membership::Registry {
                url: c.registry_url.clone(),
                key: c.registry_key.clone(),
                ttl,
                poll,
            }
        }
        "dns" => dns_membership(errors, c, &advertise, &node_id),
        other => {
            errors.push(format!(
                "cluster.membership: expected `none`, `static`, `redis` or `dns`, found `{other}`"
            ));
            Membership::Single
        }
    };
    // DNS ids are addresses: this node's must be written as every other node derives it.
    let (advertise, node_id) = match (&membership, advertise.parse::<std::net::SocketAddr>()) {
        (Membership::Dns { .. }, Ok(a)) => (a.to_string(), a.to_string()),
        _ => (advertise, node_id),
    };
    let count = |errors: &mut Vec<String>, name: &str, v: i64| {
        u32::try_from(positive(errors, name, v, 1_000)).unwrap_or(1)
    };
    ClusterConfig {
        membership,
        node_id,
        advertise,
        weight: count(errors, "cluster.weight", c.weight),
        health_interval: millis(errors, "cluster.health_interval_ms", c.health_interval_ms, false),
        fail_after: count(errors, "cluster.fail_after", c.fail_after),
        recover_after: count(errors, "cluster.recover_after", c.recover_after),
        forward_timeout: millis(errors, "cluster.forward_timeout_ms", c.forward_timeout_ms, false),
        handoff_timeout: millis(errors, "cluster.handoff_timeout_ms", c.handoff_timeout_ms, false),
        fence: millis(errors, "cluster.fence_ms", c.fence_ms, true),
        slice_ttl: millis(errors, "cluster.slice_ttl_ms", c.slice_ttl_ms, false),
        insecure_peers: c.insecure_peers,
        replication: c.replication,
        replication_interval: millis(
            errors,
            "cluster.replication_interval_ms",
            c.replication_interval_ms,
            false,
        ),
        replication_queue: positive(
            errors,
            "cluster.replication_queue",
            c.replication_queue,
            10_000_000,
        ),
        replication_timeout: millis(
            errors,
            "cluster.replication_timeout_ms",
            c.replication_timeout_ms,
            false,
        ),
    }
}
