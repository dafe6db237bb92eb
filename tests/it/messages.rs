//! The rate of the messages a client sends over its WebSockets
//! (`Policy::with_messages`): per socket and per client across its
//! sockets, the one over the rate refused and not counted, the socket
//! closed with the policy's close code; the config file's `messages`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use axum::routing::get;
use axum::{Extension, http};
use futures_util::{SinkExt, StreamExt};
use slidegate::key::Key;
use slidegate::layer::MessageLimit;
use slidegate::policy::MessageRate;
use slidegate::store::Store;
use slidegate::{Policies, Policy, RateLimitLayer};
use tokio_tungstenite::tungstenite::Message as Sent;

use crate::support::stores::StoreUnderTest;

const MINUTE: Duration = Duration::from_secs(60);

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Echoes each message the limit admits; closes the socket with the
/// refusal's code at the first it refuses.
async fn chat_handler(
    upgrade: WebSocketUpgrade,
    limit: Option<Extension<MessageLimit>>,
) -> Response {
    let Extension(limit) = limit.expect("the layer lends a message limit");
    upgrade.on_upgrade(move |mut socket: WebSocket| async move {
        while let Some(Ok(message)) = socket.recv().await {
            if !matches!(message, Message::Text(_) | Message::Binary(_)) {
                continue;
            }
            if let Err(refused) = limit.admit().await {
                let frame = CloseFrame {
                    code: refused.close_code(),
                    reason: refused.reason().into(),
                };
                let _ = socket.send(Message::Close(Some(frame))).await;
                return;
            }
            if socket.send(message).await.is_err() {
                return;
            }
        }
    })
}

/// `/chat` for one client, 100 sockets a minute, its messages at `rate`.
async fn server(store: Arc<dyn Store>, rate: MessageRate) -> SocketAddr {
    serve(store, Policy::new("chat", 100, MINUTE).with_messages(rate)).await
}

