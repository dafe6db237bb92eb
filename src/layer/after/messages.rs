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
use crate::policy::FailMode;
use crate::policy::plan::Plan;
use crate::store::{Check, Checks, Store, StoreError};

/// Decides each message a client sends over the socket a request of a
/// route with a [`MessageRate`](crate::policy::MessageRate) upgraded to:
/// the layer puts one in the extensions of each such request, for the
/// handler to take with the upgrade (axum:
/// `Option<Extension<MessageLimit>>`). Each request's handle counts its
/// own socket; every socket of a client counts in its store count.
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
    /// One per policy of the request with a message rate: the client's
    /// count of messages.
    checks: Checks,
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
        {
            let mut sockets = inner.sockets.lock().unwrap_or_else(PoisonError::into_inner);
            for socket in sockets.iter_mut() {
                if !socket.fits(now) {
                    return Err(refused(Some(socket.retry_after(now))));
                }
            }
        }
        let decided = match inner.store.check(&inner.checks).into_ready() {
            Ok(decided) => decided,
            Err(later) => later.await,
        };
        match decided {
            Ok(decisions) if decisions.iter().all(|decision| decision.admitted()) => {}
            Ok(decisions) => {
                let retry_after = decisions.iter().filter_map(|d| d.retry_after()).max();
                return Err(refused(retry_after));
            }
            Err(error) => return inner.failed(&error),
        }
        let mut sockets = inner.sockets.lock().unwrap_or_else(PoisonError::into_inner);
        for socket in sockets.iter_mut() {
            socket.sent.push_back(now);
        }
        Ok(())
    }
}

impl Messages {
    /// A message the store could not count: refused when a policy fails
    /// closed, passed otherwise.
    fn failed(&self, error: &StoreError) -> Result<(), MessageRefused> {
        tracing::debug!(%error, "a message could not be counted");
        if self.fail_closed {
            return Err(MessageRefused {
                retry_after: Some(Duration::from_secs(1)),
                close_code: self.close_code,
                unavailable: true,
            });
        }
        Ok(())
    }
}

/// Puts a [`MessageLimit`] in `parts`' extensions when a policy of `plan`
/// limits messages: for the client `key`, or the key a policy counts
/// under (`per`).
pub(crate) fn lend(
    shared: &Shared,
    plan: &Plan,
    key: &Key,
    per: Option<&PerKeys>,
    parts: &mut Parts,
) {
    if !plan.counts_messages() {
        return;
    }
    let mut checks = Checks::new();
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
        let limits = (terms.limits.limit, terms.limits.burst);
        checks.push(Check::of_terms(
            terms,
            key,
            shared.namespace.as_ref(),
            limits,
            1,
        ));
        if let Some(limit) = rate.per_socket() {
            sockets.push(SocketWindow {
                limit,
                window: rate.window(),
                sent: VecDeque::new(),
            });
        }
        let fail_mode = policy.fail_mode().unwrap_or(shared.settings.fail_mode);
        fail_closed |= fail_mode == FailMode::Closed;
        close_code.get_or_insert(rate.close_code());
    }
    if checks.is_empty() {
        return;
    }
    parts.extensions.insert(MessageLimit(Arc::new(Messages {
        store: shared.store().clone(),
        checks,
        sockets: Mutex::new(sockets),
        fail_closed,
        close_code: close_code.unwrap_or(crate::policy::POLICY_VIOLATION),
    })));
}
