//! The active policy, and its hot reload.
//!
//! The policy file's directory is watched (not the file: editors and `sed -i` save by
//! renaming a new file over the old one, and Kubernetes swaps a `..data` symlink; a
//! watch on the file itself goes deaf after the first such replacement), with a slow
//! poll as a backstop. Any event re-reads the file; an unchanged text is ignored; a
//! new one is validated in full and swapped in atomically. A broken one is logged and
//! counted, and the last good policy keeps serving. Counters live in the state table
//! keyed by limit, so unchanged limits keep their counts across a reload.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::{ArcSwap, Guard};
use limiter_core::clock::{Clock, NANOS_PER_SEC};
use limiter_core::policy::Map;
use limiter_core::policy::{Policy, PolicyErrors, from_yaml};
use notify::{RecursiveMode, Watcher};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::{self as m, DecisionCounters};

/// A policy in service.
#[derive(Debug)]
pub struct ActivePolicy {
    /// The validated policy.
    pub policy: Policy,
    /// Grows by one with every successful reload that changed the text.
    pub version: u64,
    /// When it was loaded, in clock nanoseconds (Unix time for the production clock).
    pub loaded_at: u64,
    /// A digest of its text.
    pub digest: u64,
    /// Its decision counters (one per route and outcome).
    pub counters: DecisionCounters,
}

impl ActivePolicy {
    fn new(policy: Policy, version: u64, loaded_at: u64, digest: u64) -> Self {
        let counters = DecisionCounters::new(&policy);
        Self { policy, version, loaded_at, digest, counters }
    }
}

/// How the last reload attempts went.
#[derive(Debug, Clone, Default)]
pub struct ReloadStatus {
    /// The last failure's message (every mistake, with file and line).
    pub last_error: Option<String>,
    /// When the last failure happened, in clock nanoseconds.
    pub last_failure_at: Option<u64>,
    /// Failed reloads since start.
    pub failures: u64,
    /// Successful reloads since start (the first load not counted).
    pub reloads: u64,
}

/// Why the policy file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("{path}: cannot read the policy file: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file has mistakes.
    #[error(transparent)]
    Invalid(#[from] PolicyErrors),
    /// The policy is valid but the store cannot run it.
    #[error("{path}: the store cannot run this policy:\n{message}")]
    Unsupported {
        /// The file.
        path: String,
        /// Every limit at fault.
        message: String,
    },
    /// The store could not be set up.
    #[error("{0}")]
    Store(String),
    /// A certificate, key or tokens file named by `security` is unusable.
    #[error("{0}")]
    Security(String),
}

/// A check the store makes of every policy before it takes effect.
pub type Check = Arc<dyn Fn(&Policy) -> Result<(), String> + Send + Sync>;

/// The outcome of one reload attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// The text is the same as the active policy's.
    Unchanged,
    /// A new policy is active.
    Reloaded {
        /// Its version.
        version: u64,
        /// What changed, in words.
        changes: String,
    },
    /// The new text was refused; the previous policy keeps serving.
    Failed(String),
}

/// Holds the active policy; cheap to read on every request.
pub struct PolicyHolder {
    path: PathBuf,
    current: ArcSwap<ActivePolicy>,
    status: Mutex<ReloadStatus>,
    clock: Arc<dyn Clock>,
    check: Check,
}

impl std::fmt::Debug for PolicyHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyHolder").field("path", &self.path).finish_non_exhaustive()
    }
}

fn digest(text: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

/// Reads and validates a policy file.
///
/// # Errors
///
/// An unreadable file, or every mistake in it.
pub fn read_policy(path: &Path) -> Result<(Policy, u64), LoadError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| LoadError::Io { path: path.display().to_string(), source })?;
    let policy = from_yaml(&text, &path.display().to_string())?;
    Ok((policy, digest(&text)))
}

impl PolicyHolder {
    /// Loads the policy file for the first time.
    ///
    /// # Errors
    ///
    /// As [`read_policy`].
    pub fn load(path: &Path, clock: Arc<dyn Clock>) -> Result<Self, LoadError> {
        Self::load_checked(path, clock, Arc::new(|_| Ok(())))
    }

    /// Like [`Self::load`], with a check the store makes of this and every reloaded
    /// policy (a policy it refuses never takes effect).
    ///
    /// # Errors
    ///
    /// As [`read_policy`], and the check's refusal.
    pub fn load_checked(
        path: &Path,
        clock: Arc<dyn Clock>,
        check: Check,
    ) -> Result<Self, LoadError> {
        let (policy, digest) = read_policy(path)?;
        check(&policy).map_err(|message| LoadError::Unsupported {
            path: path.display().to_string(),
            message,
        })?;
        let active = ActivePolicy::new(policy, 1, clock.now(), digest);
        publish(&active);
        Ok(Self {
            path: path.to_owned(),
            current: ArcSwap::from_pointee(active),
            status: Mutex::default(),
            clock,
            check,
        })
    }

    /// The active policy.
    pub fn current(&self) -> Guard<Arc<ActivePolicy>> {
        self.current.load()
    }

