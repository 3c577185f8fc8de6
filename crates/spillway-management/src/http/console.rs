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

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::ApiError;

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

/// The console's files (its API calls are the HTTP API's own endpoints).
pub(super) fn router() -> Router {
    assets()
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
}
