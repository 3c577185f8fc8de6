//! One mapping between Spillway's service errors and gRPC statuses, used by
//! every tonic server and client in the workspace.
//!
//! Storage failures are told apart by kind, so that a caller knows whether
//! trying again can help: [`ServiceError::is_transient`] is true only for
//! [`ServiceError::Unavailable`] (a node unreachable, a timeout, a
//! connection lost mid-call). Disk full (`ResourceExhausted`), corruption
//! (`DataLoss`), a stale lease (`FailedPrecondition`) and the rest are
//! permanent: the same request will fail the same way until an operator
//! acts.

/// An error a component returns across a service boundary.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not found: {0}")]
    NotFound(String),
    /// Transient: the peer could not be reached or did not answer in time.
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// A resource ran out: the disk is full, or the disk refused a write.
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    /// Stored data is corrupt.
    #[error("data loss: {0}")]
    DataLoss(String),
    /// A call whose feature is not built yet.
    #[error("unimplemented: {0}")]
    Unimplemented(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// Transient: a storage group member that does not lead was asked to
    /// change the store. Holds the leader's address when the member knows
    /// it ("" if not); over gRPC it is UNAVAILABLE with the address in the
    /// [`LEADER_HEADER`] response header.
    #[error("unavailable: this storage node does not lead its group (leader: {})", if .0.is_empty() { "not known yet" } else { .0.as_str() })]
    NotLeader(String),
}

/// The response header that names the storage group's leader.
pub const LEADER_HEADER: &str = "spillway-storage-leader";

impl ServiceError {
    /// Whether the same request may succeed if tried again later without
    /// anyone acting: only when the peer was unavailable.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ServiceError::Unavailable(_) | ServiceError::NotLeader(_)
        )
    }

    /// The error's kind, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ServiceError::InvalidArgument(_) => "invalid_argument",
            ServiceError::NotFound(_) => "not_found",
            ServiceError::Unavailable(_) => "unavailable",
            ServiceError::FailedPrecondition(_) => "failed_precondition",
            ServiceError::PermissionDenied(_) => "permission_denied",
            ServiceError::AlreadyExists(_) => "already_exists",
            ServiceError::ResourceExhausted(_) => "resource_exhausted",
            ServiceError::DataLoss(_) => "data_loss",
            ServiceError::Unimplemented(_) => "unimplemented",
            ServiceError::Internal(_) => "internal",
            ServiceError::NotLeader(_) => "not_leader",
        }
    }
}

impl From<ServiceError> for tonic::Status {
    fn from(error: ServiceError) -> Self {
        match error {
            ServiceError::InvalidArgument(msg) => tonic::Status::invalid_argument(msg),
            ServiceError::NotFound(msg) => tonic::Status::not_found(msg),
            ServiceError::Unavailable(msg) => tonic::Status::unavailable(msg),
            ServiceError::FailedPrecondition(msg) => tonic::Status::failed_precondition(msg),
            ServiceError::PermissionDenied(msg) => tonic::Status::permission_denied(msg),
            ServiceError::AlreadyExists(msg) => tonic::Status::already_exists(msg),
            ServiceError::ResourceExhausted(msg) => tonic::Status::resource_exhausted(msg),
            ServiceError::DataLoss(msg) => tonic::Status::data_loss(msg),
            ServiceError::Unimplemented(msg) => tonic::Status::unimplemented(msg),
            ServiceError::Internal(msg) => tonic::Status::internal(msg),
            ServiceError::NotLeader(leader) => {
                let text = ServiceError::NotLeader(leader.clone()).to_string();
                let mut status = tonic::Status::unavailable(text);
                if let Ok(value) = leader.parse() {
                    status.metadata_mut().insert(LEADER_HEADER, value);
                }
                status
            }
        }
    }
}

impl From<tonic::Status> for ServiceError {
    fn from(status: tonic::Status) -> Self {
        let msg = status.message().to_string();
        if let Some(leader) = status.metadata().get(LEADER_HEADER) {
            return ServiceError::NotLeader(leader.to_str().unwrap_or_default().to_string());
        }
        if status.code() == tonic::Code::Unavailable && msg.contains("does not lead its group") {
            return ServiceError::NotLeader(String::new());
        }
        match status.code() {
            tonic::Code::InvalidArgument => ServiceError::InvalidArgument(msg),
            tonic::Code::NotFound => ServiceError::NotFound(msg),
            tonic::Code::FailedPrecondition => ServiceError::FailedPrecondition(msg),
            tonic::Code::PermissionDenied => ServiceError::PermissionDenied(msg),
            tonic::Code::AlreadyExists => ServiceError::AlreadyExists(msg),
            tonic::Code::ResourceExhausted => ServiceError::ResourceExhausted(msg),
            tonic::Code::DataLoss => ServiceError::DataLoss(msg),
            tonic::Code::Unimplemented => ServiceError::Unimplemented(msg),
            // Our servers always answer with an explicit code: `Unknown` is
            // what the transport reports for a connection lost mid-call (a
            // storage node killed under a write), and `Aborted` a call the
            // peer gave up on. Both are worth trying again.
            tonic::Code::Unavailable
            | tonic::Code::Cancelled
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unknown
            | tonic::Code::Aborted => ServiceError::Unavailable(msg),
            _ => ServiceError::Internal(msg),
        }
    }
}

/// A transport-level failure talking to a remote component.
#[derive(Debug, thiserror::Error)]
#[error("cannot reach {endpoint}: {source}")]
pub struct RemoteError {
    pub endpoint: String,
    #[source]
    pub source: tonic::transport::Error,
}

#[cfg(test)]
mod tests {
    use super::ServiceError;

    #[test]
    fn only_unavailable_is_transient() {
        assert!(ServiceError::Unavailable("down".into()).is_transient());
        for permanent in [
            ServiceError::ResourceExhausted("disk full".into()),
            ServiceError::DataLoss("corrupt".into()),
            ServiceError::FailedPrecondition("stale epoch".into()),
            ServiceError::Internal("bug".into()),
        ] {
            assert!(!permanent.is_transient(), "{permanent}");
        }
    }

    #[test]
    fn kinds_survive_the_grpc_hop_both_ways() {
        for error in [
            ServiceError::InvalidArgument("a".into()),
            ServiceError::NotFound("b".into()),
            ServiceError::Unavailable("c".into()),
            ServiceError::FailedPrecondition("d".into()),
            ServiceError::PermissionDenied("e".into()),
            ServiceError::AlreadyExists("f".into()),
            ServiceError::ResourceExhausted("g".into()),
            ServiceError::DataLoss("h".into()),
            ServiceError::Unimplemented("i".into()),
            ServiceError::Internal("j".into()),
        ] {
            let back = ServiceError::from(tonic::Status::from(error.clone()));
            assert_eq!(back, error);
        }
    }

    #[test]
    fn transport_failures_are_transient() {
        for code in [
            tonic::Code::Unavailable,
            tonic::Code::DeadlineExceeded,
            tonic::Code::Cancelled,
            tonic::Code::Unknown,
        ] {
            let error = ServiceError::from(tonic::Status::new(code, "lost"));
            assert!(error.is_transient(), "{code:?}");
        }
    }
}
