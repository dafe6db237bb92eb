//! One request's decision, read top to bottom: what is known now (the
//! plan, an exemption, the client, its costs and limits), the store asked,
//! and its answer turned into a call or an answer (see
//! [`outcome`](mod@outcome)).
//!
//! [`decide`] goes as far as it can without waiting and without
//! allocating: on a store in process, or from the deny cache, that is to
//! the end. At the first step that must wait (an API-key, tier or limit
//! lookup, a store across the network, a delay), the rest of the decision
//! is one boxed `async` block from that step on, through the same
//! functions. Both read the one [`Plan`] chosen at the start, with the
//! costs computed under it, so a reload of the policies never changes a
//! request midway.

pub(crate) mod answered;
pub(crate) mod checks;
pub(crate) mod delay;
pub(crate) mod outcome;
pub(crate) mod per_keys;
pub(crate) mod priced;
pub(crate) mod refused;
pub(crate) mod reject;

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};

use crate::key::{Identity, KeyRejection, confirmed};
use crate::layer::after::messages;
use crate::layer::changes;
use crate::layer::decide::answered::cached_denial;
use crate::layer::decide::outcome::{outcome, refused_locally};
use crate::layer::decide::per_keys::{PerKeys, Unkeyed};
use crate::layer::decide::priced::{Asked, Priced};
use crate::layer::decide::refused::{blocked, refusal_of, refused};
use crate::layer::decide::reject::reject;
use crate::layer::future::{Continuation, Next};
use crate::layer::settings::Shared;
use crate::limits::Found;
use crate::lookup::{TIER_TIMED_OUT, within};
use crate::metrics::{self, Outcome, Timer};
use crate::policy::Policies;
use crate::policy::cost::Costs;
use crate::policy::plan::Plan;
use crate::rejection::{Listed, Rejection};
use crate::store::{Check, Checks};
use crate::store::{Soon, StoreFuture};
use checks::{Modes, SentChecks};

