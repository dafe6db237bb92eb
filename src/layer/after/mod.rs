//! What happens after the response: what an admitted request owes the
//! store ([`owed`]), the units it gives back ([`recorded`], on a task of
//! its own), the reservations of policies settled after
//! the response ([`reservations`], [`max_unsettled`]), reported through
//! the [`Usage`](crate::Usage) handle ([`usage`]) and sent to the store
//! ([`sending`]), the leases an upgraded connection holds
//! ([`connection`]) and the messages sent over it ([`messages`]).

pub(crate) mod connection;
pub(crate) mod max_unsettled;
pub(crate) mod messages;
pub(crate) mod owed;
pub(crate) mod recorded;
pub(crate) mod reservations;
pub(crate) mod sending;
pub(crate) mod usage;
