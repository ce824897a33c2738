//! Who may talk to the HTTP gateway. A TCP port on loopback is reachable by
//! every local user and, through the browser, by any web page: a page can
//! POST to `http://127.0.0.1:PORT` (a "simple" `text/plain` request needs no
//! CORS preflight), and with DNS rebinding it can read the answers too.
//!
//! So every request must name the gateway itself in `Host` (a rebound name
//! does not), a cross-site `Origin` is refused unless the settings allow it,
//! request bodies must be `application/json` (which a page cannot send
//! without a preflight; OpenAI's audio uploads are `multipart/form-data`,
//! which a page can send, so those two paths rest on the `Origin` check,
//! which every browser's cross-site POST carries), and with `http_token` set, `Authorization: Bearer`
//! (or `x-api-key`, as the Anthropic SDK and Claude Code send it) must carry
//! it (the only thing that keeps other local users out).

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;

/// The gateway's access policy.
#[derive(Debug, Clone)]
pub struct Guard {
    /// `Host` values that name this gateway (lower case).
    hosts: Vec<String>,
    /// Origins allowed besides the gateway's own.
    allowed_origins: Vec<String>,
    token: Option<String>,
}

impl Guard {
    /// The policy for a gateway listening on `addr`.
    pub fn new(addr: SocketAddr, token: Option<String>, allowed_origins: Vec<String>) -> Self {
        let port = addr.port();
        let mut hosts = vec![format!("localhost:{port}"), format!("127.0.0.1:{port}"), format!("[::1]:{port}")];
        let own = match addr {
            SocketAddr::V4(a) => format!("{}:{port}", a.ip()),
            SocketAddr::V6(a) => format!("[{}]:{port}", a.ip()),
        };
        if !hosts.contains(&own) {
            hosts.push(own);
        }
        let allowed_origins =
            allowed_origins.into_iter().map(|o| o.trim_end_matches('/').to_ascii_lowercase()).collect();
        Self { hosts, allowed_origins, token }
    }

    fn host_ok(&self, headers: &HeaderMap) -> bool {
        let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else { return false };
        self.hosts.contains(&host.to_ascii_lowercase())
    }

    /// The request's `Origin`, when it is a cross-site one that is allowed;
    /// `Err` when it is cross-site and not allowed.
    fn origin(&self, headers: &HeaderMap) -> Result<Option<HeaderValue>, ()> {
        let Some(value) = headers.get(header::ORIGIN) else { return Ok(None) };
        let origin = value.to_str().map_err(|_| ())?.trim_end_matches('/').to_ascii_lowercase();
        let same_site = ["http://", "https://"]
            .iter()
            .any(|scheme| origin.strip_prefix(scheme).is_some_and(|h| self.hosts.iter().any(|own| own == h)));
        if same_site {
            Ok(None)
        } else if self.allowed_origins.iter().any(|o| o == "*" || *o == origin) {
            Ok(Some(value.clone()))
        } else {
            Err(())
        }
    }

    fn token_ok(&self, headers: &HeaderMap) -> bool {
        let Some(want) = &self.token else { return true };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        let api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok()).unwrap_or("");
        // Both are compared (no early exit on the first).
        let by_bearer = constant_time_eq(bearer.trim().as_bytes(), want.as_bytes());
        let by_key = constant_time_eq(api_key.trim().as_bytes(), want.as_bytes());
        by_bearer | by_key
    }
}

/// Compares without an early exit, so timing does not reveal a prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn refuse(status: StatusCode, message: &str) -> Response {
    let kind = match status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        _ => "invalid_request_error",
    };
    (status, Json(json!({"error": {"message": message, "type": kind}}))).into_response()
}

/// The middleware: checks every request before any handler runs.
pub async fn check(State(guard): State<Arc<Guard>>, request: Request<Body>, next: Next) -> Response {
    let headers = request.headers();
    if !guard.host_ok(headers) {
        return refuse(
            StatusCode::FORBIDDEN,
            "the Host header must name this gateway (localhost or a loopback address, with its port)",
        );
    }
    let allowed_origin = match guard.origin(headers) {
        Ok(o) => o,
        Err(()) => {
            return refuse(
                StatusCode::FORBIDDEN,
                "cross-site requests are refused; add the page's origin to http_allowed_origins in config.toml",
            )
        }
    };
    let cors = |mut r: Response| {
        if let Some(origin) = &allowed_origin {
            let h = r.headers_mut();
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
            h.insert(header::VARY, HeaderValue::from_static("Origin"));
        }
        r
    };
    if request.method() == Method::OPTIONS {
        // A CORS preflight from an allowed origin (others were refused above).
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type, x-api-key, anthropic-version"),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
        return cors(r);
    }
    if !guard.token_ok(headers) {
        return cors(refuse(StatusCode::UNAUTHORIZED, "missing or wrong bearer token (http_token in config.toml)"));
    }
    if request.method() == Method::POST {
        let kind = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|v| v.trim().to_ascii_lowercase())
            .unwrap_or_default();
        let upload = request.uri().path().starts_with("/v1/audio/");
        if upload && kind != "multipart/form-data" {
            return cors(refuse(StatusCode::UNSUPPORTED_MEDIA_TYPE, "audio uploads must be multipart/form-data"));
        }
        if !upload && kind != "application/json" {
            return cors(refuse(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "request bodies must be Content-Type: application/json",
            ));
        }
    }
    cors(next.run(request).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn hosts_origins_and_tokens() {
        let g = Guard::new(
            "127.0.0.1:11435".parse().unwrap(),
            Some("s3cret".into()),
            vec!["http://localhost:3000/".into()],
        );
        assert!(g.host_ok(&headers(&[(header::HOST, "127.0.0.1:11435")])));
        assert!(g.host_ok(&headers(&[(header::HOST, "LOCALHOST:11435")])));
        assert!(!g.host_ok(&headers(&[(header::HOST, "evil.example:11435")])), "a rebound name");
        assert!(!g.host_ok(&headers(&[(header::HOST, "localhost:80")])));
        assert!(!g.host_ok(&HeaderMap::new()));
        assert_eq!(g.origin(&headers(&[(header::ORIGIN, "http://127.0.0.1:11435")])), Ok(None));
        assert!(g.origin(&headers(&[(header::ORIGIN, "https://evil.example")])).is_err());
        assert!(g.origin(&headers(&[(header::ORIGIN, "null")])).is_err());
        assert!(g.origin(&headers(&[(header::ORIGIN, "http://localhost:3000")])).unwrap().is_some());
        assert!(g.token_ok(&headers(&[(header::AUTHORIZATION, "Bearer s3cret")])));
        assert!(!g.token_ok(&headers(&[(header::AUTHORIZATION, "Bearer s3cre")])));
        assert!(!g.token_ok(&HeaderMap::new()));
        assert!(g.token_ok(&headers(&[(header::HeaderName::from_static("x-api-key"), "s3cret")])));
        assert!(!g.token_ok(&headers(&[(header::HeaderName::from_static("x-api-key"), "s3cre")])));
    }
}
