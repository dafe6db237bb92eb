//! One request's decision, read top to bottom.
//!
//! [`decide`] works out at once, without allocating, whatever needs no
//! waiting: the plan, an exemption, a blocked address, the client, the
//! costs, and, on a store in process or from the deny cache, the verdict.
//! A request that must wait (an API-key or tier lookup, a store across
//! the network) goes on in [`Wait::start`], one `async` continuation
//! through the same steps. Both read the one [`Plan`] chosen at the start
//! with the costs computed under it, so a reload of the policies never
//! changes a request midway.

use std::cmp::Reverse;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};

use crate::key::{Confirming, Identity, KeyRejection, confirmed};
use crate::layer::Shared;
use crate::layer::credential_failures::Refusal;
use crate::layer::delay::Delayed;
use crate::layer::deny_cache::Denied;
use crate::layer::outcome::{self, Next, Sent, SentAt, trace_decision};
use crate::layer::reject::{Reply, reject};
use crate::layer::roles::{self, Roles};
use crate::limits::Found;
use crate::metrics::{self, Outcome, Timer};
use crate::policy::cost::{self, Costs};
use crate::policy::plan::Plan;
use crate::policy::{Cost, FailMode, Policies};
use crate::response::problem::Denial;
use crate::store::{Check, CheckFuture, CheckOutcome, index_of_min};
use crate::throttle::TIER_LOOKUP_TIMEOUTS;
use crate::tier::TierFuture;

/// A request's decision: known now, or once it has waited.
pub(crate) enum Decided {
    Now(Next),
    /// The rest of the decision, which took the request head.
    Later(Continuation),
}

/// The rest of a waiting request's decision, with the request head back.
pub(crate) type Continuation = Pin<Box<dyn Future<Output = (Parts, Next)> + Send + 'static>>;

/// Decides the request whose head is `parts` as far as it can without
/// waiting; a request that must wait takes its head into the
/// continuation. An admitted client's [`Identity`] goes into `parts` when
/// the layer hands it on.
pub(crate) fn decide(shared: &Arc<Shared>, parts: &mut Parts) -> Decided {
    let policies = shared.policies.load();
    let plan = plan_for(&policies, parts);
    if plan.policies().is_empty() {
        return Decided::Now(Next::PASS);
    }
    if shared.exempt.as_ref().is_some_and(|exempt| exempt(parts)) {
        for policy in plan.policies() {
            metrics::decided(policy.shared_name(), Outcome::Exempt);
        }
        return Decided::Now(Next::PASS);
    }
    // The count of this address's refused credentials, before verifying any.
    let refusal = refusal_of(shared, parts);
    if let Some(denied) = refusal.as_ref().and_then(|check| blocked(shared, check)) {
        return Decided::Now(Next::Answer(cached_denial(shared, parts, &denied)));
    }
    let identity = match shared.keys.extract(parts) {
        Ok(Some(identity)) => identity,
        Ok(None) => return Decided::Now(Next::Answer(unidentified(shared, parts))),
        Err(rejection) => {
            return match refused(shared, parts, refusal, rejection) {
                Refused::Now(response) => Decided::Now(Next::Answer(response)),
                Refused::Counting(counting) => {
                    Wait::new(shared, plan, None, Step::Refusing(counting)).start(parts)
                }
            };
        }
    };
    let costs = costs_of(shared, plan, parts);
    if identity.unconfirmed.is_some() {
        let confirm = confirmed(identity, shared.options.lookup_timeout);
        let step = Step::Confirming(confirm, refusal);
        return Wait::new(shared, plan, costs, step).start(parts);
    }
    if let Some(lookup) = tier_lookup(shared, parts, &identity) {
        let step = Step::LookingUp(identity, lookup);
        return Wait::new(shared, plan, costs, step).start(parts);
    }
    let own = match own_limits(shared, plan, &identity) {
        Own::Known(own) => own,
        Own::Later(lookup) => {
            let step = Step::LookingUpLimits(identity, lookup);
            return Wait::new(shared, plan, costs, step).start(parts);
        }
    };
    match send(shared, parts, plan, &identity, costs.as_ref(), own.as_ref()) {
        Sending::Now(Next::Delay(delayed)) => {
            let step = Step::Holding(identity, delayed);
            Wait::new(shared, plan, costs, step).start(parts)
        }
        Sending::Now(next) => Decided::Now(hand_on(shared, parts, identity, next)),
        Sending::Later(sent, check) => {
            let step = Step::Checking(identity, own, sent, check);
            Wait::new(shared, plan, costs, step).start(parts)
        }
    }
}

/// A client's own limits under a plan: known now (`None` when the layer
/// looks none up), or being looked up.
enum Own {
    Known(Option<Found>),
    Later(OwnFuture),
}

