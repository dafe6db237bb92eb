//! The example server, run as a user would: as a process, over HTTP.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{RedisCluster, RedisServer};

/// `target/<profile>/examples/server`, which `cargo test` builds.
fn server_binary() -> PathBuf {
    example_binary("server")
}

/// `target/<profile>/examples/<name>`.
fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let binary = profile_dir.join("examples").join(name);
    assert!(
        binary.exists(),
        "{} is missing: run via cargo test",
        binary.display()
    );
    binary
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The running example server, killed on drop.
struct ExampleServer {
    child: Child,
    port: u16,
}

impl ExampleServer {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_with_log(args, env, Stdio::null())
    }

    /// Starts the server with its log (stdout) going to `log`.
    fn start_with_log(args: &[&str], env: &[(&str, &str)], log: Stdio) -> Self {
        let port = free_port();
        let mut command = Command::new(server_binary());
        command
            .args(args)
            .env("BIND", format!("127.0.0.1:{port}"))
            .env_remove("REDIS_URL")
            .env_remove("SLIDEGATE_CONFIG")
            .stdout(log)
            .stderr(Stdio::null());
        for (name, value) in env {
            command.env(name, value);
        }
        let server = Self {
            child: command.spawn().unwrap(),
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the example server did not listen on {port}");
    }

    fn request(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> Response {
        self.request_with_body(method, path, headers, "")
    }

    /// `POST /api/login` with the demo password (a login that succeeds).
    fn login(&self, headers: &[(&str, &str)]) -> Response {
        let body = r#"{"user": "alice", "password": "demo"}"#;
        self.request_with_body("POST", "/api/login", headers, body)
    }

    /// A login with the wrong password: the demo login policy counts these
    /// only.
    fn failed_login(&self, headers: &[(&str, &str)]) -> Response {
        let body = r#"{"user": "alice", "password": "guess"}"#;
        self.request_with_body("POST", "/api/login", headers, body)
    }

    fn request_with_body(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Response {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        head.push_str(body);
        stream.write_all(head.as_bytes()).unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).unwrap();
        Response::parse(&raw)
    }

    fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[])
    }
}

impl Drop for ExampleServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

/// A chunked body's content (`Transfer-Encoding: chunked`, no trailers).
fn dechunked(mut body: &str) -> String {
    let mut content = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").expect("a chunk's size line");
        let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size in hex");
        if size == 0 {
            return content;
        }
        content.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
}

impl Response {
    fn parse(raw: &str) -> Self {
        let (head, body) = raw.split_once("\r\n\r\n").expect("a complete response");
        let mut lines = head.lines();
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let chunked = headers
            .iter()
            .any(|(name, value)| name == "transfer-encoding" && value == "chunked");
        let body = if chunked {
            dechunked(body)
        } else {
            body.to_owned()
        };
        Self {
            status,
            headers,
            body,
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap()
    }
}

#[test]
fn demo_config_limits_search_and_login_but_never_health() {
    let server = ExampleServer::start(&[], &[]);
    for _ in 0..20 {
        let health = server.get("/health");
        assert_eq!(health.status, 200);
        assert_eq!(health.header("x-ratelimit-limit"), None);
    }
    for remaining in ["4", "3", "2", "1", "0"] {
        let reply = server.get("/api/search?q=redis");
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-ratelimit-limit"), Some("5"));
        assert_eq!(reply.header("x-ratelimit-remaining"), Some(remaining));
    }
    let denied = server.get("/api/search?q=redis");
    assert_eq!(denied.status, 429);
    assert_eq!(
        denied.header("content-type"),
        Some("application/problem+json")
    );
    let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry));
    assert_eq!(denied.json()["policy"], "search");

    // Successful logins do not count; three failed ones a minute do.
    for _ in 0..5 {
        assert_eq!(server.login(&[]).status, 200);
    }
    for _ in 0..3 {
        assert_eq!(server.failed_login(&[]).status, 401);
    }
    assert_eq!(server.failed_login(&[]).status, 429);
    assert_eq!(server.login(&[]).status, 429);

    let videos = server.get("/api/videos");
    assert_eq!(videos.status, 200);
    assert!(videos.json()["videos"].as_array().unwrap().len() > 1);
    assert_eq!(server.get("/nope").status, 404);

    let whoami = server.get("/api/whoami").json();
    assert_eq!(whoami["key"], "ip:127.0.0.1");
    let unknown_key = server
        .request("GET", "/api/whoami", &[("x-api-key", "made-up")])
        .json();
    assert_eq!(
        unknown_key["key"], "ip:127.0.0.1",
        "an unknown API key is no identity"
    );
    let with_key = server
        .request("GET", "/api/whoami", &[("x-api-key", "demo-pro-key")])
        .json();
    let key = with_key["key"].as_str().unwrap();
    assert!(
        key.starts_with("key:#") && !key.contains("demo-pro-key"),
        "{key}"
    );
    assert_eq!(with_key["tier"], "pro");
}

