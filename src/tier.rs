//! [`TierLookup`]: finding a client's tier asynchronously, e.g. an API key's
//! plan in a database.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::request::Parts;

use crate::key::Identity;

/// The future a [`TierLookup`] returns: the client's tier, or `None` for the
/// policies' base limits.
pub type TierFuture = Pin<Box<dyn Future<Output = Option<Arc<str>>> + Send + 'static>>;

/// Finds the tier of a client whose key extractor named none.
///
/// The layer asks it only for identities without a tier, and waits for it
/// at most the layer's lookup timeout (100 ms by default); a lookup that
/// fails or times out should answer `None`, so the base limits apply. It
/// runs on every such request, so real deployments cache (the layer does
/// not). Any `Fn(&Parts, &Identity) -> Future<Output = Option<Arc<str>>>`
/// is a lookup:
///
/// ```
/// use std::sync::Arc;
/// use http::request::Parts;
/// use slidegate::{
///     Global,
///     Policies,
///     Policy,
///     RateLimitLayer,
///     key::{Identity, TierLookup},
///     store::MemoryStore,
/// };
///
/// // Pretend the plans live in a database keyed by the limiter's key.
/// let lookup = |_parts: &Parts, identity: &Identity| {
///     let key = identity.key.clone();
///     async move { (key.as_str() == "global").then(|| Arc::<str>::from("pro")) }
/// };
/// let policies = Policies::single(Policy::new("api", 10, std::time::Duration::from_secs(1)))?;
/// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).tier_lookup(lookup);
/// # Ok::<(), slidegate::policy::PolicyError>(())
/// ```
pub trait TierLookup: Send + Sync + 'static {
    /// Starts looking up the tier of `identity`, who sent `parts`.
    fn lookup(&self, parts: &Parts, identity: &Identity) -> TierFuture;
}

impl<F, Fut> TierLookup for F
where
    F: Fn(&Parts, &Identity) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<Arc<str>>> + Send + 'static,
{
    fn lookup(&self, parts: &Parts, identity: &Identity) -> TierFuture {
        Box::pin(self(parts, identity))
    }
}
