//! `GET /ws/echo`: a WebSocket that sends back every message it gets, for
//! trying limits on upgraded connections.

use axum::Extension;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use slidegate::layer::ConnectionLease;

/// Upgrades to the echo. The connection keeps the request's concurrency
/// lease (the `sockets` policy's) until it closes.
pub(crate) async fn echo(
    upgrade: WebSocketUpgrade,
    lease: Option<Extension<ConnectionLease>>,
) -> Response {
    upgrade.on_upgrade(move |socket| async move {
        let _held = lease;
        echo_until_closed(socket).await;
    })
}

/// Text and binary messages go back as they came, until the client closes
/// or goes away (pings are answered by the socket itself).
async fn echo_until_closed(mut socket: WebSocket) {
    while let Some(Ok(message)) = socket.recv().await {
        match message {
            Message::Text(_) | Message::Binary(_) => {
                if socket.send(message).await.is_err() {
                    break;
                }
            }
            Message::Close(_) => break,
            Message::Ping(_) | Message::Pong(_) => {}
        }
    }
}