type OwnFuture = Pin<Box<dyn Future<Output = Found> + Send + 'static>>;

/// The own limits of `identity` under `plan`, when the layer looks them up.
fn own_limits(shared: &Shared, plan: &Plan, identity: &Identity) -> Own {
    let Some(limits) = &shared.client_limits else {
        return Own::Known(None);
    };
    let policies = plan.policies();
    match limits.known(&identity.key, policies, shared.options.lookup_timeout) {
        Some(found) => Own::Known(Some(found)),
        None => Own::Later(Box::pin(limits.look_up(
            &identity.key,
            policies,
            shared.options.lookup_timeout,
        ))),
    }
}

/// [`own_limits`], waited for.
async fn own_limits_now(shared: &Shared, plan: &Plan, identity: &Identity) -> Option<Found> {
    match own_limits(shared, plan, identity) {
        Own::Known(own) => own,
        Own::Later(lookup) => Some(lookup.await),
    }
}

/// Where a waiting request's decision stands.
// Lives in the request's continuation, already on the heap: boxing the
// larger variant would cost another allocation per store call.
#[allow(clippy::large_enum_variant)]
enum Pending {
    /// Its checks are to be sent.
    Send,
    /// The store has them.
    Sent(Sent, CheckFuture),
}

/// A request that waits before it is decided: what it waits for, and the
/// plan and costs it was decided under so far.
pub(crate) struct Wait {
    shared: Arc<Shared>,
    plan: Arc<Plan>,
    costs: Option<Costs>,
    step: Step,
}

/// What a waiting request waits for.
// Moved into the request's continuation, which is on the heap: boxing the
// larger variant would cost another allocation per store call.
#[allow(clippy::large_enum_variant)]
enum Step {
    /// The count of its refused credentials, to answer them.
    Refusing(Box<Counting>),
    /// An API-key lookup, to know who the client is; with the count of
    /// the address's refusals, should the key be refused.
    Confirming(Confirming, Option<Check>),
    /// A tier lookup, to know the client's limits.
    LookingUp(Identity, TierFuture),
    /// A lookup of the client's own limits.
    LookingUpLimits(Identity, OwnFuture),
    /// The store's decision.
    Checking(Identity, Option<Found>, Sent, CheckFuture),
    /// The wait of a request admitted after its delay.
    Holding(Identity, Box<Delayed>),
}

impl Wait {
    fn new(shared: &Arc<Shared>, plan: &Arc<Plan>, costs: Option<Costs>, step: Step) -> Self {
        Self {
            shared: shared.clone(),
            plan: plan.clone(),
            costs,
            step,
        }
    }

    /// The rest of the decision, which takes the request head from
    /// `parts` (leaving an empty one): confirm the API key, look up the
    /// tier, ask the store, and settle.
    fn start(self, parts: &mut Parts) -> Decided {
        let head = std::mem::replace(parts, Request::new(()).into_parts().0);
        Decided::Later(Box::pin(self.run(head)))
    }

    async fn run(self, mut parts: Parts) -> (Parts, Next) {
        let Self {
            shared,
            plan,
            costs,
            step,
        } = self;
        let (identity, own, pending) = match step {
            Step::Refusing(counting) => {
                let answer = counting.answer(&shared, &parts).await;
                return (parts, Next::Answer(answer));
            }
            Step::Confirming(confirm, refusal) => {
                let identity = match confirm.await {
                    Ok(Some(identity)) => identity,
                    Ok(None) => {
                        let answer = unidentified(&shared, &parts);
                        return (parts, Next::Answer(answer));
                    }
                    Err(rejection) => {
                        let answer = match refused(&shared, &parts, refusal, rejection) {
                            Refused::Now(response) => response,
                            Refused::Counting(counting) => counting.answer(&shared, &parts).await,
                        };
                        return (parts, Next::Answer(answer));
                    }
                };
                let identity = match tier_lookup(&shared, &parts, &identity) {
                    Some(lookup) => with_tier(identity, lookup.await),
                    None => identity,
                };
                let own = own_limits_now(&shared, &plan, &identity).await;
                (identity, own, Pending::Send)
            }
            Step::LookingUp(identity, lookup) => {
                let identity = with_tier(identity, lookup.await);
                let own = own_limits_now(&shared, &plan, &identity).await;
                (identity, own, Pending::Send)
            }
            Step::LookingUpLimits(identity, lookup) => {
                (identity, Some(lookup.await), Pending::Send)
            }
            Step::Checking(identity, own, sent, check) => {
                (identity, own, Pending::Sent(sent, check))
            }
            Step::Holding(identity, delayed) => {
                let next = delayed.pass().await;
                let next = hand_on(&shared, &mut parts, identity, next);
                return (parts, next);
            }
        };
        let tier = identity.tier.as_deref();
        let next = match pending {
            Pending::Send => {
                match send(
                    &shared,
                    &parts,
                    &plan,
                    &identity,
                    costs.as_ref(),
                    own.as_ref(),
                ) {
                    Sending::Now(next) => next,
                    Sending::Later(sent, check) => {
                        let answer = check.await;
                        outcome::outcome(&shared, &parts, &plan, tier, &sent, answer)
                    }
                }
            }
            Pending::Sent(sent, check) => {
                let answer = check.await;
                outcome::outcome(&shared, &parts, &plan, tier, &sent, answer)
            }
        };
        let next = match next {
            Next::Delay(delayed) => delayed.pass().await,
            next => next,
        };
        let next = hand_on(&shared, &mut parts, identity, next);
        (parts, next)
    }
}