/// Decides the request whose head is `parts` as far as it can without
/// waiting; `Err` is the rest of the decision of a request that must
/// wait, which took its head. An admitted client's [`Identity`] goes into
/// `parts` when the layer hands it on.
pub(crate) fn decide(shared: &Arc<Shared>, parts: &mut Parts) -> Result<Next, Continuation> {
    let policies = shared.policies.load();
    let plan = plan_for(&policies, parts);
    if plan.policies.is_empty() {
        return Ok(Next::PASS);
    }
    changes::read_if_due(shared);
    if let Some(list) = changes::refused_before_identity(shared, parts) {
        return Ok(Next::Answer(deny_listed(shared, parts, list)));
    }
    if shared.exempt.as_ref().is_some_and(|exempt| exempt(parts)) {
        exempted(plan);
        return Ok(Next::PASS);
    }
    // The count of this address's refused credentials, before verifying any.
    let refusal = shared
        .credential_failures
        .as_ref()
        .and_then(|failures| refusal_of(shared, failures, parts));
    if let Some(denied) = refusal.as_ref().and_then(|check| blocked(shared, check)) {
        return Ok(Next::Answer(cached_denial(shared, parts, &denied)));
    }
    let identity = match shared.keys.extract(parts) {
        Ok(Some(identity)) => identity,
        Ok(None) => return Ok(Next::Answer(unidentified(shared, parts))),
        Err(rejection) => return refused_now_or_later(shared, parts, refusal, rejection),
    };
    if let Some(list) = changes::refused_as(shared, &identity.key) {
        return Ok(Next::Answer(deny_listed(shared, parts, list)));
    }
    let per = match PerKeys::of(plan, parts) {
        Ok(per) => per,
        Err(Unkeyed::Missing) => return Ok(Next::Answer(without_per_key(shared, parts))),
        Err(Unkeyed::Rejected(rejection)) => {
            return refused_now_or_later(shared, parts, refusal, rejection);
        }
    };
    let costs = costs_of(shared, plan, parts);
    let costs = match &per {
        Some(per) => per.skip_in(costs),
        None => costs,
    };
    if identity.unconfirmed.is_none() {
        messages::lend(shared, plan, &identity.key, per.as_ref(), parts);
    }
    let timeout = shared.settings.lookup_timeout;
    if identity.unconfirmed.is_some() {
        let confirm = confirmed(identity, timeout);
        let rest = Rest::new(shared, plan, costs, per);
        return Err(later(parts, |mut parts| async move {
            let next = match confirm.await {
                Ok(Some(identity)) => rest.after_identity(&mut parts, identity).await,
                Ok(None) => Next::Answer(unidentified(&rest.shared, &parts)),
                Err(rejection) => {
                    Next::Answer(match refused(&rest.shared, &parts, refusal, rejection) {
                        Ok(answer) => answer,
                        Err(counting) => counting.answer(&rest.shared, &parts).await,
                    })
                }
            };
            (parts, next)
        }));
    }
    if let Some(lookup) = tier_lookup(shared, parts, &identity) {
        let rest = Rest::new(shared, plan, costs, per);
        return Err(later(parts, |mut parts| async move {
            let identity = with_tier(identity, lookup.await);
            let next = rest.after_tier(&mut parts, identity).await;
            (parts, next)
        }));
    }
    let own = match own_limits(shared, plan, &identity).map(Soon::into_ready) {
        None => None,
        Some(Ok(found)) => Some(found),
        Some(Err(lookup)) => {
            let rest = Rest::new(shared, plan, costs, per);
            return Err(later(parts, |mut parts| async move {
                let own = Some(lookup.await);
                let next = rest.after_limits(&mut parts, identity, own).await;
                (parts, next)
            }));
        }
    };
    let asked = Asked {
        costs: costs.as_ref(),
        per: per.as_ref(),
        own: own.as_ref(),
    };
    let next = match send(shared, parts, plan, &identity, asked) {
        Ok(next) => next,
        Err((sent, answer)) => {
            let rest = Rest::new(shared, plan, costs, per);
            return Err(later(parts, |mut parts| async move {
                let tier = identity.tier.as_deref();
                let (shared, plan) = (&*rest.shared, &*rest.plan);
                let next = outcome(shared, &parts, plan, tier, &sent, answer.await).await;
                let next = next.handed_on(&mut parts, identity, shared.settings.insert_identity);
                (parts, next)
            }));
        }
    };
    match next.into_ready() {
        Ok(next) => Ok(next.handed_on(parts, identity, shared.settings.insert_identity)),
        Err(delayed) => {
            let shared = shared.clone();
            Err(later(parts, |mut parts| async move {
                let insert = shared.settings.insert_identity;
                let next = delayed.await.handed_on(&mut parts, identity, insert);
                (parts, next)
            }))
        }
    }
}

/// The rest of the decision, `rest`, which takes the request head from
/// `parts` (leaving an empty one) and gives it back with the decision.
fn later<F>(parts: &mut Parts, rest: impl FnOnce(Parts) -> F) -> Continuation
where
    F: Future<Output = (Parts, Next)> + Send + 'static,
{
    let head = std::mem::replace(parts, Request::new(()).into_parts().0);
    Box::pin(rest(head))
}

/// The answer to a request whose credentials an extractor refused: at
/// once, or once the refusal is counted.
fn refused_now_or_later(
    shared: &Arc<Shared>,
    parts: &mut Parts,
    refusal: Option<Check>,
    rejection: KeyRejection,
) -> Result<Next, Continuation> {
    match refused(shared, parts, refusal, rejection) {
        Ok(answer) => Ok(Next::Answer(answer)),
        Err(counting) => {
            let shared = shared.clone();
            Err(later(parts, |parts| async move {
                let answer = counting.answer(&shared, &parts).await;
                (parts, Next::Answer(answer))
            }))
        }
    }
}

/// What a waiting request is decided under: owned, as it outlives the
/// call that began it.
struct Rest {
    shared: Arc<Shared>,
    plan: Arc<Plan>,
    costs: Option<Costs>,
    per: Option<PerKeys>,
}

impl Rest {
    fn new(
        shared: &Arc<Shared>,
        plan: &Arc<Plan>,
        costs: Option<Costs>,
        per: Option<PerKeys>,
    ) -> Self {
        Self {
            shared: shared.clone(),
            plan: plan.clone(),
            costs,
            per,
        }
    }

