//! [`ConnectionLease`]: concurrency leases held by an upgraded connection
//! (a WebSocket, a `CONNECT` tunnel) until it closes.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::task::Poll;
use std::time::Duration;

use http::StatusCode;
use http::request::Parts;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::layer::after::recorded::{Recorded, report_release};
use crate::log_lines::RELEASE_FAILURES;

/// The concurrency leases of a request whose connection is upgraded (a
/// WebSocket, a `CONNECT` tunnel), held until the upgraded connection
/// closes.
///
/// A [concurrency limit](crate::Policy::concurrency) on a route that
/// upgrades (a WebSocket's `101 Switching Protocols`, a `2xx` to
/// `CONNECT`) bounds the connections a client holds open. A lease usually
/// ends with its response's body, but an upgrade's response has no body to
/// speak of, and the connection it opens lives on. So the layer puts a
/// `ConnectionLease` in the extensions of an upgrade request it admits
/// under a concurrency limit. Move it into the task that serves the
/// upgraded connection: the leases are then held, and renewed every third
/// of their lease time, for as long as it (or a clone) lives, so a socket
/// open for hours keeps its place, and released when the last is dropped.
///
/// A handler that does not keep it leaves the leases to run out their
/// lease time: the layer cannot see when such a connection closes, and it
/// never gives a lease back early. A request that is not upgraded after
/// all (its response is anything else) releases its leases with its
/// response, as any other, whatever became of the handle.
///
/// Pair the concurrency limit with a rate of opens (the example server's
/// `socket_opens`): it counts sockets open, not opened.
///
/// ```toml
/// [[policy]]
/// name = "sockets"
/// route = "GET /ws/echo"
/// concurrency = 5                      # at most five WebSockets per client at once
/// ```
///
/// ```rust
/// use axum::{Extension, extract::ws::{WebSocket, WebSocketUpgrade}, response::Response};
/// use slidegate::layer::ConnectionLease;
///
/// async fn chat(upgrade: WebSocketUpgrade, lease: Option<Extension<ConnectionLease>>) -> Response {
///     upgrade.on_upgrade(move |socket: WebSocket| async move {
///         let _held = lease;                  // released when the socket closes
///         // serve the socket here
///         drop(socket);
///     })
/// }
/// ```
///
/// Two things a connection must heed:
///
/// * **Withdrawn leases.** A lease that is gone when it is renewed (it
///   expired while the store could not be reached, the store lost it in a
///   restart or a failover, or the connection was admitted while the store
///   was down and failed open) is taken again only within the limit. A
///   connection whose lease cannot be had is told by
///   [`withdrawn`](Self::withdrawn): close it then (the example server's
///   echo closes with 1013, try again later). Leases are renewed at once
///   when the store may have lost them (a Redis that answers again after
///   failing for a second or more, or one restarted empty; see
///   [`Store::recoveries`](crate::store::Store::recoveries)), at most once
///   a second, so within about a second of the store's return a client
///   holds at most its limit; on a store that cannot tell, within one
///   renewal period (a third of the lease time).
/// * **Silent peers.** A peer that vanishes without closing (a phone out
///   of range, a frozen proxy) leaves a connection that looks open, and
///   its leases renewed, for as long as TCP lets it: ping, and close a
///   socket that stops answering (the example server's echo pings every
///   10 s and closes one silent for 25 s with 1001). With keys by IP, two
///   dead phones would otherwise lock out everyone behind one NAT.
///
/// Closing a socket whose lease is withdrawn:
///
/// ```
/// use axum::extract::ws::{CloseFrame, Message, WebSocket, close_code};
/// use slidegate::layer::ConnectionLease;
///
/// async fn serve(mut socket: WebSocket, lease: Option<ConnectionLease>) {
///     let withdrawn = async {
///         match &lease {
///             Some(lease) => lease.withdrawn().await,
///             None => std::future::pending().await,
///         }
///     };
///     tokio::select! {
///         _ = withdrawn => {
///             // 1013: try again later; the client holds its limit.
///             let frame = CloseFrame { code: close_code::AGAIN, reason: "over the connection limit".into() };
///             let _ = socket.send(Message::Close(Some(frame))).await;
///         }
///         _ = echo(&mut socket) => {}
///     }
/// }
/// # async fn echo(_socket: &mut WebSocket) {}
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
    /// Set once a renewal finds a lease gone and cannot take it again
    /// within its limit.
    withdrawn: tokio::sync::watch::Sender<bool>,
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
            withdrawn: tokio::sync::watch::Sender::new(false),
        }))
    }

    /// Resolves once the connection's leases are withdrawn: a renewal
    /// found one gone (the store lost it, or the connection was admitted
    /// while the store was down) and could not take it again within its
    /// limit, as when the client holds its limit's worth of other
    /// connections. The connection should close then (a WebSocket with
    /// code 1013, try again later). Never resolves while the leases are
    /// held; an outer layer's withdrawal resolves it too.
    pub fn withdrawn(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut ours = self.0.withdrawn.subscribe();
        let mut outer: Option<Pin<Box<dyn Future<Output = ()> + Send>>> = self
            .0
            .outer
            .get()
            .map(|outer| Box::pin(outer.withdrawn()) as _);
        let mut ours = Box::pin(async move {
            // The sender lives as long as a handle does.
            if ours.wait_for(|withdrawn| *withdrawn).await.is_err() {
                std::future::pending::<()>().await;
            }
        });
        std::future::poll_fn(move |cx| {
            let outer_withdrawn = outer
                .as_mut()
                .is_some_and(|outer| outer.as_mut().poll(cx).is_ready());
            if outer_withdrawn || ours.as_mut().poll(cx).is_ready() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
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
        let recoveries = leases.store().recoveries();
        *held.leases() = Some(leases);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let _ = held.runtime.set(runtime.clone());
            runtime.spawn(renew(Arc::downgrade(&held), lease_time, recoveries));
        }
    }
}

