//! Changes made while the layer serves, kept in the store so that every
//! instance on it sees them and they outlive the instances: clients
//! denied (for a while, or until removed), and clients' own limits under
//! a policy. [`Changes`] makes them; each instance reads them into a
//! local copy (see [`RateLimitLayer::with_runtime_changes`]) that the
//! request path consults without a store call; the static
//! [`DenyList`] is consulted beside it.
//!
//! [`RateLimitLayer::with_runtime_changes`]: crate::RateLimitLayer::with_runtime_changes

mod deny_list;
mod snapshot;

pub use deny_list::DenyList;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use http::request::Parts;

use crate::key::Key;
use crate::layer::inspect::LimitError;
use crate::layer::settings::Shared;
use crate::limits::Found;
use crate::log_lines::RUNTIME_CHANGES_UNREAD;
use crate::policy::Policy;
use crate::policy::plan::Plan;
use crate::rejection::Listed;
use crate::store::background::spawn_on;
use crate::store::{Store, StoreError};
use snapshot::Snapshot;

/// How long a read of the store's changes may take before it is given up
/// (a store of your own that never answers), and the next is due.
const READ_WITHIN: Duration = Duration::from_secs(10);

/// The table of denied clients: field the key's label, value the Unix
/// time (ms) the entry ends at, `0` for never.
const DENY_TABLE: &str = "deny";
/// The table of clients' own limits: field `<policy>:<key label>`, value
/// the limit.
const LIMITS_TABLE: &str = "overrides";

/// What a layer's clones share of the changes: the static deny list, the
/// copy of the store's changes, and when it is next read.
pub(crate) struct ChangeState {
    deny_list: ArcSwap<DenyList>,
    snapshot: ArcSwap<Snapshot>,
    /// Whether anything can refuse or change a request: a deny list, a
    /// change in the copy, or the store's changes read.
    active: AtomicBool,
    /// When the copy is next read from the store, in ms from `started`.
    next_read: AtomicU64,
    started: Instant,
    /// Whether a read is under way.
    reading: AtomicBool,
}

impl Default for ChangeState {
    fn default() -> Self {
        Self {
            deny_list: ArcSwap::from_pointee(DenyList::new()),
            snapshot: ArcSwap::from_pointee(Snapshot::default()),
            active: AtomicBool::new(false),
            next_read: AtomicU64::new(0),
            started: Instant::now(),
            reading: AtomicBool::new(false),
        }
    }
}

impl std::fmt::Debug for ChangeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeState")
            .field("active", &self.active)
            .finish_non_exhaustive()
    }
}

impl ChangeState {
    pub(crate) fn set_deny_list(&self, list: DenyList) {
        if !list.is_empty() {
            self.active.store(true, Ordering::Relaxed);
        }
        self.deny_list.store(Arc::new(list));
    }

    pub(crate) fn mark_active(&self) {
        self.active.store(true, Ordering::Relaxed);
    }

