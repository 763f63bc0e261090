//! Who did what: roles, the actor of an operator action, and the audit log.
//!
//! Every mutating operator action writes one row to `outpost_audit` in the transaction of the
//! change itself, so the log holds an action exactly when the change committed. A refused attempt
//! changes nothing and writes no row; it is logged (`WARN`) and counted in
//! `outpost_admin_refused_total` by [`refuse`].

use chrono::{DateTime, Utc};
use sea_orm::ConnectionTrait;
use serde::{Deserialize, Serialize};

use super::super::{Store, StoreError, stmt};

/// What an identity may do. Each role can do everything the ones before it can.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads: status, events, dead letters, the audit log, the configuration.
    Viewer,
    /// Also replays and discards events, pauses and resumes partitions.
    Operator,
    /// Also creates, lists and revokes tokens.
    Admin,
}

impl Role {
    /// The role's name, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "viewer" => Ok(Role::Viewer),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            other => Err(format!(
                "unknown role {other:?}: use viewer, operator or admin"
            )),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The identity an operator action is done as: who (a token's name, or `cli:user@host`) and
/// with which role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// Who, as written to the audit log.
    pub name: String,
    /// What they may do.
    pub role: Role,
}

impl Actor {
    /// Someone with `role`.
    pub fn new(name: impl Into<String>, role: Role) -> Self {
        Self {
            name: name.into(),
            role,
        }
    }

    /// `Ok` when the actor's role allows `action` (which needs `needed`); otherwise the refusal,
    /// logged and counted.
    pub fn require(&self, needed: Role, action: &str) -> Result<(), StoreError> {
        if self.role >= needed {
            Ok(())
        } else {
            Err(refuse(
                self,
                action,
                "role",
                format!(
                    "{action} needs the {needed} role; {} has the {} role",
                    self.name, self.role
                ),
            ))
        }
    }
}

/// Logs and counts a refused operator action and returns the error to give back. `kind` is a
/// metric label (a fixed word: `role`, `state`, `count`, `input`, `not_found`).
pub fn refuse(actor: &Actor, action: &str, kind: &'static str, message: String) -> StoreError {
    tracing::warn!(
        actor = %actor.name,
        role = %actor.role,
        action,
        reason = kind,
        "operator action refused: {message}"
    );
    metrics::counter!(crate::metrics::ADMIN_REFUSED, "action" => action.to_owned(), "reason" => kind)
        .increment(1);
    StoreError::Refused { kind, message }
}

/// One row of the audit log.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditEntry {
    /// Position in the log (newest highest).
    pub id: i64,
    /// When the change committed (database clock).
    pub at: DateTime<Utc>,
    /// Who.
    pub actor: String,
    /// With which role.
    pub role: String,
    /// What: `event.replay`, `event.discard`, `partition.pause`, `partition.resume`,
    /// `token.create`, `token.revoke`.
    pub action: String,
    /// On what (partitions, a token's name; empty when the detail says it).
    pub target: String,
    /// The rest: ids or filter, count, reason.
    pub detail: serde_json::Value,
}

/// Writes one audit row on `conn`, which must be the transaction of the change.
pub(in crate::store) async fn record<C: ConnectionTrait>(
    conn: &C,
    actor: &Actor,
    action: &str,
    target: &str,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    conn.execute_raw(stmt(
        "INSERT INTO outpost_audit (actor, role, action, target, detail) \
         VALUES ($1, $2, $3, $4, $5)",
        [
            actor.name.clone().into(),
            actor.role.as_str().into(),
            action.into(),
            target.into(),
            detail.into(),
        ],
    ))
    .await
    .map_err(StoreError::from_db)?;
    Ok(())
}

/// Which part of the audit log to read: newest first, `limit` rows older than `before` (the
/// `id` of the last row of the previous page).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AuditQuery {
    /// Only this action.
    pub action: Option<String>,
    /// Only this actor.
    pub actor: Option<String>,
    /// Rows with a smaller id than this.
    pub before: Option<i64>,
    /// Page size (1 to 1,000; 50 when unset).
    pub limit: Option<u32>,
}

impl Store {
    /// A page of the audit log, newest first, read through its primary key.
    pub async fn audit_log(&self, q: &AuditQuery) -> Result<Vec<AuditEntry>, StoreError> {
        let limit = i64::from(q.limit.unwrap_or(50).clamp(1, 1000));
        let mut sql = "SELECT id, at, actor, role, action, target, detail FROM outpost_audit \
                       WHERE true"
            .to_owned();
        let mut values: Vec<sea_orm::Value> = Vec::new();
        let mut bind = |sql: &mut String, clause: &str, v: sea_orm::Value| {
            values.push(v);
            sql.push_str(&clause.replace('?', &format!("${}", values.len())));
        };
        if let Some(a) = &q.action {
            bind(&mut sql, " AND action = ?", a.clone().into());
        }
        if let Some(a) = &q.actor {
            bind(&mut sql, " AND actor = ?", a.clone().into());
        }
        if let Some(b) = q.before {
            bind(&mut sql, " AND id < ?", b.into());
        }
        bind(&mut sql, " ORDER BY id DESC LIMIT ?", limit.into());
        self.connection()
            .query_all_raw(stmt(&sql, values))
            .await
            .map_err(StoreError::from_db)?
            .into_iter()
            .map(|r| {
                let g = StoreError::from_db;
                Ok(AuditEntry {
                    id: r.try_get_by_index(0).map_err(g)?,
                    at: r.try_get_by_index(1).map_err(g)?,
                    actor: r.try_get_by_index(2).map_err(g)?,
                    role: r.try_get_by_index(3).map_err(g)?,
                    action: r.try_get_by_index(4).map_err(g)?,
                    target: r.try_get_by_index(5).map_err(g)?,
                    detail: r.try_get_by_index(6).map_err(g)?,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn roles_are_ordered_and_parse_their_names_only() {
        assert!(Role::Viewer < Role::Operator && Role::Operator < Role::Admin);
        for r in [Role::Viewer, Role::Operator, Role::Admin] {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
        }
        assert!(
            "root"
                .parse::<Role>()
                .unwrap_err()
                .contains("viewer, operator or admin")
        );
        let viewer = Actor::new("v", Role::Viewer);
        assert!(viewer.require(Role::Viewer, "event.search").is_ok());
        assert!(matches!(
            viewer.require(Role::Operator, "event.replay"),
            Err(StoreError::Refused { kind: "role", .. })
        ));
    }
}
