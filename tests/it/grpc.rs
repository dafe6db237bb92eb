//! The gRPC example, run as a user would, called with a real tonic client:
//! over the limit a call ends with `RESOURCE_EXHAUSTED` and metadata that
//! says when to retry.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// The gRPC example process, killed on drop.
struct GrpcExample {
    child: Child,
    port: u16,
}

impl GrpcExample {
    fn start(args: &[&str]) -> Self {
        let exe = std::env::current_exe().unwrap();
        let binary = exe
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .join("examples")
            .join("grpc");
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(binary)
            .args(args)
            .args(["--bind", &format!("127.0.0.1:{port}")])
            .env_remove("REDIS_URL")
            .env_remove("SLIDEGATE_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the grpc example is built by cargo test");
        let example = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the gRPC example did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        example
    }

    async fn client(&self) -> HealthClient<tonic::transport::Channel> {
        let channel =
            tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{}", self.port))
                .unwrap()
                .connect()
                .await
                .unwrap();
        HealthClient::new(channel)
    }
}

impl Drop for GrpcExample {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn check() -> HealthCheckRequest {
    HealthCheckRequest {
        service: String::new(),
    }
}

#[tokio::test]
async fn the_sixth_check_in_a_minute_is_resource_exhausted() {
    let example = GrpcExample::start(&[]);
    let mut client = example.client().await;
    for _ in 0..5 {
        let reply = client.check(check()).await.expect("within the limit");
        assert_eq!(reply.get_ref().status(), ServingStatus::Serving);
    }
    let status = client.check(check()).await.expect_err("over the limit");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("health-check"), "{status:?}");
    let metadata = status.metadata();
    let retry_after: u64 = metadata
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let pushback: u64 = metadata
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        pushback <= retry_after * 1000 && pushback > (retry_after - 1) * 1000,
        "{pushback}"
    );
    assert_eq!(metadata.get("x-ratelimit-remaining").unwrap(), "0");
}

#[tokio::test]
async fn a_config_file_limits_calls_by_their_method_path() {
    let dir = std::env::temp_dir().join(format!("slidegate-grpc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("grpc.toml");
    std::fs::write(
        &path,
        "[[policy]]\nname = \"one-check\"\nroute = \"POST /grpc.health.v1.Health/Check\"\nlimit = 1\nwindow = \"1h\"\n",
    )
    .unwrap();
    let example = GrpcExample::start(&["--config", path.to_str().unwrap()]);
    let mut client = example.client().await;
    client.check(check()).await.expect("the first call");
    let status = client.check(check()).await.expect_err("the second");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("one-check"), "{status:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A policy counting failures (or successes) only reads a call's gRPC
/// status, not its HTTP status (`200` either way): from the head when the
/// call ended at once (`NOT_FOUND` here), from the trailers otherwise (a
/// successful check).
#[tokio::test]
async fn calls_count_by_their_grpc_status() {
    let dir = std::env::temp_dir().join(format!("slidegate-grpc-count-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let unknown = || HealthCheckRequest {
        service: "no.such.Service".to_owned(),
    };
    for count in ["failures", "successes"] {
        let path = dir.join(format!("{count}.toml"));
        std::fs::write(
            &path,
            format!(
                "[[policy]]\nname = \"checks\"\nroute = \"POST /grpc.health.v1.Health/Check\"\n\
                 limit = 2\nwindow = \"1h\"\ncount = \"{count}\"\n"
            ),
        )
        .unwrap();
        let example = GrpcExample::start(&["--config", path.to_str().unwrap()]);
        let mut client = example.client().await;
        type Call = fn() -> HealthCheckRequest;
        let (counted, free): (Call, Call) = if count == "failures" {
            (unknown, check)
        } else {
            (check, unknown)
        };
        for (call, times, what) in [
            (free, 5, "a call that does not count was counted"),
            (counted, 2, "within the limit"),
        ] {
            for _ in 0..times {
                let outcome = client.check(call()).await;
                assert_ne!(
                    outcome.err().map(|status| status.code()),
                    Some(Code::ResourceExhausted),
                    "{count}: {what}"
                );
            }
        }
        let status = client.check(free()).await.expect_err("over the limit");
        assert_eq!(
            status.code(),
            Code::ResourceExhausted,
            "{count}: {status:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// tonic serves a call whatever its HTTP method: the example refuses any
/// but `POST` before the layer, so a `GET` of the limited method is never
/// served, and takes nothing of the client's limit either.
#[tokio::test]
async fn a_call_sent_as_a_get_is_never_served() {
    use tower::ServiceExt;

    let example = GrpcExample::start(&[]);
    let address = format!("http://127.0.0.1:{}", example.port);
    let channel = tonic::transport::Channel::from_shared(address.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    for method in ["GET", "PUT", "GET", "DELETE", "GET", "PATCH", "GET"] {
        // An empty `HealthCheckRequest`, framed as gRPC frames it.
        let frame = bytes::Bytes::from_static(&[0, 0, 0, 0, 0]);
        let request = http::Request::builder()
            .method(method)
            .uri(format!("{address}/grpc.health.v1.Health/Check"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(tonic::body::Body::new(http_body_util::Full::new(frame)))
            .unwrap();
        let response = channel.clone().oneshot(request).await.unwrap();
        assert_eq!(
            response.headers().get("grpc-status").map(|s| s.as_bytes()),
            Some(&b"12"[..]),
            "{method}: {:?}",
            response.headers()
        );
    }
    let mut client = example.client().await;
    for _ in 0..5 {
        client
            .check(check())
            .await
            .expect("the whole limit is left");
    }
}
