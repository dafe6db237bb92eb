//! [`ConnectionLease`]: concurrency leases held by an upgraded connection
//! (a WebSocket, a `CONNECT` tunnel) until it closes.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
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
    /// The handle of an outer layer's leases, kept while this one is.
    outer: OnceLock<ConnectionLease>,
    /// The runtime the leases were handed over on, to release them on
    /// when the last handle is dropped on a thread of none.
    runtime: OnceLock<tokio::runtime::Handle>,
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
            leases.give_back_on(self.runtime.get(), report_release);
        }
    }
}

impl ConnectionLease {
    fn new() -> Self {
        Self(Arc::new(Held {
            leases: Mutex::new(None),
            outer: OnceLock::new(),
            runtime: OnceLock::new(),
        }))
    }

    /// Keeps `outer`, an outer layer's handle the request's extensions
    /// held before this one, as long as this one is kept: the connection
    /// holds both layers' leases.
    pub(crate) fn hold_outer(&self, outer: ConnectionLease) {
        let _ = self.0.outer.set(outer);
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
        let lease_time = leases.shortest_window();
        *held.leases() = Some(leases);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let _ = held.runtime.set(runtime.clone());
            runtime.spawn(renew(Arc::downgrade(&held), lease_time));
        }
    }
}

/// Renews the leases `held` at once (the handshake may have taken part of
/// their time), then every third of `lease_time`, and a tenth of it after
/// a renewal that failed, until the connection drops them. Each renewal
/// keeps them alive until it is answered, so that their release comes
/// after it.
async fn renew(held: Weak<Held>, lease_time: Duration) {
    let floor = Duration::from_millis(1);
    let (every, after_failure) = ((lease_time / 3).max(floor), (lease_time / 10).max(floor));
    let mut wait = Duration::ZERO;
    loop {
        tokio::time::sleep(wait).await;
        let Some(held) = held.upgrade() else {
            return;
        };
        let answer = match held.leases().as_ref() {
            Some(leases) => leases.renew(),
            None => return,
        };
        wait = every;
        if let Err(error) = answer.await {
            wait = after_failure;
            if let Some(held_back) = RELEASE_FAILURES.admit() {
                tracing::warn!(%error, held_back, "concurrency lease renewal failed; retried, and the lease expires with its lease time unless renewed");
            }
        }
    }
}
