//! What keeps another web site from using the HTTP API through an
//! operator's browser (cross-site request forgery), checked on every
//! request before its credentials are looked at:
//!
//! - **Where a browser says it comes from.** A request to `/api/...`, and
//!   any request that may change something (every method but `GET`,
//!   `HEAD` and `OPTIONS`), is refused with `403` when the browser marks it
//!   as coming from another site: `Sec-Fetch-Site` other than
//!   `same-origin` or `none` (`same-site` too: another port or subdomain of
//!   the same site is another origin), or, without `Sec-Fetch-Site` (plain
//!   HTTP to another host than loopback, older browsers), an `Origin` that
//!   is `null` or names another host and port than the request's `Host`.
//!   Tools that are not browsers (curl, `rabbitmqadmin`, client libraries,
//!   KEDA, Flower) send neither header and are not affected. The console's
//!   pages (`/`, `/console/...`) may still be opened from a link.
//! - **What a body is.** A request that may change something and names a
//!   content type must name JSON (`Content-Type: application/json`, with
//!   parameters such as `charset` allowed), even when it has no body:
//!   `415` otherwise, as RabbitMQ answers a body it cannot read. An HTML
//!   form can send only `text/plain`, `application/x-www-form-urlencoded`
//!   and `multipart/form-data` without the browser asking first, so a form
//!   on another site cannot reach a handler with a body it would read. A
//!   body without any content type is read as JSON only from a tool that
//!   is not a browser (no `Origin`, no `Sec-Fetch-*`): pyrabbit2's
//!   `publish` sends none, and RabbitMQ accepts it; a browser's `fetch`
//!   can send one without a type and without asking first.
//!
//! This does not decide who the caller is (that is [`super::caller_of`])
//! nor what it may do; it only turns away requests that a browser made on
//! another site's behalf.

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;

/// The middleware: refuses cross-site requests (403) and state-changing
/// requests whose body is not JSON (415), before any handler runs.
pub(super) async fn refuse_cross_site(request: Request, next: Next) -> Response {
    let changes = changes_state(request.method());
    let api = request.uri().path().starts_with("/api/");
    if changes || api {
        if let Err(reason) = same_origin(request.headers()) {
            tracing::debug!(
                method = %request.method(),
                path = %request.uri().path(),
                reason,
                "cross-site management http request refused"
            );
            return ApiError {
                status: StatusCode::FORBIDDEN,
                error: "forbidden",
                reason: format!("cross-site request refused: {reason}"),
            }
            .into_response();
        }
    }
    if changes {
        if let Err(reason) = json_body(request.headers()) {
            return ApiError {
                status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
                error: "unsupported_media_type",
                reason,
            }
            .into_response();
        }
    }
    next.run(request).await
}

/// Every method but the safe ones may change something.
fn changes_state(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Whether the request comes from a page of this origin, or from no page at
/// all (a tool that is not a browser); `Err` says why not.
fn same_origin(headers: &HeaderMap) -> Result<(), &'static str> {
    // Browsers that send it compute it themselves: it is the surest sign.
    if let Some(site) = headers.get("sec-fetch-site") {
        return match site.as_bytes() {
            b"same-origin" | b"none" => Ok(()),
            _ => Err("Sec-Fetch-Site is not same-origin"),
        };
    }
    let Some(origin) = headers.get(header::ORIGIN) else {
        return Ok(());
    };
    let origin = origin.to_str().map_err(|_| "the Origin is not text")?;
    if origin == "null" {
        return Err("the Origin is null");
    }
    let Some((scheme, origin_host)) = origin.split_once("://") else {
        return Err("the Origin is not scheme://host");
    };
    let host = headers
        .get(header::HOST)
        .and_then(|host| host.to_str().ok())
        .ok_or("the request names no Host")?;
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" => "80",
        "https" => "443",
        _ => return Err("the Origin is not http or https"),
    };
    if authority(origin_host, default_port) != authority(host, default_port) {
        return Err("the Origin is another host or port than the Host");
    }
    Ok(())
}

/// `host[:port]` as (lowercase host, port), the port defaulting to the
/// scheme's (`Origin` leaves the default port out, `Host` usually does).
fn authority(text: &str, default_port: &str) -> (String, String) {
    let text = text.trim().to_ascii_lowercase();
    // An IPv6 literal is bracketed: its colons are not a port's.
    let port_at = match text.rfind(']') {
        Some(end) => text[end..].find(':').map(|at| end + at),
        None => text.rfind(':'),
    };
    match port_at {
        Some(at) => (text[..at].to_string(), text[at + 1..].to_string()),
        None => (text, default_port.to_string()),
    }
}

