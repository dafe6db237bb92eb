//! Which layers of the process count on which store, so that two of them
//! never give one policy name two meanings in one place.
//!
//! Store keys hold the policy's name (and the layer's namespace), not the
//! layer: two layers on one store that name a policy alike share its
//! counts. That is one budget when the policies count alike, and a silent
//! mix of two limits when they do not, which [`register`] refuses.

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use arc_swap::ArcSwap;

use crate::RateLimitLayer;
use crate::layer::stores::LayerStore;
use crate::policy::{Policies, Policy, PolicyError};

/// A layer that counts on a store: its store's state, its namespace and
/// its policies (as they are now, reloads included).
struct Registered {
    state: StateId,
    namespace: Option<Arc<str>>,
    policies: Weak<ArcSwap<Policies>>,
}

/// Every layer of the process that has wrapped a service, while its
/// policies live.
static REGISTERED: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

fn registered() -> MutexGuard<'static, Vec<Registered>> {
    // Entries are pushed or dropped whole: a panic elsewhere leaves the
    // list usable.
    let mut list = REGISTERED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    list.retain(|entry| entry.policies.strong_count() > 0);
    list
}

/// Records that the layer with `policies` and `namespace` counts on the
/// store state `state`, unless another live layer there gives one of its
/// policy names another meaning.
pub(crate) fn register(
    state: Arc<dyn Any + Send + Sync>,
    namespace: Option<&Arc<str>>,
    policies: &Arc<ArcSwap<Policies>>,
) -> Result<(), PolicyError> {
    let state = StateId(state);
    let mut list = registered();
    let same_place =
        |entry: &Registered| entry.state == state && entry.namespace.as_ref() == namespace;
    if list
        .iter()
        .any(|entry| same_place(entry) && ptr_eq(&entry.policies, policies))
    {
        return Ok(());
    }
    let ours = policies.load();
    for entry in list.iter().filter(|entry| same_place(entry)) {
        if let Some(conflict) = conflict_with(&ours, &entry.policies) {
            return Err(conflict);
        }
    }
    list.push(Registered {
        state,
        namespace: namespace.cloned(),
        policies: Arc::downgrade(policies),
    });
    Ok(())
}

/// Whether `candidate` may replace the policies `policies` of the layers
/// registered with them: `Err` if another live layer counting in the same
/// place gives one of its names another meaning.
pub(crate) fn may_replace(
    policies: &Arc<ArcSwap<Policies>>,
    candidate: &Policies,
) -> Result<(), PolicyError> {
    let list = registered();
    for ours in list
        .iter()
        .filter(|entry| ptr_eq(&entry.policies, policies))
    {
        let others = list.iter().filter(|entry| {
            entry.state == ours.state
                && entry.namespace == ours.namespace
                && !ptr_eq(&entry.policies, policies)
        });
        for other in others {
            if let Some(conflict) = conflict_with(candidate, &other.policies) {
                return Err(conflict);
            }
        }
    }
    Ok(())
}

fn ptr_eq(weak: &Weak<ArcSwap<Policies>>, policies: &Arc<ArcSwap<Policies>>) -> bool {
    std::ptr::eq(weak.as_ptr(), Arc::as_ptr(policies))
}

/// The first policy of `ours` that the live layer with `theirs` names
/// alike but counts otherwise.
fn conflict_with(ours: &Policies, theirs: &Weak<ArcSwap<Policies>>) -> Option<PolicyError> {
    let theirs = theirs.upgrade()?.load_full();
    ours.iter().find_map(|ours| {
        let theirs: &Policy = theirs.iter().find(|p| p.name() == ours.name())?;
        (!ours.counts_as(theirs)).then(|| PolicyError::SharedName {
            name: ours.name().to_owned(),
            ours: ours.describe(),
            theirs: theirs.describe(),
        })
    })
}

