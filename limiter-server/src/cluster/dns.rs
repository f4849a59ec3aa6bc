//! A small DNS stub resolver for membership: the A and AAAA records of one name (a
//! Kubernetes headless Service lists every pod's address that way), with their TTL.
//!
//! Asked of one nameserver (configured, or the first of `/etc/resolv.conf`), over UDP
//! with EDNS0 (4096-byte answers) and again over TCP when the answer is truncated,
//! with `resolv.conf`'s search list and `ndots` for relative names. Answers are
//! untrusted input: an answer must carry the query's id and question, compression
//! pointers are followed a bounded number of times, every length is checked, and only
//! records of the asked name or of the aliases (CNAME) it leads to are taken.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

const TYPE_A: u16 = 1;
const TYPE_CNAME: u16 = 5;
const TYPE_AAAA: u16 = 28;
const TYPE_OPT: u16 = 41;
const CLASS_IN: u16 = 1;
/// The UDP answer size this resolver accepts (EDNS0).
const UDP_SIZE: u16 = 4096;
/// Compression pointers followed in one name, at most.
const MAX_JUMPS: usize = 32;
/// Records read from one answer, at most (a headless Service of this many pods is
/// beyond any ring this server runs).
const MAX_RECORDS: usize = 4096;
/// CNAME hops followed from the asked name, at most.
const MAX_ALIASES: usize = 8;

/// What a lookup found: the addresses and the shortest TTL among their records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    /// Addresses, sorted, without duplicates.
    pub(crate) addresses: Vec<IpAddr>,
    /// The smallest TTL of the records taken (0 when there were none).
    pub(crate) ttl: Duration,
}

/// Why a lookup found nothing usable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum DnsError {
    /// No answer in time, or the socket failed.
    #[error("no answer from {server}: {why}")]
    Unreachable { server: SocketAddr, why: String },
    /// The server answered with an error code (other than "no such name").
    #[error("{server} answered with response code {code}")]
    Refused { server: SocketAddr, code: u8 },
    /// The answer could not be read.
    #[error("malformed answer from {server}: {why}")]
    Malformed { server: SocketAddr, why: &'static str },
    /// The name is not a valid DNS name.
    #[error("`{0}` is not a valid DNS name")]
    BadName(String),
}

/// Where and how to ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolver {
    server: SocketAddr,
    search: Vec<String>,
    ndots: usize,
    timeout: Duration,
}

/// What `resolv.conf` says: its nameservers, search list and `ndots`.
fn parse_resolv_conf(text: &str) -> (Vec<SocketAddr>, Vec<String>, usize) {
    let (mut servers, mut search, mut ndots) = (Vec::new(), Vec::new(), 1);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(ip) = words.next().and_then(|w| w.parse::<IpAddr>().ok()) {
                    servers.push(SocketAddr::new(ip, 53));
                }
            }
            Some("search" | "domain") => {
                search = words.map(|w| w.trim_end_matches('.').to_owned()).collect();
            }
            Some("options") => {
                for w in words {
                    if let Some(n) = w.strip_prefix("ndots:").and_then(|n| n.parse().ok()) {
                        ndots = std::cmp::min(n, 15);
                    }
                }
            }
            _ => {}
        }
    }
    (servers, search, ndots)
}

