//! The user-supplied layers (file, environment, flags) as figment dictionaries,
//! each remembering where every key came from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use figment::value::{Dict, Value};
use figment::{Metadata, Profile, Provider};
use toml::de::{DeTable, DeValue};

use super::error::Problem;
use super::schema::{self, Kind};
use super::{DEFAULT_FILE, ENV_PREFIX};

/// What kind of source a layer is; decides how fixes are worded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerKind {
    File,
    Env,
    Flag,
}

/// A path of keys from the root (`["relay", "batch_rows"]`).
pub(crate) type KeyPath = Vec<String>;

/// One layer: its values, and the label of where each key was written.
#[derive(Debug)]
pub(crate) struct Layer {
    pub kind: LayerKind,
    pub name: String,
    pub dict: Dict,
    /// Label of every path that was written in this layer (`file:12`,
    /// `environment variable X`, `flag --set k`).
    pub labels: BTreeMap<KeyPath, String>,
}

impl Layer {
    fn new(kind: LayerKind, name: impl Into<String>) -> Self {
        Self {
            kind,
            name: name.into(),
            dict: Dict::new(),
            labels: BTreeMap::new(),
        }
    }

    /// The label of the longest written prefix of `path`.
    pub fn label(&self, path: &[String]) -> String {
        (0..=path.len())
            .rev()
            .find_map(|n| self.labels.get(&path[..n]))
            .cloned()
            .unwrap_or_else(|| self.name.clone())
    }

    /// Whether this layer holds a value at `path`.
    pub fn contains(&self, path: &[String]) -> bool {
        let Some((first, rest)) = path.split_first() else {
            return true;
        };
        let Some(mut value) = self.dict.get(first) else {
            return false;
        };
        for segment in rest {
            value = match value {
                Value::Dict(_, d) => match d.get(segment) {
                    Some(v) => v,
                    None => return false,
                },
                Value::Array(_, a) => match segment.parse::<usize>().ok().and_then(|i| a.get(i)) {
                    Some(v) => v,
                    None => return false,
                },
                _ => return false,
            };
        }
        true
    }

    /// Reports keys that are not in the schema and sections that are not
    /// tables, and removes them so they neither hide nor duplicate other errors.
    pub fn remove_unknown_keys(&mut self, problems: &mut Vec<Problem>) {
        let mut dict = std::mem::take(&mut self.dict);
        dict.retain(|section, value| {
            let section_path = vec![section.clone()];
            if !schema::is_section(section) {
                problems.push(self.unknown_key(&section_path));
                return false;
            }
            let Value::Dict(_, fields) = value else {
                problems.push(Problem {
                    key: section.clone(),
                    source: self.label(&section_path),
                    message: format!(
                        "`{section}` must be a table of keys, not a single value; {}",
                        match self.kind {
                            LayerKind::File =>
                                format!("write its keys under a `[{section}]` header"),
                            LayerKind::Env => format!(
                                "set its keys one by one, as {ENV_PREFIX}{}__<KEY>",
                                section.to_ascii_uppercase()
                            ),
                            LayerKind::Flag => format!("use --set {section}.<key>=<value>"),
                        }
                    ),
                });
                return false;
            };
            fields.retain(|name, _| {
                if schema::lookup(section, name).is_some() {
                    true
                } else {
                    problems.push(self.unknown_key(&[section.clone(), name.clone()]));
                    false
                }
            });
            true
        });
        self.dict = dict;
    }

    fn unknown_key(&self, path: &[String]) -> Problem {
        let key = path.join(".");
        let suggestion = schema::suggest(&key);
        let hint = match (&suggestion, self.kind) {
            (Some(s), LayerKind::File) => format!("did you mean `{s}`? Fix the name or remove it"),
            (Some(s), LayerKind::Env) => format!(
                "did you mean {}? Rename or unset the variable",
                env_var_name(s)
            ),
            (Some(s), LayerKind::Flag) => format!("did you mean --set {s}=...?"),
            (None, LayerKind::File) => "remove it".to_owned(),
            (None, LayerKind::Env) => "unset the variable".to_owned(),
            (None, LayerKind::Flag) => "remove the flag".to_owned(),
        };
        Problem {
            key: key.clone(),
            source: self.label(path),
            message: format!(
                "unknown key `{key}`: {hint} (config/outpost.example.toml lists every key)"
            ),
        }
    }
}

