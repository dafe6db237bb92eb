//! `GET /ws/echo`: a WebSocket that sends back every message it gets, for
//! trying limits on upgraded connections and on the messages sent over
//! them.

use std::time::Duration;

use axum::Extension;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::response::Response;
use slidegate::layer::{ConnectionLease, MessageLimit};
use tokio::time::{Instant, interval_at, timeout};

/// How often the echo pings a socket.
const PING_EVERY: Duration = Duration::from_secs(10);
/// How long a socket may stay silent (no message, no pong) before the
/// echo closes it: a peer that vanished (a phone gone out of range, a
/// frozen proxy) would otherwise hold its lease, and its client's place
/// under the `sockets` policy, for as long as the TCP connection looks
/// open.
const SILENT_FOR: Duration = Duration::from_secs(25);
/// How long one send may wait on a peer that reads nothing.
const SEND_WITHIN: Duration = Duration::from_secs(5);

/// Upgrades to the echo. The connection keeps the request's concurrency
/// lease (the `sockets` policy's) until it closes, and each message it
/// gets is counted against the policy's message rate, when it has one.
pub(crate) async fn echo(
    upgrade: WebSocketUpgrade,
    lease: Option<Extension<ConnectionLease>>,
    messages: Option<Extension<MessageLimit>>,
) -> Response {
    upgrade.on_upgrade(move |socket| async move {
        let withdrawn = lease.as_ref().map(|Extension(lease)| lease.withdrawn());
        let messages = messages.map(|Extension(messages)| messages);
        echo_until_closed(socket, withdrawn, messages).await;
        drop(lease);
    })
}

/// Text and binary messages go back as they came, until the client closes
/// or goes away, or stays silent for `SILENT_FOR` though pinged every
/// `PING_EVERY` (closed with 1001, going away), or the limiter withdraws
/// the socket's lease: it was lost with the store's state, or the socket
/// opened while the store was down, and the client holds its limit's
/// worth of others (closed with 1013, try again later), or the client
/// sends a message over its message rate (closed with the policy's close
/// code, 1008 unless set, and not echoed).
async fn echo_until_closed(
    mut socket: WebSocket,
    withdrawn: Option<impl Future<Output = ()>>,
    messages: Option<MessageLimit>,
) {
    let mut pings = interval_at(Instant::now() + PING_EVERY, PING_EVERY);
    let mut heard = Instant::now();
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
                let frame = CloseFrame {
                    code: close_code::AGAIN,
                    reason: "over the connection limit".into(),
                };
                send(&mut socket, Message::Close(Some(frame))).await;
                return;
            }
            message = socket.recv() => {
                let Some(Ok(message)) = message else { return };
                heard = Instant::now();
                match message {
                    Message::Text(_) | Message::Binary(_) => {
                        if let Some(messages) = &messages
                            && let Err(refused) = messages.admit().await
                        {
                            let frame = CloseFrame {
                                code: refused.close_code(),
                                reason: refused.reason().into(),
                            };
                            send(&mut socket, Message::Close(Some(frame))).await;
                            return;
                        }
                        if !send(&mut socket, message).await {
                            return;
                        }
                    }
                    Message::Close(_) => return,
                    Message::Ping(_) | Message::Pong(_) => {}
                }
            }
            _ = pings.tick() => {
                if heard.elapsed() >= SILENT_FOR {
                    let frame = CloseFrame {
                        code: close_code::AWAY,
                        reason: "no answer to pings".into(),
                    };
                    send(&mut socket, Message::Close(Some(frame))).await;
                    return;
                }
                if !send(&mut socket, Message::Ping("slidegate".into())).await {
                    return;
                }
            }
        }
    }
}

/// Sends `message`, within `SEND_WITHIN`; whether it went.
async fn send(socket: &mut WebSocket, message: Message) -> bool {
    matches!(timeout(SEND_WITHIN, socket.send(message)).await, Ok(Ok(())))
}
