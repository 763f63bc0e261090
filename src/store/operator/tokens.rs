//! API tokens: an identity with a role. A token is `opk_<id>_<secret>`, the secret 32 random
//! bytes in unpadded base64url; only the SHA-256 of the secret is stored, and a presented token is
//! checked by comparing the hashes in constant time. Created, listed and revoked by admins, each
//! change audited in its transaction. A revoked token keeps its row for the audit log.

use base64::Engine as _;
use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait, TransactionTrait};
use serde::Serialize;
use serde_json::json;
use sha2::Digest as _;
use subtle::ConstantTimeEq as _;

use super::super::{Store, StoreError, stmt};
use super::audit::{self, Actor, Role, refuse};

const PREFIX: &str = "opk_";

/// A token as listed (never its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TokenInfo {
    /// Its number (part of the token).
    pub id: i64,
    /// Its name, shown as the actor in the audit log.
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// Who created it.
    pub created_by: String,
    /// When it was revoked, if it was.
    pub revoked_at: Option<DateTime<Utc>>,
    /// When it was last used (to the minute), if ever.
    pub last_used_at: Option<DateTime<Utc>>,
}

/// A token just created: the only time its text is known.
#[derive(Debug, Clone)]
pub struct NewToken {
    /// The token as listed.
    pub info: TokenInfo,
    /// The token to hand to its user. Never logged, stored or shown again.
    pub token: String,
}

fn hash(secret: &str) -> Vec<u8> {
    sha2::Sha256::digest(secret.as_bytes()).to_vec()
}