/// The environment variable that sets `key` (`relay.batch_rows` →
/// `OUTPOST_RELAY__BATCH_ROWS`).
pub(crate) fn env_var_name(key: &str) -> String {
    format!(
        "{ENV_PREFIX}{}",
        key.to_ascii_uppercase().replace('.', "__")
    )
}

/// Feeds a layer to figment.
#[derive(Debug)]
pub(crate) struct LayerProvider<'a>(pub &'a Layer);

impl Provider for LayerProvider<'_> {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.0.name.clone())
    }

    fn data(&self) -> figment::Result<figment::value::Map<Profile, Dict>> {
        Ok(Profile::Default.collect(self.0.dict.clone()))
    }
}

// ---------------------------------------------------------------- file layer

/// Reads the configuration file: `explicit` when given (it must exist),
/// otherwise [`DEFAULT_FILE`] when it exists. Returns `None` when there is no
/// file or it cannot be used (the reasons are pushed to `problems`).
pub(crate) fn file_layer(explicit: Option<&Path>, problems: &mut Vec<Problem>) -> Option<Layer> {
    let (path, source_of_path) = match explicit {
        Some(p) => (p.to_path_buf(), "flag --config".to_owned()),
        None => {
            let p = PathBuf::from(DEFAULT_FILE);
            if !p.exists() {
                return None;
            }
            (p, DEFAULT_FILE.to_owned())
        }
    };
    let shown = path.display().to_string();
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => {
            let fix = if e.kind() == std::io::ErrorKind::NotFound {
                "check the path given to --config, or omit --config to use config/outpost.toml \
                 when it exists"
            } else {
                "check that it is a readable UTF-8 text file"
            };
            problems.push(Problem {
                key: String::new(),
                source: source_of_path,
                message: format!("cannot read config file {shown}: {e}; {fix}"),
            });
            return None;
        }
    };
    file_layer_from_str(&shown, &text, problems)
}

/// Parses TOML `text` (shown as `name` in sources) into a layer.
pub(crate) fn file_layer_from_str(
    name: &str,
    text: &str,
    problems: &mut Vec<Problem>,
) -> Option<Layer> {
    let lines = LineIndex::new(text);
    let (table, errors) = DeTable::parse_recoverable(text);
    if !errors.is_empty() {
        for e in errors {
            let line = e.span().map(|s| lines.line(s.start));
            problems.push(Problem {
                key: String::new(),
                source: match line {
                    Some(l) => format!("{name}:{l}"),
                    None => name.to_owned(),
                },
                message: format!(
                    "not valid TOML: {}; fix the syntax (the rest of this file was ignored)",
                    e.message().trim()
                ),
            });
        }
        return None;
    }
    let mut layer = Layer::new(LayerKind::File, name);
    let ctx = FileCtx { name, lines };
    let mut path = Vec::new();
    layer.dict = convert_table(
        table.get_ref(),
        &mut path,
        &ctx,
        &mut layer.labels,
        problems,
    );
    Some(layer)
}

/// Names a position in the file being converted.
struct FileCtx<'a> {
    name: &'a str,
    lines: LineIndex,
}

impl FileCtx<'_> {
    fn label(&self, offset: usize) -> String {
        format!("{}:{}", self.name, self.lines.line(offset))
    }
}

fn convert_table(
    table: &DeTable<'_>,
    path: &mut KeyPath,
    ctx: &FileCtx<'_>,
    labels: &mut BTreeMap<KeyPath, String>,
    problems: &mut Vec<Problem>,
) -> Dict {
    let mut dict = Dict::new();
    for (key, value) in table.iter() {
        path.push(key.get_ref().to_string());
        let here = ctx.label(key.span().start);
        labels.insert(path.clone(), here.clone());
        if let Some(v) = convert_value(value.get_ref(), path, &here, ctx, labels, problems) {
            dict.insert(key.get_ref().to_string(), v);
        }
        path.pop();
    }
    dict
}

