//! The operator panel in a real browser: headless Chromium, driven through chromedriver, logs
//! in with an operator token, reads the backlog figure, finds a quarantined event on the
//! dead-letters page, replays it through the confirm step, and the event id reaches its Redis
//! stream. Every page is captured at 1280×800 on the way; with `OUTPOST_SCREENSHOTS=<dir>` the
//! captures are written there as PNGs (the ones in `docs/panel/` come from this test).
//!
//! Needs Debian's `chromium` and `chromium-driver` (`scripts/test` installs them); without
//! them the test fails and says so.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use outpost::produce::EventFact;
use serde_json::json;
use support::{Deliveries, TestDb, TestRedis, relay_config, wait_until};

const WIDTH: u32 = 1280;
const HEIGHT: u32 = 800;

/// A binary on `PATH`, or a failure naming the Debian package that provides it.
fn required_binary(name: &str, package: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "`{name}` is not on PATH: install Debian's `{package}` package \
             (`apt-get install chromium chromium-driver`; scripts/test does it)"
        )
    })
}

/// chromedriver on a free local port, killed when dropped (also when the test panics).
struct Chromedriver {
    child: Child,
    url: String,
}

impl Chromedriver {
    fn start() -> Self {
        let bin = required_binary("chromedriver", "chromium-driver");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A headless Chromium session with a 1280×800 viewport.
async fn browser(driver: &Chromedriver) -> Client {
    let chromium = required_binary("chromium", "chromium");
    let caps: serde_json::Map<String, serde_json::Value> = serde_json::from_value(json!({
        "goog:chromeOptions": {
            "binary": chromium,
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-dev-shm-usage",
                "--disable-gpu",
                "--hide-scrollbars",
                format!("--window-size={WIDTH},{HEIGHT}"),
            ],
        }
    }))
    .unwrap();
    let mut builder = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new());
    builder.capabilities(caps);
    let session = std::sync::Arc::new(std::sync::Mutex::new(None));
    wait_until(30, "chromedriver to accept a session", || {
        let attempt = builder.connect(&driver.url);
        let session = session.clone();
        async move {
            let connected = attempt.await.ok();
            let ok = connected.is_some();
            *session.lock().unwrap() = connected;
            ok
        }
    })
    .await;
    let client = session.lock().unwrap().take().unwrap();
    // The window's size includes its frame: grow it by the frame so the page gets 1280×800.
    let frame = client
        .execute(
            "return [window.outerWidth - window.innerWidth, window.outerHeight - window.innerHeight]",
            vec![],
        )
        .await
        .unwrap();
    let extra = |i: usize| u32::try_from(frame[i].as_u64().unwrap()).unwrap();
    client
        .set_window_size(WIDTH + extra(0), HEIGHT + extra(1))
        .await
        .unwrap();
    client
}

/// Width and height from a PNG's header.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert_eq!(&png[1..4], b"PNG", "a PNG");
    let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

/// Captures the page at 1280×800 and, when asked to, keeps it as `<dir>/<name>.png`.
async fn capture(client: &Client, name: &str) {
    let png = client.screenshot().await.unwrap();
    assert_eq!(png_size(&png), (WIDTH, HEIGHT), "{name} at 1280x800");
    if let Some(dir) = std::env::var_os("OUTPOST_SCREENSHOTS") {
        let dir = Path::new(&dir);
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }
}

async fn text_of(client: &Client, css: &str) -> String {
    let found = client
        .wait()
        .at_most(Duration::from_secs(30))
        .for_element(Locator::Css(css))
        .await;
    match found {
        Ok(element) => element.text().await.unwrap(),
        Err(e) => panic!("{css} on {:?}: {e}", client.current_url().await),
    }
}

