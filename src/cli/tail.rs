//! `outpost tail`: print a stream's entries as they arrive, decoded per the stream contract.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use redis::Value;
use redis::streams::{StreamReadOptions, StreamReadReply};

use crate::config::Config;
use crate::consume::stream::{GroupStream, RawEntry, parse_entries};
use crate::consume::{ConsumerSettings, Delivery, StartFrom};
use crate::publish::RedisConn;

/// What to read and how to print it.
#[derive(Debug, Args)]
pub struct TailArgs {
    /// Stream name as routing renders it (e.g. `events:order`); `redis.key_prefix` is added.
    stream: String,
    /// Where to start: `$` for new entries only, `0` for the whole stream, or an entry id.
    #[arg(long, default_value = "$")]
    from: String,
    /// Stop after this many entries.
    #[arg(long)]
    count: Option<u64>,
    /// Stop at the end of the stream instead of waiting for more.
    #[arg(long)]
    no_follow: bool,
    /// Read as a member of this consumer group, acknowledging what it prints (the group is
    /// created from the start of the stream when missing). Use a group of its own: entries it
    /// acknowledges are not delivered to other members.
    #[arg(long)]
    group: Option<String>,
    /// Member name within `--group` (default: host and process id).
    #[arg(long, requires = "group")]
    consumer: Option<String>,
    /// One JSON object per entry instead of the readable form.
    #[arg(long)]
    json: bool,
}

pub(super) async fn run(config: &Config, args: TailArgs) -> anyhow::Result<()> {
    let url = config.redis.url()?.expose().to_owned();
    let key = format!("{}{}", config.redis.key_prefix, args.stream);
    let mut printed = 0u64;
    let done = |n: u64| args.count.is_some_and(|c| n >= c);
    if let Some(group) = &args.group {
        let mut settings = ConsumerSettings::new(url, key.clone(), group.clone());
        settings.key_prefix = config.redis.key_prefix.clone();
        settings.topology = config.redis.topology();
        if let Some(c) = &args.consumer {
            settings.consumer = c.clone();
        }
        settings.start = if args.from == "$" {
            StartFrom::Latest
        } else {
            StartFrom::Beginning
        };
        settings.validate()?;
        let stream = GroupStream::connect(&settings).await?;
        stream.ensure_group(settings.start).await?;
        loop {
            let room = args.count.map_or(100, |c| (c - printed).min(100)) as usize;
            let read = stream.read_new(room).await?;
            if read.lost > 0 {
                eprintln!(
                    "outpost: {} entries left {key} before group {group} read them",
                    read.lost
                );
            }
            let ids: Vec<String> = read.entries.iter().map(|e| e.id.clone()).collect();
            for e in read.entries {
                print_entry(e, args.json);
                printed += 1;
            }
            stream.ack(&ids).await?;
            if done(printed) || (ids.is_empty() && args.no_follow) {
                return Ok(());
            }
            if ids.is_empty() {
                stream
                    .wait_for_new(&read.last_id, Duration::from_secs(5))
                    .await?;
            }
        }
    }
    let mut conn = RedisConn::connect(
        &url,
        &config.redis.topology(),
        config.redis.connect_timeout(),
        // Blocking reads wait up to 5 s.
        config.redis.response_timeout() + Duration::from_secs(5),
    )
    .await
    .with_context(|| format!("connecting to Redis for {key}"))?;
    let mut last = if args.from == "$" {
        // Resolve `$` once, so entries arriving between two reads are not skipped.
        let info: Option<String> = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(&key)
            .query_async::<Value>(&mut conn)
            .await
            .ok()
            .and_then(|v| last_generated_id(&v));
        info.unwrap_or_else(|| "0-0".to_owned())
    } else {
        args.from.clone()
    };
    loop {
        let mut opts = StreamReadOptions::default().count(100);
        if !args.no_follow {
            opts = opts.block(5000);
        }
        let reply: Value = redis::cmd("XREAD")
            .arg(&opts)
            .arg("STREAMS")
            .arg(&key)
            .arg(&last)
            .query_async(&mut conn)
            .await
            .with_context(|| format!("reading {key}"))?;
        let entries = read_reply_entries(&reply)
            .with_context(|| format!("unexpected reply reading {key}: {reply:?}"))?;
        if entries.is_empty() && args.no_follow {
            return Ok(());
        }
        for e in entries {
            last = e.id.clone();
            print_entry(e, args.json);
            printed += 1;
            if done(printed) {
                return Ok(());
            }
        }
    }
}