impl Resolver {
    /// Asks `server` (or, without one, the first nameserver of `/etc/resolv.conf`),
    /// each query within `timeout`.
    pub(crate) fn new(server: Option<SocketAddr>, timeout: Duration) -> Self {
        let (servers, search, ndots) = std::fs::read_to_string("/etc/resolv.conf")
            .map(|t| parse_resolv_conf(&t))
            .unwrap_or_default();
        let server = server
            .or_else(|| servers.first().copied())
            .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 53));
        Self { server, search, ndots, timeout }
    }

    /// The names tried for `name`, in order (`resolv.conf`'s rules: an absolute name
    /// as given; a relative one with fewer than `ndots` dots through the search list
    /// first).
    fn candidates(&self, name: &str) -> Vec<String> {
        if let Some(absolute) = name.strip_suffix('.') {
            return vec![absolute.to_owned()];
        }
        let searched = self.search.iter().map(|d| format!("{name}.{d}"));
        if name.matches('.').count() >= self.ndots {
            std::iter::once(name.to_owned()).chain(searched).collect()
        } else {
            searched.chain(std::iter::once(name.to_owned())).collect()
        }
    }

    /// The A and AAAA records of `name`. An answer with no address (the name does not
    /// exist, or has no records yet) is `Ok` with none: the caller decides what an
    /// empty view means.
    ///
    /// # Errors
    ///
    /// When neither lookup got a readable answer.
    pub(crate) async fn lookup(&self, name: &str) -> Result<Answer, DnsError> {
        let mut last = Ok(Answer { addresses: Vec::new(), ttl: Duration::ZERO });
        for candidate in self.candidates(name) {
            let (v4, v6) =
                tokio::join!(self.query(&candidate, TYPE_A), self.query(&candidate, TYPE_AAAA));
            let answer = match (v4, v6) {
                (Err(e), Err(_)) => Err(e),
                (Ok(a), Err(_)) | (Err(_), Ok(a)) => Ok(a),
                (Ok(mut a), Ok(b)) => {
                    a.addresses.extend(b.addresses);
                    a.addresses.sort_unstable();
                    a.addresses.dedup();
                    a.ttl = match (a.ttl, b.ttl) {
                        (Duration::ZERO, t) | (t, Duration::ZERO) => t,
                        (x, y) => x.min(y),
                    };
                    Ok(a)
                }
            };
            if matches!(&answer, Ok(a) if !a.addresses.is_empty()) {
                return answer;
            }
            last = answer;
        }
        last
    }

    async fn query(&self, name: &str, qtype: u16) -> Result<Answer, DnsError> {
        let id: u16 = rand_id();
        let packet = encode_query(id, name, qtype).ok_or_else(|| DnsError::BadName(short(name)))?;
        let server = self.server;
        let unreachable = |why: String| DnsError::Unreachable { server, why };
        let reply = tokio::time::timeout(self.timeout, async {
            let bind: SocketAddr = if server.is_ipv4() {
                (Ipv4Addr::UNSPECIFIED, 0).into()
            } else {
                (Ipv6Addr::UNSPECIFIED, 0).into()
            };
            let socket = UdpSocket::bind(bind).await.map_err(|e| unreachable(e.to_string()))?;
            socket.connect(server).await.map_err(|e| unreachable(e.to_string()))?;
            socket.send(&packet).await.map_err(|e| unreachable(e.to_string()))?;
            let mut buf = vec![0u8; usize::from(UDP_SIZE)];
            loop {
                let n = socket.recv(&mut buf).await.map_err(|e| unreachable(e.to_string()))?;
                // Anything not an answer to this question is ignored (a stray or
                // forged datagram), and the wait goes on within the deadline.
                if let Some(truncated) = answers_question(&buf[..n], id, name, qtype) {
                    if truncated {
                        return Ok(None);
                    }
                    buf.truncate(n);
                    return Ok(Some(buf));
                }
            }
        })
        .await
        .map_err(|_| unreachable(format!("no answer within {:?}", self.timeout)))??;
        let reply = match reply {
            Some(r) => r,
            None => tokio::time::timeout(self.timeout, query_tcp(server, &packet))
                .await
                .map_err(|_| unreachable(format!("no TCP answer within {:?}", self.timeout)))?
                .map_err(|e| unreachable(format!("TCP: {e}")))?,
        };
        if answers_question(&reply, id, name, qtype).is_none() {
            return Err(DnsError::Malformed { server, why: "the answer is for another question" });
        }
        parse_answer(&reply, name, qtype).map_err(|e| match e {
            Parse::Code(code) => DnsError::Refused { server, code },
            Parse::Bad(why) => DnsError::Malformed { server, why },
        })
    }
}

async fn query_tcp(server: SocketAddr, packet: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut stream = TcpStream::connect(server).await?;
    let len = u16::try_from(packet.len()).map_err(std::io::Error::other)?;
    let mut framed = len.to_be_bytes().to_vec();
    framed.extend_from_slice(packet);
    stream.write_all(&framed).await?;
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await?;
    let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut reply).await?;
    Ok(reply)
}

/// A query id nobody off the path can guess cheaply: SipHash under the process's
/// random keys, which std varies for every `RandomState`.
fn rand_id() -> u16 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let h = std::collections::hash_map::RandomState::new().build_hasher().finish();
    (h >> 48) as u16
}

/// `name` shortened for an error message.
fn short(name: &str) -> String {
    name.chars().take(64).collect()
}

