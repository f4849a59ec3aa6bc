//! The active policy, and its hot reload.
//!
//! The policy file's directory is watched (not the file: editors and `sed -i` save by
//! renaming a new file over the old one, and Kubernetes swaps a `..data` symlink; a
//! watch on the file itself goes deaf after the first such replacement), with a slow
//! poll of the file's metadata (no open) as a backstop. Only writes, creates, renames
//! and removals of the file, or of the symlink it goes through, count; opens and
//! reads (our own among them) do not. After a change the file must be still for the
//! settle time, and read twice with the same text, before it is loaded: a file
//! written in place in parts is loaded once whole. An unchanged text is ignored; a
//! new one is validated in full and swapped in atomically. A broken one is logged and
//! counted once per distinct text, and the last good policy keeps serving. Counters
//! live in the state table keyed by limit, so unchanged limits keep their counts
//! across a reload.

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
    /// The last failure's message (every mistake, with file and line), until a later
    /// load succeeds or the file is back to the text in service.
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
    /// Two reads gave different texts: the file is still being written.
    Unsettled,
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
    /// The digest of the last text refused (logged and counted once).
    refused: Mutex<Option<u64>>,
    /// The file's metadata just before its first load (a change made before the
    /// watch starts is still seen).
    loaded_stat: Option<Stat>,
    /// The largest file loaded.
    max_bytes: u64,
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

/// The default of `limits.max_policy_bytes`: 48 MiB, about 330,000 tenants written
/// one limit and one key limit each, which load in under 1 GiB (loading takes about
/// 2.3 KB of memory per such tenant while the YAML tree and the policy both exist).
pub const DEFAULT_MAX_POLICY_BYTES: u64 = 48 << 20;

/// The text of a policy file, which must be UTF-8 and at most `max_bytes` long.
///
/// # Errors
///
/// An unreadable or too large file, or bytes that are not UTF-8 (with the line,
/// column and byte offset of the first one).
pub fn read_text(path: &Path, max_bytes: u64) -> Result<String, LoadError> {
    let io = |source| LoadError::Io { path: path.display().to_string(), source };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > max_bytes {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!(
                "{len} bytes, above limits.max_policy_bytes ({max_bytes}); loading takes \
                 about 2.3 KB of memory per tenant, so raise the limit \
                 (LIMITER__LIMITS__MAX_POLICY_BYTES) only with the memory for it"
            ),
        )));
    }
    metrics::counter!(m::POLICY_READS).increment(1);
    let bytes = std::fs::read(path).map_err(io)?;
    decode(path, bytes)
}

fn decode(path: &Path, bytes: Vec<u8>) -> Result<String, LoadError> {
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let before = &e.as_bytes()[..at];
        let line = before.iter().filter(|b| **b == b'\n').count() + 1;
        let start = before.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        let column = String::from_utf8_lossy(&before[start..]).chars().count() + 1;
        LoadError::Io {
            path: format!("{}:{line}:{column}", path.display()),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("byte {at} is not UTF-8 (a policy file must be UTF-8 text)"),
            ),
        }
    })
}

/// Reads and validates a policy file.
///
/// # Errors
///
/// An unreadable file, or every mistake in it.
pub fn read_policy(path: &Path, max_bytes: u64) -> Result<(Policy, u64), LoadError> {
    let text = read_text(path, max_bytes)?;
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
        Self::load_checked(path, clock, Arc::new(|_| Ok(())), DEFAULT_MAX_POLICY_BYTES)
    }

    /// Like [`Self::load`], with a check the store makes of this and every reloaded
    /// policy (a policy it refuses never takes effect), and the largest file loaded.
    ///
    /// # Errors
    ///
    /// As [`read_policy`], and the check's refusal.
    pub fn load_checked(
        path: &Path,
        clock: Arc<dyn Clock>,
        check: Check,
        max_bytes: u64,
    ) -> Result<Self, LoadError> {
        let loaded_stat = stat(path);
        let (policy, digest) = read_policy(path, max_bytes)?;
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
            refused: Mutex::default(),
            loaded_stat,
            max_bytes,
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
    /// The file is read twice: two different texts mean it is still being written
    /// ([`Reload::Unsettled`]), and nothing is loaded.
    pub async fn reload(&self) -> Reload {
        let (path, max) = (self.path.clone(), self.max_bytes);
        let read = tokio::task::spawn_blocking(move || {
            let first = read_text(&path, max)?;
            let second = read_text(&path, max)?;
            Ok::<_, LoadError>((first, second))
        })
        .await;
        let (text, again) = match read {
            Ok(Ok(texts)) => texts,
            Ok(Err(e)) => return self.failed(&e.to_string(), None),
            Err(e) => {
                return self.failed(&format!("{}: cannot read: {e}", self.path.display()), None);
            }
        };
        let d = digest(&text);
        if d != digest(&again) {
            return Reload::Unsettled;
        }
        let old = self.current.load_full();
        if d == old.digest {
            // The file says what is in service again: a stale failure is over.
            self.status.lock().last_error = None;
            *self.refused.lock() = None;
            return Reload::Unchanged;
        }
        if *self.refused.lock() == Some(d) {
            // Refused already: logged and counted once.
            let last = self.status.lock().last_error.clone().unwrap_or_default();
            return Reload::Failed(last);
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
            Err(e) => self.failed(&e, Some(d)),
            Ok(policy) => {
                let changes = describe_changes(&old.policy, &policy);
                let active = ActivePolicy::new(policy, old.version + 1, self.clock.now(), d);
                let version = active.version;
                publish(&active);
                self.current.store(Arc::new(active));
                {
                    let mut status = self.status.lock();
                    status.reloads += 1;
                    status.last_error = None;
                }
                *self.refused.lock() = None;
                metrics::counter!(m::POLICY_RELOADS, "result" => "ok").increment(1);
                tracing::info!(version, %changes, file = %self.path.display(), "policy reloaded");
                Reload::Reloaded { version, changes }
            }
        }
    }

    fn failed(&self, error: &str, digest: Option<u64>) -> Reload {
        let error = limiter_core::text::shorten_message(error).into_owned();
        metrics::counter!(m::POLICY_RELOADS, "result" => "failed").increment(1);
        tracing::error!(
            file = %self.path.display(),
            version = self.current.load().version,
            "policy reload refused; the previous policy keeps serving: {error}"
        );
        *self.refused.lock() = digest;
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

/// What the file's metadata says, to tell a change without opening it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stat {
    modified: Option<std::time::SystemTime>,
    len: u64,
    inode: u64,
}

fn stat(path: &Path) -> Option<Stat> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(path).ok()?;
    Some(Stat { modified: m.modified().ok(), len: m.len(), inode: m.ino() })
}