/// The shortest time between two renewals of a connection's leases that
/// the store's recoveries start.
const RECOVERY_RENEWALS: Duration = Duration::from_secs(1);

/// Renews the leases `held` at once (the handshake may have taken part of
/// their time), then every third of `lease_time`, and a tenth of it after
/// a renewal that failed, until the connection drops them; and at once
/// when the store may have lost them (`recoveries`, see
/// [`Store::recoveries`](crate::store::Store::recoveries)), at most once
/// per [`RECOVERY_RENEWALS`]. Each renewal keeps them alive until it is
/// answered, so that their release comes after it.
async fn renew(
    held: Weak<Held>,
    lease_time: Duration,
    mut recoveries: Option<watch::Receiver<u64>>,
) {
    let floor = Duration::from_millis(1);
    let (every, after_failure) = ((lease_time / 3).max(floor), (lease_time / 10).max(floor));
    let mut wait = Duration::ZERO;
    let mut renewed = Instant::now();
    loop {
        let next = renewed + wait;
        match recoveries.as_mut() {
            Some(watched) => match tokio::time::timeout_at(next, watched.changed()).await {
                // Time for the renewal.
                Err(_) => {}
                // A store that flaps renews no more often than this.
                Ok(Ok(())) => tokio::time::sleep_until(renewed + RECOVERY_RENEWALS.min(wait)).await,
                Ok(Err(_)) => {
                    recoveries = None;
                    continue;
                }
            },
            None => tokio::time::sleep_until(next).await,
        }
        renewed = Instant::now();
        let Some(held) = held.upgrade() else {
            return;
        };
        let answer = match held.leases().as_ref() {
            Some(leases) => leases.renew(),
            None => return,
        };
        wait = every;
        match answer.await {
            Ok(held_now) => {
                if held_now.contains(&false) && !*held.withdrawn.borrow() {
                    tracing::info!(
                        "an upgraded connection's lease was gone and its client holds its limit: withdrawn"
                    );
                    held.withdrawn.send_replace(true);
                }
            }
            Err(error) => {
                wait = after_failure;
                if let Some(held_back) = RELEASE_FAILURES.admit() {
                    tracing::warn!(%error, held_back, "concurrency lease renewal failed; retried, and the lease expires with its lease time unless renewed");
                }
            }
        }
    }
}
