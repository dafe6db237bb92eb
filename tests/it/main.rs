//! The integration tests, in one binary: the support code (real
//! `redis-server` processes, clusters, sentinels, certificates) compiles
//! once. Three tests keep binaries of their own: `allocations` counts every
//! allocation of its process, and `logging` and `secret_logs` install
//! `tracing` subscribers, whose per-callsite interest other tests on other
//! threads would change under them.

#[macro_use]
mod support;

mod abuse;
mod accuracy;
mod atomicity;
mod bounded;
mod buckets_blocks_resets;
mod calendar;
mod changes;
mod cluster;
mod commands;
mod concurrency;
mod config;
mod delays;
mod deny_cache;
mod equivalence;
mod example_server;
mod failures_shadow_fallback;
mod faults;
mod grpc;
mod http;
mod identity;
mod layout;
mod log_chunks;
mod malformed_calls;
mod messages;
mod namespaces;
mod own_limits;
mod package;
mod per_keys;
mod pipelining;
mod production_redis;
mod redis_state;
mod refunds;
mod reported;
mod settled;
mod slices;
mod upgrades;
mod window;