/// A query for `name`'s records of `qtype`, with an EDNS0 OPT record; `None` for a
/// name that is not a valid DNS name (labels of 1 to 63 bytes, 253 in all).
fn encode_query(id: u16, name: &str, qtype: u16) -> Option<Vec<u8>> {
    let name = name.trim_end_matches('.');
    if name.is_empty() || name.len() > 253 {
        return None;
    }
    let mut p = Vec::with_capacity(32 + name.len());
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(&[0x01, 0x00]); // recursion desired
    p.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 1]); // 1 question, 1 additional
    for label in name.split('.') {
        let len = u8::try_from(label.len()).ok().filter(|l| (1..=63).contains(l))?;
        p.push(len);
        p.extend_from_slice(label.as_bytes());
    }
    p.push(0);
    p.extend_from_slice(&qtype.to_be_bytes());
    p.extend_from_slice(&CLASS_IN.to_be_bytes());
    // OPT: root name, type, UDP size as class, extended rcode and flags 0, no data.
    p.push(0);
    p.extend_from_slice(&TYPE_OPT.to_be_bytes());
    p.extend_from_slice(&UDP_SIZE.to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    Some(p)
}

/// Whether `reply` answers query `id` for (`name`, `qtype`): `Some(truncated)`.
fn answers_question(reply: &[u8], id: u16, name: &str, qtype: u16) -> Option<bool> {
    let header = reply.get(..12)?;
    let is_response = header[2] & 0x80 != 0;
    if u16::from_be_bytes([header[0], header[1]]) != id || !is_response {
        return None;
    }
    if u16::from_be_bytes([header[4], header[5]]) != 1 {
        return None;
    }
    let (qname, at) = read_name(reply, 12).ok()?;
    let fixed = reply.get(at..at + 4)?;
    let same = qname.eq_ignore_ascii_case(name.trim_end_matches('.'))
        && u16::from_be_bytes([fixed[0], fixed[1]]) == qtype
        && u16::from_be_bytes([fixed[2], fixed[3]]) == CLASS_IN;
    same.then_some(header[2] & 0x02 != 0)
}

