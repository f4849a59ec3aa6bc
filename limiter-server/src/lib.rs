//! limiter-server: the token-owner server.
//!
//! - gRPC on one port: our `limiter.v1.RateLimiter` ([`api::native`]), Envoy's
//!   `envoy.service.ratelimit.v3.RateLimitService` ([`api::envoy`]), `grpc.health.v1`
//!   and gRPC server reflection (v1 and v1alpha) for all of them;
//! - an admin HTTP port ([`admin`]): `/metrics`, `/healthz`, `/readyz`, `/policy`;
//! - the policy file, hot-reloaded ([`owner::reload`]); counters in a [`store::Store`];
//! - TLS and authentication per listener, and for calls to peers ([`security`]).
//!
//! [`Server::new`] validates everything before a socket exists; [`Server::run`] takes
//! listeners its caller bound (tests pass port 0) and a shutdown future.

pub(crate) mod admin;
pub mod api;
pub mod cli;
pub mod cluster;
pub mod config;
pub(crate) mod convert;
pub mod error;
pub(crate) mod listener;
pub mod metrics;
pub mod owner;
pub(crate) mod security;
pub mod store;
pub mod trace;

use std::future::Future;
use std::sync::Arc;

use limiter_core::clock::{Clock, MonotonicClock, Nanos};
use limiter_proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use limiter_proto::limiter::v1::rate_limiter_server::RateLimiterServer;
use tokio::net::TcpListener;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cluster::Cluster;
use crate::config::{Membership, ServerConfig, StoreKind};
use crate::owner::Owner;
use crate::owner::reload::{LoadError, PolicyHolder};
use crate::security::Security;
use crate::store::Store;
use crate::store::redis::RedisStore;

/// What one bucket of an RLQS usage report may take on the wire, at most (its id's
/// names within our name bounds, counts, durations): sizes the largest report.
const RLQS_BYTES_PER_BUCKET: usize = 1_024;
/// How often leases that reached their end are written off.
const LEASE_EXPIRY_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// The longest lease TTL `policy` can issue (what a dead node's tenants are fenced
/// for, at least).
fn longest_lease_ttl(policy: &limiter_core::policy::Policy) -> Nanos {
    policy.routes.values().map(|r| r.lease.ttl).fold(policy.lease.ttl, Nanos::max)
}

/// How often slices of root keys are looked at for renewal.
const SLICE_RENEW_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// gRPC server reflection in both versions tools speak (grpcurl and grpcui ask v1
/// first, older clients v1alpha), listing the native, Envoy and health services.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    // Each version lists both reflection services, whichever a tool asks.
    tonic_reflection::server::Builder::configure()
        .include_reflection_service(false)
        .register_encoded_file_descriptor_set(limiter_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
}

/// A configured server, not yet serving.
#[derive(Debug)]
pub struct Server {
    config: ServerConfig,
    owner: Arc<Owner>,
    security: Arc<Security>,
}

/// The two sockets a server serves on.
#[derive(Debug)]
pub struct Listeners {
    /// gRPC.
    pub grpc: TcpListener,
    /// Admin HTTP.
    pub admin: TcpListener,
}

/// Why serving stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The gRPC transport failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The admin server failed.
    #[error("admin server: {0}")]
    Admin(#[from] std::io::Error),
}

/// A server running in this process on loopback ports the OS chose (tests,
/// benchmarks, embedding). Dropping it stops the server.
#[derive(Debug)]
pub struct Running {
    /// The gRPC address.
    pub grpc: std::net::SocketAddr,
    /// The admin HTTP address.
    pub admin: std::net::SocketAddr,
    /// The decision logic.
    pub owner: Arc<Owner>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), RunError>>>,
}