fn convert_value(
    value: &DeValue<'_>,
    path: &mut KeyPath,
    here: &str,
    ctx: &FileCtx<'_>,
    labels: &mut BTreeMap<KeyPath, String>,
    problems: &mut Vec<Problem>,
) -> Option<Value> {
    let unsupported = |problems: &mut Vec<Problem>, what: &str| {
        let key = path.join(".");
        problems.push(Problem {
            message: format!(
                "{what}; {}",
                match lookup_path(path) {
                    Some(f) => format!("`{key}` must be {}", f.expected()),
                    None => "remove it".to_owned(),
                }
            ),
            key,
            source: here.to_owned(),
        });
    };
    Some(match value {
        DeValue::String(s) => Value::from(s.to_string()),
        DeValue::Integer(i) => {
            let digits = i.as_str();
            if let Ok(n) = i64::from_str_radix(digits, i.radix()) {
                Value::from(n)
            } else if let Ok(n) = u64::from_str_radix(digits, i.radix()) {
                Value::from(n)
            } else {
                unsupported(problems, "this integer is too large");
                return None;
            }
        }
        DeValue::Float(f) => match f.as_str().parse::<f64>() {
            Ok(n) => Value::from(n),
            Err(_) => {
                unsupported(problems, "this float cannot be read");
                return None;
            }
        },
        DeValue::Boolean(b) => Value::from(*b),
        DeValue::Datetime(_) => {
            unsupported(problems, "date-times are not used by any key");
            return None;
        }
        DeValue::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                path.push(i.to_string());
                let item_here = ctx.label(item.span().start);
                labels.insert(path.clone(), item_here.clone());
                if let Some(v) =
                    convert_value(item.get_ref(), path, &item_here, ctx, labels, problems)
                {
                    out.push(v);
                }
                path.pop();
            }
            Value::from(out)
        }
        DeValue::Table(t) => Value::from(convert_table(t, path, ctx, labels, problems)),
    })
}

/// Byte offset → 1-based line number.
struct LineIndex {
    starts: Vec<usize>,
}

impl LineIndex {
    fn new(text: &str) -> Self {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Self { starts }
    }

    fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset)
    }
}

fn lookup_path(path: &[String]) -> Option<&'static schema::Field> {
    match path {
        [section, name, ..] => schema::lookup(section, name),
        _ => None,
    }
}

// ------------------------------------------------------- environment & flags

/// The `OUTPOST_*` variables of `vars` (or of the process when `None`).
pub(crate) fn env_layer(vars: Option<&[(String, String)]>, problems: &mut Vec<Problem>) -> Layer {
    let mut layer = Layer::new(LayerKind::Env, "environment variables OUTPOST_*");
    let collected: Vec<(String, Option<String>)> = match vars {
        Some(vars) => vars
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.clone())))
            .collect(),
        None => std::env::vars_os()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.into_string().ok()))
            .collect(),
    };
    for (name, value) in collected {
        let Some(rest) = strip_prefix_ignore_case(&name, ENV_PREFIX) else {
            continue;
        };
        let label = format!("environment variable {name}");
        let segments: Vec<&str> = rest.split("__").collect();
        if segments.iter().any(|s| s.is_empty()) {
            problems.push(Problem {
                key: rest.to_ascii_lowercase().replace("__", "."),
                source: label,
                message: format!(
                    "malformed variable name: after {ENV_PREFIX}, a section and a key separated \
                     by `__` are expected (e.g. {}); rename or unset it",
                    env_var_name("relay.batch_rows")
                ),
            });
            continue;
        }
        // Sections and keys are case-insensitive; deeper segments (event types in
        // routing.overrides) keep their case.
        let path: KeyPath = segments
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if i < 2 {
                    s.to_ascii_lowercase()
                } else {
                    (*s).to_owned()
                }
            })
            .collect();
        let Some(value) = value else {
            problems.push(Problem {
                key: path.join("."),
                source: label,
                message: format!(
                    "{}: the value is not valid UTF-8; set it to UTF-8 text",
                    path.join(".")
                ),
            });
            continue;
        };
        insert(&mut layer, path, &value, label);
    }
    layer
}

/// The `(key path, value)` overrides given on the command line.
pub(crate) fn flag_layer(overrides: &[(String, String)], problems: &mut Vec<Problem>) -> Layer {
    let mut layer = Layer::new(LayerKind::Flag, "command-line flags");
    for (key, value) in overrides {
        let key = key.trim();
        let label = format!("flag --set {key}");
        let path: KeyPath = key.split('.').map(str::to_owned).collect();
        if path.iter().any(String::is_empty) {
            problems.push(Problem {
                key: key.to_owned(),
                source: label,
                message: "malformed key: expected a dotted key such as relay.batch_rows, as in \
                          --set relay.batch_rows=500"
                    .to_owned(),
            });
            continue;
        }
        insert(&mut layer, path, value, label);
    }
    layer
}