    /// Whether no request can be refused or changed by a change.
    #[inline]
    fn idle(&self) -> bool {
        !self.active.load(Ordering::Relaxed)
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// The table `table` in the layer's namespace.
fn table(shared: &Shared, table: &str) -> String {
    match &shared.namespace {
        Some(namespace) => format!("{namespace}:{table}"),
        None => table.to_owned(),
    }
}

/// The time now, in ms since the Unix epoch, as deny entries end.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// Starts a read of the store's changes when one is due (at most one at a
/// time, on a task of its own): never a store call on the request's path.
#[inline]
pub(crate) fn read_if_due(shared: &Shared) {
    if let Some(every) = shared.settings.runtime_changes {
        start_read_if_due(shared, every);
    }
}

fn start_read_if_due(shared: &Shared, every: Duration) {
    let state = &shared.changes;
    let due = || state.elapsed_ms() >= state.next_read.load(Ordering::Acquire);
    if !due() || state.reading.swap(true, Ordering::Acquire) {
        return;
    }
    if !due() {
        // A read ended between the two looks: the next is not due yet.
        state.reading.store(false, Ordering::Release);
        return;
    }
    state.active.store(true, Ordering::Relaxed);
    let (store, tables) = (shared.store().clone(), Tables::of(shared));
    let reading = Reading(Arc::clone(state), every);
    let read = async move {
        let state = &reading.0;
        let read = tokio::time::timeout(READ_WITHIN, read(&*store, &tables, state)).await;
        let failed = match read {
            Ok(Ok(())) => None,
            Ok(Err(error)) => Some(error.to_string()),
            Err(_) => Some(format!("no answer within {READ_WITHIN:?}")),
        };
        if let Some(error) = failed
            && let Some(held_back) = RUNTIME_CHANGES_UNREAD.admit()
        {
            tracing::warn!(%error, held_back, "the store's deny list and limits could not be read; the last copy stands");
        }
    };
    if spawn_on(None, read).is_err() {
        shared.changes.reading.store(false, Ordering::Release);
    }
}

/// A read under way: when it ends, however (a panic included), the next is
/// due a period later.
struct Reading(Arc<ChangeState>, Duration);

impl Drop for Reading {
    fn drop(&mut self) {
        let state = &self.0;
        let next = state.elapsed_ms().saturating_add(duration_ms(self.1));
        state.next_read.store(next, Ordering::Relaxed);
        state.reading.store(false, Ordering::Release);
    }
}

fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The names of a layer's tables of changes.
struct Tables {
    deny: String,
    limits: String,
}

impl Tables {
    fn of(shared: &Shared) -> Self {
        Self {
            deny: table(shared, DENY_TABLE),
            limits: table(shared, LIMITS_TABLE),
        }
    }
}

/// Reads the store's changes into `state`'s copy, unless this instance
/// changed its copy meanwhile (the read may have missed that change: the
/// next one reads it); the entries of denials that ended a while ago are
/// removed from the store on the way, each only while it still holds what
/// was read (a denial set again meanwhile stays).
async fn read(store: &dyn Store, tables: &Tables, state: &ChangeState) -> Result<(), StoreError> {
    let before = state.snapshot.load_full();
    let denied = store.entries(&tables.deny).await?;
    let limits = store.entries(&tables.limits).await?;
    let (snapshot, ended) = Snapshot::read(&denied, &limits, unix_ms());
    state.snapshot.compare_and_swap(&before, Arc::new(snapshot));
    for (field, until) in ended {
        // Another instance may remove it first: either is the same.
        let _ = store.remove_entry(&tables.deny, &field, Some(&until)).await;
    }
    Ok(())
}

/// Which list refuses the request before its client is identified: its
/// address (a network, or an address listed by its key, in the static
/// list or at run time) or its API key.
#[inline]
pub(crate) fn refused_before_identity(shared: &Shared, parts: &Parts) -> Option<Listed> {
    if shared.changes.idle() {
        return None;
    }
    listed_address_or_api_key(&shared.changes, parts)
}

fn listed_address_or_api_key(state: &ChangeState, parts: &Parts) -> Option<Listed> {
    let list = state.deny_list.load();
    let snapshot = state.snapshot.load();
    if list.is_empty() && snapshot.denies_nothing() {
        return None;
    }
    let client = list.client(parts);
    if let Some(listed) = list.refuses(parts, client) {
        return Some(listed);
    }
    if !list.names_keys() && snapshot.denies_nothing() {
        return None;
    }
    let now = unix_ms();
    if let Some(ip) = client {
        let listed = |key: &Key| list.names(key) || snapshot.denies(key, now);
        if snapshot.denies_address(ip, now) || list.address_keys(ip).iter().any(listed) {
            return Some(Listed::Address);
        }
    }
    list.api_key(parts)
        .filter(|key| list.names(key) || snapshot.denies(key, now))
        .map(|_| Listed::ApiKey)
}

/// Which list refuses the client identified by `key`.
#[inline]
pub(crate) fn refused_as(shared: &Shared, key: &Key) -> Option<Listed> {
    if shared.changes.idle() {
        return None;
    }
    listed_key(&shared.changes, key)
}

fn listed_key(state: &ChangeState, key: &Key) -> Option<Listed> {
    let (list, snapshot, now) = (state.deny_list.load(), state.snapshot.load(), unix_ms());
    // A client keyed by its address is in the networks denied too,
    // wherever the list's own address resolver would have found it.
    let in_a_network = || {
        deny_list::address_of(key)
            .is_some_and(|ip| list.holds(ip) || snapshot.denies_address(ip, now))
    };
    let denied = list.names(key) || snapshot.denies(key, now) || in_a_network();
    denied.then(|| Listed::of(key))
}

/// The limit set at run time for `key` under `policy`, if one is (and
/// the policy can count it).
pub(crate) fn limit_set(shared: &Shared, policy: &Policy, key: &Key) -> Option<u32> {
    let state = &shared.changes;
    if state.idle() {
        return None;
    }
    countable_limit(&state.snapshot.load(), policy, key)
}

/// The limit `snapshot` sets for `key` under `policy`, if the policy can
/// count it: another instance may run other policies, and a limit this
/// one's cannot count (0 among them) is passed over.
fn countable_limit(snapshot: &Snapshot, policy: &Policy, key: &Key) -> Option<u32> {
    snapshot
        .limit(policy.name(), key)
        .filter(|&limit| policy.validate_own_limit(limit).is_ok())
}

/// `own` with the limits set at run time for the keys the plan's policies
/// count under (`key_of(index)`), which take the place of any other.
#[inline]
pub(crate) fn with_limits_set<'k>(
    shared: &Shared,
    plan: &Plan,
    own: Option<&Found>,
    key_of: impl Fn(usize) -> &'k Key,
) -> Option<Found> {
    if shared.changes.idle() {
        return None;
    }
    limits_set_over(shared, plan, own, key_of)
}

fn limits_set_over<'k>(
    shared: &Shared,
    plan: &Plan,
    own: Option<&Found>,
    key_of: impl Fn(usize) -> &'k Key,
) -> Option<Found> {
    let snapshot = shared.changes.snapshot.load();
    if !snapshot.sets_limits() {
        return None;
    }
    let mut found: Option<Found> = None;
    for (index, policy) in plan.policies.iter().enumerate() {
        if let Some(limit) = countable_limit(&snapshot, policy, key_of(index)) {
            let found = found.get_or_insert_with(|| {
                own.cloned()
                    .unwrap_or_else(|| plan.policies.iter().map(|_| None).collect())
            });
            found[index] = Some(limit);
        }
    }
    found
}

