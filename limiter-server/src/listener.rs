//! Connections on the two listeners, bounded: each listener has its own cap on open
//! connections (so a flood of one port never starves the other), a connection must
//! send its first request within the header timeout, and one that has nothing in
//! flight for the idle timeout is closed. Refusals and timeouts are counted in
//! `limiter_connections_refused_total` and `limiter_connection_timeouts_total`.
//!
//! The watchdog lives in the connection's reads: the HTTP server always has a read
//! pending on an open connection, so a timer polled there closes it (the read fails)
//! without a task per connection. Requests mark the connection busy through
//! [`ActivityLayer`], which finds the connection's [`Activity`] in the request's
//! extensions (tonic puts the connection's [`ConnInfo`] there; the admin server
//! inserts it itself).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use crate::metrics as m;

/// The bounds of one listener's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections at most; more are closed as soon as they are accepted.
    pub max: usize,
    /// Time from accept to the first request.
    pub header_timeout: Duration,
    /// Time with no request in flight before a connection is closed.
    pub idle_timeout: Duration,
}

/// What one connection is doing, shared by its reads and its requests.
#[derive(Debug)]
pub(crate) struct Activity {
    opened: Instant,
    in_flight: AtomicUsize,
    requests: AtomicU64,
    /// Milliseconds after `opened` when the last request ended.
    last_ms: AtomicU64,
    /// Its place under the listener's cap; taken by a newer connection when the
    /// listener is full and this one has been idle the longest.
    slot: Mutex<Option<OwnedSemaphorePermit>>,
    evicted: AtomicBool,
    /// The connection's task (so an eviction can wake it).
    waker: Mutex<Option<Waker>>,
}

impl Activity {
    fn new(slot: OwnedSemaphorePermit) -> Self {
        Self {
            opened: Instant::now(),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
            slot: Mutex::new(Some(slot)),
            evicted: AtomicBool::new(false),
            waker: Mutex::new(None),
        }
    }

    /// Takes this connection's slot if it has nothing in flight; it then closes.
    fn evict(&self) -> Option<OwnedSemaphorePermit> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let slot = self.slot.lock().take()?;
        self.evicted.store(true, Ordering::Release);
        if let Some(w) = self.waker.lock().take() {
            w.wake();
        }
        Some(slot)
    }

    /// A request started; the returned guard ends it.
    pub(crate) fn begin(self: &Arc<Self>) -> Busy {
        // Relaxed: counters read only by this connection's watchdog, which re-checks.
        // Release: an eviction that sees a request in flight leaves the connection alone.
        self.in_flight.fetch_add(1, Ordering::Release);
        self.requests.fetch_add(1, Ordering::Relaxed);
        Busy(self.clone())
    }

    /// When it last did anything: its last request's end, or its opening.
    fn last_active(&self) -> Instant {
        self.opened + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    fn since_opened_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A request in flight on a connection (ends when dropped).
#[derive(Debug)]
pub(crate) struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.last_ms.store(self.0.since_opened_ms(), Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The connection's information tonic puts in every request: its [`Activity`] (under
/// TLS, tonic wraps it with the certificates).
#[derive(Debug, Clone)]
pub(crate) struct ConnInfo {
    /// The connection's activity.
    pub(crate) activity: Arc<Activity>,
}

/// A connection counted against its listener's cap and closed when it idles.
#[derive(Debug)]
pub(crate) struct Conn<IO> {
    io: IO,
    activity: Arc<Activity>,
    timer: Pin<Box<Sleep>>,
    limits: ConnectionLimits,
    listener: &'static str,
    expired: bool,
}

impl<IO> Conn<IO> {
    /// The connection's activity.
    #[cfg(test)]
    fn activity(&self) -> &Arc<Activity> {
        &self.activity
    }

    /// The inner stream.
    pub(crate) fn get_ref(&self) -> &IO {
        &self.io
    }

    /// True once the connection has waited too long: polled from reads.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.expired {
            return true;
        }
        let a = &self.activity;
        if a.evicted.load(Ordering::Acquire) {
            metrics::counter!(m::CONNECTION_TIMEOUTS, "listener" => self.listener, "kind" => "evicted")
                .increment(1);
            self.expired = true;
            return true;
        }
        // An eviction must be able to wake this task (the waker is cloned only when it
        // changes).
        {
            let mut w = a.waker.lock();
            if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *w = Some(cx.waker().clone());
            }
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            let a = &self.activity;
            let now_ms = a.since_opened_ms();
            let (base_ms, limit, kind) = if a.in_flight.load(Ordering::Relaxed) > 0 {
                (now_ms, self.limits.idle_timeout, "idle")
            } else if a.requests.load(Ordering::Relaxed) == 0 {
                (0, self.limits.header_timeout, "header")
            } else {
                (a.last_ms.load(Ordering::Relaxed), self.limits.idle_timeout, "idle")
            };
            let limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
            let due_ms = base_ms.saturating_add(limit_ms);
            if due_ms <= now_ms {
                metrics::counter!(m::CONNECTION_TIMEOUTS, "listener" => self.listener, "kind" => kind)
                    .increment(1);
                tracing::debug!(listener = self.listener, kind, "connection closed: timed out");
                self.expired = true;
                return true;
            }
            let deadline = a.opened + Duration::from_millis(due_ms);
            self.timer.as_mut().reset(deadline);
        }
        false
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Conn<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.expired(cx) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection idle or too slow to send its request",
            )));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Conn<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO> tonic::transport::server::Connected for Conn<IO> {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        ConnInfo { activity: self.activity.clone() }
    }
}

