//! The wake-up channel: `LISTEN outpost_wakeup`.
//!
//! Producers NOTIFY only while some node has asked for it (`outpost_node.wants_nudge`), once per
//! partition a transaction wrote to, with the partition as the payload (schemas before migration
//! `000007` sent a comma-separated list per statement; both parse). A nudge may be missed
//! (connection loss); callers must also poll on a schedule.

use sea_orm::sqlx::postgres::PgListener;

use super::StoreError;

/// The channel name the insert trigger notifies.
pub const WAKEUP_CHANNEL: &str = "outpost_wakeup";

/// What a wait on the channel produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Nudge {
    /// Rows were committed to these partitions.
    Partitions(Vec<i32>),
    /// The connection was lost and re-established: nudges may have been missed, so every
    /// partition should be checked.
    MaybeMissed,
}

/// A dedicated connection listening for nudges.
#[derive(Debug)]
pub struct NudgeListener {
    inner: PgListener,
}

impl NudgeListener {
    /// Opens a connection and starts listening.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let mut inner = PgListener::connect(url).await.map_err(listen_err)?;
        inner.listen(WAKEUP_CHANNEL).await.map_err(listen_err)?;
        Ok(Self { inner })
    }

    /// Waits for the next nudge. Reconnects by itself after a connection loss, reporting
    /// [`Nudge::MaybeMissed`]; an error means the database is unreachable.
    pub async fn recv(&mut self) -> Result<Nudge, StoreError> {
        match self.inner.try_recv().await.map_err(listen_err)? {
            Some(n) => Ok(Nudge::Partitions(parse_partitions(n.payload()))),
            None => Ok(Nudge::MaybeMissed),
        }
    }
}

fn parse_partitions(payload: &str) -> Vec<i32> {
    payload
        .split(',')
        .filter_map(|p| p.trim().parse().ok())
        .collect()
}

fn listen_err(e: sea_orm::sqlx::Error) -> StoreError {
    StoreError::Unavailable(format!("listening for nudges: {e}"))
}

#[cfg(test)]
mod tests {
    use super::parse_partitions;

    #[test]
    fn payloads() {
        assert_eq!(parse_partitions("1,5,63"), vec![1, 5, 63]);
        assert_eq!(parse_partitions(""), Vec::<i32>::new());
        assert_eq!(parse_partitions("x,2"), vec![2]);
    }
}
