//! [`Count`]: which responses a policy counts.

/// Which requests a policy counts, by their response.
///
/// [`Count::Failures`] (config `count = "failures"`) limits what failed,
/// such as wrong passwords: successful logins are not counted.
///
/// ```toml
/// [[policy]]
/// name = "login"
/// route = "POST /api/login"
/// limit = 3
/// window = "60s"
/// count = "failures"                  # responses with a status of 400 or more
/// ```
///
/// ```rust
/// use slidegate::{Policy, policy::Count};
/// use std::time::Duration;
///
/// let login = Policy::new("login", 3, Duration::from_secs(60)).with_count(Count::Failures);
/// ```
///
/// # gRPC
///
/// A gRPC call (`content-type: application/grpc`) fails by its
/// `grpc-status` (anything but `0`), since its HTTP status is `200` either
/// way: read from the response head when the call ended at once, and from
/// the trailers otherwise (a call whose body breaks has failed; one whose
/// body never reaches its trailers stays counted). gRPC-Web's trailers are
/// inside its body: a gRPC-Web call is judged by its status only when it
/// ends at once (the status in the head), and stays counted otherwise.
///
/// # Counted, then refunded
///
/// Every request is still counted when it is admitted, so a burst can
/// never pass the limit; once its response shows it should not count, its
/// units are taken back ([`Store::refund`](crate::store::Store::refund)):
/// a sliding log drops exactly that request's entry, a counter takes the
/// units from the window that counted them, and a token bucket takes back
/// the part of the request's debt not yet repaid, counted as if its units
/// were the first the bucket owed and repaid at the fastest rate any tier
/// refilled it at (so never another request's; after the clock steps back
/// by more than a window, a request recorded before the step gets nothing
/// back). A refund gives back only what the request still holds, never
/// more: units that have left the window, or that the bucket has refilled
/// already, are not given twice (a slow successful login refunded a second
/// later gives nothing back to a bucket of one a second). At no instant are
/// more requests in the service than the limit allows.
///
/// Refunding from a sliding log names the one record it took back (records
/// have times of their own), so refunding a request twice takes nothing
/// the second time, and it rewrites at most one page of the log.
///
/// The headers say what is left after the request, as of its decision
/// (requests decided while it ran are not in them): a response that does
/// not count shows its units given back (a successful login leaves
/// `X-RateLimit-Remaining` where it was, and a client with nothing counted
/// sees a reset of `0`; a gRPC call settled by its trailers cannot: its
/// head has gone). [`Store::peek`](crate::store::Store::peek) gives a
/// client's remaining units and reset without counting anything.
///
/// A refund to Redis runs on a task of its own, so the response never
/// waits for it: it lands just after the response, and a request sent the
/// instant the response arrives may still find the units counted. If it
/// fails, the units stay counted until they leave the window, and a
/// warning is logged. A request whose response never comes (the client
/// went away) stays counted, and a denial of such a policy is not kept in
/// the [deny cache](crate::layer::DenyCache), since a refund may free it
/// early. With a [block](crate::Policy::with_block), mind the requests still in
/// flight: they count until their responses show otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Count {
    /// Every admitted request.
    #[default]
    All,
    /// Requests answered with a status of 400 or above (a gRPC status but
    /// `OK`), or failing in the service: failed logins, say.
    Failures,
    /// Requests answered with a status below 400 (gRPC calls ending `OK`).
    Successes,
}

impl Count {
    /// Whether a request whose response `failed` (or the service did)
    /// counts.
    pub(crate) fn counts(self, failed: bool) -> bool {
        match self {
            Self::All => true,
            Self::Failures => failed,
            Self::Successes => !failed,
        }
    }
}