/// Waits until the element at `css` says `needle` (after a click the old page may still be
/// showing, or be replaced while read); returns its text.
async fn wait_for_text(client: &Client, css: &str, needle: &str) -> String {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    wait_until(30, &format!("{css} to say {needle:?}"), || {
        let (client, seen) = (client.clone(), seen.clone());
        async move {
            let text = match client.find(Locator::Css(css)).await {
                Ok(element) => element.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            let found = text.contains(needle);
            *seen.lock().unwrap() = text;
            found
        }
    })
    .await;
    seen.lock().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_logs_in_sees_the_backlog_and_replays_a_dead_letter_into_its_stream() {
    let driver = Chromedriver::start();
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let mut conn = redis.conn().await;
    let poisoned = support::poison_stream(&mut conn, &redis, "invoice").await;
    let mut ids = Vec::new();
    for n in 0..2 {
        let fact = EventFact::new("invoice", "inv-7", "invoice.issued", json!({"n": n}));
        ids.extend(support::commit_facts(&db.store, vec![fact]).await);
    }
    let node = support::start_node(relay_config(&db, &redis, "browser-node")).await;
    let base = format!("http://{}", node.admin_addr());
    support::wait_quarantined(&db, 1).await;
    let token = support::operator_token(&db, "ops-browser").await;
    let client = browser(&driver).await;

    // Log in with the token; the overview shows the backlog figure.
    client.goto(&format!("{base}/panel")).await.unwrap();
    let field = client
        .wait()
        .at_most(Duration::from_secs(30))
        .for_element(Locator::Css("#token"))
        .await
        .expect("an anonymous visit lands on the login form");
    field.send_keys(&token).await.unwrap();
    client
        .find(Locator::Css(
            "form[action='/panel/login'] button[type=submit]",
        ))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let backlog = text_of(&client, "#backlog").await;
    assert!(
        backlog.trim().parse::<u64>().is_ok(),
        "the backlog figure is a number: {backlog:?}"
    );
    capture(&client, "overview").await;

    for (path, name) in [
        ("/panel/partitions", "partitions"),
        ("/panel/events", "events"),
    ] {
        client.goto(&format!("{base}{path}")).await.unwrap();
        text_of(&client, "h1").await;
        capture(&client, name).await;
    }
    client
        .goto(&format!("{base}/panel/events/{}", ids[0]))
        .await
        .unwrap();
    let detail = text_of(&client, "main").await;
    assert!(detail.contains("WRONGTYPE"), "the last error: {detail}");
    capture(&client, "event").await;

    // The dead-letters page lists the quarantined event; select it and ask to replay it.
    client
        .goto(&format!("{base}/panel/dead-letters"))
        .await
        .unwrap();
    let row = format!("a[href='/panel/events/{}']", ids[0]);
    text_of(&client, &row).await;
    assert!(
        client
            .find(Locator::Css(&format!("a[href='/panel/events/{}']", ids[1])))
            .await
            .is_err(),
        "only the quarantined event is a dead letter, not its held successor"
    );
    capture(&client, "dead-letters").await;
    client
        .find(Locator::Css(&format!("input[name=id][value='{}']", ids[0])))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    client
        .find(Locator::Css("button[name=action][value=replay]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for_text(&client, "h1", "Replay 1 event(s)?").await;
    let reason = client.find(Locator::Css("#reason")).await.unwrap();
    capture(&client, "confirm").await;

    // The cause is fixed; confirming replays the event and it is published.
    let _: () = redis::cmd("DEL")
        .arg(&poisoned)
        .query_async(&mut conn)
        .await
        .unwrap();
    reason.send_keys("stream key repaired").await.unwrap();
    client
        .find(Locator::Css("button[name=confirm]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for_text(&client, "main", "Replayed 1 event(s)").await;
    wait_until(60, "the replayed event id in its Redis stream", || {
        let (mut c, prefix, id) = (conn.clone(), redis.prefix.clone(), ids[0].clone());
        async move { Deliveries::collect(&mut c, &prefix).await.copies.get(&id) == Some(&1) }
    })
    .await;

    client.goto(&format!("{base}/panel/audit")).await.unwrap();
    let audit = text_of(&client, "main").await;
    assert!(
        audit.contains("event.replay") && audit.contains("ops-browser"),
        "the replay is in the audit log: {audit}"
    );
    capture(&client, "audit").await;
    client.goto(&format!("{base}/panel/config")).await.unwrap();
    text_of(&client, "h1").await;
    capture(&client, "config").await;

    client.close().await.unwrap();
    node.shutdown().await;
    drop(driver);
}
