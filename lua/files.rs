// The files of the check library, each with its path from the crate's
// root, in the order they are joined into one source: the shared state
// and helpers first, the driver, which calls every algorithm, last.
// Included as an expression by `src/store/redis/script.rs`; the
// benchmarks read the order from this file as it is.
[
    ("lua/shared.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/shared.lua"))),
    ("lua/log_pages.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/log_pages.lua"))),
    ("lua/log.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/log.lua"))),
    ("lua/counter.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/counter.lua"))),
    ("lua/fixed.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/fixed.lua"))),
    ("lua/bucket.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/bucket.lua"))),
    ("lua/lease.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lease.lua"))),
    ("lua/calendar.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/calendar.lua"))),
    ("lua/driver.lua", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/driver.lua"))),
]