/// `/chat` for one client under `chat`, on a loopback port.
async fn serve(store: Arc<dyn Store>, chat: Policy) -> SocketAddr {
    let one_client = |_: &http::request::Parts| Some(Key::new("client"));
    let policies = Policies::builder()
        .with_route("GET /chat", chat)
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(store, one_client, policies).with_deny_cache(None);
    let app = Router::new()
        .route("/chat", get(chat_handler))
        .route_layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

async fn open(address: SocketAddr) -> Socket {
    let (socket, _) = tokio_tungstenite::connect_async(format!("ws://{address}/chat"))
        .await
        .unwrap();
    socket
}

/// Sends `text` and reads what comes back: the echo, or the close code.
async fn say(socket: &mut Socket, text: &str) -> Result<(), u16> {
    socket.send(Sent::text(text)).await.unwrap();
    loop {
        let answer = tokio::time::timeout(Duration::from_secs(30), socket.next())
            .await
            .expect("an answer within 30 s");
        match answer {
            Some(Ok(Sent::Text(echo))) => {
                assert_eq!(echo.as_str(), text);
                return Ok(());
            }
            Some(Ok(Sent::Close(frame))) => {
                return Err(frame.map_or(0, |frame| u16::from(frame.code)));
            }
            Some(Ok(_)) => {}
            other => panic!("the socket ended without a close frame: {other:?}"),
        }
    }
}

async fn messages_are_limited_per_socket_and_per_client(tested: StoreUnderTest) {
    let rate = MessageRate::new(5, MINUTE).with_per_socket(3);
    let address = server(tested.store.clone(), rate).await;
    let mut first = open(address).await;
    for n in 0..3 {
        assert_eq!(say(&mut first, &format!("a{n}")).await, Ok(()));
    }
    assert_eq!(say(&mut first, "a3").await, Err(1008), "3 on one socket");

    // Another socket of the client: the refused message was not counted,
    // so 2 of the client's 5 are left.
    let mut second = open(address).await;
    for n in 0..2 {
        assert_eq!(say(&mut second, &format!("b{n}")).await, Ok(()));
    }
    assert_eq!(say(&mut second, "b2").await, Err(1008), "5 across sockets");
    let mut third = open(address).await;
    assert_eq!(say(&mut third, "c0").await, Err(1008));
}

on_both_stores!(messages_are_limited_per_socket_and_per_client);

/// A close code of the application's own, and the refusal's retry time.
#[tokio::test]
async fn a_refused_message_names_the_policys_close_code() {
    let store: Arc<dyn Store> = Arc::new(slidegate::store::MemoryStore::new());
    let address = server(store, MessageRate::new(1, MINUTE).with_close_code(4029)).await;
    let mut socket = open(address).await;
    assert_eq!(say(&mut socket, "one").await, Ok(()));
    assert_eq!(say(&mut socket, "two").await, Err(4029));
}

/// The config file's `messages`, and the rates it refuses.
#[test]
fn the_config_file_sets_a_message_rate() {
    use slidegate::config::Config;

    let config = Config::from_toml_str(
        r#"
        [[policy]]
        name = "chat"
        route = "GET /ws"
        concurrency = 2
        messages = { limit = 20, window = "10s", per_socket = 10 }
        "#,
    )
    .unwrap();
    let chat = config.policies().iter().next().unwrap();
    let rate = chat.messages().unwrap();
    assert_eq!(
        (
            rate.limit(),
            rate.window(),
            rate.per_socket(),
            rate.close_code()
        ),
        (20, Duration::from_secs(10), Some(10), 1008)
    );
    for (messages, message) in [
        (
            "{ limit = 0, window = \"10s\" }",
            "limit must be at least 1",
        ),
        ("{ limit = 5, window = \"0s\" }", "window"),
        (
            "{ limit = 5, window = \"10s\", per_socket = 0 }",
            "per_socket",
        ),
        (
            "{ limit = 5, window = \"10s\", close_code = 999 }",
            "close code",
        ),
        (
            "{ limit = 5, window = \"10s\", close_code = 1006 }",
            "close code",
        ),
        ("{ limit = 5 }", "missing field `window`"),
        ("{ limit = 5, window = \"10s\", rate = 1 }", "unknown field"),
    ] {
        let file = format!(
            "[[policy]]\nname = \"chat\"\nlimit = 5\nwindow = \"1s\"\nmessages = {messages}\n"
        );
        let error = Config::from_toml_str(&file).unwrap_err().to_string();
        assert!(error.contains("policy[0].messages"), "{messages}: {error}");
        assert!(error.contains(message), "{messages}: {error}");
    }
}

/// What a message costs is bounded: a client's messages are one count in
/// the store, whatever the number of its sockets.
#[tokio::test]
async fn a_clients_messages_are_one_count_in_redis() {
    let tested = StoreUnderTest::redis(false);
    let address = server(tested.store.clone(), MessageRate::new(50, MINUTE)).await;
    let mut sockets = Vec::new();
    for _ in 0..3 {
        sockets.push(open(address).await);
    }
    for (n, socket) in sockets.iter_mut().enumerate() {
        assert_eq!(say(socket, &format!("m{n}")).await, Ok(()));
    }
    let redis = tested.redis.as_ref().unwrap();
    let keys = redis.cli(&["--scan", "--pattern", "*messages*"]);
    assert_eq!(keys.lines().count(), 1, "{keys}");
    assert!(
        keys.contains("slidegate:chat:messages:{user:client}"),
        "{keys}"
    );
}

/// A message rate in shadow mode counts and never refuses.
#[tokio::test]
async fn a_message_rate_in_shadow_mode_never_closes_a_socket() {
    let store: Arc<dyn Store> = Arc::new(slidegate::store::MemoryStore::new());
    let chat = Policy::new("chat", 100, MINUTE)
        .with_messages(MessageRate::new(2, MINUTE).with_per_socket(1))
        .with_shadow(true);
    let address = serve(store, chat).await;
    let mut socket = open(address).await;
    for n in 0..5 {
        assert_eq!(say(&mut socket, &format!("m{n}")).await, Ok(()));
    }
}
