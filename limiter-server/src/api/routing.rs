//! Routing by ownership: each request is decided by its tenant's owner. A node that
//! is not the owner forwards the request once (single decisions queued per peer and
//! sent as batches); the owner answers, or names the node that owns the tenant in its
//! own view, and that node is asked once more and must answer (hop 2): never a loop.
//! When the owner cannot be reached, the route's failure policy decides here.

use std::sync::Arc;

use limiter_core::policy::Request;
use limiter_proto::limiter::v1 as pb;

use crate::cluster::ring::Member;
use crate::cluster::{Cluster, Placement};
use crate::convert;
use crate::error::ServerError;
use crate::metrics::{self as m, Api};
use crate::owner::{Charge, Outcome, Owner, Reach, Report};

fn counted(api: Api, outcome: &'static str) {
    metrics::counter!(m::FORWARDS, "api" => api.as_str(), "outcome" => outcome).increment(1);
}

/// Where a request for `name` goes: `None` decides here; `Some(Err(owner))` answers
/// "moved" (a forwarded call this node does not own); `Some(Ok(owner))` forwards.
pub async fn target(cluster: &Cluster, name: &str, hop: u8) -> Option<Result<Member, Member>> {
    if hop >= 2 || cluster.is_single() {
        return None;
    }
    match cluster.settle(name).await {
        Placement::Remote(owner) if hop == 1 => Some(Err(owner)),
        Placement::Remote(owner) => Some(Ok(owner)),
        _ => None,
    }
}

/// Sends one call about `tenant` to its `owner` (hop 1) and follows one redirect
/// (hop 2): the answer, or `Ok(None)` when the redirect names this node and this
/// node's own view agrees that the tenant is its own.
///
/// # Errors
///
/// The owner's error, or `UNAVAILABLE` when no owner could be reached or the views
/// disagree.
pub async fn forward_once<T, F, Fut>(
    cluster: &Cluster,
    owner: &Member,
    tenant: &str,
    call: F,
) -> Result<Option<T>, tonic::Status>
where
    F: Fn(crate::cluster::peers::Peer, u8) -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let to = match call(cluster.peer(owner)?, 1).await {
        Ok(answer) => return Ok(Some(answer)),
        Err(s) => crate::cluster::peers::moved_to(&s).ok_or(s)?,
    };
    if *to != *cluster.me().address {
        return call(cluster.peers().get(&to)?, 2).await.map(Some);
    }
    match cluster.settle(tenant).await {
        Placement::Remote(o) => Err(tonic::Status::unavailable(format!(
            "{} and {} each name the other",
            o.id,
            cluster.me().id
        ))),
        _ => Ok(None),
    }
}

/// Files element `i` under its owner.
fn group(groups: &mut Vec<(Member, Vec<usize>)>, owner: Member, i: usize) {
    match groups.iter_mut().find(|(m, _)| m.id == owner.id) {
        Some((_, v)) => v.push(i),
        None => groups.push((owner, vec![i])),
    }
}

/// Decisions of a batch made between two yields to the runtime.
const YIELD_EVERY: usize = 64;

async fn decide_here(
    owner: &Owner,
    reqs: &[pb::ShouldAllowRequest],
    idx: &[usize],
    unreachable: bool,
) -> Result<Vec<Outcome>, (usize, ServerError)> {
    let mut out = Vec::with_capacity(idx.len());
    // Tickets and permit blocks are decided one by one.
    let later = idx.iter().any(|&i| reqs[i].report_later || reqs[i].permit_block);
    if !later {
        // A large batch is decided in parts, yielding between them, so that one
        // caller's batches cannot hold a worker while single decisions wait. It is
        // validated whole first: a bad request still refuses it before any charge.
        if idx.len() > YIELD_EVERY {
            owner
                .validate(idx.iter().map(|&i| convert::request(&reqs[i])))
                .map_err(|(j, e)| (idx[j], e))?;
        }
        for (n, part) in idx.chunks(YIELD_EVERY).enumerate() {
            if n > 0 {
                tokio::task::yield_now().await;
            }
            let core: Vec<Request<'_>> = part.iter().map(|&i| convert::request(&reqs[i])).collect();
            let turns: Vec<Option<u64>> = part.iter().map(|&i| reqs[i].turn).collect();
            let o = owner
                .decide_waiting(
                    Api::Native,
                    &core,
                    &turns,
                    Charge::Each,
                    Report::Now,
                    Reach::of(unreachable),
                )
                .await
                .map_err(|(j, e)| (part[j], e))?;
            out.extend(o);
        }
        return Ok(out);
    }
    for &i in idx {
        let core = convert::request(&reqs[i]);
        let api = if reqs[i].permit_block { Api::Permits } else { Api::Native };
        let o = owner
            .decide_waiting(
                api,
                std::slice::from_ref(&core),
                &[reqs[i].turn],
                Charge::Each,
                if reqs[i].report_later { Report::Later } else { Report::Now },
                Reach::of(unreachable),
            )
            .await
            .map_err(|(_, e)| (i, e))?;
        out.extend(o);
    }
    Ok(out)
}

