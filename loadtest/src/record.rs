//! One line per request: what was planned, when it went, what came back. Gateway
//! processes print records on their standard output; the run collects them all.

use std::fmt::Write as _;

use limiter_core::Reason;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Admitted (including shadow-mode admissions).
    Admitted,
    /// Rejected by a limit or a failure policy.
    Rejected,
    /// No answer: a transport error, a deadline, or a refusal of the request.
    Error,
    /// Not sent: the gateway already had its maximum of requests in flight.
    Unsent,
}

/// Where an admission or rejection was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// A server decided (native, Envoy, ping).
    Remote,
    /// The agent, from its leased balance.
    Local,
    /// The agent, after asking the owner, who decided directly.
    Owner,
    /// The agent, from a lease the owner granted for the request.
    Granted,
    /// The agent's failure policy: the owner was out of reach.
    Fallback,
}

/// Labels of rejections and errors, by index (`Record::label`).
pub const LABELS: [&str; 15] = [
    "",
    "global_ceiling",
    "route_limit",
    "tenant_limit",
    "tenant_route_limit",
    "key_limit",
    "emergency_ceiling",
    "limiter_unavailable",
    "unknown_tenant",
    "over_limit",
    "deadline",
    "unavailable",
    "invalid_argument",
    "other_error",
    "share_limit",
];

/// The label index of a rejection reason.
pub fn reason_label(r: Reason) -> u8 {
    match r {
        Reason::GlobalCeiling => 1,
        Reason::RouteLimit => 2,
        Reason::TenantLimit => 3,
        Reason::TenantRouteLimit => 4,
        Reason::KeyLimit => 5,
        Reason::EmergencyCeiling => 6,
        Reason::LimiterUnavailable => 7,
        Reason::UnknownTenant => 8,
        Reason::ShareLimit => 14,
    }
}

/// `over_limit`: a rejection whose reason the API does not say (Envoy).
pub const OVER_LIMIT: u8 = 9;
/// A deadline passed.
pub const DEADLINE: u8 = 10;
/// `UNAVAILABLE` (no connection, owner out of reach).
pub const UNAVAILABLE: u8 = 11;
/// `INVALID_ARGUMENT`.
pub const INVALID: u8 = 12;
/// Anything else.
pub const OTHER: u8 = 13;

/// The label index of a gRPC error.
pub fn status_label(s: &tonic::Status) -> u8 {
    match s.code() {
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => DEADLINE,
        tonic::Code::Unavailable => UNAVAILABLE,
        tonic::Code::InvalidArgument => INVALID,
        _ => OTHER,
    }
}

/// One request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The gateway that sent it.
    pub gateway: u16,
    /// Planned arrival, nanoseconds from the start of the run.
    pub at: u64,
    /// When it was sent (= `at` when unsent).
    pub sent: u64,
    /// From the planned arrival to the answer (0 when unsent): what a caller waited,
    /// including any delay in sending.
    pub latency: u64,
    /// Tenant index.
    pub tenant: u32,
    /// Route index.
    pub route: u16,
    /// Key index (`workload::NO_KEY`: none).
    pub key: u32,
    /// Units.
    pub cost: u64,
    /// How it ended.
    pub kind: Kind,
    /// Why it was rejected or failed (an index into [`LABELS`]; 0 when admitted).
    pub label: u8,
    /// Who decided.
    pub source: Source,
}

impl Record {
    /// The line a gateway process prints.
    pub fn to_line(&self) -> String {
        let mut s = String::with_capacity(64);
        let _ = write!(
            s,
            "R {} {} {} {} {} {} {} {} {} {} {}",
            self.gateway,
            self.at,
            self.sent,
            self.latency,
            self.tenant,
            self.route,
            self.key,
            self.cost,
            kind_char(self.kind),
            self.label,
            source_char(self.source)
        );
        s
    }

    /// Reads a line of [`Self::to_line`]; `None` for any other line.
    pub fn from_line(line: &str) -> Option<Self> {
        let mut it = line.strip_prefix("R ")?.split(' ');
        let mut num = || it.next()?.parse::<u64>().ok();
        let gateway = u16::try_from(num()?).ok()?;
        let (at, sent, latency) = (num()?, num()?, num()?);
        let tenant = u32::try_from(num()?).ok()?;
        let route = u16::try_from(num()?).ok()?;
        let key = u32::try_from(num()?).ok()?;
        let cost = num()?;
        let kind = match it.next()? {
            "A" => Kind::Admitted,
            "R" => Kind::Rejected,
            "E" => Kind::Error,
            "U" => Kind::Unsent,
            _ => return None,
        };
        let label = it.next()?.parse::<u8>().ok().filter(|&l| usize::from(l) < LABELS.len())?;
        let source = match it.next()? {
            "r" => Source::Remote,
            "l" => Source::Local,
            "o" => Source::Owner,
            "g" => Source::Granted,
            "f" => Source::Fallback,
            _ => return None,
        };
        Some(Self { gateway, at, sent, latency, tenant, route, key, cost, kind, label, source })
    }
}

fn kind_char(k: Kind) -> char {
    match k {
        Kind::Admitted => 'A',
        Kind::Rejected => 'R',
        Kind::Error => 'E',
        Kind::Unsent => 'U',
    }
}

fn source_char(s: Source) -> char {
    match s {
        Source::Remote => 'r',
        Source::Local => 'l',
        Source::Owner => 'o',
        Source::Granted => 'g',
        Source::Fallback => 'f',
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_reads_back() {
        let r = Record {
            gateway: 3,
            at: 10,
            sent: 12,
            latency: 900,
            tenant: 7,
            route: 1,
            key: u32::MAX,
            cost: 5,
            kind: Kind::Rejected,
            label: 6,
            source: Source::Fallback,
        };
        assert_eq!(Record::from_line(&r.to_line()), Some(r));
        assert_eq!(Record::from_line("R 1 2"), None);
        assert_eq!(Record::from_line("hello"), None);
    }
}
