//! A small HTTP client for the admin endpoint's tests: raw HTTP/1.0 requests, and a panel log-in.

use std::collections::HashMap;

/// An answer: status, headers (names lowercased) and body.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: String,
}

/// One HTTP/1.0 request with headers and a body of a content type.
pub async fn call_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<(&str, &str)>,
) -> Resp {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.map(|(kind, b)| {
        req.push_str(&format!(
            "Content-Type: {kind}\r\nContent-Length: {}\r\n",
            b.len()
        ));
        b
    });
    req.push_str("\r\n");
    req.push_str(body.unwrap_or(""));
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Resp {
        status,
        headers,
        body: body.to_owned(),
    }
}

pub const FORM: &str = "application/x-www-form-urlencoded";

/// Logs in to the panel with `token`: the session cookie and the CSRF token of its pages.
pub async fn panel_login(addr: &str, token: &str) -> Option<(String, String)> {
    let origin = format!("http://{addr}");
    let r = call_with(
        addr,
        "POST",
        "/panel/login",
        &[("Origin", &origin)],
        Some((FORM, &format!("token={token}"))),
    )
    .await;
    if r.status != 303 {
        return None;
    }
    let set = r.headers.get("set-cookie")?;
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    let cookie = set.split(';').next()?.to_owned();
    let page = call_with(addr, "GET", "/panel", &[("Cookie", &cookie)], None).await;
    let csrf = page
        .body
        .split("name=\"csrf\" value=\"")
        .nth(1)?
        .split('"')
        .next()?
        .to_owned();
    Some((cookie, csrf))
}