    /// The decision from a confirmed client on: its tier looked up if
    /// need be, then [`after_tier`](Self::after_tier).
    async fn after_identity(&self, parts: &mut Parts, identity: Identity) -> Next {
        // The client may be another than the one first found: an API key
        // the lookup does not know leaves it to the next extractor.
        if let Some(list) = changes::refused_as(&self.shared, &identity.key) {
            return Next::Answer(deny_listed(&self.shared, parts, list));
        }
        messages::lend(
            &self.shared,
            &self.plan,
            &identity.key,
            self.per.as_ref(),
            parts,
        );
        let identity = match tier_lookup(&self.shared, parts, &identity) {
            Some(lookup) => with_tier(identity, lookup.await),
            None => identity,
        };
        self.after_tier(parts, identity).await
    }

    /// The decision from a client of a known tier on: its own limits
    /// looked up if the layer does, then [`after_limits`](Self::after_limits).
    async fn after_tier(&self, parts: &mut Parts, identity: Identity) -> Next {
        let own = match own_limits(&self.shared, &self.plan, &identity) {
            Some(lookup) => Some(lookup.await),
            None => None,
        };
        self.after_limits(parts, identity, own).await
    }

    /// The decision from a client of known limits on: the store asked,
    /// and its answer turned into the request's way on.
    async fn after_limits(
        &self,
        parts: &mut Parts,
        identity: Identity,
        own: Option<Found>,
    ) -> Next {
        let (shared, plan) = (&*self.shared, &*self.plan);
        let asked = Asked {
            costs: self.costs.as_ref(),
            per: self.per.as_ref(),
            own: own.as_ref(),
        };
        let next = match send(shared, parts, plan, &identity, asked) {
            Ok(next) => next.await,
            Err((sent, answer)) => {
                let tier = identity.tier.as_deref();
                outcome(shared, parts, plan, tier, &sent, answer.await).await
            }
        };
        next.handed_on(parts, identity, shared.settings.insert_identity)
    }
}

/// `identity`, of the tier a lookup found, if it found one.
fn with_tier(mut identity: Identity, tier: Option<Arc<str>>) -> Identity {
    if tier.is_some() {
        identity.tier = tier;
    }
    identity
}

/// The plan of a request: by the route pattern axum matched
/// (`MatchedPath`), or, outside axum, by its path matched against the
/// policies' patterns.
fn plan_for<'a>(policies: &'a Policies, parts: &Parts) -> &'a Arc<Plan> {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return policies.plan_in(&parts.method, matched.as_str(), false);
    }
    policies.plan_in(&parts.method, parts.uri.path(), true)
}

/// Counts a request the layer leaves alone as exempt under each policy.
fn exempted(plan: &Plan) {
    for policy in &plan.policies {
        metrics::decided(policy.shared_name(), Outcome::Exempt);
    }
}

/// The request's cost under each policy of `plan`, when the layer
/// computes costs.
fn costs_of(shared: &Shared, plan: &Plan, parts: &Parts) -> Option<Costs> {
    let request_cost = shared.request_cost.as_ref()?;
    Some(
        plan.policies
            .iter()
            .map(|policy| request_cost.cost(parts, policy))
            .collect(),
    )
}

/// The answer to a request of a client a deny list names: `403`.
fn deny_listed(shared: &Shared, parts: &Parts, list: Listed) -> Response<Bytes> {
    metrics::deny_listed(list);
    reject(shared, parts, Rejection::DenyListed(list))
}

/// The answer to a request without the key of a policy that counts per
/// another key and refuses requests without one: `401`.
fn without_per_key(shared: &Shared, parts: &Parts) -> Response<Bytes> {
    let rejection = Rejection::Unidentified {
        missing_credentials: true,
    };
    reject(shared, parts, rejection)
}

/// The answer to a request no extractor identified: `401` when the chain
/// keys by credentials alone, `500` otherwise.
fn unidentified(shared: &Shared, parts: &Parts) -> Response<Bytes> {
    let missing_credentials = shared.keys.needs_credentials();
    reject(
        shared,
        parts,
        Rejection::Unidentified {
            missing_credentials,
        },
    )
}