/// Decides `reqs` (arrived at hop `hop`), each by its tenant's owner.
///
/// # Errors
///
/// The first request that can never succeed, by index.
pub async fn should_allow(
    owner: &Arc<Owner>,
    reqs: &[pb::ShouldAllowRequest],
    hop: u8,
) -> Result<Vec<pb::ShouldAllowResponse>, (usize, ServerError)> {
    let Some(cluster) = owner.cluster().filter(|c| !c.is_single()) else {
        let all: Vec<usize> = (0..reqs.len()).collect();
        return Ok(decide_here(owner, reqs, &all, false)
            .await?
            .iter()
            .map(Outcome::response)
            .collect());
    };
    // Refuse what can never succeed here, before anything is forwarded.
    owner.validate(reqs.iter().map(convert::request))?;
    let mut out: Vec<Option<pb::ShouldAllowResponse>> = vec![None; reqs.len()];
    let mut here = Vec::new();
    let mut away: Vec<(Member, Vec<usize>)> = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        match target(cluster, &r.tenant, hop).await {
            None => here.push(i),
            Some(Err(o)) => {
                out[i] = Some(pb::ShouldAllowResponse {
                    moved_to: o.address.to_string(),
                    ..Default::default()
                });
            }
            Some(Ok(o)) => group(&mut away, o, i),
        }
    }
    let mut unreachable = Vec::new();
    let mut redirected: Vec<(usize, String)> = Vec::new();
    for (member, idx) in away {
        let answers = forward(cluster, &member, reqs, &idx).await;
        match answers {
            Ok(answers) => {
                for (&i, a) in idx.iter().zip(answers) {
                    if a.moved_to.is_empty() {
                        out[i] = Some(a);
                    } else {
                        redirected.push((i, a.moved_to));
                    }
                }
                counted(Api::Native, "answered");
            }
            Err(e) => {
                tracing::debug!(peer = %member.id, "forward failed: {e}");
                counted(Api::Native, "unreachable");
                unreachable.extend(idx);
            }
        }
    }
    for (i, to) in redirected {
        counted(Api::Native, "redirected");
        if *to == *cluster.me().address {
            // Named the owner by a node whose view differs: decide here only if this
            // node's own view agrees; otherwise neither holds the counters for sure.
            if matches!(cluster.settle(&reqs[i].tenant).await, Placement::Remote(_)) {
                unreachable.push(i);
            } else {
                here.push(i);
            }
            continue;
        }
        let answer = match cluster.peers().get(&to) {
            Ok(p) => p.allow_batch(vec![reqs[i].clone()], 2).await.ok().and_then(|mut v| v.pop()),
            Err(_) => None,
        };
        match answer {
            Some(a) if a.moved_to.is_empty() => out[i] = Some(a),
            _ => unreachable.push(i),
        }
    }
    here.sort_unstable();
    for (i, o) in here.iter().zip(decide_here(owner, reqs, &here, false).await?) {
        out[*i] = Some(o.response());
    }
    unreachable.sort_unstable();
    for (i, o) in unreachable.iter().zip(decide_here(owner, reqs, &unreachable, true).await?) {
        out[*i] = Some(o.response());
    }
    Ok(out.into_iter().map(Option::unwrap_or_default).collect())
}

async fn forward(
    cluster: &Cluster,
    member: &Member,
    reqs: &[pb::ShouldAllowRequest],
    idx: &[usize],
) -> Result<Vec<pb::ShouldAllowResponse>, tonic::Status> {
    let peer = cluster.peer(member)?;
    if let [i] = idx {
        return Ok(vec![peer.allow(reqs[*i].clone()).await?]);
    }
    let batch: Vec<_> = idx.iter().map(|&i| reqs[i].clone()).collect();
    let answers = peer.allow_batch(batch, 1).await?;
    if answers.len() == idx.len() {
        Ok(answers)
    } else {
        Err(tonic::Status::internal("peer answered a different count"))
    }
}

