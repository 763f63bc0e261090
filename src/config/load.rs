//! [`load`]: layering, section-by-section deserialization and validation.

use std::collections::BTreeSet;
use std::fmt;
use std::path::PathBuf;

use figment::Figment;
use figment::error::{Actual, Kind as ErrorKind};
use figment::providers::Serialized;
use figment::value::Value;
use serde::de::DeserializeOwned;

use super::error::{ConfigErrors, Problem};
use super::layers::{self, Layer, LayerKind, LayerProvider};
use super::schema::{self, Field, Kind};
use super::secret::REDACTED;
use super::{Config, validate};

/// What [`load`] reads.
#[derive(Clone)]
pub struct LoadOptions {
    /// The `--config` file; it must exist. When `None`, `config/outpost.toml`
    /// (relative to the working directory) is read if it exists.
    pub file: Option<PathBuf>,
    /// `(key path, value)` overrides from the command line, applied last, in
    /// order (`("relay.batch_rows", "500")`, `("node.id", "relay-1")`).
    pub overrides: Vec<(String, String)>,
    /// Whether to read `OUTPOST_*` environment variables.
    pub env: bool,
    /// When `Some` (and `env` is true), these variables are read instead of the
    /// process environment; for tests.
    pub env_vars: Option<Vec<(String, String)>>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            file: None,
            overrides: Vec::new(),
            env: true,
            env_vars: None,
        }
    }
}

/// Shows the variable names only, and hides the value of URL overrides.
impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let overrides: Vec<(&str, &str)> = self
            .overrides
            .iter()
            .map(|(k, v)| {
                let hidden = k.to_ascii_lowercase().contains("url");
                (k.as_str(), if hidden { REDACTED } else { v.as_str() })
            })
            .collect();
        let env_var_names: Option<Vec<&str>> = self
            .env_vars
            .as_ref()
            .map(|vars| vars.iter().map(|(k, _)| k.as_str()).collect());
        f.debug_struct("LoadOptions")
            .field("file", &self.file)
            .field("overrides", &overrides)
            .field("env", &self.env)
            .field("env_var_names", &env_var_names)
            .finish()
    }
}

/// Loads the configuration: defaults, then the file, then `OUTPOST_*`
/// variables, then `opts.overrides`; then checks it. Every problem found is
/// returned at once.
pub fn load(opts: &LoadOptions) -> Result<Config, ConfigErrors> {
    let mut problems = Vec::new();
    let mut layers = Vec::new();
    if let Some(layer) = layers::file_layer(opts.file.as_deref(), &mut problems) {
        layers.push(layer);
    }
    if opts.env {
        layers.push(layers::env_layer(opts.env_vars.as_deref(), &mut problems));
    }
    layers.push(layers::flag_layer(&opts.overrides, &mut problems));
    for layer in &mut layers {
        layer.remove_unknown_keys(&mut problems);
    }

    let figment = layers.iter().fold(
        Figment::from(Serialized::defaults(Config::default())),
        |figment, layer| figment.merge(LayerProvider(layer)),
    );

    let sources = Sources { layers: &layers };
    let mut reader = SectionReader {
        figment: &figment,
        sources: &sources,
        problems: &mut problems,
        failed: BTreeSet::new(),
    };
    let config = Config {
        database: reader.read("database"),
        redis: reader.read("redis"),
        node: reader.read("node"),
        admin: reader.read("admin"),
        producer: reader.read("producer"),
        relay: reader.read("relay"),
        routing: reader.read("routing"),
        rate_limit: reader.read("rate_limit"),
        retention: reader.read("retention"),
        log: reader.read("log"),
    };
    let failed = reader.failed;

    for issue in validate::check(&config) {
        let key = issue.key();
        // A key that could not be read was replaced by its default: checking
        // that default would only confuse.
        if failed.contains(&key) || issue.related.iter().any(|r| failed.contains(*r)) {
            continue;
        }
        let (source, _) = sources.source_of(&issue.path);
        let mut message = format!("{key} {}", issue.message).trim().to_owned();
        for related in &issue.related {
            let path: Vec<String> = related.split('.').map(str::to_owned).collect();
            let (related_source, _) = sources.source_of(&path);
            message.push_str(&format!(" ({related} comes from {related_source})"));
        }
        problems.push(Problem {
            key,
            source,
            message,
        });
    }

    if problems.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors { problems })
    }
}

