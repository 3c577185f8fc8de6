//! One mapping between Spillway's service errors and gRPC statuses, used by
//! every tonic server and client in the workspace.

/// An error a component returns across a service boundary.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// A call whose feature is not built yet.
    #[error("unimplemented: {0}")]
    Unimplemented(String),
    #[error("internal error: {0}")]
    Internal(String),
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
            ServiceError::Unimplemented(msg) => tonic::Status::unimplemented(msg),
            ServiceError::Internal(msg) => tonic::Status::internal(msg),
        }
    }
}

impl From<tonic::Status> for ServiceError {
    fn from(status: tonic::Status) -> Self {
        let msg = status.message().to_string();
        match status.code() {
            tonic::Code::InvalidArgument => ServiceError::InvalidArgument(msg),
            tonic::Code::NotFound => ServiceError::NotFound(msg),
            tonic::Code::FailedPrecondition => ServiceError::FailedPrecondition(msg),
            tonic::Code::PermissionDenied => ServiceError::PermissionDenied(msg),
            tonic::Code::AlreadyExists => ServiceError::AlreadyExists(msg),
            tonic::Code::Unimplemented => ServiceError::Unimplemented(msg),
            tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => {
                ServiceError::Unavailable(msg)
            }
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
