//! A TCP proxy on a free loopback port that delivers every byte a fixed
//! delay after it arrived, each way: a link between regions, with its
//! latency and none of its limits on throughput. It runs on the test's
//! Tokio runtime, and its tasks end when it is dropped.

use std::time::Duration;

use slidegate::deadpool_redis::Pool;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// The proxy; dropping it aborts its every task.
pub struct SlowLink {
    port: u16,
    tasks: std::sync::Arc<std::sync::Mutex<JoinSet<()>>>,
}

impl SlowLink {
    /// Listens on 127.0.0.1 and forwards to 127.0.0.1:`upstream`, each
    /// way `delay` late.
    pub async fn start(upstream: u16, delay: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let port = listener.local_addr().unwrap().port();
        let tasks = std::sync::Arc::new(std::sync::Mutex::new(JoinSet::new()));
        let spawned = tasks.clone();
        tasks.lock().unwrap().spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let mut tasks = spawned.lock().unwrap();
                tasks.spawn(delayed(client_read, server_write, delay));
                tasks.spawn(delayed(server_read, client_write, delay));
            }
        });
        Self { port, tasks }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A pool of `size` connections through the link.
    pub fn pool(&self, size: usize) -> Pool {
        super::pool_at(&self.url(), size)
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        self.tasks.lock().unwrap().abort_all();
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read, in order.
async fn delayed(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut buffer = vec![0; 64 * 1024];
    while let Ok(read) = from.read(&mut buffer).await {
        if read == 0
            || chunks
                .send((Instant::now() + delay, buffer[..read].to_vec()))
                .is_err()
        {
            break;
        }
    }
    drop(chunks);
    let _ = writer.await;
}