/// A body, if any, is JSON; `Err` is the reason of the 415.
fn json_body(headers: &HeaderMap) -> Result<(), String> {
    let Some(content_type) = headers.get(header::CONTENT_TYPE) else {
        if has_body(headers) && from_a_browser(headers) {
            return Err("a request body must be JSON: send Content-Type: application/json".into());
        }
        return Ok(());
    };
    let essence = content_type
        .to_str()
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim();
    if essence.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    Err(format!(
        "unsupported content type '{}': request bodies are application/json",
        String::from_utf8_lossy(content_type.as_bytes())
    ))
}

/// Browsers send these on every request that may change something; tools
/// do not.
fn from_a_browser(headers: &HeaderMap) -> bool {
    headers.contains_key(header::ORIGIN)
        || headers.contains_key("sec-fetch-site")
        || headers.contains_key("sec-fetch-mode")
}

/// A body follows the head: a non-zero length, or chunks.
fn has_body(headers: &HeaderMap) -> bool {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        return true;
    }
    headers
        .get(header::CONTENT_LENGTH)
        .is_some_and(|length| length.as_bytes() != b"0")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use axum::http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn only_this_origin_or_no_browser_at_all_is_let_in() {
        for allowed in [
            headers(&[("host", "localhost:15672")]),
            headers(&[
                ("host", "localhost:15672"),
                ("origin", "http://localhost:15672"),
            ]),
            headers(&[
                ("host", "Broker.Example:443"),
                ("origin", "https://broker.example"),
            ]),
            headers(&[
                ("host", "broker.example"),
                ("origin", "http://broker.example:80"),
            ]),
            headers(&[("host", "[::1]:15672"), ("origin", "http://[::1]:15672")]),
            headers(&[
                ("sec-fetch-site", "same-origin"),
                ("origin", "http://proxy"),
            ]),
            headers(&[("sec-fetch-site", "none")]),
        ] {
            assert!(same_origin(&allowed).is_ok(), "{allowed:?}");
        }
        for refused in [
            headers(&[
                ("host", "localhost:15672"),
                ("origin", "http://evil.example"),
            ]),
            headers(&[("host", "localhost:15672"), ("origin", "null")]),
            headers(&[
                ("host", "localhost:15672"),
                ("origin", "http://localhost:8080"),
            ]),
            headers(&[("host", "localhost:15672"), ("origin", "http://localhost")]),
            headers(&[("host", "[::1]:15672"), ("origin", "http://[::1]")]),
            headers(&[("host", "localhost"), ("origin", "file://")]),
            headers(&[("origin", "http://localhost")]),
            headers(&[
                ("host", "localhost:15672"),
                ("sec-fetch-site", "cross-site"),
            ]),
            headers(&[("host", "localhost:15672"), ("sec-fetch-site", "same-site")]),
            headers(&[
                ("host", "localhost:15672"),
                ("origin", "http://localhost:15672"),
                ("sec-fetch-site", "cross-site"),
            ]),
        ] {
            assert!(same_origin(&refused).is_err(), "{refused:?}");
        }
    }

    #[test]
    fn a_body_says_it_is_json() {
        for allowed in [
            headers(&[]),
            headers(&[("content-length", "0")]),
            headers(&[("content-type", "application/json")]),
            headers(&[("content-type", "Application/JSON; charset=utf-8")]),
            headers(&[
                ("content-type", "application/json"),
                ("content-length", "2"),
            ]),
            // pyrabbit2's publish: a JSON body without a type, not a browser.
            headers(&[("content-length", "2")]),
        ] {
            assert!(json_body(&allowed).is_ok(), "{allowed:?}");
        }
        for refused in [
            headers(&[("content-length", "2"), ("origin", "http://localhost")]),
            headers(&[
                ("transfer-encoding", "chunked"),
                ("sec-fetch-mode", "no-cors"),
            ]),
            headers(&[("content-length", "2"), ("sec-fetch-site", "same-origin")]),
            headers(&[("content-type", "text/plain"), ("content-length", "0")]),
            headers(&[("content-type", "text/plain;charset=UTF-8")]),
            headers(&[("content-type", "application/x-www-form-urlencoded")]),
            headers(&[("content-type", "multipart/form-data; boundary=x")]),
            headers(&[("content-type", "application/jsonp")]),
        ] {
            assert!(json_body(&refused).is_err(), "{refused:?}");
        }
    }
}