/// Finds which layer supplied a value.
struct Sources<'a> {
    layers: &'a [Layer],
}

impl Sources<'_> {
    /// The label of the last layer holding `path`, or `default`.
    fn source_of(&self, path: &[String]) -> (String, Option<LayerKind>) {
        self.layers
            .iter()
            .rev()
            .find(|layer| layer.contains(path))
            .map_or_else(
                || ("default".to_owned(), None),
                |layer| (layer.label(path), Some(layer.kind)),
            )
    }
}

/// Deserializes sections one by one, collecting type errors.
struct SectionReader<'a> {
    figment: &'a Figment,
    sources: &'a Sources<'a>,
    problems: &'a mut Vec<Problem>,
    /// Keys that had a type error (`section.field` and the full path).
    failed: BTreeSet<String>,
}

impl SectionReader<'_> {
    /// Reads section `name`. On a type error the offending key is reported and
    /// removed, and the section is read again, so that every bad key of the
    /// section is reported; removed keys take their default.
    fn read<T: DeserializeOwned + Default>(&mut self, name: &str) -> T {
        let Ok(mut value) = self.figment.find_value(name) else {
            // The defaults layer provides every section.
            return T::default();
        };
        // Each round removes one key, so this bounds the rounds generously.
        for _ in 0..1000 {
            match value.deserialize::<T>() {
                Ok(section) => return section,
                Err(e) => {
                    self.report(name, &e);
                    if e.path.is_empty() || !remove_path(&mut value, &e.path) {
                        return T::default();
                    }
                }
            }
        }
        T::default()
    }

    fn report(&mut self, section: &str, e: &figment::Error) {
        let mut path = vec![section.to_owned()];
        path.extend(e.path.iter().cloned());
        let field = path.get(1).and_then(|n| schema::lookup(section, n));
        let (source, layer) = self.sources.source_of(&path);
        let secret = field.is_some_and(|f| f.kind == Kind::Secret);

        let (subject, expected) = match (field, path.get(2)) {
            (Some(f), Some(index)) if f.kind == Kind::StrList => (
                format!(
                    "entry {} of {}",
                    index
                        .parse::<usize>()
                        .map_or_else(|_| index.clone(), |i| (i + 1).to_string()),
                    f.key()
                ),
                "a string".to_owned(),
            ),
            (Some(f), Some(entry)) if f.kind == Kind::StrMap => (
                format!("{}.{entry}", f.key()),
                format!("a stream template string or \"{}\"", super::NO_DESTINATION),
            ),
            (Some(f), Some(entry)) if matches!(f.kind, Kind::UIntMap { .. }) => (
                format!("{}.{entry}", f.key()),
                format!("a whole number from 0 to {} ({})", u32::MAX, f.unit),
            ),
            (Some(f), _) => (f.key(), f.expected()),
            (None, _) => (path.join("."), "a valid value".to_owned()),
        };
        let found = match &e.kind {
            ErrorKind::InvalidType(actual, _) | ErrorKind::InvalidValue(actual, _) => {
                describe(actual, !secret)
            }
            _ if secret => "an invalid value".to_owned(),
            other => format!("an invalid value ({other})"),
        };
        let fix = field.map(|f| fix_hint(f, layer)).unwrap_or_default();
        let key = path.join(".");
        if let Some(f) = field {
            self.failed.insert(f.key());
        }
        self.failed.insert(key.clone());
        self.problems.push(Problem {
            key,
            source,
            message: format!("{subject} must be {expected}, but found {found}{fix}"),
        });
    }
}

/// Removes the value at `path` (relative to `value`); an element of a list
/// removes the whole list.
fn remove_path(value: &mut Value, path: &[String]) -> bool {
    let Value::Dict(_, dict) = value else {
        return false;
    };
    match path {
        [] => false,
        [last] => dict.remove(last).is_some(),
        [first, rest @ ..] => match dict.get_mut(first) {
            Some(child) => remove_path(child, rest) || dict.remove(first).is_some(),
            None => false,
        },
    }
}

