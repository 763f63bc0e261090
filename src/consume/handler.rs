//! What the application supplies: a handler that applies one event inside the helper's
//! transaction, and says whether a failure is worth retrying.

use std::future::Future;

use sea_orm::{DatabaseTransaction, DbErr};

use super::Delivery;
use crate::store::{DbErrorKind, classify};

/// Applies one event. The helper has opened `txn` on the consumer's database and has already
/// checked that this is the aggregate's next event for the group; the handler writes its effects
/// through `txn` and returns. The helper then records the event in the inbox in the same
/// transaction, commits, and only then acknowledges the entry. The handler must not commit or
/// roll back `txn` itself.
///
/// Implement it with an `async fn`:
///
/// ```ignore
/// struct ApplyPayment;
///
/// impl Handler for ApplyPayment {
///     async fn handle(&self, event: &Delivery, txn: &DatabaseTransaction)
///         -> Result<(), HandlerError> {
///         let paid: OrderPaid = event.payload()?;
///         txn.execute_raw(/* UPDATE orders … */).await?;
///         Ok(())
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// Applies `event` through `txn`.
    fn handle<'a>(
        &'a self,
        event: &'a Delivery,
        txn: &'a DatabaseTransaction,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'a;
}

/// Why a handler did not apply an event, and what to do about it. The helper rolls the
/// transaction back either way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Worth another try (a dependency was down, a lock timed out). The helper delivers the
    /// event again after a back-off, and dead-letters it once the group has delivered it
    /// `max_deliveries` times.
    #[error("retry: {0}")]
    Retry(String),
    /// No retry will help (the payload does not decode, the schema version is unknown, a
    /// business rule refuses it). The helper dead-letters it at once.
    #[error("permanent: {0}")]
    Permanent(String),
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn retry(reason: impl std::fmt::Display) -> Self {
        HandlerError::Retry(reason.to_string())
    }

    /// A failure no retry will fix.
    pub fn permanent(reason: impl std::fmt::Display) -> Self {
        HandlerError::Permanent(reason.to_string())
    }

    /// The reason, without the decision.
    pub fn reason(&self) -> &str {
        match self {
            HandlerError::Retry(r) | HandlerError::Permanent(r) => r,
        }
    }
}

/// A database error inside a handler: a row the database refuses (constraint, bad value) is
/// permanent; anything else (connection, deadlock, timeout) is worth a retry.
impl From<DbErr> for HandlerError {
    fn from(err: DbErr) -> Self {
        match classify(&err) {
            DbErrorKind::InvalidRow(_) | DbErrorKind::UniqueViolation(_) => {
                HandlerError::permanent(err)
            }
            _ => HandlerError::retry(err),
        }
    }
}