#[derive(Debug, PartialEq, Eq)]
enum Parse {
    Code(u8),
    Bad(&'static str),
}

/// Reads a (possibly compressed) name at `at`: the name in dotted form, lower case,
/// and where the record goes on after it.
fn read_name(msg: &[u8], mut at: usize) -> Result<(String, usize), Parse> {
    let mut name = String::new();
    let mut end = None;
    let mut jumps = 0;
    loop {
        let len = *msg.get(at).ok_or(Parse::Bad("a name runs past the end"))?;
        match len & 0xC0 {
            0x00 if len == 0 => {
                return Ok((name, end.unwrap_or(at + 1)));
            }
            0x00 => {
                let label = msg
                    .get(at + 1..at + 1 + usize::from(len))
                    .ok_or(Parse::Bad("a label runs past the end"))?;
                if !name.is_empty() {
                    name.push('.');
                }
                name.extend(label.iter().map(|b| char::from(b.to_ascii_lowercase())));
                if name.len() > 255 {
                    return Err(Parse::Bad("a name is longer than 255 bytes"));
                }
                at += 1 + usize::from(len);
            }
            0xC0 => {
                let low = *msg.get(at + 1).ok_or(Parse::Bad("a pointer runs past the end"))?;
                jumps += 1;
                if jumps > MAX_JUMPS {
                    return Err(Parse::Bad("too many compression pointers"));
                }
                end.get_or_insert(at + 2);
                at = usize::from(u16::from_be_bytes([len & 0x3F, low]));
            }
            _ => return Err(Parse::Bad("an unknown label type")),
        }
    }
}

/// The addresses an answer gives `name` (directly or through its aliases).
fn parse_answer(msg: &[u8], name: &str, qtype: u16) -> Result<Answer, Parse> {
    let header = msg.get(..12).ok_or(Parse::Bad("shorter than a header"))?;
    let code = header[3] & 0x0F;
    let count = |i: usize| usize::from(u16::from_be_bytes([header[i], header[i + 1]]));
    match code {
        0 => {}
        // No such name: a definitive empty answer.
        3 => return Ok(Answer { addresses: Vec::new(), ttl: Duration::ZERO }),
        c => return Err(Parse::Code(c)),
    }
    let (questions, answers) = (count(4), count(6));
    if answers > MAX_RECORDS {
        return Err(Parse::Bad("too many records"));
    }
    let mut at = 12;
    for _ in 0..questions {
        at = read_name(msg, at)?.1 + 4;
    }
    let mut records = Vec::with_capacity(answers);
    for _ in 0..answers {
        let (owner, next) = read_name(msg, at)?;
        let fixed = msg.get(next..next + 10).ok_or(Parse::Bad("a record runs past the end"))?;
        let rtype = u16::from_be_bytes([fixed[0], fixed[1]]);
        let class = u16::from_be_bytes([fixed[2], fixed[3]]);
        let ttl = u32::from_be_bytes([fixed[4], fixed[5], fixed[6], fixed[7]]);
        let len = usize::from(u16::from_be_bytes([fixed[8], fixed[9]]));
        let data_at = next + 10;
        let data =
            msg.get(data_at..data_at + len).ok_or(Parse::Bad("record data runs past the end"))?;
        let value = match (rtype, class) {
            (TYPE_CNAME, CLASS_IN) => Some(Value::Alias(read_name(msg, data_at)?.0)),
            (TYPE_A, CLASS_IN) => {
                let b: [u8; 4] =
                    data.try_into().map_err(|_| Parse::Bad("an A record not of 4 bytes"))?;
                Some(Value::Address(IpAddr::from(b)))
            }
            (TYPE_AAAA, CLASS_IN) => {
                let b: [u8; 16] =
                    data.try_into().map_err(|_| Parse::Bad("an AAAA record not of 16 bytes"))?;
                Some(Value::Address(IpAddr::from(b)))
            }
            _ => None,
        };
        if let Some(v) = value {
            records.push((owner, ttl, v));
        }
        at = data_at + len;
    }
    // The asked name and the aliases it leads to, in the answer's own words.
    let mut names = vec![name.trim_end_matches('.').to_ascii_lowercase()];
    for _ in 0..MAX_ALIASES {
        let more: Vec<String> = records
            .iter()
            .filter_map(|(owner, _, v)| match v {
                Value::Alias(target) if names.contains(owner) && !names.contains(target) => {
                    Some(target.clone())
                }
                _ => None,
            })
            .collect();
        if more.is_empty() {
            break;
        }
        names.extend(more);
    }
    let mut addresses = Vec::new();
    let mut ttl = None::<u32>;
    for (owner, t, v) in &records {
        if let Value::Address(ip) = v {
            let wanted =
                matches!((ip, qtype), (IpAddr::V4(_), TYPE_A) | (IpAddr::V6(_), TYPE_AAAA));
            if wanted && names.contains(owner) {
                addresses.push(*ip);
                ttl = Some(ttl.map_or(*t, |m| m.min(*t)));
            }
        }
    }
    addresses.sort_unstable();
    addresses.dedup();
    Ok(Answer { addresses, ttl: Duration::from_secs(u64::from(ttl.unwrap_or(0))) })
}

enum Value {
    Alias(String),
    Address(IpAddr),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer to `query` with `records` (owner, type, ttl, data), names uncompressed
    /// except where a record's owner is `None` (a pointer to the question's name).
    fn reply(query: &[u8], code: u8, records: &[(Option<&str>, u16, u32, Vec<u8>)]) -> Vec<u8> {
        let qlen = query.len() - 11; // without the OPT record
        let mut r = query[..qlen].to_vec();
        r[2] = 0x81;
        r[3] = 0x80 | code;
        r[6..8].copy_from_slice(&u16::try_from(records.len()).unwrap().to_be_bytes());
        r[10..12].copy_from_slice(&[0, 0]);
        for (owner, rtype, ttl, data) in records {
            match owner {
                None => r.extend_from_slice(&[0xC0, 12]),
                Some(n) => r.extend(encoded_name(n)),
            }
            r.extend_from_slice(&rtype.to_be_bytes());
            r.extend_from_slice(&CLASS_IN.to_be_bytes());
            r.extend_from_slice(&ttl.to_be_bytes());
            r.extend_from_slice(&u16::try_from(data.len()).unwrap().to_be_bytes());
            r.extend_from_slice(data);
        }
        r
    }

    fn encoded_name(n: &str) -> Vec<u8> {
        let mut v = Vec::new();
        for l in n.split('.') {
            v.push(u8::try_from(l.len()).unwrap());
            v.extend_from_slice(l.as_bytes());
        }
        v.push(0);
        v
    }