/// A connection that knows its [`Activity`] (plain or under TLS).
pub(crate) trait Counted {
    /// The connection's activity.
    fn activity(&self) -> Arc<Activity>;
}

impl Counted for Conn<TcpStream> {
    fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }
}

impl Counted for tokio_rustls::server::TlsStream<Conn<TcpStream>> {
    fn activity(&self) -> Arc<Activity> {
        self.get_ref().0.activity.clone()
    }
}

/// Serves `app` over HTTP/1.1 on the connections of `incoming` until `stop` fires,
/// then lets requests in flight finish within `grace`. A request's headers must
/// arrive within `header_timeout`.
pub(crate) async fn serve_http1<IO>(
    mut incoming: mpsc::Receiver<IO>,
    app: axum::Router,
    header_timeout: Duration,
    stop: CancellationToken,
    grace: Duration,
) where
    IO: AsyncRead + AsyncWrite + Counted + Unpin + Send + 'static,
{
    use tower::ServiceExt as _;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let io = tokio::select! {
            () = stop.cancelled() => break,
            io = incoming.recv() => match io {
                Some(io) => io,
                None => break,
            },
        };
        let activity = io.activity();
        let app = app.clone();
        let service =
            hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let busy = activity.begin();
                let app = app.clone();
                async move {
                    let answer = app.oneshot(req.map(axum::body::Body::new)).await;
                    drop(busy);
                    answer
                }
            });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(hyper_util::rt::TokioIo::new(io), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(incoming);
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!(?grace, "admin requests abandoned after the grace period");
    }
}

/// Accepts on `listener` until `stop` fires and hands over the connections within
/// `limits.max`; those beyond it are closed at once and counted.
pub(crate) fn accept(
    listener: TcpListener,
    name: &'static str,
    limits: ConnectionLimits,
    stop: CancellationToken,
) -> mpsc::Receiver<Conn<TcpStream>> {
    let (tx, rx) = mpsc::channel(64);
    let slots = Arc::new(Semaphore::new(limits.max.max(1)));
    metrics::gauge!(m::CONNECTIONS_MAX, "listener" => name).set(limits.max as f64);
    tokio::spawn(async move {
        // Every open connection (dead ones pruned now and then).
        let mut open: Vec<std::sync::Weak<Activity>> = Vec::new();
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return,
                () = tx.closed() => return,
                a = listener.accept() => a,
            };
            let tcp = match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::warn!(listener = name, "accept failed: {e}");
                    // Out of descriptors and the like: do not spin.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            let slot = match slots.clone().try_acquire_owned() {
                Ok(slot) => Some(slot),
                // Full: one that never asked gives its place up, else the one idle
                // the longest (an idle flood churns itself, and so does one that
                // asks once and then holds its connections).
                Err(_) => evict_idlest(&mut open),
            };
            let Some(slot) = slot else {
                metrics::counter!(m::CONNECTIONS_REFUSED, "listener" => name).increment(1);
                tracing::debug!(
                    listener = name,
                    max = limits.max,
                    "connection refused: at the cap"
                );
                drop(tcp);
                continue;
            };
            // No Nagle: a decision is a small message that must leave at once.
            let _ = tcp.set_nodelay(true);
            let activity = Arc::new(Activity::new(slot));
            if open.len() >= 2 * limits.max.max(1) {
                open.retain(|w| w.strong_count() > 0);
            }
            open.push(Arc::downgrade(&activity));
            let timer = Box::pin(tokio::time::sleep(limits.header_timeout));
            let conn = Conn { io: tcp, activity, timer, limits, listener: name, expired: false };
            if tx.send(conn).await.is_err() {
                return;
            }
        }
    });
    rx
}

