//! What the store benchmarks share: running decisions over concurrent
//! tasks, slidegate's `RedisStore` and the raw redis-rs baseline: the same
//! script by `EVALSHA` on one shared multiplexed connection, which
//! pipelines whatever is in flight.

#![allow(dead_code)]

use std::future::Future;
use std::hint::black_box;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use slidegate::deadpool_redis::Pool;
use slidegate::deadpool_redis::redis::aio::MultiplexedConnection;
use slidegate::deadpool_redis::redis::{Client, Script, Value};
use slidegate::{
    Policy,
    key::Key,
    store::{Check, RedisStore, Store},
};

/// The check library's source: the files of `lua/`, joined in the order
/// `RedisStore` joins them (the order `lua/files.rs` lists them in).
pub(crate) fn check_source() -> String {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let order = std::fs::read_to_string(format!("{root}/lua/files.rs")).unwrap();
    order
        .split('"')
        .filter(|part| part.starts_with("lua/") && part.ends_with(".lua"))
        .map(|path| std::fs::read_to_string(format!("{root}/{path}")).unwrap())
        .collect()
}

/// A check script (the library in `lua/`, or an earlier version of it) as a
/// Redis function library named `name`, registering each of `functions`:
/// a function name and the Lua function it runs (`main`, `check`,
/// `check_batch`, ...). Its functions are defined once, when the library
/// loads, rather than on every call, as `RedisStore` loads it.
pub(crate) fn library(source: &str, name: &str, functions: &[(&str, &str)]) -> String {
    let body = source
        .strip_prefix("#!lua\n")
        .and_then(|body| body.strip_suffix("return main(KEYS, ARGV)\n"))
        .expect("a check script opens with its shebang and ends by deciding");
    let mut library = format!("#!lua name={name}\n{body}\n");
    for (function, runs) in functions {
        library.push_str(&format!("redis.register_function('{function}', {runs})\n"));
    }
    library
}

/// A limit no benchmark reaches: every decision admits and records.
pub(crate) const NEVER: u32 = 1_000_000_000;

/// A check's integers from the script's `reply`: packed in one string
/// (8 bytes each, big-endian), as the library in `lua/` answers, or a list of
/// integers, as earlier versions did.
pub(crate) fn integers(reply: Value) -> Vec<i64> {
    match reply {
        Value::BulkString(packed) => packed
            .chunks_exact(8)
            .map(|bytes| i64::from_be_bytes(bytes.try_into().expect("8 bytes")))
            .collect(),
        Value::Array(values) => values
            .into_iter()
            .map(|value| match value {
                Value::Int(integer) => integer,
                other => panic!("expected an integer, got {other:?}"),
            })
            .collect(),
        other => panic!("expected a check's integers, got {other:?}"),
    }
}

/// The runtime the Redis benchmarks' tasks run on: one worker, so that the
/// client's side of the comparison has the same CPU in every variant.
pub(crate) fn one_worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// `iters` decisions spread over `tasks` tasks, each on its own key;
/// returns the wall time.
pub(crate) async fn concurrently<F, Fut>(tasks: usize, iters: u64, one: F) -> Duration
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let one = Arc::new(one);
    let per_task = iters.div_ceil(tasks as u64);
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let one = one.clone();
            tokio::spawn(async move {
                for _ in 0..per_task {
                    one(task).await;
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.unwrap();
    }
    started.elapsed()
}

/// A `RedisStore` on `pool`, with a timeout no benchmark reaches.
pub(crate) fn store_on(pool: Pool) -> RedisStore {
    RedisStore::builder(pool)
        .with_timeout(Duration::from_secs(1))
        .build()
        .unwrap()
}

/// One key per task.
pub(crate) fn task_keys(tasks: usize) -> Arc<Vec<Key>> {
    Arc::new((0..tasks).map(|t| Key::new(format!("task-{t}"))).collect())
}

/// One decision for task `task` on its own key through `store`, under a
/// policy that never denies: what `raw_evalsha` runs, through slidegate.
pub(crate) fn slidegate_checks(
    store: RedisStore,
    keys: Arc<Vec<Key>>,
) -> impl Fn(usize) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync + 'static {
    let policy = Policy::new("bench", NEVER, Duration::from_secs(1));
    move |task| {
        let future = store.check(&[Check::new(&policy, keys[task].clone()).unwrap()]);
        Box::pin(async move {
            black_box(future.await.unwrap());
        })
    }
}

/// One multiplexed connection to `url`, for the baseline.
pub(crate) async fn multiplexed(url: &str) -> MultiplexedConnection {
    Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// One decision for task `task` by a plain `EVALSHA` of the library in `lua/` on
/// a handle of one shared multiplexed connection.
pub(crate) fn raw_evalsha(
    connection: MultiplexedConnection,
    script: Arc<Script>,
) -> impl Fn(usize) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync + 'static {
    move |task| {
        let (mut connection, script) = (connection.clone(), script.clone());
        Box::pin(async move {
            let key = format!("raw:bench:{{task-{task}}}");
            let reply: Value = script
                .key(format!("{key}:l"))
                .key(&key)
                .arg("")
                .arg("log")
                .arg(NEVER)
                .arg(1_000_000)
                // The burst (the limit, for a log), no block, no delay, the
                // window's span, and the cost.
                .arg(NEVER)
                .arg(0)
                .arg(0)
                .arg(0)
                .arg(1)
                .invoke_async(&mut connection)
                .await
                .unwrap();
            black_box(reply);
        })
    }
}

/// The middle value of `values` (the upper middle for an even count).
pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
