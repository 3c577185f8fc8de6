//! The one shape every network server of a Spillway process has: the AMQP
//! gateway, the internal gRPC services, management, and the `/metrics` and
//! `/healthz` endpoint. The wiring (`spillway-serve`) starts the servers a
//! role needs, keeps them in one list and stops them in the reverse order
//! of their start, so that the endpoint that says "not ready" is the last
//! to go.

use std::net::SocketAddr;

use async_trait::async_trait;

/// A started server: what it serves, where, and how it stops.
#[async_trait]
pub trait Server: Send + Sync {
    /// What it serves, as logs and the ready file name it (`amqp`,
    /// `engine`, `storage`, `management`, `metrics`).
    fn name(&self) -> &'static str;

    /// Every address it listens on, each under the name the ready file
    /// gives it (the real port when configured with 0). A gateway has two:
    /// `amqp` and `amqps`.
    fn bind_addrs(&self) -> Vec<(&'static str, SocketAddr)>;

    /// Stops accepting, ends or drains what is open, and returns once it is
    /// gone.
    async fn shutdown(self: Box<Self>);
}

#[async_trait]
impl Server for crate::HttpServer {
    fn name(&self) -> &'static str {
        "metrics"
    }

    fn bind_addrs(&self) -> Vec<(&'static str, SocketAddr)> {
        vec![("metrics", self.local_addr())]
    }

    async fn shutdown(self: Box<Self>) {
        crate::HttpServer::shutdown(*self).await;
    }
}
