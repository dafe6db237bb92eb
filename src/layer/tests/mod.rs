//! The layer's decision core, tested inside the crate: its pure parts
//! alone, and requests that wait.

mod pure_parts;
mod setters;
mod waiting;