/// Replaces a layer's policies while it serves (a configuration reloaded
/// at runtime); made by [`RateLimitLayer::policies_handle`].
///
/// [`replace`](Self::replace) puts new policies in force for the next
/// request, in every service the layer wraps, clones included, without a
/// lock on the request path; a request already past its policy selection
/// finishes under the policies it started with. Counts are kept by policy
/// name: a policy that keeps its name keeps its clients' counts, under its
/// new limit and window. Policies that would give a name another meaning
/// than another layer's on the same store are refused
/// ([`PolicyError`]), and the policies in force stay.
///
/// The example server reloads its `--config` file this way on `SIGHUP`
/// and logs each policy added, changed or removed; a bad file is refused
/// with the start-up error, and the policies in force stay.
///
/// ```
/// use slidegate::{Global, Policies, Policy, RateLimitLayer, store::MemoryStore};
/// use std::time::Duration;
///
/// let minute = |limit| Policies::single(Policy::new("all", limit, Duration::from_secs(60))).unwrap();
/// let layer = RateLimitLayer::new(MemoryStore::new(), Global, minute(10));
/// let handle = layer.policies_handle();
/// handle.replace(minute(20)).unwrap();
/// assert_eq!(handle.current().iter().next().unwrap().limit(), 20);
/// ```
#[derive(Clone)]
pub struct PoliciesHandle {
    policies: Arc<ArcSwap<Policies>>,
    /// The layer's store, which serves slices once policies take them.
    stores: Arc<LayerStore>,
}

impl std::fmt::Debug for PoliciesHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PoliciesHandle")
            .field(&**self.policies.load())
            .finish()
    }
}

impl PoliciesHandle {
    /// The policies in force.
    pub fn current(&self) -> Arc<Policies> {
        self.policies.load_full()
    }

    /// Puts `policies` in force for every request from now on.
    ///
    /// # Errors
    ///
    /// [`PolicyError::SharedName`], leaving the policies in force as they
    /// are, if another layer on the same store and namespace has a policy
    /// of one of these names that counts otherwise: the two would share
    /// counts under two limits.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, policy::PolicyError, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// let store = MemoryStore::new();
    /// let minute = |limit| Policies::single(Policy::new("api", limit, Duration::from_secs(60))).unwrap();
    /// let handler = tower::service_fn(|_: http::Request<()>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(()))
    /// });
    /// // Two layers, one budget: "api" counts alike in both.
    /// let public = RateLimitLayer::new(store.clone(), Global, minute(100));
    /// let admin = RateLimitLayer::new(store, Global, minute(100));
    /// let _served = (tower::Layer::layer(&public, handler.clone()), tower::Layer::layer(&admin, handler));
    /// // Another limit under that name would mix into the public layer's counts.
    /// let refused = admin.policies_handle().replace(minute(20)).unwrap_err();
    /// assert!(matches!(&refused, PolicyError::SharedName { name, .. } if name == "api"));
    /// ```
    pub fn replace(&self, policies: Policies) -> Result<(), PolicyError> {
        may_replace(&self.policies, &policies)?;
        // Slices are served before a request can meet a policy that takes
        // them.
        self.stores.serve(&policies);
        self.policies.store(Arc::new(policies));
        Ok(())
    }
}

impl RateLimitLayer {
    /// A [`PoliciesHandle`] that replaces this layer's policies while it
    /// serves, in every service the layer wraps, clones included; counts
    /// are kept by policy name.
    pub fn policies_handle(&self) -> PoliciesHandle {
        PoliciesHandle {
            policies: self.shared.policies.clone(),
            stores: self.shared.stores.clone(),
        }
    }
}

/// The identity of the state a store's clones share
/// ([`Store::shared_state`](crate::store::Store::shared_state)): two stores
/// with equal ids count in one place. It holds the state, so its address is
/// not reused while a layer names it.
struct StateId(Arc<dyn Any + Send + Sync>);

impl StateId {
    fn address(&self) -> usize {
        Arc::as_ptr(&self.0).cast::<()>().addr()
    }
}

impl PartialEq for StateId {
    fn eq(&self, other: &Self) -> bool {
        self.address() == other.address()
    }
}