/// The entries of an `XREAD` reply for one stream (a list of `[key, entries]`, or a map under
/// RESP3), names and values kept as bytes: a hostile entry never makes the read fail.
fn read_reply_entries(v: &Value) -> Option<Vec<RawEntry>> {
    let streams: Vec<&Value> = match v {
        Value::Nil => return Some(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Array(pair) if pair.len() == 2 => Some(&pair[1]),
                _ => None,
            })
            .collect::<Option<_>>()?,
        Value::Map(kv) => kv.iter().map(|(_, entries)| entries).collect(),
        _ => return None,
    };
    let mut entries = Vec::new();
    for s in streams {
        entries.extend(parse_entries(s, 0)?);
    }
    Some(entries)
}

fn last_generated_id(info: &Value) -> Option<String> {
    let Value::Array(items) = info else {
        return None;
    };
    items.chunks_exact(2).find_map(|kv| match kv {
        [k, v] if redis::from_redis_value_ref::<String>(k).ok()? == "last-generated-id" => {
            redis::from_redis_value_ref(v).ok()
        }
        _ => None,
    })
}

fn print_entry(e: RawEntry, json: bool) {
    println!("{}", render_entry(e, json));
}

/// An entry as `tail` prints it (one line in JSON, a header and the indented payload
/// otherwise). Everything from the entry is escaped ([`escape_text`], [`escape_json`]): an entry
/// is written by whoever can `XADD`, and must not move the cursor, change colours or rewrite
/// the operator's terminal.
fn render_entry(e: RawEntry, json: bool) -> String {
    match Delivery::decode(e.id, e.fields, e.deliveries) {
        Ok(d) => {
            let payload: serde_json::Value =
                serde_json::from_str(&d.data).unwrap_or(serde_json::Value::String(d.data.clone()));
            if json {
                escape_json(
                    &serde_json::json!({
                        "stream_id": d.stream_id,
                        "event_id": d.event_id,
                        "event_type": d.event_type,
                        "aggregate_type": d.aggregate_type,
                        "aggregate_id": d.aggregate_id,
                        "aggregate_seq": d.aggregate_seq,
                        "schema_version": d.schema_version,
                        "time": d.time,
                        "traceparent": d.traceparent,
                        "headers": d.headers,
                        "data": payload,
                        "defect": d.defect(),
                    })
                    .to_string(),
                )
            } else {
                let mut out = format!(
                    "{}  {}  {}/{} #{}  v{}  {}  {}",
                    escape_text(&d.stream_id),
                    escape_text(&d.event_type),
                    escape_text(&d.aggregate_type),
                    escape_text(&d.aggregate_id),
                    d.aggregate_seq,
                    escape_text(&d.schema_version),
                    escape_text(&d.time),
                    d.event_id
                );
                if let Some(defect) = d.defect() {
                    out.push_str(&format!("  (malformed: {})", escape_text(defect)));
                }
                let pretty =
                    escape_json(&serde_json::to_string_pretty(&payload).unwrap_or_default());
                for line in pretty.lines() {
                    out.push_str("\n    ");
                    out.push_str(line);
                }
                out
            }
        }
        Err(bad) => {
            let fields: serde_json::Map<String, serde_json::Value> = bad
                .raw
                .iter()
                .map(|(k, v)| {
                    (
                        String::from_utf8_lossy(k).into_owned(),
                        serde_json::Value::String(String::from_utf8_lossy(v).into_owned()),
                    )
                })
                .collect();
            let fields = serde_json::Value::Object(fields);
            if json {
                escape_json(
                    &serde_json::json!({"stream_id": bad.stream_id, "not_an_event": bad.reason, "fields": fields})
                        .to_string(),
                )
            } else {
                format!(
                    "{}  (not an Outpost event: {})\n    {}",
                    escape_text(&bad.stream_id),
                    escape_text(&bad.reason),
                    escape_json(&fields.to_string())
                )
            }
        }
    }
}