/// The names in the watched directories whose change can change the policy: the
/// file's own, and the symlinks it is reached through (Kubernetes' `..data`).
fn names_of_interest(path: &Path) -> (Vec<PathBuf>, Vec<std::ffi::OsString>) {
    let parent = |p: &Path| {
        p.parent()
            .filter(|d| !d.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    };
    let mut dirs = vec![parent(path)];
    let mut names: Vec<std::ffi::OsString> = path.file_name().map(Into::into).into_iter().collect();
    if let Ok(target) = std::fs::read_link(path) {
        if let Some(first) = target.components().next()
            && target.is_relative()
        {
            names.push(first.as_os_str().to_owned());
        }
        let target = if target.is_relative() { parent(path).join(target) } else { target };
        if let Some(n) = target.file_name() {
            names.push(n.to_owned());
        }
        let dir = parent(&target);
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    (dirs, names)
}

/// Whether a file event can change the policy: a write, create, rename or removal of
/// one of `names`, never an open or a read.
fn relevant(event: &notify::Event, names: &[std::ffi::OsString]) -> bool {
    use notify::EventKind as K;
    use notify::event::{AccessKind, AccessMode, ModifyKind};
    let kind = match event.kind {
        K::Create(_) | K::Remove(_) | K::Any => true,
        K::Modify(ModifyKind::Metadata(_)) => false,
        K::Modify(_) => true,
        K::Access(AccessKind::Close(AccessMode::Write)) => true,
        K::Access(_) | K::Other => false,
    };
    kind && event.paths.iter().any(|p| p.file_name().is_some_and(|n| names.iter().any(|x| x == n)))
}

/// Watches the policy file's directory and reloads on every change, polling its
/// metadata as a backstop, until `cancel` fires. A change is loaded once the file has
/// been still for `settle`.
pub async fn watch(
    holder: Arc<PolicyHolder>,
    poll: Duration,
    settle: Duration,
    cancel: CancellationToken,
) {
    let (tx, mut rx) = mpsc::channel::<()>(1);
    let (dirs, names) = names_of_interest(holder.path());
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|e| relevant(&e, &names)) {
            // A full channel already holds a wake-up; any event means "look again".
            let _ = tx.try_send(());
        }
    })
    .and_then(|mut w| {
        for dir in &dirs {
            w.watch(dir, RecursiveMode::NonRecursive)?;
        }
        Ok(w)
    });
    let _watcher = match watcher {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(dirs = ?dirs, "cannot watch the policy directory, polling only: {e}");
            None
        }
    };
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let path = holder.path().to_path_buf();
    let mut seen = holder.loaded_stat.clone();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {
                let now = stat(&path);
                if now == seen {
                    continue;
                }
            }
            Some(()) = rx.recv() => {}
        }
        // Settle: no event and no change of the metadata for `settle`.
        loop {
            let before = stat(&path);
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(settle) => {}
                Some(()) = rx.recv() => continue,
            }
            while rx.try_recv().is_ok() {}
            let after = stat(&path);
            if before == after {
                seen = after;
                break;
            }
        }
        if holder.reload().await == Reload::Unsettled {
            // Written between the two reads: look again after another settle.
            seen = None;
        }
    }
}