fn strip_prefix_ignore_case<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    let head = name.get(..prefix.len())?;
    if head.eq_ignore_ascii_case(prefix) {
        name.get(prefix.len()..)
    } else {
        None
    }
}

/// Types a raw string from the environment or a flag according to the key it
/// sets: strings and URLs stay as they are (so `node.id = 123` or a URL is not
/// turned into a number), lists accept `a,b,c` as well as `[a, b, c]`, and
/// everything else goes through figment's value parser (`500`, `true`, `{..}`).
fn typed_value(path: &[String], raw: &str) -> Value {
    let kind = lookup_path(path).map(|f| f.kind);
    let whole_field = path.len() == 2;
    match kind {
        Some(Kind::Str | Kind::Secret) => Value::from(raw.to_owned()),
        // One entry of routing.overrides: a template string.
        Some(Kind::StrMap) if !whole_field => Value::from(raw.to_owned()),
        Some(Kind::StrList) if whole_field && !raw.trim_start().starts_with('[') => Value::from(
            raw.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| Value::from(s.to_owned()))
                .collect::<Vec<_>>(),
        ),
        Some(_) => raw
            .parse()
            .unwrap_or_else(|e: std::convert::Infallible| match e {}),
        // Unknown key: reported later; do not interpret the value.
        None => Value::from(raw.to_owned()),
    }
}

fn insert(layer: &mut Layer, path: KeyPath, raw: &str, label: String) {
    let value = typed_value(&path, raw);
    for n in 1..=path.len() {
        layer
            .labels
            .entry(path[..n].to_vec())
            .or_insert_with(|| label.clone());
    }
    layer.labels.insert(path.clone(), label);
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut dict = &mut layer.dict;
    for segment in parents {
        let entry = dict
            .entry(segment.clone())
            .or_insert_with(|| Value::from(Dict::new()));
        if !matches!(entry, Value::Dict(..)) {
            *entry = Value::from(Dict::new());
        }
        dict = match entry {
            Value::Dict(_, d) => d,
            // Made a dictionary just above.
            _ => return,
        };
    }
    dict.insert(last.clone(), value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_index() {
        let idx = LineIndex::new("a\nbc\n\nd");
        assert_eq!(idx.line(0), 1);
        assert_eq!(idx.line(1), 1);
        assert_eq!(idx.line(2), 2);
        assert_eq!(idx.line(5), 3);
        assert_eq!(idx.line(6), 4);
    }

    #[test]
    fn file_labels_name_the_line() {
        let mut problems = Vec::new();
        let text = "# c\n[relay]\nbatch_rows = 5\n\n[routing.overrides]\nA = \"x\"\n";
        let layer = file_layer_from_str("f.toml", text, &mut problems).expect("parses");
        assert!(problems.is_empty(), "{problems:?}");
        let p = |s: &str| s.split('.').map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(layer.label(&p("relay.batch_rows")), "f.toml:3");
        assert_eq!(layer.label(&p("routing.overrides.A")), "f.toml:6");
        assert!(layer.contains(&p("routing.overrides.A")));
        assert!(!layer.contains(&p("routing.overrides.B")));
    }

    #[test]
    fn env_values_are_typed_by_key() {
        let mut problems = Vec::new();
        let vars = vec![
            ("OUTPOST_NODE__ID".to_owned(), "123".to_owned()),
            ("OUTPOST_RELAY__BATCH_ROWS".to_owned(), "123".to_owned()),
            (
                "OUTPOST_ROUTING__NO_DESTINATION".to_owned(),
                "A, B".to_owned(),
            ),
            (
                "OUTPOST_ROUTING__OVERRIDES__OrderPlaced".to_owned(),
                "none".to_owned(),
            ),
            ("PATH".to_owned(), "/bin".to_owned()),
        ];
        let layer = env_layer(Some(&vars), &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        let v = Value::from(layer.dict.clone());
        assert_eq!(v.find_ref("node.id").and_then(Value::as_str), Some("123"));
        assert_eq!(
            v.find_ref("relay.batch_rows").and_then(Value::to_u128),
            Some(123)
        );
        assert_eq!(
            v.find_ref("routing.no_destination")
                .and_then(Value::as_array)
                .map(<[_]>::len),
            Some(2)
        );
        assert_eq!(
            v.find_ref("routing.overrides.OrderPlaced")
                .and_then(Value::as_str),
            Some("none")
        );
    }
}
