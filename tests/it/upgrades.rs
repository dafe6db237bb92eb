//! Concurrency limits on upgraded connections (WebSockets), served on a
//! loopback port, on both stores: a connection holds its lease until it
//! closes, renewed past its lease time; one whose handler does not keep
//! the lease holds it for its lease time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Extension;
use axum::Router;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::response::Response;
use axum::routing::get;
use futures_util::StreamExt;
use slidegate::key::Key;
use slidegate::layer::ConnectionLease;
use slidegate::store::Store;
use slidegate::{Global, Policies, Policy, RateLimitLayer};
use tokio_tungstenite::tungstenite::Error;

use crate::support::stores::StoreUnderTest;

/// The lease time: the tests hold sockets for several of them. A kept
/// lease is renewed every third of it, so a renewal held up by more than
/// two thirds of it (a loaded machine: the renewing task or Redis not
/// scheduled) would let it run out; a second leaves room for that.
const LEASE: Duration = Duration::from_secs(1);

/// Reads until the client closes; `keep` says whether the connection
/// keeps the request's lease. A socket whose lease the limiter withdraws
/// is closed with 1013 (try again later).
async fn serve(
    upgrade: WebSocketUpgrade,
    lease: Option<Extension<ConnectionLease>>,
    keep: bool,
) -> Response {
    let lease = lease.filter(|_| keep);
    upgrade.on_upgrade(move |mut socket: WebSocket| async move {
        let withdrawn = lease.as_ref().map(|Extension(lease)| lease.withdrawn());
        let withdrawn = async {
            match withdrawn {
                Some(withdrawn) => withdrawn.await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(withdrawn);
        loop {
            tokio::select! {
                () = &mut withdrawn => {
                    let frame = CloseFrame { code: close_code::AGAIN, reason: "withdrawn".into() };
                    let _ = socket.send(Message::Close(Some(frame))).await;
                    break;
                }
                message = socket.recv() => {
                    if !matches!(message, Some(Ok(_))) {
                        break;
                    }
                }
            }
        }
        drop(lease);
    })
}

/// Every socket of [`server`] is the one client's.
fn one_client(_: &http::request::Parts) -> Option<Key> {
    Some(Key::new("client"))
}

/// The `sockets` policy of [`server`].
fn sockets_policy() -> Policy {
    Policy::concurrency("sockets", 2).with_lease(LEASE)
}

/// Serves `/ws` (keeps its lease) and `/forgetful` (does not), each
/// under a limit of two connections at once, on a loopback port.
async fn server(store: Arc<dyn Store>) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    server_leasing_for(store, LEASE).await
}

/// [`server`], its leases lasting `lease`.
async fn server_leasing_for(
    store: Arc<dyn Store>,
    lease: Duration,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let sockets = Policy::concurrency("sockets", 2).with_lease(lease);
    let forgetful = Policy::concurrency("forgetful", 2).with_lease(lease);
    let policies = Policies::builder()
        .with_route("GET /ws", sockets)
        .with_route("GET /forgetful", forgetful)
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(store, one_client, policies).with_deny_cache(None);
    let app = Router::new()
        .route("/ws", get(|u, l| serve(u, l, true)))
        .route("/forgetful", get(|u, l| serve(u, l, false)))
        .route_layer(layer);
    listen(app).await
}

/// Serves `app` on a loopback port, on a task of its own.
async fn listen(app: Router) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (address, task)
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn open(address: SocketAddr, path: &str) -> Result<Socket, u16> {
    match tokio_tungstenite::connect_async(format!("ws://{address}{path}")).await {
        Ok((socket, _)) => Ok(socket),
        Err(Error::Http(response)) => Err(response.status().as_u16()),
        Err(error) => panic!("no answer from the server: {error}"),
    }
}

/// Closes `socket` and waits for the server's side to end.
async fn close(mut socket: Socket) {
    socket.close(None).await.unwrap();
    while socket.next().await.is_some() {}
}

/// Opens a socket on `path`, retrying while refused, for at most `within`.
async fn open_within(address: SocketAddr, path: &str, within: Duration) -> (Socket, Duration) {
    let started = Instant::now();
    loop {
        match open(address, path).await {
            Ok(socket) => return (socket, started.elapsed()),
            Err(status) => {
                assert_eq!(status, 429);
                assert!(started.elapsed() < within, "still refused after {within:?}");
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Two sockets held for four lease times keep their leases: a third is
/// refused, and admitted once one of them closes.
async fn open_sockets_keep_their_leases(tested: StoreUnderTest) {
    let (address, server) = server(tested.store.clone()).await;
    let first = open(address, "/ws").await.unwrap();
    let _second = open(address, "/ws").await.unwrap();
    assert_eq!(open(address, "/ws").await.err(), Some(429));
    // Past the lease time, renewed: still two held.
    tokio::time::sleep(4 * LEASE).await;
    assert_eq!(
        open(address, "/ws").await.err(),
        Some(429),
        "a lease ran out"
    );
    close(first).await;
    let (_third, _) = open_within(address, "/ws", Duration::from_secs(5)).await;
    assert_eq!(open(address, "/ws").await.err(), Some(429));
    server.abort();
}
on_both_stores!(open_sockets_keep_their_leases);

/// A handler that does not keep the lease: its sockets' leases stand for
/// their lease time, closed or not, and no longer.
async fn an_unkept_lease_runs_out_its_time(tested: StoreUnderTest) {
    let (address, server) = server(tested.store.clone()).await;
    // No lease is taken before this moment, so none ends before it + LEASE;
    // and a socket is decided before its answer comes back. So an answer
    // that comes back sooner than that must be a refusal, however slowly
    // the machine got there.
    let started = Instant::now();
    let first = open(address, "/forgetful").await.unwrap();
    let second = open(address, "/forgetful").await.unwrap();
    close(first).await;
    close(second).await;
    // Closed, but the layer cannot know: the leases run out their time.
    let _third = match open(address, "/forgetful").await {
        Ok(socket) => socket,
        Err(status) => {
            assert_eq!(status, 429, "refused while both leases stand");
            open_within(address, "/forgetful", 10 * LEASE).await.0
        }
    };
    assert!(started.elapsed() >= LEASE, "admitted before a lease time");
    server.abort();
}
on_both_stores!(an_unkept_lease_runs_out_its_time);

/// Under two layers that each limit concurrency (one for the whole
/// service, one for the route), a socket holds both layers' leases while
/// it is open.
async fn a_socket_holds_the_leases_of_nested_layers(tested: StoreUnderTest) {
    let store = tested.store.clone();
    let inner = Policies::single(Policy::concurrency("route", 5).with_lease(LEASE)).unwrap();
    let outer = Policies::single(Policy::concurrency("service", 1).with_lease(LEASE)).unwrap();
    let app = Router::new()
        .route("/ws", get(|u, l| serve(u, l, true)))
        .route_layer(RateLimitLayer::new(store.clone(), Global, inner).with_deny_cache(None))
        .layer(RateLimitLayer::new(store, Global, outer).with_deny_cache(None));
    let (address, server) = listen(app).await;
    let first = open(address, "/ws").await.unwrap();
    tokio::time::sleep(4 * LEASE).await;
    assert_eq!(
        open(address, "/ws").await.err(),
        Some(429),
        "the outer lease ran out"
    );
    close(first).await;
    let (_second, _) = open_within(address, "/ws", Duration::from_secs(5)).await;
    server.abort();
}
on_both_stores!(a_socket_holds_the_leases_of_nested_layers);

/// Whether the server has withdrawn `socket` (closed it with 1013), or it
/// is still open; a server's close of another kind fails the test.
async fn is_withdrawn(socket: &mut Socket) -> bool {
    use tokio_tungstenite::tungstenite::Message as ClientMessage;
    match tokio::time::timeout(Duration::from_millis(200), socket.next()).await {
        Err(_) => false,
        Ok(Some(Ok(ClientMessage::Close(Some(frame))))) => {
            assert_eq!(u16::from(frame.code), 1013, "{frame:?}");
            true
        }
        Ok(other) => panic!("neither open nor withdrawn: {other:?}"),
    }
}

/// Counts the sockets still open among `sockets` after a few renewal
/// periods; every other one must have been withdrawn.
async fn open_after_renewals(sockets: &mut [Socket]) -> usize {
    tokio::time::sleep(3 * LEASE).await;
    let mut open = 0;
    for socket in sockets {
        if !is_withdrawn(socket).await {
            open += 1;
        }
    }
    open
}

/// The store loses the leases of a client's two open sockets (a restart
/// without persistence, a failover); more open into the emptied set. A
/// renewal that finds its lease gone takes it again only within the
/// limit, so a few renewal periods on the client holds two sockets, and
/// the others are withdrawn (closed with 1013), where all stayed open.
async fn lost_leases_are_taken_again_only_within_the_limit(tested: StoreUnderTest) {
    let (address, server) = server(tested.store.clone()).await;
    let mut sockets = vec![
        open(address, "/ws").await.unwrap(),
        open(address, "/ws").await.unwrap(),
    ];
    assert_eq!(open(address, "/ws").await.err(), Some(429));
    let lost = slidegate::store::Check::new(&sockets_policy(), Key::new("client")).unwrap();
    // A connection renews its lease at once, then every third of the
    // lease time: a renewal that runs between the reset and the opens
    // (a loaded machine runs the first ones late) takes the emptied set
    // back first, within the limit, as it should. Then the store is
    // emptied again, until sockets open into it.
    for _ in 0..5 {
        tested
            .store
            .reset(std::slice::from_ref(&lost))
            .await
            .unwrap();
        for _ in 0..3 {
            if let Ok(socket) = open(address, "/ws").await {
                sockets.push(socket);
            }
        }
        if sockets.len() > 2 {
            break;
        }
    }
    assert!(sockets.len() > 2, "no socket opened into the emptied set");
    assert_eq!(open_after_renewals(&mut sockets).await, 2);
    assert_eq!(open(address, "/ws").await.err(), Some(429));
    server.abort();
}
on_both_stores!(lost_leases_are_taken_again_only_within_the_limit);

/// Sockets opened while Redis is down fail open, without leases; once it
/// is back (empty), their renewals take leases within the limit: a few
/// renewal periods on, two of five are open and three withdrawn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_admitted_while_redis_was_down_are_counted_when_it_returns() {
    let mut tested = StoreUnderTest::redis(false);
    let (address, server) = server(tested.store.clone()).await;
    let redis = tested.redis.as_mut().unwrap();
    redis.kill();
    let mut sockets = Vec::new();
    for _ in 0..5 {
        sockets.push(open(address, "/ws").await.expect("failing open"));
    }
    redis.restart();
    assert_eq!(open_after_renewals(&mut sockets).await, 2);
    assert_eq!(open(address, "/ws").await.err(), Some(429));
    server.abort();
}

/// Redis restarts empty while a client holds its two sockets: the
/// sockets opened into the emptied set are admitted, and the older ones'
/// leases are taken again as soon as Redis answers (not at their next
/// renewal, a third of the lease time on: 20 s here), within the limit,
/// so within a call or two the client holds two sockets and the others
/// are withdrawn. Before, all four stayed open for up to 20 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_lost_in_a_restart_are_taken_again_when_redis_answers() {
    let mut tested = StoreUnderTest::redis(false);
    let (address, server) = server_leasing_for(tested.store.clone(), Duration::from_secs(60)).await;
    let mut sockets = vec![
        open(address, "/ws").await.unwrap(),
        open(address, "/ws").await.unwrap(),
    ];
    assert_eq!(open(address, "/ws").await.err(), Some(429));
    tested.redis.as_mut().unwrap().restart();
    // Admitted into the emptied set, or refused where the older sockets
    // took their leases again first.
    for _ in 0..4 {
        if let Ok(socket) = open(address, "/ws").await {
            sockets.push(socket);
        }
    }
    // Well within the 20 s of the next renewal.
    let deadline = Instant::now() + Duration::from_secs(10);
    while sockets.len() > 2 && Instant::now() < deadline {
        let mut open = Vec::new();
        for mut socket in sockets {
            if !is_withdrawn(&mut socket).await {
                open.push(socket);
            }
        }
        sockets = open;
    }
    assert_eq!(sockets.len(), 2, "sockets open after the restart");
    assert_eq!(open(address, "/ws").await.err(), Some(429));
    server.abort();
}