/// Characters a terminal acts on rather than shows: C0 and C1 controls (ESC starts ANSI
/// sequences, CR and BS overwrite, U+009B is a one-character CSI) and DEL, and the
/// bidirectional controls that reorder what follows.
fn acts_on_terminal(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every character a terminal acts on written as an escape (`\n`, `\r`, `\t`,
/// `\u{1b}`), and backslashes doubled, so what is printed is unambiguous.
fn escape_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if acts_on_terminal(c) => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

/// JSON text written by `serde_json`, with the characters a terminal acts on that JSON leaves
/// raw (DEL, C1 controls, bidirectional controls) written as `\uXXXX` escapes: still the same
/// JSON value. JSON escapes the C0 controls inside strings itself, so a line feed here is the
/// pretty form's layout, and stays.
fn escape_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c != '\n' && acts_on_terminal(c) {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

/// `XREAD … STREAMS key last`: the entries of one stream after `last`, flattened.
pub(super) async fn read_after(
    conn: &mut impl redis::aio::ConnectionLike,
    key: &str,
    last: &str,
    opts: &StreamReadOptions,
) -> redis::RedisResult<Vec<redis::streams::StreamId>> {
    let reply: Option<StreamReadReply> = redis::cmd("XREAD")
        .arg(opts)
        .arg("STREAMS")
        .arg(key)
        .arg(last)
        .query_async(conn)
        .await?;
    Ok(flatten(reply))
}

/// The entries of an `XREAD`/`XREADGROUP` reply, in order.
pub(super) fn flatten(reply: Option<StreamReadReply>) -> Vec<redis::streams::StreamId> {
    reply
        .into_iter()
        .flat_map(|r| r.keys)
        .flat_map(|k| k.ids)
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// What a terminal acts on: ESC, CSI (8-bit), BEL, backspace, carriage return, line feed,
    /// DEL, a bidirectional override.
    const HOSTILE: [char; 8] = [
        '\u{1b}', '\u{9b}', '\u{7}', '\u{8}', '\r', '\n', '\u{7f}', '\u{202e}',
    ];

    fn entry(fields: &[(&[u8], &[u8])]) -> RawEntry {
        RawEntry {
            id: "1-0".into(),
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_vec(), v.to_vec()))
                .collect(),
            deliveries: 0,
        }
    }

    fn event(aggregate_id: &str, data: &str) -> RawEntry {
        entry(&[
            (b"ce_id", b"0193a4b2-7c1e-7d2f-9a3b-1c2d3e4f5a6b"),
            (b"ce_type", b"order.paid\x1b[2J"),
            (b"ce_aggregatetype", b"order"),
            (b"ce_subject", aggregate_id.as_bytes()),
            (b"ce_aggregateseq", b"1"),
            (b"ce_time", b"2026-12-01T10:00:00Z\r"),
            (b"data", data.as_bytes()),
        ])
    }

    fn assert_inert(out: &str, lines: usize) {
        for c in HOSTILE {
            if c == '\n' {
                continue;
            }
            assert!(!out.contains(c), "{c:?} reaches the terminal in {out:?}");
        }
        assert_eq!(out.lines().count(), lines, "{out}");
    }

    #[test]
    fn escaping_leaves_nothing_a_terminal_acts_on() {
        let all: String = HOSTILE.iter().collect();
        let text = escape_text(&format!("o-1{all}\\"));
        assert_eq!(
            text,
            "o-1\\u{1b}\\u{9b}\\u{7}\\u{8}\\r\\n\\u{7f}\\u{202e}\\\\"
        );
        let json = escape_json(&serde_json::Value::String(all.clone()).to_string());
        assert!(!json.contains(|c: char| HOSTILE.contains(&c)), "{json}");
        let back: String = serde_json::from_str(&json).unwrap();
        assert_eq!(back, all, "the JSON escape is the same value");
        assert_eq!(escape_text("order/o-1 émoji ✓"), "order/o-1 émoji ✓");
    }

    #[test]
    fn a_hostile_event_prints_inert_in_both_forms() {
        let id = "o-1\u{1b}]0;owned\u{7}\n\rfake line\u{9b}2J\u{202e}";
        let data = r#"{"note":"a\u001b[31mred\u001b[0m\u009b\u007f\u202e"}"#;
        let out = render_entry(event(id, data), false);
        // The header line and the payload's three pretty lines.
        assert_inert(&out, 4);
        assert!(
            out.contains("o-1\\u{1b}]0;owned\\u{7}\\n\\rfake line"),
            "{out}"
        );
        let out = render_entry(event(id, data), true);
        assert_inert(&out, 1);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["aggregate_id"], id, "JSON output keeps the exact value");
    }

    #[test]
    fn an_entry_that_is_not_an_event_prints_inert() {
        let e = entry(&[
            (b"ce_id\x1b[2J", b"x\n\x1b[31m"),
            (b"\xff\x9b", b"\xc2\x9b1;1H"),
        ]);
        let out = render_entry(e.clone(), false);
        assert_inert(&out, 2);
        assert!(out.contains("not an Outpost event"), "{out}");
        assert_inert(&render_entry(e, true), 1);
    }
}