/// Handles a lease call (arrived at hop `hop`): items this node owns are granted
/// here, the others forwarded to their owners (or, for a caller that routes by an
/// older ring, answered with the owner's address).
///
/// # Errors
///
/// An item that can never succeed, by index.
pub async fn lease(
    owner: &Arc<Owner>,
    req: &pb::LeaseRequest,
    hop: u8,
) -> Result<Vec<pb::LeaseGrant>, (usize, ServerError)> {
    // Slices of root levels are leased between nodes only (a peer's call, which the
    // listener's auth holds to the peer role): a client naming a level or a class
    // would take what the level's owner divides among nodes, or a class's share.
    if hop == 0
        && let Some(i) = req.items.iter().position(|i| i.level != 0 || !i.share_class.is_empty())
    {
        let field = if req.items[i].level != 0 { "level" } else { "share_class" };
        return Err((
            i,
            ServerError::invalid(field, "slices of root levels are leased by nodes only"),
        ));
    }
    // A rate holder's asks are not cut to the batch and may name the least they take:
    // the server's own RLQS service makes them (through `lease_routed`), never a
    // client (a client's `least` would otherwise be dropped without a word).
    if hop == 0
        && let Some(i) = req.items.iter().position(|i| i.rates || i.least != 0 || i.after_keeps)
    {
        let item = &req.items[i];
        let field = match () {
            () if item.rates => "rates",
            () if item.least != 0 => "least",
            () => "after_keeps",
        };
        return Err((i, ServerError::invalid(field, "set by the server's RLQS service only")));
    }
    lease_routed(owner, req, hop).await
}

/// [`lease`] without the checks of what only nodes may ask: the server's own callers
/// (the RLQS service) and peers.
///
/// # Errors
///
/// As [`lease`].
pub async fn lease_routed(
    owner: &Arc<Owner>,
    req: &pb::LeaseRequest,
    hop: u8,
) -> Result<Vec<pb::LeaseGrant>, (usize, ServerError)> {
    let Some(cluster) = owner.cluster().filter(|c| !c.is_single()) else {
        return owner.lease(&req.agent_id, &req.items).await;
    };
    let epoch = cluster.ring().epoch;
    let mut out: Vec<Option<pb::LeaseGrant>> = vec![None; req.items.len()];
    let mut here = Vec::new();
    let mut away: Vec<(Member, Vec<usize>)> = Vec::new();
    for (i, item) in req.items.iter().enumerate() {
        match target(cluster, &crate::cluster::lease_name(item), hop).await {
            None => here.push(i),
            Some(Ok(o)) if req.epoch == 0 => group(&mut away, o, i),
            Some(Ok(o) | Err(o)) => {
                out[i] =
                    Some(pb::LeaseGrant { redirect: o.address.to_string(), ..Default::default() });
            }
        }
    }
    let mut failed = Vec::new();
    for (member, idx) in away {
        let sub = pb::LeaseRequest {
            agent_id: req.agent_id.clone(),
            items: idx.iter().map(|&i| req.items[i].clone()).collect(),
            epoch: 0,
        };
        let answer = match cluster.peer(&member) {
            Ok(p) => p.lease(sub, 1).await.map(|r| r.grants),
            Err(e) => Err(e),
        };
        match answer {
            Ok(grants) if grants.len() == idx.len() => {
                counted(Api::Lease, "answered");
                for (&i, g) in idx.iter().zip(grants) {
                    if g.redirect.is_empty() {
                        out[i] = Some(g);
                    } else if *g.redirect == *cluster.me().address {
                        let name = crate::cluster::lease_name(&req.items[i]);
                        if matches!(cluster.settle(&name).await, Placement::Remote(_)) {
                            failed.push(i);
                        } else {
                            here.push(i);
                        }
                    } else {
                        counted(Api::Lease, "redirected");
                        let again = pb::LeaseRequest {
                            agent_id: req.agent_id.clone(),
                            items: vec![req.items[i].clone()],
                            epoch: 0,
                        };
                        let r = match cluster.peers().get(&g.redirect) {
                            Ok(p) => p
                                .lease(again, 2)
                                .await
                                .ok()
                                .and_then(|r| r.grants.into_iter().next()),
                            Err(_) => None,
                        };
                        match r {
                            Some(g) if g.redirect.is_empty() => out[i] = Some(g),
                            _ => failed.push(i),
                        }
                    }
                }
            }
            _ => {
                counted(Api::Lease, "unreachable");
                failed.extend(idx);
            }
        }
    }
    here.sort_unstable();
    if !here.is_empty() {
        let items: Vec<pb::LeaseItem> = here.iter().map(|&i| req.items[i].clone()).collect();
        let grants = owner.lease(&req.agent_id, &items).await.map_err(|(j, e)| (here[j], e))?;
        for (&i, g) in here.iter().zip(grants) {
            out[i] = Some(g);
        }
    }
    // Owners out of reach: nothing to hold; a waiting request gets its route's
    // failure policy, decided here.
    for i in failed {
        let item = &req.items[i];
        let mut g = pb::LeaseGrant { mode: pb::LeaseMode::Direct.into(), ..Default::default() };
        if item.cost > 0 && item.level == 0 {
            let core = Request {
                tenant: &item.tenant,
                route: &item.route,
                key: (!item.key.is_empty()).then_some(item.key.as_str()),
                cost: Some(item.cost),
                dry_run: false,
            };
            g.decision = owner.fallback_decision(&core).await.map_err(|e| (i, e))?;
        }
        out[i] = Some(g);
    }
    Ok(out.into_iter().map(|g| pb::LeaseGrant { epoch, ..g.unwrap_or_default() }).collect())
}