/// `identity`, of the tier a lookup found, if it found one.
fn with_tier(mut identity: Identity, tier: Option<Arc<str>>) -> Identity {
    if tier.is_some() {
        identity.tier = tier;
    }
    identity
}

/// `next`, after giving an admitted client's identity to the inner
/// service when the layer does.
fn hand_on(shared: &Shared, parts: &mut Parts, identity: Identity, next: Next) -> Next {
    if shared.options.insert_identity && matches!(next, Next::Call(..)) {
        parts.extensions.insert(identity);
    }
    next
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

/// The request's cost under each policy of `plan`, when the layer
/// computes costs.
fn costs_of(shared: &Shared, plan: &Plan, parts: &Parts) -> Option<Costs> {
    let request_cost = shared.request_cost.as_ref()?;
    Some(
        plan.policies()
            .iter()
            .map(|policy| request_cost.cost(parts, policy))
            .collect(),
    )
}

/// The count of this address's refused credentials, when the layer
/// counts them and the request presents some.
fn refusal_of(shared: &Shared, parts: &Parts) -> Option<Check> {
    let failures = shared.credential_failures.as_ref()?;
    let mut check = failures.check_for(parts, &*shared.keys)?;
    shared.in_namespace(&mut check);
    Some(check)
}

/// The cached denial of the address `check` counts refusals of, while it
/// is blocked; never in shadow mode.
fn blocked<'a>(shared: &Shared, check: &'a Check) -> Option<Denied<'a>> {
    let failures = shared.credential_failures.as_ref()?;
    (!shared.options.shadow)
        .then(|| failures.blocked_now(check))
        .flatten()
}

/// The answer to a request no extractor identified: `401` when the chain
/// keys by credentials alone, `500` otherwise.
fn unidentified(shared: &Shared, parts: &Parts) -> Response<Bytes> {
    let missing_credentials = shared.keys.needs_credentials();
    reject(
        shared,
        parts,
        Reply::Unidentified {
            missing_credentials,
        },
    )
}

/// Refused credentials: answered `401` at once, or once the refusal is
/// counted against the client's address.
enum Refused {
    Now(Response<Bytes>),
    Counting(Box<Counting>),
}

/// A refusal of credentials the store is counting.
struct Counting {
    refusal: Refusal,
    rejection: KeyRejection,
    check: CheckFuture,
}

impl Counting {
    async fn answer(self, shared: &Shared, parts: &Parts) -> Response<Bytes> {
        let outcome = self.check.await;
        refusal_answer(shared, parts, &self.refusal, &self.rejection, outcome)
    }
}

/// Answers refused credentials `401`, after counting the refusal against
/// the client's address (`check`) when the layer counts them: `429` once
/// the address is past its limit.
fn refused(
    shared: &Shared,
    parts: &Parts,
    check: Option<Check>,
    rejection: KeyRejection,
) -> Refused {
    tracing::debug!(reason = rejection.reason(), "credentials refused");
    let Some((failures, check)) = shared.credential_failures.as_ref().zip(check) else {
        return Refused::Now(reject(shared, parts, Reply::InvalidCredentials(&rejection)));
    };
    let refusal = failures.refusal(check);
    match shared
        .store
        .check(std::slice::from_ref(&refusal.check))
        .into_ready()
    {
        Ok(outcome) => Refused::Now(refusal_answer(shared, parts, &refusal, &rejection, outcome)),
        Err(check) => Refused::Counting(Box::new(Counting {
            refusal,
            rejection,
            check,
        })),
    }
}

fn refusal_answer(
    shared: &Shared,
    parts: &Parts,
    refusal: &Refusal,
    rejection: &KeyRejection,
    outcome: CheckOutcome,
) -> Response<Bytes> {
    match refusal.past_limit(outcome, shared.options.shadow) {
        Some(decision) => reject(
            shared,
            parts,
            Reply::Limited(Denial {
                checks: std::slice::from_ref(&refusal.check),
                decisions: &[decision],
                denied: 0,
                body: None,
            }),
        ),
        None => reject(shared, parts, Reply::InvalidCredentials(rejection)),
    }
}