    #[test]
    fn an_answer_gives_the_names_addresses_and_the_shortest_ttl() {
        let q = encode_query(7, "limiter.ns.svc", TYPE_A).unwrap();
        let r = reply(
            &q,
            0,
            &[
                (None, TYPE_A, 30, vec![10, 0, 0, 2]),
                (Some("LIMITER.ns.svc"), TYPE_A, 5, vec![10, 0, 0, 1]),
                (Some("other.example"), TYPE_A, 1, vec![6, 6, 6, 6]),
                (None, 16, 1, b"\x03txt".to_vec()),
            ],
        );
        assert_eq!(answers_question(&r, 7, "limiter.ns.svc", TYPE_A), Some(false));
        assert_eq!(answers_question(&r, 8, "limiter.ns.svc", TYPE_A), None, "another id");
        assert_eq!(answers_question(&r, 7, "other.ns.svc", TYPE_A), None, "another name");
        let a = parse_answer(&r, "limiter.ns.svc", TYPE_A).unwrap();
        let ips: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()];
        assert_eq!(a, Answer { addresses: ips, ttl: Duration::from_secs(5) });
    }

    #[test]
    fn aliases_are_followed_and_nothing_else_is_taken() {
        let q = encode_query(1, "svc.example", TYPE_AAAA).unwrap();
        let target = encoded_name("real.example");
        let r = reply(
            &q,
            0,
            &[
                (None, TYPE_CNAME, 60, target),
                (Some("real.example"), TYPE_AAAA, 60, vec![0xfd; 16]),
                (Some("real.example"), TYPE_A, 60, vec![1, 2, 3, 4]),
            ],
        );
        let a = parse_answer(&r, "svc.example", TYPE_AAAA).unwrap();
        assert_eq!(a.addresses, vec![IpAddr::from([0xfd; 16])]);
    }

    #[test]
    fn hostile_answers_are_errors_not_panics() {
        let q = encode_query(1, "a.b", TYPE_A).unwrap();
        let good = reply(&q, 0, &[(None, TYPE_A, 1, vec![1, 2, 3, 4])]);
        // Every truncation of a good answer.
        for n in 0..good.len() {
            let _ = parse_answer(&good[..n], "a.b", TYPE_A);
            let _ = answers_question(&good[..n], 1, "a.b", TYPE_A);
        }
        // A pointer to itself loops: bounded.
        let mut looped = good.clone();
        let owner_at = q.len() - 11;
        looped[owner_at..owner_at + 2].copy_from_slice(&[0xC0, u8::try_from(owner_at).unwrap()]);
        assert_eq!(
            parse_answer(&looped, "a.b", TYPE_A),
            Err(Parse::Bad("too many compression pointers"))
        );
        // A wrong-sized A record.
        let bad = reply(&q, 0, &[(None, TYPE_A, 1, vec![1, 2, 3])]);
        assert!(parse_answer(&bad, "a.b", TYPE_A).is_err());
        // Error codes: no such name is an empty answer, a failure an error.
        assert!(parse_answer(&reply(&q, 3, &[]), "a.b", TYPE_A).unwrap().addresses.is_empty());
        assert_eq!(parse_answer(&reply(&q, 2, &[]), "a.b", TYPE_A), Err(Parse::Code(2)));
        // Random bytes.
        let mut x: u32 = 0x9E37_79B9;
        for _ in 0..2000 {
            let msg: Vec<u8> = (0..64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            let _ = parse_answer(&msg, "a.b", TYPE_A);
        }
    }

    #[test]
    fn names_that_are_not_dns_names_are_refused() {
        assert!(encode_query(1, "", TYPE_A).is_none());
        assert!(encode_query(1, "a..b", TYPE_A).is_none());
        assert!(encode_query(1, &"x".repeat(64), TYPE_A).is_none());
        assert!(encode_query(1, &["a"; 200].join("."), TYPE_A).is_none());
        assert!(encode_query(1, "limiter-headless.default.svc.cluster.local.", TYPE_A).is_some());
    }

    #[test]
    fn resolv_conf_search_rules() {
        let (servers, search, ndots) = parse_resolv_conf(
            "# k8s\nnameserver 10.96.0.10\nnameserver bad\nsearch default.svc.cluster.local svc.cluster.local\noptions ndots:5 timeout:1\n",
        );
        assert_eq!(servers, vec!["10.96.0.10:53".parse().unwrap()]);
        let r = Resolver { server: servers[0], search, ndots, timeout: Duration::from_secs(1) };
        assert_eq!(
            r.candidates("limiter-headless"),
            vec![
                "limiter-headless.default.svc.cluster.local",
                "limiter-headless.svc.cluster.local",
                "limiter-headless"
            ]
        );
        assert_eq!(
            r.candidates("a.b.c.d.e.f"),
            vec![
                "a.b.c.d.e.f",
                "a.b.c.d.e.f.default.svc.cluster.local",
                "a.b.c.d.e.f.svc.cluster.local"
            ]
        );
        assert_eq!(r.candidates("x.y."), vec!["x.y"]);
    }
}
