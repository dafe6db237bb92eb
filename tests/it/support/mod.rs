//! Real `redis-server` processes for tests, on free loopback ports, killed
//! by PID when dropped (even when the test panics).

#![allow(dead_code, unreachable_pub, unused_macros)]

#[macro_use]
pub mod stores;

pub mod down_store;
pub mod proxy;
pub mod reply;
pub mod sentinel;
pub mod slow_link;
pub mod tls;
pub mod trace;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use slidegate::deadpool_redis::{Config, Pool, PoolConfig, Runtime};

/// How long a server may take to answer its first PING: generous, for a
/// loaded machine (the wait ends at the first answer).
const READY_WITHIN: Duration = Duration::from_secs(60);

/// One `redis-server` on 127.0.0.1.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra_args: Vec<String>,
    /// For a server that speaks only TLS: `redis-cli`'s TLS arguments.
    tls: Option<Vec<String>>,
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
            if let Some(server) = Self::try_start(free_port(), &[], None) {
                return server;
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// Starts a server on a free port with `extra_args` (`--maxmemory 3mb`,
    /// say) and waits until it answers PING.
    pub fn start_with(extra_args: &[&str]) -> Self {
        for _ in 0..5 {
            if let Some(server) = Self::try_start(free_port(), extra_args, None) {
                return server;
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// Starts a server on `port` with `extra_args`; `None` if it would not
    /// come up there. With `tls` (`redis-cli`'s TLS arguments), `port` is
    /// its TLS port and it speaks nothing else.
    fn try_start(port: u16, extra_args: &[&str], tls: Option<Vec<String>>) -> Option<Self> {
        let dir =
            std::env::temp_dir().join(format!("slidegate-redis-{port}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Self {
            child: None,
            port,
            dir,
            extra_args: extra_args.iter().map(|a| (*a).to_owned()).collect(),
            tls,
        };
        server.spawn().then_some(server)
    }

    /// Starts a server that speaks only TLS (`--port 0 --tls-port N`),
    /// with `certs`' server certificate; `clients_need_certificates` asks
    /// every client for a certificate signed by the test CA (mutual TLS).
    pub fn start_tls(certs: &tls::TestCerts, clients_need_certificates: bool) -> Self {
        let auth = if clients_need_certificates {
            "yes"
        } else {
            "no"
        };
        let args = [
            "--tls-cert-file".to_owned(),
            certs.path("server.pem"),
            "--tls-key-file".to_owned(),
            certs.path("server.key"),
            "--tls-ca-cert-file".to_owned(),
            certs.path("ca.pem"),
            "--tls-auth-clients".to_owned(),
            auth.to_owned(),
        ];
        let cli = vec![
            "--tls".to_owned(),
            "--cacert".to_owned(),
            certs.path("ca.pem"),
            "--cert".to_owned(),
            certs.path("client.pem"),
            "--key".to_owned(),
            certs.path("client.key"),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        for _ in 0..5 {
            if let Some(server) = Self::try_start(free_port(), &args, Some(cli.clone())) {
                return server;
            }
        }
        panic!("could not start a TLS redis-server on a free port");
    }

    /// Whether the server is up: a `PING` answered, or for a TLS server
    /// (whose handshake is redis-cli's to make), its port open.
    fn ready(&self) -> bool {
        match self.tls {
            None => ping(self.port),
            Some(_) => TcpStream::connect(("127.0.0.1", self.port)).is_ok(),
        }
    }

    /// Spawns on `self.port`; false if the server exited before answering.
    fn spawn(&mut self) -> bool {
        let ports = match self.tls {
            None => vec!["--port".to_owned(), self.port.to_string()],
            Some(_) => vec![
                "--port".to_owned(),
                "0".to_owned(),
                "--tls-port".to_owned(),
                self.port.to_string(),
            ],
        };
        let child = Command::new("redis-server")
            .args(ports)
            .args([
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir.to_str().unwrap(),
            ])
            .args(&self.extra_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: run scripts/test, which installs it");
        self.child = Some(child);
        let deadline = Instant::now() + READY_WITHIN;
        while Instant::now() < deadline {
            if self.ready() {
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

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    /// A deadpool-redis pool of at most `size` connections.
    pub fn pool(&self, size: usize) -> Pool {
        pool_at(&self.url(), size)
    }

    /// A pool logged in as a user whom this server refuses `FUNCTION` and
    /// `FCALL` (created here), as an ACL might.
    pub fn pool_refusing_functions(&self) -> Pool {
        self.cli(&[
            "acl",
            "setuser",
            "nofunctions",
            "on",
            ">secret",
            "~*",
            "+@all",
            "-function",
            "-fcall",
        ]);
        let url = format!("redis://nofunctions:secret@127.0.0.1:{}/", self.port);
        Config::from_url(url)
            .create_pool(Some(Runtime::Tokio1))
            .unwrap()
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

    /// Whether the server fails to answer a PING within 50 ms: busy.
    pub fn is_busy(&self) -> bool {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        stream.write_all(b"PING\r\n").unwrap();
        let mut reply = [0u8; 7];
        stream.read_exact(&mut reply).is_err()
    }

    /// Makes the server busy for `seconds` (`DEBUG SLEEP`, from another
    /// thread; the server needs `--enable-debug-command local`) and returns
    /// once it is; the thread tells whether the sleep ran.
    pub fn keep_busy(&self, seconds: &str) -> std::thread::JoinHandle<bool> {
        let (port, seconds) = (self.port.to_string(), seconds.to_owned());
        let sleeper = std::thread::spawn(move || {
            Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &port, "debug", "sleep", &seconds])
                .output()
                .expect("run redis-cli")
                .status
                .success()
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.is_busy() {
            assert!(Instant::now() < deadline, "DEBUG SLEEP never started");
        }
        sleeper
    }

    /// The keys named `base` then `:` and anything, sorted: every key of
    /// one client's state under a policy, given its base key (a sliding
    /// log's `:l` and its chunks of pages, `:p:0` on).
    pub fn keys_of(&self, base: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .cli(&["--scan", "--pattern", &format!("{base}:*")])
            .lines()
            .map(str::to_owned)
            .collect();
        keys.sort();
        keys
    }

    /// Copies every key of `from`'s state (see `keys_of`) to the same key
    /// under `to`.
    pub fn copy_state(&self, from: &str, to: &str) {
        for key in self.keys_of(from) {
            let copy = format!("{to}{}", &key[from.len()..]);
            assert_eq!(self.cli(&["copy", &key, &copy]).trim(), "1", "{key}");
        }
    }

    /// Script calls since Redis's statistics were last reset, and the
    /// commands they ran (`INFO commandstats` counts a script's commands as
    /// it counts a client's): what the test itself sends is left out.
    pub fn script_work(&self) -> (u64, u64) {
        let (mut calls, mut commands) = (0, 0);
        for line in self.cli(&["info", "commandstats"]).lines() {
            let Some((name, stats)) = line
                .strip_prefix("cmdstat_")
                .and_then(|line| line.split_once(':'))
            else {
                continue;
            };
            let count: u64 = stats
                .strip_prefix("calls=")
                .and_then(|stats| stats.split(',').next())
                .and_then(|count| count.parse().ok())
                .unwrap_or_else(|| panic!("INFO commandstats: {line}"));
            let family = name.split('|').next().unwrap_or(name);
            match family {
                "fcall" | "fcall_ro" => calls += count,
                "slowlog" | "info" | "config" | "function" | "client" | "hello" | "ping" => {}
                _ => commands += count,
            }
        }
        (calls, commands)
    }

    /// Runs `redis-cli` against the server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(self.tls.iter().flatten())
            .args(args)
            .output()
            .expect("redis-cli is not installed: run scripts/test, which installs it");
        assert!(output.status.success(), "redis-cli {args:?} failed");
        String::from_utf8(output.stdout).unwrap()
    }
}

/// A deadpool-redis pool of at most `size` connections to `url` (a server,
/// or a proxy in front of one).
pub fn pool_at(url: &str, size: usize) -> Pool {
    let mut config = Config::from_url(url);
    config.pool = Some(PoolConfig::new(size));
    config.create_pool(Some(Runtime::Tokio1)).unwrap()
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free loopback port below 55535 whose cluster bus port (+10000) is free
/// too.
fn free_cluster_port(taken: &[u16]) -> u16 {
    for _ in 0..1000 {
        let port = free_port();
        if port < 55_535
            && !taken.contains(&port)
            && !taken.contains(&(port - 10_000))
            && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
        {
            return port;
        }
        // Ephemeral ports are often above 55535: try a random low one.
        let candidate = 20_000 + (port % 30_000);
        if !taken.contains(&candidate)
            && TcpListener::bind(("127.0.0.1", candidate)).is_ok()
            && TcpListener::bind(("127.0.0.1", candidate + 10_000)).is_ok()
        {
            return candidate;
        }
    }
    panic!("no free port pair for a cluster node");
}

/// A local Redis Cluster: three primaries and three replicas on free
/// loopback ports, every process killed when dropped.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts six nodes, joins them with `redis-cli --cluster create`, and
    /// waits until every node reports `cluster_state:ok`.
    pub fn start() -> Self {
        let mut nodes: Vec<RedisServer> = Vec::new();
        while nodes.len() < 6 {
            let taken: Vec<u16> = nodes.iter().map(RedisServer::port).collect();
            let port = free_cluster_port(&taken);
            let config = format!("nodes-{port}.conf");
            if let Some(node) = RedisServer::try_start(
                port,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &config,
                    "--cluster-node-timeout",
                    "2000",
                    // Replicas sync at once, not after diskless sync's
                    // default wait of 5 s for more replicas to join.
                    "--repl-diskless-sync-delay",
                    "0",
                    "--enable-debug-command",
                    "local",
                ],
                None,
            ) {
                nodes.push(node);
            }
        }
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        let cluster = Self { nodes };
        let deadline = Instant::now() + Duration::from_secs(120);
        while !cluster.is_ready() {
            assert!(
                Instant::now() < deadline,
                "the cluster did not become ready"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// Whether every node sees the cluster as ok with its slots and every
    /// node, and every replication link is up, its replica online (so
    /// `WAIT` can count it).
    fn is_ready(&self) -> bool {
        self.nodes.iter().all(|node| {
            let info = node.cli(&["cluster", "info"]);
            let slots = node.cli(&["cluster", "slots"]);
            let replication = node.cli(&["info", "replication"]);
            let linked = if replication.contains("role:master") {
                replication.contains("state=online")
            } else {
                replication.contains("master_link_status:up")
            };
            let known = format!("cluster_known_nodes:{}", self.nodes.len());
            info.contains("cluster_state:ok")
                && info.contains(&known)
                && !slots.trim().is_empty()
                && linked
        })
    }

    /// The cluster as one `redis+cluster://` URL of every node.
    pub fn cluster_url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis+cluster://{}/", hosts.join(","))
    }

    /// The nodes' `redis://` URLs, as cluster seeds.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// A deadpool-redis cluster pool of at most `size` clients.
    pub fn pool(&self, size: usize) -> slidegate::deadpool_redis::cluster::Pool {
        let mut config = slidegate::deadpool_redis::cluster::Config::from_urls(self.urls());
        config.pool = Some(PoolConfig::new(size));
        config.create_pool(Some(Runtime::Tokio1)).unwrap()
    }

    /// The nodes that are primaries now.
    pub fn primaries(&self) -> Vec<&RedisServer> {
        self.nodes
            .iter()
            .filter(|node| node.is_running())
            .filter(|node| {
                node.cli(&["cluster", "nodes"])
                    .lines()
                    .any(|l| l.contains("myself") && l.contains("master"))
            })
            .collect()
    }

    /// Every key, with the primary that holds it, from `SCAN` on each
    /// primary (replicas hold copies).
    pub fn keys_by_primary(&self) -> Vec<(String, &RedisServer)> {
        self.primaries()
            .into_iter()
            .flat_map(|node| {
                node.cli(&["--scan"])
                    .lines()
                    .map(|key| (key.to_owned(), node))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Every key in the cluster.
    pub fn keys(&self) -> Vec<String> {
        self.keys_by_primary()
            .into_iter()
            .map(|(key, _)| key)
            .collect()
    }

    /// The node serving `key`'s slot as primary.
    pub fn primary_of(&self, key: &str) -> &RedisServer {
        let slot: u16 = self.nodes[0]
            .cli(&["cluster", "keyslot", key])
            .trim()
            .parse()
            .unwrap();
        self.nodes
            .iter()
            .find(|node| {
                node.cli(&["cluster", "nodes"]).lines().any(|line| {
                    line.contains("myself") && line.contains("master") && serves(line, slot)
                })
            })
            .expect("a primary serves every slot")
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Kills a replica (SIGKILL) and returns its port.
    pub fn kill_a_replica(&mut self) -> u16 {
        let primaries: Vec<u16> = self.primaries().iter().map(|n| n.port()).collect();
        let replica = self
            .nodes
            .iter_mut()
            .find(|node| !primaries.contains(&node.port()))
            .expect("a replica");
        replica.kill();
        replica.port()
    }

    /// Promotes the replica of `key`'s primary with `CLUSTER FAILOVER` (a
    /// coordinated failover: the replica catches up first), waits until
    /// it reports itself primary, and returns its port.
    pub fn fail_over_primary_of(&self, key: &str) -> u16 {
        let id = self
            .primary_of(key)
            .cli(&["cluster", "myid"])
            .trim()
            .to_owned();
        let replica = self
            .nodes
            .iter()
            .filter(|node| node.is_running())
            .find(|node| {
                node.cli(&["cluster", "nodes"]).lines().any(|line| {
                    line.contains("myself") && line.contains("slave") && line.contains(&id)
                })
            })
            .expect("the primary has a replica");
        // A manual failover that finds the cluster still settling (its
        // election gets no majority) is given up after a few seconds:
        // asked again, it goes through.
        let deadline = Instant::now() + Duration::from_secs(120);
        let is_primary = |node: &RedisServer| node.cli(&["role"]).lines().next() == Some("master");
        while !is_primary(replica) {
            assert!(Instant::now() < deadline, "the replica was not promoted");
            assert_eq!(replica.cli(&["cluster", "failover"]).trim(), "OK");
            let asked = Instant::now();
            while !is_primary(replica) && asked.elapsed() < Duration::from_secs(6) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        replica.port()
    }

    /// Moves the slot of `key`, with its keys, to another primary (as a
    /// resharding would) and returns that primary's port.
    pub fn migrate_slot_of(&self, key: &str) -> u16 {
        let slot = self.nodes[0]
            .cli(&["cluster", "keyslot", key])
            .trim()
            .to_owned();
        let source = self.primary_of(key);
        let id = |node: &RedisServer| node.cli(&["cluster", "myid"]).trim().to_owned();
        let primaries = self.primaries();
        let target = *primaries
            .iter()
            .find(|n| n.port() != source.port())
            .expect("another primary");
        let (source_id, target_id) = (id(source), id(target));
        target.cli(&["cluster", "setslot", &slot, "importing", &source_id]);
        source.cli(&["cluster", "setslot", &slot, "migrating", &target_id]);
        loop {
            let keys = source.cli(&["cluster", "getkeysinslot", &slot, "100"]);
            let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let port = target.port().to_string();
            let mut args = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "keys"];
            args.extend(keys);
            source.cli(&args);
        }
        for node in primaries {
            node.cli(&["cluster", "setslot", &slot, "node", &target_id]);
        }
        target.port()
    }
}

/// Whether a `CLUSTER NODES` line lists `slot` among its ranges.
fn serves(line: &str, slot: u16) -> bool {
    line.split_whitespace().skip(8).any(|range| {
        let (start, end) = range.split_once('-').unwrap_or((range, range));
        match (start.parse::<u16>(), end.parse::<u16>()) {
            (Ok(start), Ok(end)) => (start..=end).contains(&slot),
            _ => false,
        }
    })
}
