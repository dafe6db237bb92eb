//! `GET /ws/echo`: a WebSocket that sends back every message it gets, for
//! trying limits on upgraded connections.

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;

pub(crate) async fn echo(upgrade: WebSocketUpgrade) -> Response {
    upgrade.on_upgrade(echo_until_closed)
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