/// The lookup of `identity`'s tier, when the layer has a lookup and the
/// identity names no tier.
fn tier_lookup(shared: &Shared, parts: &Parts, identity: &Identity) -> Option<TierFuture> {
    match &shared.tier_lookup {
        Some(lookup) if identity.tier.is_none() => Some(with_timeout(
            lookup.lookup(parts, identity),
            shared.options.lookup_timeout,
        )),
        _ => None,
    }
}

/// Bounds a tier lookup: past `timeout` the base limits apply.
fn with_timeout(lookup: TierFuture, timeout: Duration) -> TierFuture {
    Box::pin(async move {
        tokio::time::timeout(timeout, lookup)
            .await
            .unwrap_or_else(|_| {
                if let Some(held_back) = TIER_LOOKUP_TIMEOUTS.admit() {
                    tracing::warn!(
                        ?timeout,
                        held_back,
                        "tier lookup timed out; base limits apply"
                    );
                }
                None
            })
    })
}

/// The request's checks, sent: decided at once, or when the store answers.
// Moved once, from `send` to its caller, and never stored: boxing the
// larger variant would cost an allocation per store call.
#[allow(clippy::large_enum_variant)]
enum Sending {
    Now(Next),
    Later(Sent, CheckFuture),
}

/// Builds the checks of `identity` under `plan` (at its `own` limits) and
/// sends them: the answer is known at once for a cost above the limit, an
/// exempt request, a denial the deny cache knows, or a store that decides
/// in process.
fn send(
    shared: &Shared,
    parts: &Parts,
    plan: &Plan,
    identity: &Identity,
    costs: Option<&Costs>,
    own: Option<&Found>,
) -> Sending {
    let tier = identity.tier.as_deref();
    let mut checks = match cost::checks(plan, &identity.key, tier, costs, own) {
        Ok(checks) => checks,
        Err(denied) => {
            return Sending::Now(Next::Answer(reject(
                shared,
                parts,
                Reply::CostAboveLimit(&denied),
            )));
        }
    };
    if checks.is_empty() {
        // Every policy of the request exempts it.
        return Sending::Now(Next::PASS);
    }
    if shared.namespace.is_some() {
        for check in &mut checks {
            shared.in_namespace(check);
        }
    }
    let roles = Roles::assign(plan, &mut checks, shared.options);
    let enforced = roles
        .as_ref()
        .map_or(checks.len(), |roles| roles.shadow_from);
    if let Some(next) = roles
        .as_deref()
        .and_then(|roles| outcome::refused_locally(shared, parts, roles))
    {
        return Sending::Now(next);
    }
    let mut deny_clock = 0;
    if let Some(cache) = &shared.deny_cache {
        if let Some(denied) = cache.lookup(&checks[..enforced]) {
            return Sending::Now(Next::Answer(cached_denial(shared, parts, &denied)));
        }
        deny_clock = cache.now();
    }
    let sent = Sent {
        fail_closed: fails_closed(shared, plan, costs),
        checks,
        roles,
        at: SentAt {
            deny_clock,
            timer: Timer::start(),
        },
    };
    match roles::check(&shared.store, &sent.checks, enforced).into_ready() {
        Ok(answer) => Sending::Now(outcome::outcome(shared, parts, plan, tier, &sent, answer)),
        Err(check) => Sending::Later(sent, check),
    }
}

/// Whether a policy that counts the request fails closed: policies a
/// computed cost exempts, and shadow policies, do not decide how the
/// request fails.
fn fails_closed(shared: &Shared, plan: &Plan, costs: Option<&Costs>) -> bool {
    let default = shared.options.fail_mode;
    if shared.options.shadow {
        return false;
    }
    let Some(costs) = costs else {
        return plan.fails_closed(default);
    };
    plan.policies().iter().zip(costs).any(|(policy, cost)| {
        *cost != Cost::Exempt
            && !policy.is_shadow()
            && policy.fail_mode().unwrap_or(default) == FailMode::Closed
    })
}

/// A `429` from the deny cache, for checks it knows to be denied.
fn cached_denial(shared: &Shared, parts: &Parts, denied: &Denied<'_>) -> Response<Bytes> {
    for check in denied.checks.iter() {
        metrics::decided(&check.policy, Outcome::DenyCache);
    }
    let index = index_of_min(&denied.decisions, |d| Reverse(d.retry_after));
    trace_decision(&denied.checks[index].policy, Outcome::DenyCache, None);
    reject(
        shared,
        parts,
        Reply::Limited(Denial {
            checks: &denied.checks,
            decisions: &denied.decisions,
            denied: index,
            body: Some(&denied.bodies[index]),
        }),
    )
}