/// Takes the slot of an open connection with nothing in flight: the oldest of those
/// that never sent a request, else the one idle the longest. `None` when every one is
/// busy. (A caller that keeps asking is never the first to go.)
fn evict_idlest(open: &mut Vec<std::sync::Weak<Activity>>) -> Option<OwnedSemaphorePermit> {
    open.retain(|w| w.strong_count() > 0);
    let idlest = open
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .filter(|a| a.in_flight.load(Ordering::Acquire) == 0 && !a.evicted.load(Ordering::Acquire))
        .min_by_key(|a| (a.requests.load(Ordering::Relaxed) > 0, a.last_active()))?;
    idlest.evict()
}

/// The gRPC port's tower layer: marks a connection busy while a call is in flight,
/// and answers HTTP/1 requests (a browser, `curl` without `--http2`) with a hint.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ActivityLayer;

impl<S> tower::Layer<S> for ActivityLayer {
    type Service = ActivityService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ActivityService { inner }
    }
}

/// The service of [`ActivityLayer`].
#[derive(Debug, Clone)]
pub(crate) struct ActivityService<S> {
    inner: S,
}

/// The activity of the connection a request came on, wherever the server put it.
fn activity_of<B>(req: &http::Request<B>) -> Option<Arc<Activity>> {
    use tonic::transport::server::TlsConnectInfo;
    let ext = req.extensions();
    ext.get::<Arc<Activity>>()
        .or_else(|| ext.get::<ConnInfo>().map(|c| &c.activity))
        .or_else(|| ext.get::<TlsConnectInfo<ConnInfo>>().map(|c| &c.get_ref().activity))
        .cloned()
}

impl<S, B> tower::Service<http::Request<B>> for ActivityService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let busy = activity_of(&req).map(|a| a.begin());
        if req.version() < http::Version::HTTP_2 {
            return Box::pin(async move {
                drop(busy);
                Ok(grpc_only())
            });
        }
        let call = self.inner.call(req);
        Box::pin(async move {
            let r = call.await;
            drop(busy);
            r
        })
    }
}

/// What an HTTP/1 request to the gRPC port is told.
pub(crate) const GRPC_ONLY: &str = "this port speaks gRPC (HTTP/2): use a gRPC client; \
     /metrics, /healthz, /readyz and /dashboard are on the admin port\n";

/// The answer to an HTTP/1 request on the gRPC port: `426 Upgrade Required` and a
/// line saying what the port speaks, instead of a reset.
fn grpc_only() -> http::Response<tonic::body::Body> {
    metrics::counter!(m::CONNECTIONS_REFUSED, "listener" => "grpc_http1").increment(1);
    let mut answer = http::Response::new(tonic::body::Body::new(GRPC_ONLY.to_owned()));
    *answer.status_mut() = http::StatusCode::UPGRADE_REQUIRED;
    answer.headers_mut().insert(http::header::UPGRADE, http::HeaderValue::from_static("h2c"));
    answer.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    answer
}

/// The soft open-file limit raised to the hard one (logged), and the limit now in
/// force.
pub(crate) fn raise_file_limit() -> u64 {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let before = getrlimit(Resource::Nofile);
    let soft = before.current.unwrap_or(u64::MAX);
    let hard = before.maximum;
    if hard.is_none_or(|h| h > soft) {
        let mut raised = before;
        raised.current = hard;
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::info!(from = soft, to = ?hard, "open-file limit raised to the hard limit");
                return hard.unwrap_or(u64::MAX);
            }
            Err(e) => tracing::warn!(soft, ?hard, "cannot raise the open-file limit: {e}"),
        }
    }
    soft
}

/// Descriptors kept out of the listeners' budgets: the policy file, the store, peers,
/// logs.
const RESERVED_FILES: u64 = 128;

/// The default caps of the gRPC and admin listeners for an open-file limit of
/// `files`: three quarters of what is not reserved for gRPC, an eighth for admin.
pub(crate) fn default_caps(files: u64) -> (usize, usize) {
    let spare = files.saturating_sub(RESERVED_FILES).max(16);
    let grpc = usize::try_from(spare / 4 * 3).unwrap_or(usize::MAX).min(1 << 20);
    let admin = usize::try_from(spare / 8).unwrap_or(usize::MAX).clamp(4, 4_096);
    (grpc, admin)
}

#[cfg(test)]
mod tests;