/// Describes a value found where another was expected; with `reveal` false,
/// only its type.
fn describe(actual: &Actual, reveal: bool) -> String {
    const MAX: usize = 80;
    match actual {
        Actual::Bool(b) if reveal => format!("`{b}`"),
        Actual::Bool(_) => "a boolean".to_owned(),
        Actual::Unsigned(n) if reveal => format!("the number {n}"),
        Actual::Signed(n) if reveal => format!("the number {n}"),
        Actual::Float(n) if reveal => format!("the number {n}"),
        Actual::Unsigned(_) | Actual::Signed(_) | Actual::Float(_) => "a number".to_owned(),
        Actual::Char(c) if reveal => format!("the character {c:?}"),
        Actual::Str(s) if reveal && s.chars().count() <= MAX => format!("the string {s:?}"),
        Actual::Str(s) if reveal => {
            let head: String = s.chars().take(MAX).collect();
            format!("the string {head:?}...")
        }
        Actual::Char(_) | Actual::Str(_) => "a string".to_owned(),
        Actual::Unit | Actual::Option => "an empty value".to_owned(),
        Actual::Seq => "a list".to_owned(),
        Actual::Map => "a table".to_owned(),
        _ => "a value of another type".to_owned(),
    }
}

/// "; write it as ..." for the layer the bad value came from.
fn fix_hint(field: &Field, layer: Option<LayerKind>) -> String {
    let example_raw = match (field.kind, field.section, field.name) {
        (Kind::Secret, "database", _) => "postgres://user:password@host:5432/dbname".to_owned(),
        (Kind::Secret, _, _) => "redis://host:6379".to_owned(),
        (Kind::UInt { .. }, _, _) => default_of(field),
        (Kind::Bool, _, _) => "false".to_owned(),
        (Kind::Str, _, _) => default_of(field).trim_matches('"').to_owned(),
        (Kind::StrList, _, _) => "OrderPlaced,OrderCancelled".to_owned(),
        (Kind::StrMap, _, _) => "events:orders".to_owned(),
        (Kind::UIntMap { .. }, _, _) => "100".to_owned(),
    };
    let example_toml = match field.kind {
        Kind::Secret | Kind::Str => format!("{} = {example_raw:?}", field.name),
        Kind::StrList => format!("{} = [\"OrderPlaced\", \"OrderCancelled\"]", field.name),
        Kind::StrMap => "OrderPlaced = \"events:orders\" under [routing.overrides]".to_owned(),
        Kind::UIntMap { .. } => {
            format!("\"events:orders\" = {example_raw} under [{}]", field.key())
        }
        Kind::UInt { .. } | Kind::Bool => format!("{} = {example_raw}", field.name),
    };
    match (layer, field.kind) {
        (Some(LayerKind::Env), Kind::StrMap) => format!(
            "; set one entry per variable, e.g. {}__OrderPlaced={example_raw}",
            layers::env_var_name(&field.key())
        ),
        (Some(LayerKind::Env), Kind::UIntMap { .. }) => format!(
            "; set one entry per variable, e.g. {}__orders={example_raw}",
            layers::env_var_name(&field.key())
        ),
        (Some(LayerKind::Env), _) => format!(
            "; set e.g. {}={example_raw}",
            layers::env_var_name(&field.key())
        ),
        (Some(LayerKind::Flag), Kind::StrMap) => {
            format!("; use e.g. --set {}.OrderPlaced={example_raw}", field.key())
        }
        (Some(LayerKind::Flag), Kind::UIntMap { .. }) => {
            format!("; use e.g. --set {}.orders={example_raw}", field.key())
        }
        (Some(LayerKind::Flag), _) => format!("; use e.g. --set {}={example_raw}", field.key()),
        (Some(LayerKind::File) | None, _) => format!("; write it as e.g. {example_toml}"),
    }
}

/// The default value of an integer or string key, as written in TOML.
fn default_of(field: &Field) -> String {
    let defaults = Value::serialize(Config::default()).ok();
    match defaults.as_ref().and_then(|d| d.find_ref(&field.key())) {
        Some(Value::Num(_, n)) => n.to_u128().map(|n| n.to_string()).unwrap_or_default(),
        Some(Value::String(_, s)) => format!("{s:?}"),
        Some(Value::Bool(_, b)) => b.to_string(),
        _ => String::new(),
    }
}