/// Splits `opk_<id>_<secret>`; `None` for anything else.
fn parse(token: &str) -> Option<(i64, &str)> {
    let rest = token.strip_prefix(PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    let id: i64 = id.parse().ok()?;
    (id > 0 && secret.len() == 43).then_some((id, secret))
}

fn info(r: &sea_orm::QueryResult) -> Result<TokenInfo, StoreError> {
    let g = StoreError::from_db;
    let role: String = r.try_get_by_index(2).map_err(g)?;
    Ok(TokenInfo {
        id: r.try_get_by_index(0).map_err(g)?,
        name: r.try_get_by_index(1).map_err(g)?,
        role: role.parse().map_err(StoreError::Corrupt)?,
        created_at: r.try_get_by_index(3).map_err(g)?,
        created_by: r.try_get_by_index(4).map_err(g)?,
        revoked_at: r.try_get_by_index(5).map_err(g)?,
        last_used_at: r.try_get_by_index(6).map_err(g)?,
    })
}

const COLUMNS: &str = "id, name, role, created_at, created_by, revoked_at, last_used_at";

impl Store {
    /// Creates a token named `name` with `role`. Needs the admin role; audited.
    pub async fn create_token(
        &self,
        actor: &Actor,
        name: &str,
        role: Role,
    ) -> Result<NewToken, StoreError> {
        actor.require(Role::Admin, "token.create")?;
        let name = name.trim();
        if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
            return Err(refuse(
                actor,
                "token.create",
                "input",
                "a token's name is 1 to 128 printable characters (say whose it is, e.g. ops-alice)"
                    .to_owned(),
            ));
        }
        let mut secret = [0u8; 32];
        rand::Rng::fill(&mut rand::rng(), &mut secret);
        let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret);
        let txn = self
            .connection()
            .begin()
            .await
            .map_err(StoreError::from_db)?;
        let row = txn
            .query_one_raw(stmt(
                &format!(
                    "INSERT INTO outpost_token (name, role, secret_hash, created_by) \
                     VALUES ($1, $2, $3, $4) RETURNING {COLUMNS}"
                ),
                [
                    name.into(),
                    role.as_str().into(),
                    hash(&secret).into(),
                    actor.name.clone().into(),
                ],
            ))
            .await;
        let row = match row {
            Err(e) if matches!(StoreError::from_db(e.clone()), StoreError::Rejected { .. }) => {
                return Err(refuse(
                    actor,
                    "token.create",
                    "input",
                    format!(
                        "a token named {name:?} exists already: revoke it first or pick another name"
                    ),
                ));
            }
            other => other
                .map_err(StoreError::from_db)?
                .ok_or_else(|| StoreError::Corrupt("INSERT returned no row".to_owned()))?,
        };
        let info = info(&row)?;
        audit::record(
            &txn,
            actor,
            "token.create",
            name,
            json!({ "id": info.id, "role": role }),
        )
        .await?;
        txn.commit().await.map_err(StoreError::from_db)?;
        let token = format!("{PREFIX}{}_{secret}", info.id);
        Ok(NewToken { info, token })
    }

    /// Every token, newest first (never their secrets). Needs the admin role.
    pub async fn list_tokens(&self, actor: &Actor) -> Result<Vec<TokenInfo>, StoreError> {
        actor.require(Role::Admin, "token.list")?;
        self.connection()
            .query_all_raw(stmt(
                &format!("SELECT {COLUMNS} FROM outpost_token ORDER BY id DESC"),
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .iter()
            .map(info)
            .collect()
    }

    /// Revokes the live token named `name`. Needs the admin role; audited.
    pub async fn revoke_token(&self, actor: &Actor, name: &str) -> Result<TokenInfo, StoreError> {
        actor.require(Role::Admin, "token.revoke")?;
        let txn = self
            .connection()
            .begin()
            .await
            .map_err(StoreError::from_db)?;
        let row = txn
            .query_one_raw(stmt(
                &format!(
                    "UPDATE outpost_token SET revoked_at = now() \
                     WHERE name = $1 AND revoked_at IS NULL RETURNING {COLUMNS}"
                ),
                [name.into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        let Some(row) = row else {
            txn.rollback().await.map_err(StoreError::from_db)?;
            return Err(refuse(
                actor,
                "token.revoke",
                "not_found",
                format!("no live token is named {name:?}: `outpost admin token list` shows them"),
            ));
        };
        let info = info(&row)?;
        audit::record(&txn, actor, "token.revoke", name, json!({ "id": info.id })).await?;
        txn.commit().await.map_err(StoreError::from_db)?;
        Ok(info)
    }

    /// How many tokens are live (not revoked).
    pub async fn live_tokens(&self) -> Result<i64, StoreError> {
        self.connection()
            .query_one_raw(stmt(
                "SELECT count(*) FROM outpost_token WHERE revoked_at IS NULL",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .map(|r| r.try_get_by_index(0))
            .transpose()
            .map_err(StoreError::from_db)
            .map(Option::unwrap_or_default)
    }

    /// The identity of a presented token: `None` for a malformed, unknown, wrong or revoked
    /// token (the caller answers 401 alike for all). The hashes are compared in constant time.
    pub async fn authenticate(&self, token: &str) -> Result<Option<Actor>, StoreError> {
        let Some((id, secret)) = parse(token) else {
            return Ok(None);
        };
        let row = self
            .connection()
            .query_one_raw(stmt(
                "SELECT name, role, secret_hash, \
                        last_used_at IS NULL OR last_used_at < now() - interval '1 minute' \
                 FROM outpost_token WHERE id = $1 AND revoked_at IS NULL",
                [id.into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        let Some(row) = row else { return Ok(None) };
        let g = StoreError::from_db;
        let stored: Vec<u8> = row.try_get_by_index(2).map_err(g)?;
        if !bool::from(stored.as_slice().ct_eq(&hash(secret))) {
            return Ok(None);
        }
        let name: String = row.try_get_by_index(0).map_err(g)?;
        let role: String = row.try_get_by_index(1).map_err(g)?;
        let stale: bool = row.try_get_by_index(3).map_err(g)?;
        if stale {
            // Kept to the minute: one write per token per minute, not one per request.
            self.connection()
                .execute_raw(stmt(
                    "UPDATE outpost_token SET last_used_at = now() WHERE id = $1",
                    [id.into()],
                ))
                .await
                .map_err(StoreError::from_db)?;
        }
        Ok(Some(Actor::new(
            name,
            role.parse().map_err(StoreError::Corrupt)?,
        )))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn only_well_formed_tokens_are_looked_up() {
        let secret = "A".repeat(43);
        assert_eq!(
            parse(&format!("opk_12_{secret}")),
            Some((12, secret.as_str()))
        );
        for bad in [
            "",
            "opk_",
            "opk_x_abc",
            &format!("opk_0_{secret}"),
            &format!("opk_-1_{secret}"),
            &format!("opk_12_{secret}A"),
            &format!("xyz_12_{secret}"),
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        assert_eq!(hash("x").len(), 32);
    }
}
