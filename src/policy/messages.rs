//! [`MessageRate`]: a limit on the messages a client sends over the
//! connections a route upgrades (WebSockets), beside the route's limit on
//! requests.

use std::sync::Arc;
use std::time::Duration;

use super::error::validate_limits;
use super::{Algorithm, Policy, PolicyError, Terms};

/// The close code a socket over its message rate is closed with unless
/// set: 1008, policy violation (RFC 6455).
pub const POLICY_VIOLATION: u16 = 1008;

/// At most `limit` messages per sliding `window` from one client, across
/// all its sockets on every instance (counted in the store, exactly, as a
/// sliding log), and optionally at most
/// [`per_socket`](Self::with_per_socket) on any one socket (counted in
/// the process). Set on a policy with [`Policy::with_messages`]; the
/// handler asks a [`MessageLimit`](crate::layer::MessageLimit) about each
/// message, and closes the socket (with [`close_code`](Self::close_code),
/// 1008 unless set) or answers with an error frame, as it chooses.
///
/// ```
/// use slidegate::{Policy, policy::MessageRate};
/// use std::time::Duration;
///
/// // Two sockets at a time, 20 messages per 10 s across them, 10 on one.
/// let chat = Policy::concurrency("chat", 2)
///     .with_messages(MessageRate::new(20, Duration::from_secs(10)).with_per_socket(10));
/// assert_eq!(chat.messages().unwrap().limit(), 20);
/// ```
#[derive(Debug, Clone)]
pub struct MessageRate {
    limit: u32,
    window: Duration,
    per_socket: Option<u32>,
    close_code: u16,
    /// The terms of the client's count, `<policy>:messages`, once the
    /// rate is on a policy.
    terms: Option<Arc<Terms>>,
}

impl PartialEq for MessageRate {
    fn eq(&self, other: &Self) -> bool {
        (self.limit, self.window, self.per_socket, self.close_code)
            == (
                other.limit,
                other.window,
                other.per_socket,
                other.close_code,
            )
    }
}

impl Eq for MessageRate {}

impl MessageRate {
    /// At most `limit` messages per `window` from one client.
    pub fn new(limit: u32, window: Duration) -> Self {
        Self {
            limit,
            window,
            per_socket: None,
            close_code: POLICY_VIOLATION,
            terms: None,
        }
    }

    /// At most `limit` messages per window on any one socket too.
    #[must_use]
    pub fn with_per_socket(mut self, limit: u32) -> Self {
        self.per_socket = Some(limit);
        self
    }

    /// The close code a [`MessageLimit`](crate::layer::MessageLimit)
    /// refusal names: 1008 unless set; one a socket may be closed with
    /// (1000 to 1003, 1007 to 1014, 3000 to 4999; 4000 to 4999 are the
    /// application's own).
    #[must_use]
    pub fn with_close_code(mut self, code: u16) -> Self {
        self.close_code = code;
        self
    }

    /// Messages per window, per client.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Messages per window on one socket, if bounded.
    pub fn per_socket(&self) -> Option<u32> {
        self.per_socket
    }

    /// The close code of a refusal.
    pub fn close_code(&self) -> u16 {
        self.close_code
    }

    pub(crate) fn terms(&self) -> Option<&Arc<Terms>> {
        self.terms.as_ref()
    }

    /// The count of the messages of `policy`'s clients, as a policy of its
    /// own named `<policy>:messages` (no policy can take that name).
    fn count_of(&self, policy: &str) -> Policy {
        Policy::new(format!("{policy}:messages"), self.limit, self.window)
    }

    /// Refuses a rate that cannot be counted, naming `policy`.
    pub(super) fn validate(&self, policy: &str) -> Result<(), PolicyError> {
        let invalid = |reason: String| PolicyError::InvalidMessages {
            name: policy.to_owned(),
            reason,
        };
        let count = self.count_of(policy);
        validate_limits(
            policy.to_owned(),
            count.limits_for(None),
            Algorithm::SlidingLog,
        )
        .map_err(|error| {
            let reason = error.to_string();
            let prefix = format!("policy `{policy}`: ");
            invalid(reason.strip_prefix(&prefix).unwrap_or(&reason).to_owned())
        })?;
        if self.per_socket == Some(0) {
            return Err(invalid("per_socket must be at least 1".to_owned()));
        }
        // RFC 6455: 1004 is reserved, and 1005, 1006 and 1015 are never
        // sent; 3000 to 4999 are registered or the application's own.
        let sendable = matches!(self.close_code, 1000..=1003 | 1007..=1014 | 3000..=4999);
        if !sendable {
            return Err(invalid(format!(
                "close code {} is not one a socket may be closed with (1000 to 1003, 1007 to \
                 1014, 3000 to 4999)",
                self.close_code
            )));
        }
        Ok(())
    }
}

impl Policy {
    /// Limits the messages a client sends over the connections this
    /// policy's route upgrades (see [`MessageRate`]). The layer puts a
    /// [`MessageLimit`](crate::layer::MessageLimit) in the extensions of
    /// each request of the route (config: `messages = { limit = 20,
    /// window = "10s" }`, with an optional `per_socket`).
    #[must_use]
    pub fn with_messages(mut self, mut rate: MessageRate) -> Self {
        let count = rate.count_of(self.name());
        rate.terms = Some(Arc::new(Terms::of(&count, None)));
        self.messages = Some(rate);
        self
    }

    /// The limit on the messages of this policy's upgraded connections,
    /// if set.
    pub fn messages(&self) -> Option<&MessageRate> {
        self.messages.as_ref()
    }
}