    /// The policy file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How reloads went.
    pub fn status(&self) -> ReloadStatus {
        self.status.lock().clone()
    }

    /// Re-reads the file; swaps in a new valid policy, keeps the old one otherwise.
    pub async fn reload(&self) -> Reload {
        let text = match tokio::fs::read_to_string(&self.path).await {
            Ok(t) => t,
            Err(e) => {
                return self.failed(format!("{}: cannot read: {e}", self.path.display())).await;
            }
        };
        let d = digest(&text);
        let old = self.current.load_full();
        if d == old.digest {
            return Reload::Unchanged;
        }
        let checked = from_yaml(&text, &self.path.display().to_string())
            .map_err(|e| e.to_string())
            .and_then(|p| match (self.check)(&p) {
                Ok(()) => Ok(p),
                Err(m) => {
                    Err(format!("{}: the store cannot run this policy:\n{m}", self.path.display()))
                }
            });
        match checked {
            Err(e) => self.failed(e).await,
            Ok(policy) => {
                let changes = describe_changes(&old.policy, &policy);
                let active = ActivePolicy::new(policy, old.version + 1, self.clock.now(), d);
                let version = active.version;
                publish(&active);
                self.current.store(Arc::new(active));
                self.status.lock().reloads += 1;
                metrics::counter!(m::POLICY_RELOADS, "result" => "ok").increment(1);
                tracing::info!(version, %changes, file = %self.path.display(), "policy reloaded");
                Reload::Reloaded { version, changes }
            }
        }
    }

    async fn failed(&self, error: String) -> Reload {
        metrics::counter!(m::POLICY_RELOADS, "result" => "failed").increment(1);
        tracing::error!(
            file = %self.path.display(),
            version = self.current.load().version,
            "policy reload refused; the previous policy keeps serving: {error}"
        );
        let mut s = self.status.lock();
        s.failures += 1;
        s.last_error = Some(error.clone());
        s.last_failure_at = Some(self.clock.now());
        Reload::Failed(error)
    }
}

#[allow(clippy::cast_precision_loss)] // gauges are floats; versions and seconds fit
fn publish(active: &ActivePolicy) {
    metrics::gauge!(m::POLICY_VERSION).set(active.version as f64);
    metrics::gauge!(m::POLICY_LOADED).set((active.loaded_at / NANOS_PER_SEC) as f64);
}

/// A one-line summary of what differs between two policies.
pub fn describe_changes(old: &Policy, new: &Policy) -> String {
    fn diff<V: PartialEq>(what: &str, old: &Map<V>, new: &Map<V>, out: &mut Vec<String>) {
        let mut added: Vec<&str> =
            new.keys().filter(|k| !old.contains_key(*k)).map(AsRef::as_ref).collect();
        let mut removed: Vec<&str> =
            old.keys().filter(|k| !new.contains_key(*k)).map(AsRef::as_ref).collect();
        let mut changed: Vec<&str> = new
            .iter()
            .filter(|(k, v)| old.get(*k).is_some_and(|o| o != *v))
            .map(|(k, _)| k.as_ref())
            .collect();
        for (verb, list) in
            [("added", &mut added), ("removed", &mut removed), ("changed", &mut changed)]
        {
            if !list.is_empty() {
                list.sort_unstable();
                out.push(format!("{what} {verb}: {}", list.join(", ")));
            }
        }
    }
    let mut out = Vec::new();
    if old.global != new.global {
        out.push("global ceiling changed".to_owned());
    }
    let settings_changed = old.shadow != new.shadow
        || old.on_limiter_failure != new.on_limiter_failure
        || old.lease != new.lease
        || old.unknown_tenants != new.unknown_tenants
        || old.default_tenant != new.default_tenant;
    if settings_changed {
        out.push("defaults changed".to_owned());
    }
    diff("routes", &old.routes, &new.routes, &mut out);
    diff("tenants", &old.tenants, &new.tenants, &mut out);
    if out.is_empty() {
        "no change in effect (formatting or comments)".to_owned()
    } else {
        out.join("; ")
    }
}

/// Watches the policy file's directory and reloads on every change, polling as a
/// backstop, until `cancel` fires.
pub async fn watch(holder: Arc<PolicyHolder>, poll: Duration, cancel: CancellationToken) {
    let (tx, mut rx) = mpsc::channel::<()>(1);
    let dir = holder.path().parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    let dir = if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir };
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            // A full channel already holds a wake-up; any event means "look again".
            let _ = tx.try_send(());
        }
    })
    .and_then(|mut w| w.watch(&dir, RecursiveMode::NonRecursive).map(|()| w));
    let _watcher = match watcher {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), "cannot watch the policy directory, polling only: {e}");
            None
        }
    };
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
            Some(()) = rx.recv() => {
                // Let a burst of events (truncate, write, rename) settle first.
                tokio::time::sleep(Duration::from_millis(50)).await;
                while rx.try_recv().is_ok() {}
            }
        }
        let _ = holder.reload().await;
    }
}
