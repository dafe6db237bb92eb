//! [`ConnectionLease`]: concurrency leases held by an upgraded connection
//! (a WebSocket, a `CONNECT` tunnel) until it closes.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use http::StatusCode;
use http::request::Parts;

use crate::layer::owed::{Recorded, report_release};
use crate::throttle::RELEASE_FAILURES;

/// The concurrency leases of a request whose connection is upgraded (a
/// WebSocket, a `CONNECT` tunnel), held until the upgraded connection
/// closes.
///
/// A lease of a [concurrency limit](crate::Policy::concurrency) usually
/// ends with its response's body. An upgrade's response (`101 Switching
/// Protocols`, or a `2xx` to `CONNECT`) has no body to speak of, and the
/// connection it opens lives on. So the layer puts a `ConnectionLease` in
/// the extensions of an upgrade request it admits under a concurrency
/// limit. Move it into the task that serves the upgraded connection: the
/// leases are then held, and renewed every third of their lease time, for
/// as long as it (or a clone) lives, and released when the last is
/// dropped.
///
/// A handler that does not keep it leaves the leases to run out their
/// lease time: the layer cannot see when such a connection closes, and it
/// never gives a lease back early. A request that is not upgraded after
/// all (its response is anything else) releases its leases with its
/// response, whatever became of the handle.
///
/// ```
/// use axum::extract::ws::{WebSocket, WebSocketUpgrade};
/// use axum::response::Response;
/// use axum::Extension;
/// use slidegate::layer::ConnectionLease;
///
/// async fn chat(upgrade: WebSocketUpgrade, lease: Option<Extension<ConnectionLease>>) -> Response {
///     upgrade.on_upgrade(move |socket| async move {
///         // Held while the socket is served; released when it closes.
///         let _lease = lease;
///         serve(socket).await;
///     })
/// }
/// # async fn serve(_socket: WebSocket) {}
/// ```
#[derive(Clone)]
pub struct ConnectionLease(Arc<Held>);

/// The leases an upgraded connection holds: none until the upgrade's
/// response, then released when the last handle is dropped.
struct Held {
    leases: Mutex<Option<Recorded>>,
}

impl std::fmt::Debug for ConnectionLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.0.leases().as_ref().map_or(0, Recorded::len);
        f.debug_struct("ConnectionLease")
            .field("leases", &held)
            .finish()
    }
}

impl Held {
    fn leases(&self) -> MutexGuard<'_, Option<Recorded>> {
        // A panic while holding the lock leaves the leases as they were.
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(mut leases) = self.leases().take() {
            leases.give_back(report_release);
        }
    }
}

impl ConnectionLease {
    fn new() -> Self {
        Self(Arc::new(Held {
            leases: Mutex::new(None),
        }))
    }
}

/// An upgrade request's leases, and whether its response upgrades it.
pub(crate) struct Upgrade {
    lease: ConnectionLease,
    /// A `CONNECT` request, upgraded by any `2xx`; others by `101`.
    connect: bool,
}

impl Upgrade {
    /// The upgrade `parts` asks for, if it asks for one: a `CONNECT`, or
    /// an `Upgrade` header.
    pub(crate) fn of(parts: &Parts) -> Option<Self> {
        let connect = parts.method == http::Method::CONNECT;
        (connect || parts.headers.contains_key(http::header::UPGRADE)).then(|| Self {
            lease: ConnectionLease::new(),
            connect,
        })
    }

    /// The handle the handler keeps.
    pub(crate) fn lease(&self) -> &ConnectionLease {
        &self.lease
    }

    /// Whether a response of `status` upgrades the connection.
    pub(crate) fn upgrades(&self, status: StatusCode) -> bool {
        status == StatusCode::SWITCHING_PROTOCOLS || (self.connect && status.is_success())
    }

    /// Hands `leases` to the upgraded connection: held, and renewed,
    /// while the handler keeps its handle; left to run out their lease
    /// time if it kept none.
    pub(crate) fn hold(self, mut leases: Recorded) {
        let held = self.lease.0;
        if Arc::strong_count(&held) == 1 {
            leases.keep();
            return;
        }
        let every = leases.shortest_window() / 3;
        *held.leases() = Some(leases);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(renew(
                Arc::downgrade(&held),
                every.max(Duration::from_millis(1)),
            ));
        }
    }
}

/// Renews the leases `held` every `every`, until the connection drops
/// them. Each renewal keeps them alive until it is answered, so that their
/// release comes after it.
async fn renew(held: Weak<Held>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(held) = held.upgrade() else {
            return;
        };
        let answer = match held.leases().as_ref() {
            Some(leases) => leases.renew(),
            None => return,
        };
        if let Err(error) = answer.await
            && let Some(held_back) = RELEASE_FAILURES.admit()
        {
            tracing::warn!(%error, held_back, "concurrency lease renewal failed; it expires with its lease time unless renewed");
        }
    }
}
