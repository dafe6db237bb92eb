//! [`MessageLimit`]: the messages a client sends over an upgraded
//! connection, counted per client in the store and per socket here.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::request::Parts;
use smallvec::SmallVec;

use crate::key::Key;
use crate::layer::decide::per_keys::PerKeys;
use crate::layer::settings::Shared;
use crate::log_lines::MESSAGES_UNCOUNTED;
use crate::policy::FailMode;
use crate::policy::plan::Plan;
use crate::store::{Check, Checks, Decisions, Store, StoreError};

/// Decides each message a client sends over the socket a request of a
/// route with a [`MessageRate`](crate::policy::MessageRate) upgraded to:
/// the layer puts one in the extensions of each such request, for the
/// handler to take with the upgrade (axum:
/// `Option<Extension<MessageLimit>>`). Each request's handle counts its
/// own socket; every socket of a client counts in its store count. A
/// client denied once its socket is open (a deny list changed at run
/// time) keeps that socket: close it from the application if need be.
///
/// ```no_run
/// use axum::Extension;
/// use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
/// use slidegate::layer::MessageLimit;
///
/// async fn chat(upgrade: WebSocketUpgrade, limit: Option<Extension<MessageLimit>>) -> axum::response::Response {
///     upgrade.on_upgrade(move |mut socket: WebSocket| async move {
///         while let Some(Ok(message)) = socket.recv().await {
///             if let Some(Extension(limit)) = &limit
///                 && let Err(refused) = limit.admit().await
///             {
///                 let code = refused.close_code();
///                 let frame = CloseFrame { code, reason: refused.reason().into() };
///                 let _ = socket.send(Message::Close(Some(frame))).await;
///                 return;
///             }
///             let _ = socket.send(message).await;
///         }
///     })
/// }
/// ```
#[derive(Clone)]
pub struct MessageLimit(Arc<Messages>);

impl std::fmt::Debug for MessageLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageLimit")
            .field("checks", &self.0.checks.len())
            .finish_non_exhaustive()
    }
}

struct Messages {
    store: Arc<dyn Store>,
    /// One per enforced policy of the request with a message rate: the
    /// client's count of messages.
    checks: Checks,
    /// The same of the policies in shadow mode (or all, in a layer in
    /// shadow mode): counted once the enforced ones admit the message,
    /// never refusing it.
    shadow: Checks,
    /// Where the checks of policies that fall back to a local limit are
    /// decided while the store fails, each at its share of the limit.
    local: Option<(Arc<dyn Store>, Checks)>,
    /// Per such policy with a bound per socket: the bound, its window,
    /// and when this socket's messages in it were sent.
    sockets: Mutex<SmallVec<[SocketWindow; 1]>>,
    /// Whether a store failure refuses the message.
    fail_closed: bool,
    close_code: u16,
}

struct SocketWindow {
    limit: u32,
    window: Duration,
    sent: VecDeque<Instant>,
}

impl SocketWindow {
    /// Whether one more message fits now, with those that left the
    /// window forgotten.
    fn fits(&mut self, now: Instant) -> bool {
        while self
            .sent
            .front()
            .is_some_and(|&sent| now.duration_since(sent) >= self.window)
        {
            self.sent.pop_front();
        }
        self.sent.len() < self.limit as usize
    }

    /// When the oldest message in the window leaves it.
    fn retry_after(&self, now: Instant) -> Duration {
        self.sent.front().map_or(Duration::ZERO, |&oldest| {
            self.window.saturating_sub(now.duration_since(oldest))
        })
    }
}

/// Why a message was refused: the client is over its message rate (or the
/// store could not count it and a policy fails closed).
#[derive(Debug, Clone)]
pub struct MessageRefused {
    retry_after: Option<Duration>,
    close_code: u16,
    unavailable: bool,
}

impl MessageRefused {
    /// The close code the policy names for it (1008, policy violation,
    /// unless set with
    /// [`MessageRate::with_close_code`](crate::policy::MessageRate::with_close_code));
    /// 1011 when the store could not count the message.
    pub fn close_code(&self) -> u16 {
        if self.unavailable {
            1011
        } else {
            self.close_code
        }
    }

    /// A close frame's reason, at most 123 bytes.
    pub fn reason(&self) -> &'static str {
        if self.unavailable {
            "the rate limiter is unavailable"
        } else {
            "message rate limit reached"
        }
    }

    /// How long until a message would fit, when known.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

impl MessageLimit {
    /// Counts one message the client sent: `Ok` when it fits within the
    /// socket's bound and the client's rate (and is then counted in
    /// both), `Err` when it does not (counted in neither). On a store in
    /// process it is decided at once.
    ///
    /// # Errors
    ///
    /// [`MessageRefused`] when the message is over a rate, or the store
    /// failed and a policy fails closed.
    pub async fn admit(&self) -> Result<(), MessageRefused> {
        let inner = &*self.0;
        let refused = |retry_after| MessageRefused {
            retry_after,
            close_code: inner.close_code,
            unavailable: false,
        };
        let now = Instant::now();
        // Taken in the socket's windows before the store is asked, so that
        // messages decided at once on one socket never share a place.
        if let Some(retry_after) = inner.take_socket_places(now) {
            return Err(refused(Some(retry_after)));
        }
        let decided = if inner.checks.is_empty() {
            Ok(Decisions::new())
        } else {
            match inner.store.check(&inner.checks).into_ready() {
                Ok(decided) => decided,
                Err(later) => later.await,
            }
        };
        let outcome = match decided {
            Ok(decisions) if decisions.iter().all(|decision| decision.admitted()) => Ok(()),
            Ok(decisions) => Err(refused(
                decisions.iter().filter_map(|d| d.retry_after()).max(),
            )),
            Err(error) => inner.failed(&error).await,
        };
        match outcome {
            Ok(()) if !inner.shadow.is_empty() => inner.count_shadow().await,
            Ok(()) => {}
            Err(_) => inner.give_socket_places_back(now),
        }
        outcome
    }
}