impl Running {
    /// The gRPC URL, like `http://127.0.0.1:40001`.
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// Stops the server and waits for its drain.
    ///
    /// # Errors
    ///
    /// A transport failure while serving.
    ///
    /// # Panics
    ///
    /// When the server task panicked.
    pub async fn stop(mut self) -> Result<(), RunError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.task.take() {
            Some(t) => t.await.expect("the server task does not panic"),
            None => Ok(()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl Server {
    /// Serves on `127.0.0.1` ports the OS chooses, in a task of the current runtime.
    ///
    /// # Errors
    ///
    /// When the ports cannot be bound.
    pub async fn spawn_local(self) -> std::io::Result<Running> {
        let grpc = TcpListener::bind("127.0.0.1:0").await?;
        let admin = TcpListener::bind("127.0.0.1:0").await?;
        let (grpc_addr, admin_addr) = (grpc.local_addr()?, admin.local_addr()?);
        let owner = self.owner.clone();
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(self.run(Listeners { grpc, admin }, async {
            let _ = rx.await;
        }));
        Ok(Running {
            grpc: grpc_addr,
            admin: admin_addr,
            owner,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Loads and validates the policy; binds nothing.
    ///
    /// # Errors
    ///
    /// An unreadable or invalid policy file.
    pub fn new(config: ServerConfig) -> Result<Self, LoadError> {
        Self::with_clock(config, Arc::new(MonotonicClock::new()))
    }

    /// Like [`Server::new`] with a given clock.
    ///
    /// # Errors
    ///
    /// As [`Server::new`].
    pub fn with_clock(config: ServerConfig, clock: Arc<dyn Clock>) -> Result<Self, LoadError> {
        // The recorder first: loading the policy already publishes its version.
        metrics::handle();
        let security = Arc::new(Security::load(&config.security).map_err(LoadError::Security)?);
        let store = match &config.store {
            StoreKind::Memory => Store::memory(
                config.max_keys,
                config.limits.max_keys_per_tenant,
                config.cluster.replication && config.cluster.membership != Membership::Single,
            ),
            StoreKind::Redis(settings) => Store::redis(
                RedisStore::new(settings.clone(), clock.clone()).map_err(LoadError::Store)?,
                clock.clone(),
            ),
        };
        let max_log = config.limits.max_log_entries;
        let clustered = config.cluster.membership != Membership::Single;
        let envoy_route = config.envoy.default_route.clone();
        let shared_store_cluster = clustered && matches!(store, Store::Redis(_));
        let permits = move |p: &limiter_core::policy::Policy| {
            owner::check_concurrency(p, clustered, envoy_route.as_deref())
                .and(owner::check_shares(p, shared_store_cluster))
        };
        let check: owner::reload::Check = match &store {
            Store::Memory(_) => {
                Arc::new(move |p| store::check_log_sizes(p, max_log).and(permits(p)))
            }
            Store::Redis(_) => Arc::new(move |p| {
                store::check_log_sizes(p, max_log)
                    .and(store::redis::check_policy(p))
                    .and(permits(p))
            }),
        };
        let policies = Arc::new(PolicyHolder::load_checked(
            &config.policy_file,
            clock.clone(),
            check,
            config.limits.max_policy_bytes,
        )?);
        let stateful = matches!(store, Store::Memory(_));
        let longest_ttl = longest_lease_ttl(&policies.current().policy);
        let cluster = Arc::new(
            Cluster::new(
                config.cluster.clone(),
                security.peers.clone(),
                stateful,
                clock.clone(),
                longest_ttl,
            )
            .with_replica_room(config.max_keys),
        );
        if config.rlqs.envoys_carry_tokens {
            tracing::warn!(
                "rlqs.envoys_carry_tokens is set: a changed RLQS bucket is paid as Envoy 1.33 \
                 and later start it; an older Envoy admits up to its max_tokens beyond the \
                 limits at each change"
            );
        }
        let keys = if config.show_keys {
            tracing::warn!("dashboard.show_keys is set: the status page shows keys as sent");
            owner::heavy::KeyDisplay::Shown
        } else {
            owner::heavy::KeyDisplay::Hashed
        };
        let owner = Arc::new(
            Owner::new(policies, store, clock, config.limits)
                .with_cluster(cluster)
                .with_key_display(keys),
        );
        Ok(Self { config, owner, security })
    }

    /// The decision logic (for embedding and tests).
    pub fn owner(&self) -> &Arc<Owner> {
        &self.owner
    }

    /// Serves until `shutdown` resolves, then drains: readiness goes false, new
    /// connections stop after the drain delay, in-flight calls get the grace period.
    ///
    /// # Errors
    ///
    /// A transport failure.
    pub async fn run(
        self,
        listeners: Listeners,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), RunError> {
        let Self { config, owner, security } = self;
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(security.clone().watch(config.reload_poll, cancel.child_token()));
        tasks.spawn(owner::reload::watch(
            owner.policies().clone(),
            config.reload_poll,
            config.reload_settle,
            cancel.child_token(),
        ));
        tasks.spawn({
            let (owner, cancel, every) =
                (owner.clone(), cancel.child_token(), config.sweep_interval);
            async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        _ = tick.tick() => owner.sweep(),
                        () = tokio::time::sleep(LEASE_EXPIRY_EVERY) => {
                            let now = owner.clock().now();
                            owner.leases().expire(now);
                            owner.publish_fallback(now);
                            let policy = owner.policies().current();
                            owner.store().return_batches(&policy.policy, now, store::Returning::Due).await;
                        }
                    }
                }
            }
        });

        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_serving::<RateLimiterServer<api::native::NativeService>>().await;
        health.set_serving::<RateLimitServiceServer<api::envoy::EnvoyService>>().await;
        health.set_serving::<RateLimitQuotaServiceServer<api::rlqs::RlqsService>>().await;
        let max_message = config.limits.max_message_bytes;
        let native = RateLimiterServer::new(api::native::NativeService::new(owner.clone()))
            .max_decoding_message_size(max_message);
        let envoy = RateLimitServiceServer::new(api::envoy::EnvoyService::new(
            owner.clone(),
            config.envoy.clone(),
        ))
        .max_decoding_message_size(max_message);
        // An Envoy reports every bucket it tracks in one message: up to
        // `rlqs.max_buckets` of them, each a few dozen bytes of names.
        let rlqs_stop = CancellationToken::new();
        let rlqs = RateLimitQuotaServiceServer::new(api::rlqs::RlqsService::new(
            owner.clone(),
            config.envoy.clone(),
            config.rlqs,
            rlqs_stop.clone(),
        ))
        .max_decoding_message_size(
            max_message.max(config.rlqs.max_buckets.saturating_mul(RLQS_BYTES_PER_BUCKET)),
        );
        // The descriptor sets are built into the binary: a failure to decode them is a
        // build defect (the reflection test catches it), never caused by a caller.
        let reflection_v1 = reflection().build_v1().expect("the built-in descriptors decode");
        let reflection_alpha =
            reflection().build_v1alpha().expect("the built-in descriptors decode");
        let grpc_stop = CancellationToken::new();
        let (grpc_limits, admin_limits) = config.limits.connections(listener::raise_file_limit());
        tracing::info!(
            grpc = grpc_limits.max,
            admin = admin_limits.max,
            header_timeout = ?grpc_limits.header_timeout,
            "connection caps"
        );
        let router = tonic::transport::Server::builder()
            .max_concurrent_streams(config.limits.max_concurrent_streams)
            .http2_keepalive_interval(Some(config.limits.keepalive_interval))
            .http2_keepalive_timeout(Some(config.limits.keepalive_timeout))
            // A call whose body trickles in is ended: a connection busy with it is
            // never idle, so the idle timeout alone would not bound it.
            .timeout(config.limits.request_timeout)
            // HTTP/1 is accepted only to answer it with a hint (`listener::GRPC_ONLY`).
            .accept_http1(true)
            .layer(listener::ActivityLayer)
            .layer(security::guard::GuardLayer(security.grpc_guard.clone()))
            .layer(trace::Traced)
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_alpha)
            .add_service(native)
            .add_service(envoy)
            .add_service(rlqs);
        let conns = listener::accept(listeners.grpc, "grpc", grpc_limits, grpc_stop.clone());
        let stopped = grpc_stop.clone().cancelled_owned();
        let grpc = match &security.grpc_tls {
            None => {
                let incoming =
                    tokio_stream::wrappers::ReceiverStream::new(conns).map(Ok::<_, std::io::Error>);
                tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped))
            }
            Some(tls) => {
                let incoming = tokio_stream::wrappers::ReceiverStream::new(security::tls::accept(
                    conns,
                    tls.clone(),
                ))
                .map(Ok::<_, std::io::Error>);
                tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped))
            }
        };
        let admin_stop = CancellationToken::new();
        let history = Arc::new(admin::dashboard::History::default());
        tasks.spawn(admin::dashboard::sample_loop(
            owner.clone(),
            history.clone(),
            cancel.child_token(),
        ));
        let members = vec![config.listen.to_string()];
        if let Some(cluster) = owner.cluster().filter(|c| !c.is_single()).cloned() {
            let state: Arc<dyn cluster::LocalState> = owner.clone();
            tasks.spawn(cluster::membership::run(
                cluster.clone(),
                state.clone(),
                cancel.child_token(),
            ));
            tasks.spawn(cluster::replica::run(cluster.clone(), state, cancel.child_token()));
            let cancel = cancel.child_token();
            tasks.spawn(async move {
                let mut tick = tokio::time::interval(SLICE_RENEW_EVERY);
                loop {
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        _ = tick.tick() => cluster.renew_slices().await,
                    }
                }
            });
        }
        let app = admin::router(owner.clone(), history, members)
            .layer(security::guard::GuardLayer(security.admin_guard.clone()));
        let admin_conns =
            listener::accept(listeners.admin, "admin", admin_limits, admin_stop.clone());
        let (header, grace) = (admin_limits.header_timeout, config.grace);
        let admin = match &security.admin_tls {
            None => tokio::spawn(listener::serve_http1(
                admin_conns,
                app,
                header,
                admin_stop.clone(),
                grace,
            )),
            Some(tls) => tokio::spawn(listener::serve_http1(
                security::tls::accept(admin_conns, tls.clone()),
                app,
                header,
                admin_stop.clone(),
                grace,
            )),
        };
        if config.cluster.insecure_peers && owner.shared().is_some() {
            tracing::warn!(
                "cluster.insecure_peers is set: the gRPC port authenticates nobody, so any \
                 client can pass for a peer (hand off counters, send forwarded calls)"
            );
        }
        owner.set_ready(true);
        tracing::info!(
            grpc = %config.listen,
            admin = %config.admin_listen,
            policy = %config.policy_file.display(),
            version = owner.policies().current().version,
            "serving"
        );

        shutdown.await;
        tracing::info!(drain_delay = ?config.drain_delay, "shutting down: readiness off, draining");
        owner.set_ready(false);
        if let Some(cluster) = owner.cluster().filter(|c| !c.is_single()) {
            // Hand every counter to its next owner, then redirect until the end.
            cluster.drain(owner.store().limiter(), owner.leases()).await;
            cluster.return_slices().await;
        }
        health.set_not_serving::<RateLimiterServer<api::native::NativeService>>().await;
        health.set_not_serving::<RateLimitServiceServer<api::envoy::EnvoyService>>().await;
        health.set_not_serving::<RateLimitQuotaServiceServer<api::rlqs::RlqsService>>().await;
        // RLQS streams here pay their Envoys' assignments until they have reconnected
        // elsewhere (routed to the counters' new owners), then end.
        rlqs_stop.cancel();
        health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        tokio::time::sleep(config.drain_delay).await;
        grpc_stop.cancel();
        let result = match tokio::time::timeout(config.grace, grpc).await {
            Ok(Ok(r)) => r.map_err(RunError::from),
            Ok(Err(join)) => {
                tracing::error!("gRPC server task failed: {join}");
                Ok(())
            }
            Err(_) => {
                tracing::warn!(grace = ?config.grace, "in-flight calls abandoned after the grace period");
                Ok(())
            }
        };
        cancel.cancel();
        tasks.close();
        // Batches leased from Redis go back before the process ends.
        let policy = owner.policies().current();
        owner
            .store()
            .return_batches(&policy.policy, owner.clock().now(), store::Returning::All)
            .await;
        if tokio::time::timeout(config.grace, tasks.wait()).await.is_err() {
            tracing::warn!("background tasks abandoned after the grace period");
        }
        admin_stop.cancel();
        if tokio::time::timeout(config.grace, admin).await.is_err() {
            tracing::warn!("admin server abandoned after the grace period");
        }
        tracing::info!("stopped");
        result
    }
}
