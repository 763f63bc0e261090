//! A TCP proxy of the test's own, put between a node and PostgreSQL or Redis to make the network
//! misbehave: hold every byte for a while (a partition that heals: TCP retransmits, nothing is
//! lost, everything is late), let a request through and lose its reply (the write landed, the
//! caller never heard), or delay every byte (a slow link).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

/// A proxy forwarding `127.0.0.1:<port>` to a target address. Dropping it stops it and cuts its
/// connections.
pub struct Proxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
}

struct Shared {
    target: SocketAddr,
    /// `true` while held: no byte moves in either direction, new connections wait.
    held: watch::Sender<bool>,
    /// Replies still to lose: each one lost cuts its connection.
    lose_replies: AtomicU64,
    /// Replies lost so far.
    lost: AtomicU64,
    /// Microseconds each chunk spends on its way, in either direction.
    delay_us: AtomicU64,
    /// Every pump task, so that a cut can end them all.
    pumps: Mutex<Vec<AbortHandle>>,
}

impl Proxy {
    /// Starts a proxy to `target` (`host:port`).
    pub async fn start(target: &str) -> Self {
        let target = tokio::net::lookup_host(target)
            .await
            .expect("resolvable target")
            .next()
            .expect("an address");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let shared = Arc::new(Shared {
            target,
            held: watch::channel(false).0,
            lose_replies: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            delay_us: AtomicU64::new(0),
            pumps: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move { s.serve(client).await });
            }
        })
        .abort_handle();
        Self {
            addr,
            shared,
            accept,
        }
    }

    /// `url` with its host and port replaced by the proxy's (`postgres://u@h:5432/db?x` →
    /// `postgres://u@127.0.0.1:<port>/db?x`).
    pub fn url_for(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let user = authority
            .rsplit_once('@')
            .map(|(u, _)| format!("{u}@"))
            .unwrap_or_default();
        format!("{scheme}://{user}{}{path}", self.addr)
    }

    /// Holds every byte in both directions, and new connections, until [`Proxy::release`].
    pub fn hold(&self) {
        self.shared.held.send_replace(true);
    }

    /// Lets everything held go through, in order, and traffic flow again.
    pub fn release(&self) {
        self.shared.held.send_replace(false);
    }

    /// Cuts every open connection (both sides see it closed).
    pub fn cut(&self) {
        for p in self.shared.pumps.lock().unwrap().drain(..) {
            p.abort();
        }
    }

    /// Loses the next `n` replies: each time the server answers, the answer is dropped and that
    /// connection cut, after the request reached the server.
    pub fn lose_replies(&self, n: u64) {
        self.shared.lose_replies.store(n, Ordering::SeqCst);
    }

    /// Delays every chunk by `delay` in each direction (a round trip costs twice that), from
    /// the next chunk read on.
    pub fn delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).expect("a short delay");
        self.shared.delay_us.store(us, Ordering::SeqCst);
    }

    /// Replies lost so far.
    pub fn lost(&self) -> u64 {
        self.shared.lost.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

impl Shared {
    async fn serve(self: Arc<Self>, client: TcpStream) {
        self.wait_released().await;
        let Ok(server) = TcpStream::connect(self.target).await else {
            return;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (client_read, client_write) = client.into_split();
        let (server_read, server_write) = server.into_split();
        // Each pump ends its connection when it ends: aborting one half drops its halves, and
        // the other half sees the connection closed.
        let (done_tx, done_rx) = watch::channel(false);
        let up = tokio::spawn(self.clone().pump(
            client_read,
            server_write,
            false,
            done_tx.clone(),
            done_rx.clone(),
        ));
        let down =
            tokio::spawn(
                self.clone()
                    .pump(server_read, client_write, true, done_tx, done_rx),
            );
        self.pumps
            .lock()
            .unwrap()
            .extend([up.abort_handle(), down.abort_handle()]);
    }

    async fn wait_released(&self) {
        let mut held = self.held.subscribe();
        let _ = held.wait_for(|h| !*h).await;
    }

    /// Copies `from` to `to` until either side closes: each chunk read is sent on its way at
    /// once and written after the delay, in order, holding while held; `replies` marks the
    /// server-to-client direction, whose chunks may be lost.
    async fn pump(
        self: Arc<Self>,
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        replies: bool,
        done: watch::Sender<bool>,
        mut other_done: watch::Receiver<bool>,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let writer = async {
            while let Some((due, chunk)) = rx.recv().await {
                tokio::time::sleep_until(due.into()).await;
                self.wait_released().await;
                if replies
                    && self
                        .lose_replies
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                        .is_ok()
                {
                    self.lost.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                if to.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        };
        let shared = self.clone();
        let reader = async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = tokio::select! {
                    r = from.read(&mut buf) => match r {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    },
                    _ = other_done.wait_for(|d| *d) => return,
                };
                let delay = Duration::from_micros(shared.delay_us.load(Ordering::SeqCst));
                if tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
                {
                    return;
                }
            }
        };
        // The writer ends the pump: when it loses a reply or cannot write, or, once the reader
        // has ended (and dropped the sender), after writing everything read before the end.
        tokio::select! {
            () = writer => {}
            () = async {
                reader.await;
                std::future::pending::<()>().await;
            } => {}
        }
        let _ = done.send(true);
    }
}
