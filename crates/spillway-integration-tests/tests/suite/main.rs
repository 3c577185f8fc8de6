//! The end-to-end suite: real clients over real sockets against both
//! wirings, one module per feature. The modules live in one test binary, not
//! one each: every binary links the whole broker (about 115 MB), so 24 of
//! them made the link step most of an incremental build.
//!
//! `tests/traces.rs` stays a binary of its own: it installs a global tracing
//! subscriber, which would collect the spans of every other module's
//! in-process broker.

mod alternate_exchanges;
mod amqp1;
mod amqp_methods;
mod amqps;
mod background_recovery;
mod cluster_tls;
mod compression;
mod configuration;
mod consumer_selection;
mod consumer_timeout;
mod crash_recovery;
mod dead_letters;
mod delayed_messages;
mod direct_reply_to;
mod expiry;
mod flow_to_disk;
mod hostile_clients;
mod http_api;
mod internal_auth;
mod limits;
mod loadgen_clients;
mod malformed_input;
mod management;
mod memory_ceiling;
mod metrics;
mod permission_escapes;
mod policies;
mod priority_queues;
mod producer_flow_control;
mod publisher_pacing;
mod queue_deletion;
mod queue_types;
mod replication;
mod role_rights;
mod storage_faults;
mod transactions;
mod update_secret;
mod users_and_permissions;
