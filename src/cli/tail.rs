//! `outpost tail`: print a stream's entries as they arrive, decoded per the stream contract.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use redis::Value;
use redis::streams::{StreamReadOptions, StreamReadReply};

use crate::config::Config;
use crate::consume::stream::{GroupStream, RawEntry};
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
        let entries = read_after(&mut conn, &key, &last, &opts)
            .await
            .with_context(|| format!("reading {key}"))?;
        if entries.is_empty() && args.no_follow {
            return Ok(());
        }
        for e in entries {
            last = e.id.clone();
            print_entry(
                RawEntry {
                    id: e.id,
                    fields: e.map,
                    deliveries: 0,
                },
                args.json,
            );
            printed += 1;
            if done(printed) {
                return Ok(());
            }
        }
    }
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
    match Delivery::decode(e.id, e.fields, e.deliveries) {
        Ok(d) => {
            let payload: serde_json::Value =
                serde_json::from_str(&d.data).unwrap_or(serde_json::Value::String(d.data.clone()));
            if json {
                println!(
                    "{}",
                    serde_json::json!({
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
                    })
                );
            } else {
                println!(
                    "{}  {}  {}/{} #{}  v{}  {}  {}",
                    d.stream_id,
                    d.event_type,
                    d.aggregate_type,
                    d.aggregate_id,
                    d.aggregate_seq,
                    d.schema_version,
                    d.time,
                    d.event_id
                );
                let pretty = serde_json::to_string_pretty(&payload).unwrap_or_default();
                for line in pretty.lines() {
                    println!("    {line}");
                }
            }
        }
        Err(bad) => {
            let fields: serde_json::Map<String, serde_json::Value> = bad
                .raw
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        serde_json::Value::String(String::from_utf8_lossy(v).into_owned()),
                    )
                })
                .collect();
            if json {
                println!(
                    "{}",
                    serde_json::json!({"stream_id": bad.stream_id, "not_an_event": bad.reason, "fields": fields})
                );
            } else {
                println!("{}  (not an Outpost event: {})", bad.stream_id, bad.reason);
                println!("    {}", serde_json::Value::Object(fields));
            }
        }
    }
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