/// The lookup of `identity`'s tier, when the layer has a lookup and the
/// identity names no tier; past the lookup timeout, the base limits apply.
fn tier_lookup(
    shared: &Shared,
    parts: &Parts,
    identity: &Identity,
) -> Option<impl Future<Output = Option<Arc<str>>> + Send + 'static> {
    let lookup = shared
        .tier_lookup
        .as_ref()
        .filter(|_| identity.tier.is_none())?;
    let asked = lookup.lookup((parts, identity));
    let timeout = shared.settings.lookup_timeout;
    Some(async move { within(asked, timeout, &TIER_TIMED_OUT).await.flatten() })
}

/// The own limits of `identity` under `plan`, when the layer looks them
/// up: known now when a fresh answer is kept.
fn own_limits(shared: &Shared, plan: &Plan, identity: &Identity) -> Option<Soon<Found>> {
    let limits = shared.client_limits.as_ref()?;
    let (policies, timeout) = (&plan.policies[..], shared.settings.lookup_timeout);
    Some(match limits.known(&identity.key, policies, timeout) {
        Some(found) => Soon::ready(found),
        None => Soon::new(limits.look_up(&identity.key, policies, timeout)),
    })
}

/// Prices the request of `identity` under `plan` (as `asked`),
/// asks the deny cache, then builds the checks and sends them: the
/// request's way on, when it is known without waiting (a cost above the
/// limit, a request every policy exempts, a denial the deny cache or the
/// local counts know, a store in process); `Err` holds the checks, sent,
/// and the store's answer to come.
// Returned once to its caller, and large only when the request waits for
// the network anyway; a request decided at once moves none.
#[allow(clippy::result_large_err)]
fn send(
    shared: &Shared,
    parts: &Parts,
    plan: &Plan,
    identity: &Identity,
    asked: Asked<'_>,
) -> Result<Soon<Next>, (SentChecks, StoreFuture)> {
    let tier = identity.tier.as_deref();
    let settings = shared.settings;
    let per = asked.per;
    let counted = |index| per.and_then(|per| per.key(index)).unwrap_or(&identity.key);
    // The client's own limits are not those of a key shared with others.
    let clients = per.zip(asked.own).map(|(per, own)| per.clients_only(own));
    let own = clients.as_ref().or(asked.own);
    let set = changes::with_limits_set(shared, plan, own, counted);
    let asked = Asked {
        own: set.as_ref().or(own),
        ..asked
    };
    let priced = match Priced::of(plan, tier, asked, settings.shadow, settings.fail_mode) {
        Ok(priced) => priced,
        Err(denied) => {
            let rejection = Rejection::CostAboveLimit(&denied);
            return Ok(Soon::ready(Next::Answer(reject(shared, parts, rejection))));
        }
    };
    if priced.prices.is_empty() {
        // Every policy of the request exempts it.
        return Ok(Soon::ready(Next::PASS));
    }
    let (key, namespace) = (&identity.key, shared.namespace.as_ref());
    let mut deny_clock = 0;
    if let Some(cache) = &shared.deny_cache {
        match cache.lookup(key, namespace, &priced.prices) {
            Ok(denied) => {
                let answer = cached_denial(shared, parts, &denied);
                return Ok(Soon::ready(Next::Answer(answer)));
            }
            Err(now) => deny_clock = now,
        }
    }
    // Built where it stays: the checks are large, and each move copies them.
    let mut sent = SentChecks {
        fail_closed: priced.fail_closed,
        checks: Checks::new(),
        modes: None,
        deny_clock,
        timer: Timer::default(),
    };
    for price in &priced.prices {
        sent.checks.push(price.check(key, namespace));
    }
    if priced.has_modes {
        sent.modes = Some(Modes::new(plan, &mut sent.checks, settings));
    }
    let enforced = sent
        .modes
        .as_ref()
        .map_or(sent.checks.len(), |modes| modes.shadow_from);
    if let Some(next) = sent
        .modes
        .as_deref()
        .and_then(Modes::local)
        .and_then(|local| refused_locally(shared, parts, local))
    {
        return Ok(Soon::ready(next));
    }
    sent.timer = Timer::start();
    match checks::check(shared.store(), &sent.checks, enforced).into_ready() {
        Ok(answer) => Ok(outcome(shared, parts, plan, tier, &sent, answer)),
        Err(answer) => Err((sent, answer)),
    }
}
