//! `outpost admin token create|list|revoke`: the identities of the JSON API and the panel.

use clap::Subcommand;

use crate::config::Config;
use crate::store::Role;

/// Administration.
#[derive(Debug, Subcommand)]
pub enum AdminAction {
    /// API tokens.
    Token {
        #[command(subcommand)]
        action: TokenAction,
    },
}

/// What to do with tokens.
#[derive(Debug, Subcommand)]
pub enum TokenAction {
    /// Create a token; it is printed once and cannot be shown again.
    Create {
        /// viewer (reads), operator (+ replay, discard, pause, resume) or admin (+ tokens).
        #[arg(long)]
        role: Role,
        /// Whose it is, e.g. ops-alice (shown as the actor in the audit log).
        #[arg(long)]
        name: String,
    },
    /// List tokens (never their secrets).
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Revoke the live token with this name.
    Revoke {
        /// The token's name.
        #[arg(long)]
        name: String,
    },
}

impl clap::ValueEnum for Role {
    fn value_variants<'a>() -> &'a [Self] {
        &[Role::Viewer, Role::Operator, Role::Admin]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.as_str()))
    }
}

pub(super) async fn run(config: &Config, action: AdminAction) -> anyhow::Result<()> {
    let AdminAction::Token { action } = action;
    let store = super::connect(config, "admin").await?;
    let actor = super::cli_actor();
    match action {
        TokenAction::Create { role, name } => {
            let created = store.create_token(&actor, &name, role).await?;
            eprintln!(
                "created token {:?} ({}); it is shown once, below — keep it in a secret store:",
                created.info.name, created.info.role
            );
            println!("{}", created.token);
        }
        TokenAction::List { json } => {
            let tokens = store.list_tokens(&actor).await?;
            if json {
                super::emit(&format!("{}\n", serde_json::to_string_pretty(&tokens)?));
                return Ok(());
            }
            use std::fmt::Write as _;
            let mut out = String::new();
            if tokens.is_empty() {
                writeln!(
                    out,
                    "(no tokens: create one with `outpost admin token create`)"
                )?;
            }
            for t in &tokens {
                let time = |t: Option<chrono::DateTime<chrono::Utc>>| {
                    t.map_or_else(
                        || "-".to_owned(),
                        |t| t.format("%Y-%m-%d %H:%M").to_string(),
                    )
                };
                writeln!(
                    out,
                    "{:>4}  {:<24} {:<8}  created {} by {}  last used {}  {}",
                    t.id,
                    t.name,
                    t.role,
                    t.created_at.format("%Y-%m-%d %H:%M"),
                    t.created_by,
                    time(t.last_used_at),
                    t.revoked_at
                        .map(|r| format!("REVOKED {}", r.format("%Y-%m-%d %H:%M")))
                        .unwrap_or_default()
                )?;
            }
            super::emit(&out);
        }
        TokenAction::Revoke { name } => {
            let t = store.revoke_token(&actor, &name).await?;
            println!("revoked token {:?} ({})", t.name, t.role);
        }
    }
    Ok(())
}
