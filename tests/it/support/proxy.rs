//! A TCP proxy on a free loopback port whose upstream can be switched, as
//! a virtual IP moves to a new primary on failover: new connections go to
//! the new upstream, open ones stay where they were, or fall silent, as
//! when the old host vanishes without closing anything.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::thread::JoinHandle;

/// The proxy; its threads end when it is dropped.
pub struct TcpProxy {
    port: u16,
    upstream: Arc<AtomicU16>,
    stopped: Arc<AtomicBool>,
    /// Bumped to silence every connection opened before.
    generation: Arc<AtomicU16>,
    acceptor: Option<JoinHandle<()>>,
}

impl TcpProxy {
    /// Listens on 127.0.0.1 and forwards to 127.0.0.1:`upstream`.
    pub fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener.local_addr().unwrap().port();
        let upstream = Arc::new(AtomicU16::new(upstream));
        let stopped = Arc::new(AtomicBool::new(false));
        let generation = Arc::new(AtomicU16::new(0));
        let acceptor = {
            let (upstream, stopped) = (upstream.clone(), stopped.clone());
            let generation = generation.clone();
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stopped.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    let port = upstream.load(Ordering::SeqCst);
                    match TcpStream::connect(("127.0.0.1", port)) {
                        Ok(server) => pump_both_ways(client, server, &generation),
                        Err(_) => drop(client),
                    }
                }
            })
        };
        Self {
            port,
            upstream,
            stopped,
            generation,
            acceptor: Some(acceptor),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Sends new connections to 127.0.0.1:`upstream`.
    pub fn switch_to(&self, upstream: u16) {
        self.upstream.store(upstream, Ordering::SeqCst);
    }

    /// Every connection open now stops carrying bytes either way, and
    /// stays open: nothing is answered, nothing is closed.
    pub fn silence_open_connections(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

/// Copies bytes both ways until either side closes, or until the proxy
/// silences the connection.
fn pump_both_ways(client: TcpStream, server: TcpStream, generation: &Arc<AtomicU16>) {
    let (client_in, server_in) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    let born = generation.load(Ordering::SeqCst);
    let (up, down) = (generation.clone(), generation.clone());
    std::thread::spawn(move || copy(client_in, server, born, &up));
    std::thread::spawn(move || copy(server_in, client, born, &down));
}

fn copy(mut from: TcpStream, mut to: TcpStream, born: u16, generation: &AtomicU16) {
    let mut buffer = [0u8; 16 * 1024];
    while let Ok(read) = from.read(&mut buffer) {
        if read == 0 {
            break;
        }
        if generation.load(Ordering::SeqCst) != born {
            // Silenced: swallow everything, close nothing.
            continue;
        }
        if to.write_all(&buffer[..read]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        // Wake the acceptor so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}