/// Changes to make while the layer serves, on every instance that shares
/// its store: clients denied (`403` before any limit is counted) and
/// clients' own limits under a policy. Each is written to the store (so it
/// survives the instances' restarts) and to this instance's copy at once;
/// other instances read the store's every
/// [`with_runtime_changes`](crate::RateLimitLayer::with_runtime_changes)
/// period. A changed limit applies to the client's current window: its
/// count is kept, so a lower limit than its count denies at once.
///
/// The example server serves these as `PUT` and `DELETE
/// /admin/deny/{key}` and `/admin/overrides/{policy}/{key}`.
///
/// ```
/// use slidegate::{Global, Policies, Policy, RateLimitLayer, key::Key, store::MemoryStore};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let policies = Policies::single(Policy::new("search", 5, Duration::from_secs(60)))?;
/// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies)
///     .with_runtime_changes(Duration::from_secs(1));
/// let changes = layer.changes();
/// let mallory = Key::parse("jwt:mallory").expect("a key in label form");
/// changes.deny(&mallory, Some(Duration::from_secs(3600))).await?;
/// changes.set_limit("search", &Key::parse("jwt:alice").unwrap(), 50).await?;
/// changes.remove_denial(&mallory).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Changes {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Changes").finish_non_exhaustive()
    }
}

impl Changes {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    fn store(&self) -> &Arc<dyn Store> {
        self.shared.store()
    }

