//! Real `redis-server` processes for tests, on free loopback ports, killed
//! by PID when dropped (even when the test panics).

#![allow(dead_code, unreachable_pub)]

pub mod reply;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use slidegate::deadpool_redis::{Config, Pool, PoolConfig, Runtime};

const READY_WITHIN: Duration = Duration::from_secs(10);

/// One `redis-server` on 127.0.0.1.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind an ephemeral loopback port")
        .local_addr()
        .unwrap()
        .port()
}

fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    stream.read_exact(&mut reply).is_ok() && &reply == b"+PONG\r\n"
}

fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid} failed");
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    pub fn start() -> Self {
        for _ in 0..5 {
            let port = free_port();
            let dir =
                std::env::temp_dir().join(format!("slidegate-redis-{port}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let mut server = Self {
                child: None,
                port,
                dir,
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// Spawns on `self.port`; false if the server exited before answering.
    fn spawn(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir.to_str().unwrap(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: run scripts/test, which installs it");
        self.child = Some(child);
        let deadline = Instant::now() + READY_WITHIN;
        while Instant::now() < deadline {
            if ping(self.port) {
                return true;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                eprintln!("redis-server on port {} exited: {status}", self.port);
                self.child = None;
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    /// A deadpool-redis pool of at most `size` connections.
    pub fn pool(&self, size: usize) -> Pool {
        let mut config = Config::from_url(self.url());
        config.pool = Some(PoolConfig::new(size));
        config.create_pool(Some(Runtime::Tokio1)).unwrap()
    }

    /// Kills the server (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: nothing is saved).
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server did not come back on port {}",
            self.port
        );
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn freeze(&self) {
        signal(self.pid(), "STOP");
    }

    /// Thaws a frozen server (SIGCONT).
    pub fn thaw(&self) {
        signal(self.pid(), "CONT");
    }

    /// Runs `redis-cli` against the server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli is not installed: run scripts/test, which installs it");
        assert!(output.status.success(), "redis-cli {args:?} failed");
        String::from_utf8(output.stdout).unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
