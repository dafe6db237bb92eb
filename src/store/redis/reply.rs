//! Reading the script's replies: the five integers per policy, packed
//! in one string, as decisions, and a batch call's replies, one per
//! request, each with its own error; and a Redis error as the store
//! reports it.

use deadpool_redis::redis::aio::ConnectionLike;
use deadpool_redis::redis::{Cmd, ErrorKind, RedisError, RedisResult, Value};

use super::call::{Call, PolicyArgs};
use super::library::Library;
use super::script;
use crate::store::UNSET;
use crate::store::{CheckOutcome, Decision, Decisions, StoreError};

/// The bytes of one policy's five integers (`DECISION` in
/// `lua/shared.lua`): 8 each, big-endian, signed.
const DECISION_BYTES: usize = 5 * 8;

/// The script's five integers per policy, `packed`, as decisions, for the
/// policies of `args`.
pub(super) fn decisions(
    args: &[(PolicyArgs, u64)],
    packed: &[u8],
) -> Result<Decisions, StoreError> {
    if packed.len() != args.len() * DECISION_BYTES {
        return Err(StoreError::Protocol(format!(
            "expected {} bytes of decisions, got {}",
            args.len() * DECISION_BYTES,
            packed.len()
        )));
    }
    // A time the script sent, in µs; one it marks -1 (or that does not
    // apply) is not set.
    let micros = |v: i64| u64::try_from(v).unwrap_or(0);
    let time_if = |applies: bool, v: i64| match u64::try_from(v) {
        Ok(us) if applies => us,
        _ => UNSET,
    };
    let integers = |bytes: &[u8]| -> [i64; 5] {
        std::array::from_fn(|i| {
            let mut integer = [0; 8];
            integer.copy_from_slice(&bytes[8 * i..8 * i + 8]);
            i64::from_be_bytes(integer)
        })
    };
    Ok(args
        .iter()
        .zip(packed.chunks_exact(DECISION_BYTES).map(integers))
        // A token bucket's burst is the units a client may spend at once:
        // its limit as a decision reports it (the limit otherwise).
        // The fifth is when an admitted request's units were recorded, or
        // how long a denied client's block lasts.
        .map(|(&((_, _, _, burst, _, _, _), _), v)| {
            let admitted = v[0] == 1;
            Decision {
                admitted,
                limit: burst,
                remaining: u32::try_from(v[1]).unwrap_or(0),
                reset_us: micros(v[2]),
                // An admitted request's retry time is its wait.
                retry_after_us: time_if(!admitted, v[3]),
                delayed_for_us: time_if(admitted, v[3]),
                recorded_at_us: time_if(admitted, v[4]),
                blocked_for_us: time_if(!admitted, v[4]),
                sliced: false,
            }
        })
        .collect())
}

/// The batch function's replies, one per request, errors included: a
/// request's error stays in its place instead of failing the whole call,
/// as `query_async` would make it.
pub(super) async fn replies(
    fcall: &Cmd,
    connection: &mut impl ConnectionLike,
) -> RedisResult<Vec<Value>> {
    match connection.req_packed_command(fcall).await? {
        Value::Array(replies) => Ok(replies),
        Value::ServerError(error) => Err(error.into()),
        other => Err(RedisError::from((
            ErrorKind::UnexpectedReturnType,
            "the batch function answered something else than a list",
            format!("{other:?}"),
        ))),
    }
}

/// One request's answer within a batch's reply.
pub(super) fn batched_outcome(call: &Call, reply: Value) -> CheckOutcome {
    match reply {
        Value::BulkString(packed) => decisions(&call.args, &packed),
        Value::ServerError(error) => Err(store_error_of(RedisError::from(error))),
        other => Err(StoreError::Protocol(format!(
            "expected a request's integers, got {other:?}"
        ))),
    }
}

/// `error` as the store reports it: Redis out of memory refusing a client
/// it does not track is [`StoreError::Full`]; anything else a backend
/// failure.
pub(super) fn store_error_of(error: RedisError) -> StoreError {
    if Library::out_of_memory(&error) {
        StoreError::Full(error.detail().unwrap_or_default().to_owned())
    } else if let Some(annotated) = script::annotate(&error.to_string()) {
        // The library's line that failed, named in `lua/`.
        StoreError::backend(annotated)
    } else {
        StoreError::backend(error)
    }
}
