//! The web console: a few static files (HTML, JavaScript, CSS, written by
//! hand in `crates/spillway-management/console/`, no build step) embedded
//! in the binary and served at `/` and `/console/{file}`, and the one
//! endpoint the console needs that RabbitMQ's API has no counterpart for,
//! `POST /api/queues/{vhost}/{name}/move` (the gRPC `MoveMessages`).
//!
//! The static files need no credentials: they hold no data. The console's
//! JavaScript asks the `/api/...` endpoints for everything, with the user's
//! HTTP Basic credentials, so it can show and do no more than the user may
//! over the API. Every console response carries a Content-Security-Policy
//! that allows only this origin's scripts and styles (no inline script), and
//! forbids framing.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use spillway_proto::management::management_server::Management;
use spillway_proto::management::{self as m};

use super::handlers::{call, Who};
use super::{ApiError, HttpApi};

/// The console's files: name under `/console/`, content type, content.
const ASSETS: [(&str, &str, &str); 7] = [
    ("app.js", JAVASCRIPT, include_str!("../../console/app.js")),
    ("api.js", JAVASCRIPT, include_str!("../../console/api.js")),
    ("dom.js", JAVASCRIPT, include_str!("../../console/dom.js")),
    (
        "charts.js",
        JAVASCRIPT,
        include_str!("../../console/charts.js"),
    ),
    (
        "pages.js",
        JAVASCRIPT,
        include_str!("../../console/pages.js"),
    ),
    ("style.css", CSS, include_str!("../../console/style.css")),
    (
        "favicon.svg",
        SVG,
        include_str!("../../console/favicon.svg"),
    ),
];

const INDEX_HTML: &str = include_str!("../../console/index.html");

const JAVASCRIPT: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const SVG: &str = "image/svg+xml";
const HTML: &str = "text/html; charset=utf-8";

/// Only this origin's files and API; SVG drawn by the scripts is part of
/// the document, so nothing else is needed.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// The console's routes and the move endpoint.
pub(super) fn router(api: Arc<HttpApi>) -> Router {
    Router::new()
        .route("/api/queues/{vhost}/{name}/move", post(move_messages))
        .with_state(api)
        .merge(assets())
}

/// The static files alone (no state: they need no service).
fn assets() -> Router {
    Router::new()
        .route("/", get(|| async { page(HTML, INDEX_HTML) }))
        .route("/console/{file}", get(asset))
}

async fn asset(Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|(name, _, _)| *name == file) {
        Some((_, content_type, content)) => page(content_type, content),
        None => ApiError::not_found().into_response(),
    }
}

/// One static file with the console's security headers. `no-cache`: the
/// browser revalidates, so a new broker version's files are used at once.
fn page(content_type: &'static str, content: &'static str) -> Response {
    let mut response = (StatusCode::OK, content).into_response();
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_TYPE, content_type),
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-cache"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// The body of a move: the destination queue (same vhost) and how many
/// ready messages at most (absent or 0: all of them).
#[derive(Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct MoveOrder {
    destination: String,
    #[serde(default)]
    count: Option<u64>,
}

impl MoveOrder {
    fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let order: MoveOrder = serde_json::from_slice(bytes).map_err(|error| {
            ApiError::bad_request(format!(
                "the body must be {{\"destination\": QUEUE, \"count\": N}}: {error}"
            ))
        })?;
        if order.destination.is_empty() {
            return Err(ApiError::bad_request("'destination' must name a queue"));
        }
        Ok(order)
    }
}

/// `POST /api/queues/{vhost}/{name}/move`: moves ready messages, from the
/// head, to another queue of the vhost through the gRPC `MoveMessages`
/// with the caller attached, so its checks apply (read on the source,
/// write on the destination). Answers `{"moved", "remaining",
/// "stopped_reason"}`.
async fn move_messages(
    State(api): State<Arc<HttpApi>>,
    Who(caller): Who,
    Path((vhost, source)): Path<(String, String)>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let order = MoveOrder::parse(&bytes)?;
    let request = m::MoveMessagesRequest {
        vhost,
        source,
        destination: order.destination,
        max_messages: order.count.unwrap_or(0),
    };
    let answer = api
        .service
        .move_messages(call(&caller, request))
        .await?
        .into_inner();
    Ok(Json(json!({
        "moved": answer.moved,
        "remaining": answer.remaining,
        "stopped_reason": answer.stopped_reason,
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use axum::body::{to_bytes, Body};
    use axum::http::Request;
    use tower::ServiceExt;

    use super::*;

    async fn get(path: &str) -> (StatusCode, axum::http::HeaderMap, String) {
        let request = Request::get(path).body(Body::empty()).unwrap();
        let response = assets().oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let body = to_bytes(body, usize::MAX).await.unwrap();
        (
            parts.status,
            parts.headers,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn the_index_is_html_with_the_security_headers() {
        let (status, headers, body) = get("/").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers[header::CONTENT_TYPE], HTML);
        let csp = headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(csp.contains("script-src 'self'"), "{csp}");
        assert!(!csp.contains("unsafe"), "{csp}");
        assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert_eq!(headers[header::X_FRAME_OPTIONS], "DENY");
        assert!(body.starts_with("<!doctype html>"), "{body}");
        // No inline script: the CSP would refuse it.
        assert!(body.contains(r#"<script type="module" src="/console/app.js"></script>"#));
        assert_eq!(body.matches("<script").count(), 1);
    }

    #[tokio::test]
    async fn every_file_the_pages_name_is_served() {
        for (name, content_type, _) in ASSETS {
            let (status, headers, body) = get(&format!("/console/{name}")).await;
            assert_eq!(status, StatusCode::OK, "{name}");
            assert_eq!(headers[header::CONTENT_TYPE], content_type, "{name}");
            assert!(headers.contains_key(header::CONTENT_SECURITY_POLICY));
            assert!(!body.is_empty(), "{name}");
        }
        // Every module a script imports (`... from './x.js';`) is one of the files.
        let mut imports = 0;
        for (name, _, content) in ASSETS {
            for rest in content.split(" from './").skip(1) {
                let file = rest.split('\'').next().unwrap_or_default();
                assert!(
                    ASSETS.iter().any(|(asset, _, _)| *asset == file),
                    "{name} imports {file}, which is not served"
                );
                imports += 1;
            }
        }
        assert!(imports >= 4, "{imports}");
        for missing in ["/console/nope.js", "/console/..%2Fapp.js", "/console/"] {
            let (status, _, _) = get(missing).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{missing}");
        }
    }

    #[test]
    fn a_move_names_its_destination() {
        let order = MoveOrder::parse(br#"{"destination": "b", "count": 5}"#).unwrap();
        assert_eq!(
            order,
            MoveOrder {
                destination: "b".into(),
                count: Some(5)
            }
        );
        assert_eq!(
            MoveOrder::parse(br#"{"destination": "b"}"#).unwrap().count,
            None
        );
        for bad in [
            &br#"{"destination": ""}"#[..],
            br#"{"count": 1}"#,
            br#"{"destination": "b", "count": -1}"#,
            br#"{"destination": "b", "max": 1}"#,
            b"[]",
            b"not json",
        ] {
            assert!(
                MoveOrder::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