/// A demo token from the `mint_token` example, as
/// `docs/example-server.md` mints it.
fn mint_token(args: &[&str]) -> String {
    let output = Command::new(example_binary("mint_token"))
        .args(args)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

#[test]
fn demo_tiers_differ_for_minted_tokens_and_api_keys() {
    let server = ExampleServer::start(&[], &[]);
    let pro = format!("Bearer {}", mint_token(&["alice", "pro"]));
    let whoami = server
        .request("GET", "/api/whoami", &[("authorization", &pro)])
        .json();
    assert_eq!(whoami["key"], "jwt:alice");
    assert_eq!(whoami["tier"], "pro");

    // pro: 100 units a minute at 2 units a search.
    let search = server.request("GET", "/api/search?q=redis", &[("authorization", &pro)]);
    assert_eq!(search.status, 200);
    assert_eq!(search.header("x-ratelimit-limit"), Some("100"));
    assert_eq!(search.header("x-ratelimit-remaining"), Some("98"));
    assert_eq!(
        search.header("ratelimit-policy"),
        Some("\"search\";q=100;w=60")
    );
    assert_eq!(search.header("ratelimit"), Some("\"search\";r=98;t=60"));

    // No tier claim: the base 5 a minute.
    let bob = format!("Bearer {}", mint_token(&["bob"]));
    let search = server.request("GET", "/api/search", &[("authorization", &bob)]);
    assert_eq!(search.header("x-ratelimit-limit"), Some("5"));

    let by_key = server.request("GET", "/api/search", &[("x-api-key", "demo-pro-key")]);
    assert_eq!(by_key.header("x-ratelimit-limit"), Some("100"));
    let whoami = server
        .request("GET", "/api/whoami", &[("x-api-key", "demo-free-key")])
        .json();
    assert_eq!(whoami["tier"], "free");

    let forged = format!(
        "Bearer {}",
        mint_token(&["carol", "pro", "--secret", "guessed"])
    );
    let forged = server.request("GET", "/api/search", &[("authorization", &forged)]);
    let garbage = server.request(
        "GET",
        "/api/search",
        &[("authorization", "Bearer not-a-token")],
    );
    for (reply, reason) in [(forged, "bad_signature"), (garbage, "malformed")] {
        assert_eq!(reply.status, 401, "{}", reply.body);
        assert_eq!(reply.json()["reason"], reason);
    }
}

#[test]
fn redis_url_switches_to_redis() {
    let redis = RedisServer::start();
    let server = ExampleServer::start(&[], &[("REDIS_URL", &redis.url())]);
    for _ in 0..3 {
        assert_eq!(server.failed_login(&[]).status, 401);
    }
    assert_eq!(server.failed_login(&[]).status, 429);
    let keys = redis.cli(&["--scan"]);
    assert!(keys.contains("slidegate:login:{ip:127.0.0.1}"), "{keys}");
    for _ in 0..5 {
        assert_eq!(server.get("/api/search?q=a").status, 200);
    }
    assert_eq!(server.get("/api/search?q=a").status, 429);

    // Redis gone: login fails closed, videos fail open, health is untouched.
    // The client denied a moment ago is still denied, from the deny cache.
    drop(redis);
    assert_eq!(server.get("/api/search?q=a").status, 429);
    let other_client = [("x-api-key", "demo-free-key")];
    assert_eq!(server.login(&other_client).status, 503);
    assert_eq!(server.get("/api/videos").status, 200);
    assert_eq!(server.get("/health").status, 200);
}

#[test]
fn a_cluster_url_runs_on_redis_cluster() {
    let cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster
        .urls()
        .iter()
        .take(2)
        .map(|url| {
            url.trim_start_matches("redis://")
                .trim_end_matches('/')
                .to_owned()
        })
        .collect();
    let url = format!("redis+cluster://{}", seeds.join(","));
    let server = ExampleServer::start(&[], &[("REDIS_URL", &url)]);
    for _ in 0..3 {
        assert_eq!(server.failed_login(&[]).status, 401);
    }
    assert_eq!(server.failed_login(&[]).status, 429);
    let keys = cluster.keys();
    assert!(
        keys.iter().any(|k| k == "slidegate:login:{ip:127.0.0.1}:l"),
        "{keys:?}"
    );
}

#[test]
fn config_file_from_flag_or_environment() {
    let dir = std::env::temp_dir().join(format!("slidegate-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tight.toml");
    std::fs::write(
        &path,
        "[limiter]\nkeys = [\"global\"]\n\n[default]\nlimit = 1\nwindow = \"1h\"\n",
    )
    .unwrap();
    let path = path.to_str().unwrap();
    for server in [
        ExampleServer::start(&["--config", path], &[]),
        ExampleServer::start(&[], &[("SLIDEGATE_CONFIG", path)]),
    ] {
        assert_eq!(server.get("/api/videos").status, 200);
        assert_eq!(
            server.get("/api/search").status,
            429,
            "one global key, limit 1"
        );
        assert_eq!(server.get("/api/whoami").status, 429);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_config_stops_start_up_naming_key_and_line() {
    let dir = std::env::temp_dir().join(format!("slidegate-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(
        &path,
        "[[policy]]\nname = \"p\"\nlimit = 5\nwindow = \"1m\"\ncost = 6\n",
    )
    .unwrap();
    let output = Command::new(server_binary())
        .args(["--config", path.to_str().unwrap(), "--bind", "127.0.0.1:0"])
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("line 5") && stderr.contains("cost"),
        "{stderr}"
    );
}

#[test]
fn sigterm_shuts_down_gracefully() {
    let mut server = ExampleServer::start(&[], &[]);
    assert_eq!(server.get("/health").status, 200);
    let status = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(exit) = server.child.try_wait().unwrap() {
            assert!(exit.success(), "exited with {exit}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `POST /api/login` takes the demo password for any user, and refuses
/// anything else with `401`: a wrong password, no user, a body that is
/// not JSON, no body.
#[test]
fn login_takes_the_demo_password_only() {
    let server = ExampleServer::start(&[], &[]);
    let attempt = |headers: &[(&str, &str)], body: &str| {
        server
            .request_with_body("POST", "/api/login", headers, body)
            .status
    };
    assert_eq!(attempt(&[], r#"{"user": "bob", "password": "demo"}"#), 200);
    assert_eq!(attempt(&[], r#"{"user": "bob", "password": "guess"}"#), 401);
    assert_eq!(attempt(&[], r#"{"password": "demo"}"#), 401);
    // The login policy allows 3 failed logins a minute per client, and
    // counts no successful one; a known API key is a client of its own.
    assert_eq!(attempt(&[], r#"{"user": "bob", "password": "demo"}"#), 200);
    assert_eq!(attempt(&[], r#"{"user": "bob"}"#), 401);
    assert_eq!(attempt(&[], r#"{"user": "bob", "password": "demo"}"#), 429);
    let keyed = [("x-api-key", "demo-pro-key")];
    assert_eq!(attempt(&keyed, "not json"), 401);
    assert_eq!(attempt(&keyed, ""), 401);
}

#[test]
fn the_demo_config_cannot_be_walked_around() {
    let server = ExampleServer::start(&[], &[]);
    // A fresh random API key per login: limited by address all the same.
    let logins: Vec<u16> = (0..6)
        .map(|n| {
            let key = format!("random-key-{n}-{}", std::process::id());
            server.failed_login(&[("x-api-key", &key)]).status
        })
        .collect();
    assert_eq!(logins, [401, 401, 401, 429, 429, 429]);

    // HEAD runs the GET handler, so it spends the GET's searches.
    let heads: Vec<u16> = (0..8)
        .map(|_| server.request("HEAD", "/api/search?q=a", &[]).status)
        .collect();
    assert_eq!(heads, [200, 200, 200, 200, 200, 429, 429, 429]);
    assert_eq!(server.get("/api/search?q=a").status, 429);

    // Forged tokens: ten refusals, then 429 without verifying.
    let forged = format!("Bearer {}x", mint_token(&["mallory"]));
    let replies: Vec<u16> = (0..12)
        .map(|_| {
            server
                .request("GET", "/api/videos", &[("authorization", &forged)])
                .status
        })
        .collect();
    assert_eq!(replies[..10], [401; 10]);
    assert_eq!(replies[10..], [429; 2]);
}

/// The lines of the server's log, read on a thread of their own.
fn log_lines(server: &mut ExampleServer) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let stdout = server.child.stdout.take().expect("the log is piped");
    let (lines, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

/// Waits (at most 5 s) for a log line containing `text`.
fn wait_for_line(log: &std::sync::mpsc::Receiver<String>, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match log.recv_timeout(left) {
            Ok(line) if line.contains(text) => return,
            Ok(_) => {}
            Err(_) => panic!("no log line with `{text}`"),
        }
    }
}

/// `SIGHUP` reloads the config file: a changed limit is in force for the
/// next request, with the client's count kept; a bad file, or one with no
/// policy, is refused, and the policies in force stay.
#[test]
fn sighup_reloads_the_policies_and_keeps_the_counts() {
    let dir = std::env::temp_dir().join(format!("slidegate-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("limits.toml");
    let config = |limit: u32| {
        format!(
            "[[policy]]\nname = \"search\"\nroute = \"GET /api/search\"\nlimit = {limit}\nwindow = \"60s\"\n"
        )
    };
    std::fs::write(&file, config(5)).unwrap();
    let path = file.to_str().unwrap();
    let mut server = ExampleServer::start_with_log(&["--config", path], &[], Stdio::piped());
    let log = log_lines(&mut server);
    let hangup = |server: &ExampleServer| {
        let pid = server.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-HUP", &pid])
                .status()
                .unwrap()
                .success()
        );
    };
    for remaining in ["4", "3"] {
        let reply = server.get("/api/search?q=a");
        assert_eq!(reply.header("x-ratelimit-remaining"), Some(remaining));
    }

    std::fs::write(&file, config(10)).unwrap();
    hangup(&server);
    wait_for_line(&log, "policies reloaded");
    let reply = server.get("/api/search?q=a");
    assert_eq!(reply.header("x-ratelimit-limit"), Some("10"));
    assert_eq!(
        reply.header("x-ratelimit-remaining"),
        Some("7"),
        "the two requests before the reload still count"
    );

    std::fs::write(&file, "[[policy]]\nname = \"search\"\nlimit = \"ten\"\n").unwrap();
    hangup(&server);
    wait_for_line(&log, "config refused");
    let reply = server.get("/api/search?q=a");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-ratelimit-limit"), Some("10"));
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("6"));

    // An emptied file would lift every limit: refused too.
    std::fs::write(&file, "# truncated\n").unwrap();
    hangup(&server);
    wait_for_line(&log, "defines no policy");
    let reply = server.get("/api/search?q=a");
    assert_eq!(reply.header("x-ratelimit-limit"), Some("10"));
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("5"));

    // [deny] is reloaded with the policies, and so is its removal.
    std::fs::write(
        &file,
        format!("{}[deny]\nips = [\"127.0.0.0/8\"]\n", config(10)),
    )
    .unwrap();
    hangup(&server);
    wait_for_line(&log, "policies reloaded");
    assert_eq!(server.get("/api/search?q=a").status, 403);
    std::fs::write(&file, config(10)).unwrap();
    hangup(&server);
    wait_for_line(&log, "policies reloaded");
    let reply = server.get("/api/search?q=a");
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-ratelimit-remaining"),
        Some("4"),
        "the refused request uncounted"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The value of the `slidegate_decisions_total` sample of `policy` and
/// `outcome` in Prometheus text, 0 when absent.
fn decisions(exposition: &str, policy: &str, outcome: &str) -> u64 {
    let (policy, outcome) = (
        format!("policy=\"{policy}\""),
        format!("outcome=\"{outcome}\""),
    );
    exposition
        .lines()
        .filter(|line| line.starts_with("slidegate_decisions_total{"))
        .find(|line| line.contains(&policy) && line.contains(&outcome))
        .map_or(0, |line| {
            line.rsplit(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap_or_else(|_| panic!("a count: {line}"))
        })
}

/// `GET /metrics` serves Prometheus text, is never limited, and its
/// counters move as requests are admitted, denied, shadow-denied and
/// exempted.
#[test]
fn metrics_count_each_outcome() {
    let dir = std::env::temp_dir().join(format!("slidegate-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("metrics.toml");
    std::fs::write(
        &file,
        r#"
[limiter]
keys = ["ip"]
exempt_api_keys = ["internal-key"]

[[policy]]
name = "trial"
route = "GET /api/search"
limit = 2
window = "60s"
shadow = true

[[policy]]
name = "videos"
route = "GET /api/videos"
limit = 3
window = "60s"
"#,
    )
    .unwrap();
    let server = ExampleServer::start(&["--config", file.to_str().unwrap()], &[]);
    let search: Vec<u16> = (0..10)
        .map(|_| server.get("/api/search?q=a").status)
        .collect();
    assert_eq!(search, [200; 10], "a shadow policy never denies");
    let videos: Vec<u16> = (0..5).map(|_| server.get("/api/videos").status).collect();
    assert_eq!(videos, [200, 200, 200, 429, 429]);
    for _ in 0..4 {
        let exempt = server.request("GET", "/api/videos", &[("x-api-key", "internal-key")]);
        assert_eq!(exempt.status, 200);
        assert!(exempt.header("x-ratelimit-limit").is_none());
    }

    for _ in 0..50 {
        assert_eq!(server.get("/metrics").status, 200, "never limited");
    }
    let metrics = server.get("/metrics");
    let text = &metrics.body;
    assert_eq!(decisions(text, "trial", "admitted"), 2, "{text}");
    assert_eq!(decisions(text, "trial", "shadow_denied"), 8, "{text}");
    assert_eq!(decisions(text, "videos", "admitted"), 3, "{text}");
    assert_eq!(decisions(text, "videos", "denied"), 2, "{text}");
    assert_eq!(decisions(text, "videos", "exempt"), 4, "{text}");
    assert!(!text.contains("127.0.0.1"), "no client key in a label");
    // The store's answer times are a histogram, as the Grafana dashboard
    // reads them (a summary has no buckets).
    let every_answer = text
        .lines()
        .find(|line| line.starts_with("slidegate_store_seconds_bucket{le=\"+Inf\"}"))
        .unwrap_or_else(|| panic!("no buckets of slidegate_store_seconds: {text}"));
    let answers: u64 = every_answer.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(answers > 0, "{every_answer}");
    // Near the limit: at most a fifth of it left after an admitted request
    // (the third video, with none left).
    assert!(
        text.contains("slidegate_near_limit_total{policy=\"videos\"} 1"),
        "{text}"
    );
}

/// `/api/slow` sleeps as asked (at most five seconds), and the demo lets a
/// client have two of them in flight at once.
#[test]
fn slow_requests_are_limited_in_flight() {
    let server = ExampleServer::start(&[], &[]);
    assert_eq!(server.get("/api/slow?ms=abc").status, 400);
    assert_eq!(server.get("/api/slow?ms=-5").status, 400);
    // Three at once, each three seconds long: two are admitted, and the
    // third, arriving while they sleep, is refused.
    let replies: Vec<Response> = std::thread::scope(|scope| {
        let calls: Vec<_> = (0..3)
            .map(|_| scope.spawn(|| server.get("/api/slow?ms=3000")))
            .collect();
        calls.into_iter().map(|call| call.join().unwrap()).collect()
    });
    let mut statuses: Vec<u16> = replies.iter().map(|reply| reply.status).collect();
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 429]);
    for reply in &replies {
        match reply.status {
            200 => assert_eq!(reply.json()["slept_ms"], 3000),
            _ => assert_eq!(reply.header("retry-after"), Some("1")),
        }
    }
    assert_eq!(
        server.get("/api/slow?ms=999999").json()["slept_ms"],
        5000,
        "at most five seconds"
    );
    // All ended: their places are free again.
    assert_eq!(server.get("/api/slow?ms=0").status, 200);
    assert_eq!(server.get("/api/slow?ms=0").status, 200);
}

/// `POST /api/complete?tokens=N` streams `{"tokens":N}` and reports N in
/// `x-usage-tokens`; N must be a whole number from 1 to 100,000. The demo
/// reserves the N a completion asks for, so one asking for more than the
/// limit is refused before it runs, and counts completions beside tokens.
#[test]
fn completions_reserve_what_they_ask_for() {
    let server = ExampleServer::start(&[], &[]);
    // The remaining units of each policy, from the IETF field.
    let remaining = |reply: &Response, policy: &str| -> u64 {
        let field = reply.header("ratelimit").expect("a RateLimit field");
        let item = field
            .split(", ")
            .find(|item| item.starts_with(&format!("\"{policy}\";")))
            .unwrap_or_else(|| panic!("no {policy} in {field}"));
        let r = item.split(';').find_map(|p| p.strip_prefix("r=")).unwrap();
        r.parse().unwrap()
    };
    // Refused completions generate nothing: their reservations come back,
    // but each is a completion counted.
    for asked in ["0", "100001", "-1", "1.5", "many", "", "0", "0", "0"] {
        let reply = server.request("POST", &format!("/api/complete?tokens={asked}"), &[]);
        assert_eq!(reply.status, 400, "tokens={asked}");
        assert_eq!(reply.header("x-usage-tokens"), Some("0"));
        assert!(reply.json()["error"].is_string(), "tokens={asked}");
    }
    let reply = server.request("POST", "/api/complete", &[]);
    assert_eq!(reply.status, 400);
    assert_eq!(
        remaining(&reply, "completions"),
        50,
        "ten completions counted"
    );
    let reply = server.request("POST", "/api/complete?tokens=42", &[]);
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-usage-tokens"), Some("42"));
    assert_eq!(
        remaining(&reply, "tokens"),
        958,
        "the 42 asked for reserved"
    );
    assert_eq!(
        reply.header("transfer-encoding"),
        Some("chunked"),
        "streamed"
    );
    assert_eq!(reply.json(), serde_json::json!({ "tokens": 42 }));
    // More than the limit: refused before it runs, without Retry-After.
    let too_many = server.request("POST", "/api/complete?tokens=5000", &[]);
    assert_eq!(too_many.status, 422);
    assert_eq!(too_many.header("retry-after"), None);
    assert_eq!(too_many.header("x-usage-tokens"), None, "never ran");
    let rest = server.request("POST", "/api/complete?tokens=958", &[]);
    assert_eq!(rest.status, 200);
    assert_eq!(remaining(&rest, "tokens"), 0);
    // The 1,000 spent: denied until they leave the window.
    let denied = server.request("POST", "/api/complete?tokens=1", &[]);
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("retry-after"), Some("60"));
    // Requests are counted whatever they cost: another client's refused
    // completions are free of tokens, and the 61st in a minute is denied.
    let other = [("x-api-key", "demo-free-key")];
    for _ in 0..60 {
        let reply = server.request("POST", "/api/complete?tokens=0", &other);
        assert_eq!(reply.status, 400);
        assert_eq!(
            remaining(&reply, "tokens"),
            900,
            "100 reserved, each given back"
        );
    }
    let reply = server.request("POST", "/api/complete?tokens=0", &other);
    assert_eq!(reply.status, 429);
    assert_eq!(remaining(&reply, "completions"), 0);
}

/// A peer that vanishes (here: a client that reads nothing, so answers no
/// ping) does not hold its sockets for ever: the echo pings, closes a
/// socket silent for 25 seconds, and its place under the demo's `sockets`
/// policy is free again, where two dead sockets would lock their client
/// (everyone behind one NAT, with keys by IP) out.
#[tokio::test]
async fn silent_websockets_are_closed_and_free_their_places() {
    use tokio_tungstenite::tungstenite::Error;

    let server = ExampleServer::start(&[], &[]);
    let url = format!("ws://127.0.0.1:{}/ws/echo", server.port);
    let open = || tokio_tungstenite::connect_async(url.clone());
    let (first, _) = open().await.unwrap();
    let (second, _) = open().await.unwrap();
    let started = std::time::Instant::now();
    loop {
        match open().await {
            Ok((third, response)) => {
                assert_eq!(response.status(), 101);
                assert!(
                    started.elapsed() >= Duration::from_secs(20),
                    "a socket closed before it was silent long: {:?}",
                    started.elapsed()
                );
                drop(third);
                break;
            }
            Err(Error::Http(response)) => {
                assert_eq!(response.status(), 429);
                assert!(
                    started.elapsed() < Duration::from_secs(120),
                    "still refused two minutes after the sockets fell silent"
                );
            }
            Err(other) => panic!("{other}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    drop((first, second));
}

/// `GET /ws/echo` upgrades to a WebSocket that sends every message back.
#[tokio::test]
async fn the_websocket_echoes() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;

    let server = ExampleServer::start(&[], &[]);
    let url = format!("ws://127.0.0.1:{}/ws/echo", server.port);
    let (mut socket, response) = tokio_tungstenite::connect_async(url).await.unwrap();
    assert_eq!(response.status(), 101);
    // The next message other than the echo's pings, within a minute.
    async fn next_echo(
        socket: &mut (
                 impl futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>>
                 + Unpin
             ),
    ) -> Message {
        loop {
            let message = tokio::time::timeout(Duration::from_secs(60), socket.next())
                .await
                .expect("an echo within a minute")
                .expect("the socket open")
                .unwrap();
            if !message.is_ping() {
                return message;
            }
        }
    }
    for text in ["hello", "again"] {
        socket.send(Message::text(text)).await.unwrap();
        assert_eq!(next_echo(&mut socket).await, Message::text(text));
    }
    socket.send(Message::binary(vec![0, 1, 2])).await.unwrap();
    assert_eq!(next_echo(&mut socket).await, Message::binary(vec![0, 1, 2]));
    socket.close(None).await.unwrap();
}

/// The demo's `sockets` policy counts the messages of a client's sockets:
/// 100 per 10 s are echoed, and the one past them closes its socket with
/// 1008, unechoed.
#[tokio::test]
async fn a_websocket_past_its_message_rate_is_closed_with_1008() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;

    let server = ExampleServer::start(&[], &[]);
    let url = format!("ws://127.0.0.1:{}/ws/echo", server.port);
    let (mut socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    let mut echoed = 0;
    let closed = loop {
        socket
            .send(Message::text(format!("m{echoed}")))
            .await
            .unwrap();
        let answer = loop {
            let next = tokio::time::timeout(Duration::from_secs(60), socket.next())
                .await
                .expect("an answer within a minute")
                .expect("the socket open")
                .unwrap();
            if !next.is_ping() {
                break next;
            }
        };
        match answer {
            Message::Text(text) => {
                assert_eq!(text.as_str(), format!("m{echoed}"));
                echoed += 1;
            }
            Message::Close(frame) => break frame.map(|frame| u16::from(frame.code)),
            other => panic!("unexpected {other:?}"),
        }
        assert!(echoed <= 100, "more than 100 messages echoed");
    };
    assert_eq!((echoed, closed), (100, Some(1008)));
}

/// The demo's `sockets` policy: a third WebSocket of a client is refused
/// while two are open, and admitted once one of them closes.
#[tokio::test]
async fn a_third_websocket_waits_for_one_of_two_to_close() {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Error;

    let server = ExampleServer::start(&[], &[]);
    let url = format!("ws://127.0.0.1:{}/ws/echo", server.port);
    let open = || tokio_tungstenite::connect_async(url.clone());
    let (mut first, _) = open().await.unwrap();
    let (_second, _) = open().await.unwrap();
    match open().await {
        Err(Error::Http(response)) => {
            assert_eq!(response.status(), 429);
            assert_eq!(response.headers()["x-ratelimit-limit"], "2");
        }
        other => panic!("a third socket was not refused: {other:?}"),
    }
    first.close(None).await.unwrap();
    // The server's close, then the end of the stream.
    while first.next().await.is_some() {}
    let started = std::time::Instant::now();
    loop {
        match open().await {
            Ok((third, response)) => {
                assert_eq!(response.status(), 101);
                drop(third);
                break;
            }
            Err(error) => assert!(
                started.elapsed() < Duration::from_secs(30),
                "still refused 30 seconds after a socket closed: {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A config with `[admin] token` and a search limit of 5, keyed by IP.
const ADMIN_CONFIG: &str = r#"
[limiter]
keys = ["ip"]

[[policy]]
name = "search"
route = "GET /api/search"
limit = 5
window = "60s"

[admin]
token = "s3cret-admin-token"
"#;

const BEARER: (&str, &str) = ("authorization", "Bearer s3cret-admin-token");

#[test]
fn admin_routes_inspect_and_reset_a_client_behind_the_token() {
    let dir = std::env::temp_dir().join(format!("slidegate-admin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("admin.toml");
    std::fs::write(&path, ADMIN_CONFIG).unwrap();
    let server = ExampleServer::start(&["--config", path.to_str().unwrap()], &[]);
    let me = "/admin/limits/search/ip%3A127.0.0.1";

    // No token, a wrong one, another scheme: 401 with a challenge.
    for headers in [
        vec![],
        vec![("authorization", "Bearer s3cret-admin-tokem")],
        vec![("authorization", "Bearer s3cret-admin-token-and-more")],
        vec![("authorization", "Basic czNjcmV0LWFkbWluLXRva2Vu")],
    ] {
        let reply = server.request("GET", me, &headers);
        assert_eq!(reply.status, 401, "{headers:?}");
        assert!(
            reply
                .header("www-authenticate")
                .unwrap()
                .starts_with("Bearer")
        );
        assert_eq!(server.request("DELETE", me, &headers).status, 401);
    }

    let standing = |server: &ExampleServer| {
        let reply = server.request("GET", me, &[BEARER]);
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()
    };
    let fresh = standing(&server);
    assert_eq!(
        (fresh["limit"].as_u64(), fresh["remaining"].as_u64()),
        (Some(5), Some(5))
    );
    assert_eq!(fresh["reset_seconds"], 0);
    // Inspecting records nothing, and is never limited itself.
    for _ in 0..20 {
        assert_eq!(standing(&server)["remaining"], 5);
    }
    for _ in 0..5 {
        assert_eq!(server.get("/api/search").status, 200);
    }
    assert_eq!(server.get("/api/search").status, 429);
    let spent = standing(&server);
    assert_eq!(spent["remaining"], 0);
    let reset = spent["reset_seconds"].as_u64().unwrap();
    assert!((1..=60).contains(&reset), "{spent}");

    // Reset: the client starts over.
    assert_eq!(server.request("DELETE", me, &[BEARER]).status, 204);
    assert_eq!(standing(&server)["remaining"], 5);
    assert_eq!(server.get("/api/search").status, 200);

    // A policy the server does not have, a key no client can have.
    let unknown = server.request("GET", "/admin/limits/serch/ip%3A127.0.0.1", &[BEARER]);
    assert_eq!(unknown.status, 404);
    assert!(unknown.json()["error"].as_str().unwrap().contains("serch"));
    assert_eq!(
        server
            .request("DELETE", "/admin/limits/serch/ip%3A127.0.0.1", &[BEARER])
            .status,
        404
    );
    for key in ["ip%3A%7Bx%7D", "jwt%3Aal%20ice", "%FF%FE"] {
        let reply = server.request("GET", &format!("/admin/limits/search/{key}"), &[BEARER]);
        assert_eq!(reply.status, 400, "{key}");
    }
    std::fs::remove_dir_all(&dir).unwrap();

    // Without a token, the routes do not exist.
    let demo = ExampleServer::start(&[], &[]);
    assert_eq!(demo.request("GET", me, &[BEARER]).status, 404);
    assert_eq!(demo.request("DELETE", me, &[BEARER]).status, 404);
}

/// Asks `server` for `path` until it answers `status` (each try an
/// admitted request, or a refused one); how long that took.
fn until_status(server: &ExampleServer, path: &str, status: u16) -> Duration {
    let started = Instant::now();
    while server.get(path).status != status {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{path} was not answered {status} within 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}

/// `PUT` and `DELETE /admin/deny/{key}` and `/admin/overrides/{policy}/{key}`
/// on one instance reach another on the same Redis within a few seconds,
/// and a restarted instance keeps them.
#[test]
fn admin_denials_and_limits_reach_every_instance_and_survive_a_restart() {
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("slidegate-changes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("admin.toml");
    std::fs::write(&path, ADMIN_CONFIG.replace("limit = 5", "limit = 500")).unwrap();
    let args = ["--config", path.to_str().unwrap()];
    let env = [("REDIS_URL", redis.url())];
    let env: Vec<(&str, &str)> = env.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let (one, mut other) = (
        ExampleServer::start(&args, &env),
        ExampleServer::start(&args, &env),
    );
    let me = "ip%3A127.0.0.1";
    assert_eq!(other.get("/api/search").status, 200);

    // Bad requests: no token, a bad key, a bad body, an unknown policy, a
    // limit no policy can count.
    assert_eq!(
        one.request("PUT", &format!("/admin/deny/{me}"), &[]).status,
        401
    );
    assert_eq!(
        one.request("PUT", "/admin/deny/jwt%3A%7Bx%7D", &[BEARER])
            .status,
        400
    );
    let put = |server: &ExampleServer, path: &str, body: &str| {
        server
            .request_with_body("PUT", path, &[BEARER], body)
            .status
    };
    assert_eq!(
        put(&one, &format!("/admin/deny/{me}"), r#"{"seconds": "x"}"#),
        400
    );
    assert_eq!(
        put(&one, &format!("/admin/deny/{me}"), r#"{"seconds": 0}"#),
        400
    );
    assert_eq!(
        put(
            &one,
            &format!("/admin/overrides/serch/{me}"),
            r#"{"limit": 5}"#
        ),
        404
    );
    assert_eq!(
        put(
            &one,
            &format!("/admin/overrides/search/{me}"),
            r#"{"limit": 0}"#
        ),
        422
    );
    assert_eq!(
        put(&one, &format!("/admin/overrides/search/{me}"), "5"),
        400
    );

    assert_eq!(put(&one, &format!("/admin/deny/{me}"), ""), 204);
    assert_eq!(
        one.get("/api/search").status,
        403,
        "at once where it was made"
    );
    let took = until_status(&other, "/api/search", 403);
    eprintln!("a denial reached the other instance in {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    drop(other);
    other = ExampleServer::start(&args, &env);
    assert_eq!(
        other.get("/api/search").status,
        403,
        "kept across a restart"
    );
    assert_eq!(
        one.request("DELETE", &format!("/admin/deny/{me}"), &[BEARER])
            .status,
        204
    );
    until_status(&other, "/api/search", 200);

    // A limit below the count denies at once; it reaches the other
    // instance, and outlives it.
    assert_eq!(
        put(
            &one,
            &format!("/admin/overrides/search/{me}"),
            r#"{"limit": 1}"#
        ),
        204
    );
    let denied = one.get("/api/search");
    assert_eq!(
        (denied.status, denied.header("x-ratelimit-limit")),
        (429, Some("1"))
    );
    until_status(&other, "/api/search", 429);
    drop(other);
    other = ExampleServer::start(&args, &env);
    assert_eq!(
        other.get("/api/search").status,
        429,
        "kept across a restart"
    );
    let path = format!("/admin/overrides/search/{me}");
    assert_eq!(one.request("DELETE", &path, &[BEARER]).status, 204);
    until_status(&other, "/api/search", 200);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An instance killed while its requests hold leases: another instance on
/// the same Redis counts them until their lease time is over, then never
/// again.
#[test]
fn the_leases_of_a_killed_instance_expire_with_their_lease_time() {
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("slidegate-lease-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("lease.toml");
    std::fs::write(
        &path,
        "[[policy]]\nname = \"slow\"\nroute = \"GET /api/slow\"\nconcurrency = 2\nlease = \"5s\"\n",
    )
    .unwrap();
    let config = ["--config", path.to_str().unwrap()];
    let env = [("REDIS_URL", redis.url())];
    let env: Vec<(&str, &str)> = env.iter().map(|(n, v)| (*n, v.as_str())).collect();

    let mut doomed = ExampleServer::start(&config, &env);
    let port = doomed.port;
    // No lease is taken before this moment, so none ends before it + 5 s.
    let started = Instant::now();
    let callers: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                // The connection dies with the server; nothing to read.
                let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
                let _ = stream.write_all(
                    b"GET /api/slow?ms=5000 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
                );
                let _ = stream.read_to_end(&mut Vec::new());
            })
        })
        .collect();
    // Both leases are in Redis: one sorted set with two members.
    let held = || {
        let keys = redis.cli(&["--scan", "--pattern", "slidegate:slow:*"]);
        keys.lines().next().map_or(0, |key| {
            redis.cli(&["ZCARD", key]).trim().parse().unwrap_or(0)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while held() < 2 {
        assert!(
            Instant::now() < deadline,
            "the two slow requests never got leases"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();
    for caller in callers {
        caller.join().unwrap();
    }

    // Another instance counts the dead one's leases...
    let survivor = ExampleServer::start(&config, &env);
    let first = survivor.get("/api/slow?ms=0");
    if started.elapsed() < Duration::from_secs(4) {
        assert_eq!(first.status, 429, "the dead instance's leases still count");
    }
    // ...until their lease time is over.
    let deadline = Instant::now() + Duration::from_secs(15);
    while survivor.get("/api/slow?ms=0").status != 200 {
        assert!(Instant::now() < deadline, "the leases never expired");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "a lease ended before its time: {:?}",
        started.elapsed()
    );
    // Nothing is left: the expired leases were cleaned, and the admitted
    // requests gave theirs back (on a task of their own, so wait for it).
    while held() != 0 {
        assert!(Instant::now() < deadline, "leases left in Redis");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A forwarding header from a peer that is not a trusted proxy is ignored,
/// and said once: the proxy may have been left out of `trusted_proxies`.
#[test]
fn a_forwarding_header_from_an_untrusted_peer_is_reported_once() {
    let mut server = ExampleServer::start_with_log(&[], &[], Stdio::piped());
    let log = log_lines(&mut server);
    for _ in 0..3 {
        let reply = server.request("GET", "/api/whoami", &[("x-forwarded-for", "203.0.113.9")]);
        assert_eq!(reply.json()["key"], "ip:127.0.0.1", "the header is ignored");
    }
    // A line logged after the three requests: every warning of theirs is
    // in the log before it.
    let pid = server.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut warnings = 0;
    loop {
        let line = log
            .recv_timeout(Duration::from_secs(10))
            .expect("the SIGHUP line");
        if line.contains("not a trusted proxy") {
            assert!(
                line.contains("127.0.0.1") && line.contains("x-forwarded-for"),
                "{line}"
            );
            warnings += 1;
        }
        if line.contains("SIGHUP") {
            break;
        }
    }
    assert_eq!(warnings, 1, "reported once per process");
}
