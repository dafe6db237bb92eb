//! A Redis Sentinel setup on loopback: a primary, a replica and three
//! sentinels watching them as `mymaster`, every process killed by PID when
//! dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{RedisServer, free_port, ping};

/// The name the sentinels know the primary by.
pub const MASTER: &str = "mymaster";

/// How long to wait for the sentinels to get somewhere. Generous: on a
/// loaded machine a sentinel whose timer runs 2 s late goes into TILT mode
/// and does nothing for 30 s, and a failover attempt that runs out of its
/// failover timeout is aborted, the next one starting only twice that
/// timeout later. A wait ends as soon as what it waits for is true.
const WAIT_WITHIN: Duration = Duration::from_secs(120);

/// How long a `SENTINEL FAILOVER` is given before it is asked again: more
/// than an attempt takes to succeed or abort (a few times the failover
/// timeout of 10 s below).
const ASK_AGAIN_AFTER: Duration = Duration::from_secs(30);

/// One `redis-server --sentinel`.
struct Sentinel {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub struct SentinelSet {
    /// The two data nodes, the first the primary at the start.
    pub nodes: Vec<RedisServer>,
    sentinels: Vec<Sentinel>,
}

fn start_sentinel(primary: u16) -> Sentinel {
    let port = free_port();
    let dir =
        std::env::temp_dir().join(format!("slidegate-sentinel-{port}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("sentinel.conf");
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\ndir {dir}\n\
             sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
             sentinel down-after-milliseconds {MASTER} 5000\n\
             sentinel failover-timeout {MASTER} 10000\n\
             sentinel parallel-syncs {MASTER} 1\n",
            dir = dir.display()
        ),
    )
    .unwrap();
    let child = Command::new("redis-server")
        .arg(&conf)
        .arg("--sentinel")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server is not installed: run scripts/test, which installs it");
    let sentinel = Sentinel { child, port, dir };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ping(port) {
        assert!(
            Instant::now() < deadline,
            "sentinel on {port} never answered"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    sentinel
}

impl SentinelSet {
    /// Starts the primary, a replica in sync with it, and three sentinels
    /// that all see both.
    pub fn start() -> Self {
        let primary = RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]);
        let replica = RedisServer::start_with(&[
            "--replicaof",
            "127.0.0.1",
            &primary.port().to_string(),
            "--repl-diskless-sync-delay",
            "0",
        ]);
        let primary_port = primary.port();
        let set = Self {
            sentinels: (0..3).map(|_| start_sentinel(primary_port)).collect(),
            nodes: vec![primary, replica],
        };
        set.wait_until("the replica is in sync and every sentinel sees it", |set| {
            set.nodes[1]
                .cli(&["info", "replication"])
                .contains("master_link_status:up")
                && set.sentinels.iter().all(|s| {
                    let replicas = sentinel_cli(s.port, &["sentinel", "replicas", MASTER]);
                    replicas.contains(&set.nodes[1].port().to_string())
                        && !replicas.contains("s_down")
                })
                && set.sentinels.iter().all(|s| {
                    sentinel_cli(s.port, &["sentinel", "sentinels", MASTER])
                        .matches("runid")
                        .count()
                        >= 2
                })
        });
        set
    }

    /// The sentinels' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}/", s.port))
            .collect()
    }

    /// The port the sentinels name as the primary now.
    pub fn primary_port(&self) -> u16 {
        let reply = sentinel_cli(
            self.sentinels[0].port,
            &["sentinel", "get-master-addr-by-name", MASTER],
        );
        reply.lines().nth(1).unwrap().trim().parse().unwrap()
    }

    /// Asks a sentinel for a failover (`SENTINEL FAILOVER`) and waits (at
    /// most [`WAIT_WITHIN`]) until `done`. A forced failover whose replica
    /// is not seen promoted within the failover timeout (a loaded machine)
    /// is aborted, and sentinels never retry a forced failover of a
    /// primary that is up: so it is asked again while `done` is not, once
    /// the attempt before has had its time. An answer other than `OK`
    /// (`INPROG`, or `NOGOODSLAVE` while the sentinel's view of the
    /// replica is stale) is asked again the same way, and told if it all
    /// comes to nothing.
    pub fn fail_over_until(&self, what: &str, done: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + WAIT_WITHIN;
        let mut answers: Vec<String> = Vec::new();
        let mut asked: Option<Instant> = None;
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "gave up waiting until {what}; SENTINEL FAILOVER answered {answers:?}"
            );
            if asked.is_none_or(|at| at.elapsed() >= ASK_AGAIN_AFTER) {
                let reply = sentinel_cli(self.sentinels[0].port, &["sentinel", "failover", MASTER]);
                answers.push(reply.trim().to_owned());
                asked = Some(Instant::now());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits (at most [`WAIT_WITHIN`]) until `ready`.
    pub fn wait_until(&self, what: &str, ready: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + WAIT_WITHIN;
        while !ready(self) {
            assert!(Instant::now() < deadline, "gave up waiting until {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The data node on `port`.
    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes.iter().find(|n| n.port() == port).unwrap()
    }
}

fn sentinel_cli(port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8(output.stdout).unwrap()
}