    /// Denies the client `key` (in label form; `ip:` keys may name a
    /// network, `ip:203.0.113.0/24`) on every instance, for `lasting`, or
    /// until [`remove_denial`](Self::remove_denial) when `None`.
    ///
    /// # Errors
    ///
    /// The store's, when it could not write the entry (this instance's
    /// copy is then left as it was).
    pub async fn deny(&self, key: &Key, lasting: Option<Duration>) -> Result<(), StoreError> {
        let key = &deny_list::canonical(key);
        let until = match lasting {
            Some(lasting) => unix_ms().saturating_add(duration_ms(lasting)).max(1),
            None => 0,
        };
        let deny = table(&self.shared, DENY_TABLE);
        self.store()
            .set_entry(&deny, key.as_str(), &until.to_string())
            .await?;
        self.update(|snapshot| snapshot.deny(key, until));
        Ok(())
    }

    /// Lifts the denial of `key` set with [`deny`](Self::deny) (a
    /// [`DenyList`] given in code or the config file stays).
    ///
    /// # Errors
    ///
    /// The store's, when it could not remove the entry.
    pub async fn remove_denial(&self, key: &Key) -> Result<(), StoreError> {
        let key = &deny_list::canonical(key);
        let deny = table(&self.shared, DENY_TABLE);
        self.store().remove_entry(&deny, key.as_str(), None).await?;
        self.update(|snapshot| snapshot.remove_denial(key));
        Ok(())
    }

    /// Gives the client `key` the limit `limit` under the policy named
    /// `policy`, in place of its tier's, a [limit
    /// lookup](crate::RateLimitLayer::with_limit_lookup)'s or the config
    /// file's `[overrides]`. A policy counted
    /// [per another key](crate::Policy::per) takes the limit of that key
    /// (`global`, say).
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownPolicy`] for a policy the layer does not have,
    /// [`LimitError::InvalidLimit`] for a limit it cannot count (0, or past
    /// its algorithm's bounds), [`LimitError::Store`] when the store could
    /// not write it.
    pub async fn set_limit(&self, policy: &str, key: &Key, limit: u32) -> Result<(), LimitError> {
        let key = &deny_list::canonical(key);
        let named = self.shared.policy_named(policy)?;
        named
            .validate_own_limit(limit)
            .map_err(|invalid| LimitError::InvalidLimit(invalid.to_string()))?;
        let limits = table(&self.shared, LIMITS_TABLE);
        let field = format!("{policy}:{}", key.as_str());
        self.store()
            .set_entry(&limits, &field, &limit.to_string())
            .await?;
        self.update(|snapshot| snapshot.set_limit(named.shared_name(), key, limit));
        Ok(())
    }

    /// Takes back the limit [`set_limit`](Self::set_limit) gave `key`
    /// under `policy`: the one it would have otherwise applies again.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownPolicy`] for a policy the layer does not have,
    /// [`LimitError::Store`] when the store could not remove it.
    pub async fn clear_limit(&self, policy: &str, key: &Key) -> Result<(), LimitError> {
        let key = &deny_list::canonical(key);
        self.shared.policy_named(policy)?;
        let limits = table(&self.shared, LIMITS_TABLE);
        let field = format!("{policy}:{}", key.as_str());
        self.store().remove_entry(&limits, &field, None).await?;
        self.update(|snapshot| snapshot.clear_limit(policy, key));
        Ok(())
    }

    /// Reads the store's changes into this instance's copy now: at
    /// start-up, so that the first requests already meet them.
    ///
    /// # Errors
    ///
    /// The store's, when it could not answer (the copy stays as it was).
    pub async fn read(&self) -> Result<(), StoreError> {
        let state = &self.shared.changes;
        state.mark_active();
        read(&**self.store(), &Tables::of(&self.shared), state).await
    }

    /// Replaces the static deny list (as a reload of the config file does);
    /// entries set with [`deny`](Self::deny) stay.
    pub fn replace_deny_list(&self, list: DenyList) {
        self.shared.changes.set_deny_list(list);
    }

    /// This instance's copy, changed by `change`.
    fn update(&self, change: impl Fn(&mut Snapshot)) {
        let state = &self.shared.changes;
        state.mark_active();
        state.snapshot.rcu(|snapshot| {
            let mut changed = Snapshot::clone(snapshot);
            change(&mut changed);
            changed
        });
    }
}