impl Messages {
    /// Takes a place for a message sent at `now` in each of the socket's
    /// windows; when one is full, takes none and says when it frees.
    fn take_socket_places(&self, now: Instant) -> Option<Duration> {
        let mut sockets = self.sockets.lock().unwrap_or_else(PoisonError::into_inner);
        for socket in sockets.iter_mut() {
            if !socket.fits(now) {
                return Some(socket.retry_after(now));
            }
        }
        for socket in sockets.iter_mut() {
            socket.sent.push_back(now);
        }
        None
    }

    /// Gives back the places taken at `now` for a message refused.
    fn give_socket_places_back(&self, now: Instant) {
        let mut sockets = self.sockets.lock().unwrap_or_else(PoisonError::into_inner);
        for socket in sockets.iter_mut() {
            if let Some(place) = socket.sent.iter().rposition(|&sent| sent == now) {
                socket.sent.remove(place);
            }
        }
    }

    /// Counts an admitted message under the shadow policies, which never
    /// refuse it.
    async fn count_shadow(&self) {
        let counted = match self.store.check(&self.shadow).into_ready() {
            Ok(counted) => counted,
            Err(later) => later.await,
        };
        match counted {
            Ok(decisions) if decisions.iter().any(|decision| !decision.admitted()) => {
                tracing::debug!("a shadow message rate would have refused a message");
            }
            Ok(_) => {}
            Err(error) => tracing::debug!(%error, "shadow message rates undecided"),
        }
    }

    /// A message the store could not count: refused when a policy fails
    /// closed; else decided by the local limits of policies that fall
    /// back to them, and passed otherwise (a warning is logged, at most
    /// once a second).
    async fn failed(&self, error: &StoreError) -> Result<(), MessageRefused> {
        if self.fail_closed {
            tracing::debug!(%error, "a message could not be counted; refused");
            return Err(MessageRefused {
                retry_after: Some(Duration::from_secs(1)),
                close_code: self.close_code,
                unavailable: true,
            });
        }
        if let Some(held_back) = MESSAGES_UNCOUNTED.admit() {
            tracing::warn!(
                %error,
                held_back,
                local = self.local.is_some(),
                "messages could not be counted in the store; passed on their local limits, if any"
            );
        }
        if let Some((local, checks)) = &self.local {
            let decided = match local.check(checks).into_ready() {
                Ok(decided) => decided,
                Err(later) => later.await,
            };
            if let Ok(decisions) = decided
                && !decisions.iter().all(|decision| decision.admitted())
            {
                return Err(MessageRefused {
                    retry_after: decisions.iter().filter_map(|d| d.retry_after()).max(),
                    close_code: self.close_code,
                    unavailable: false,
                });
            }
        }
        Ok(())
    }
}

/// Puts a [`MessageLimit`] in `parts`' extensions when a policy of `plan`
/// limits messages: for the client `key`, or the key a policy counts
/// under (`per`).
#[inline]
pub(crate) fn lend(
    shared: &Shared,
    plan: &Plan,
    key: &Key,
    per: Option<&PerKeys>,
    parts: &mut Parts,
) {
    if plan.counts_messages() {
        lend_to(shared, plan, key, per, parts);
    }
}

fn lend_to(shared: &Shared, plan: &Plan, key: &Key, per: Option<&PerKeys>, parts: &mut Parts) {
    let settings = shared.settings;
    let (mut checks, mut shadow, mut local) = (Checks::new(), Checks::new(), Checks::new());
    let mut sockets = SmallVec::new();
    let (mut fail_closed, mut close_code) = (false, None);
    for (index, policy) in plan.policies.iter().enumerate() {
        let Some(rate) = policy.messages() else {
            continue;
        };
        let Some(terms) = rate.terms() else {
            continue;
        };
        let key = per.and_then(|per| per.key(index)).unwrap_or(key);
        let namespace = shared.namespace.as_ref();
        let (limit, burst) = (terms.limits.limit, terms.limits.burst);
        let check = Check::of_terms(terms, key, namespace, (limit, burst), 1);
        if settings.shadow || policy.is_shadow() {
            shadow.push(check);
            continue;
        }
        match policy.fail_mode().unwrap_or(settings.fail_mode) {
            FailMode::Closed => fail_closed = true,
            FailMode::Local => {
                let share = |units: u32| (units / settings.local_share.max(1)).max(1);
                let at_share = (share(limit), share(burst));
                local.push(Check::of_terms(terms, key, namespace, at_share, 1));
            }
            FailMode::Open => {}
        }
        checks.push(check);
        if let Some(limit) = rate.per_socket() {
            sockets.push(SocketWindow {
                limit,
                window: rate.window(),
                sent: VecDeque::new(),
            });
        }
        close_code.get_or_insert(rate.close_code());
    }
    if checks.is_empty() && shadow.is_empty() {
        return;
    }
    parts.extensions.insert(MessageLimit(Arc::new(Messages {
        store: shared.store().clone(),
        checks,
        shadow,
        local: (!local.is_empty()).then(|| (shared.local.store().clone(), local)),
        sockets: Mutex::new(sockets),
        fail_closed,
        close_code: close_code.unwrap_or(crate::policy::POLICY_VIOLATION),
    })));
}
