//! The node's memory of the streams it writes: which are known to exist (so that Redis losing
//! one is noticed at the next append), and how far each was acknowledged since the last time
//! the positions were recorded in the database.
//!
//! Workers note every acknowledged append here (a map update, no I/O); the supervisor writes
//! the positions to `outpost_stream` once per heartbeat while the node publishes, never once per
//! batch.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::publish::parse_entry_id;

/// Streams known to this node and their unrecorded positions.
#[derive(Debug, Default)]
pub struct StreamBook {
    inner: Mutex<Book>,
    lost: AtomicBool,
}

#[derive(Debug, Default)]
struct Book {
    /// The Redis incarnation (`outpost_redis.incarnation`) the positions belong to.
    incarnation: i64,
    /// Streams written before, by this node or (as recorded) by any node.
    known: HashSet<String>,
    /// Newest acknowledged entry id per stream since the last flush.
    dirty: HashMap<String, (i64, i64)>,
    /// Per partition and stream, the newest entry id this node knows the partition appended:
    /// noted at every acknowledged append, loaded from `outpost_stream_position` when the
    /// partition is taken. Each append carries it, and Redis refuses the append when it holds
    /// an older one (it lost the entries after it).
    acked: HashMap<i32, HashMap<String, (i64, i64)>>,
}

impl StreamBook {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        // A panic while the book was locked leaves plain maps behind; they are still usable.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `stream` was written before: its fence hash must then exist at Redis.
    pub fn is_known(&self, stream: &str) -> bool {
        self.book().known.contains(stream)
    }

    /// Notes entries `partition` appended to `stream`, the newest being `last_id`.
    pub fn published(&self, stream: &str, partition: i32, last_id: &str) {
        let Some(id) = parse_entry_id(last_id) else {
            return;
        };
        let mut book = self.book();
        if !book.known.contains(stream) {
            book.known.insert(stream.to_owned());
        }
        let pos = book.dirty.entry(stream.to_owned()).or_insert(id);
        if *pos < id {
            *pos = id;
        }
        let acked = book.acked.entry(partition).or_default();
        match acked.get_mut(stream) {
            Some(pos) => *pos = (*pos).max(id),
            None => {
                acked.insert(stream.to_owned(), id);
            }
        }
    }

    /// The newest entry id `partition` is known to have appended to `stream`.
    pub fn expected(&self, stream: &str, partition: i32) -> Option<(i64, i64)> {
        self.book()
            .acked
            .get(&partition)
            .and_then(|s| s.get(stream))
            .copied()
    }

    /// A partition was taken: what it appended is what the database recorded (`marks`, stream
    /// and position), replacing what this node remembered of an earlier lease of it.
    pub fn take_partition(&self, partition: i32, marks: Vec<(String, (i64, i64))>) {
        let mut book = self.book();
        for (stream, _) in &marks {
            if !book.known.contains(stream) {
                book.known.insert(stream.clone());
            }
        }
        book.acked.insert(partition, marks.into_iter().collect());
    }

    /// A known stream turned out to have no fence: Redis lost data. The supervisor checks at
    /// its next heartbeat.
    pub fn flag_lost(&self) {
        self.lost.store(true, Ordering::Release);
    }

    /// Takes the lost flag.
    pub fn take_lost(&self) -> bool {
        self.lost.swap(false, Ordering::AcqRel)
    }

    /// The positions to record and the incarnation they belong to; clears them.
    pub fn take_dirty(&self) -> (i64, Vec<(String, i64, i64)>) {
        let mut book = self.book();
        let dirty = std::mem::take(&mut book.dirty)
            .into_iter()
            .map(|(s, (ms, seq))| (s, ms, seq))
            .collect();
        (book.incarnation, dirty)
    }

    /// After recording: the database's incarnation and every recorded stream. A newer
    /// incarnation (another node recovered from a loss) drops positions noted before it.
    pub fn absorb(&self, incarnation: i64, recorded: Vec<String>) {
        let mut book = self.book();
        if book.incarnation != incarnation {
            book.incarnation = incarnation;
            book.dirty.clear();
        }
        book.known.extend(recorded);
    }

    /// Every known stream.
    pub fn known(&self) -> Vec<String> {
        self.book().known.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_grow_and_a_new_incarnation_drops_old_ones() {
        let book = StreamBook::default();
        assert!(!book.is_known("s"));
        book.published("s", 3, "5-1");
        book.published("s", 3, "4-9");
        book.published("s", 3, "bad");
        assert_eq!(book.expected("s", 3), Some((5, 1)));
        assert_eq!(book.expected("s", 4), None);
        assert!(book.is_known("s"));
        assert_eq!(book.take_dirty(), (0, vec![("s".to_owned(), 5, 1)]));
        assert_eq!(book.take_dirty(), (0, vec![]));
        book.published("s", 3, "6-0");
        book.absorb(1, vec!["t".to_owned()]);
        assert_eq!(book.take_dirty(), (1, vec![]));
        assert!(book.is_known("t"));
        // Taking the partition again replaces what was remembered with the recorded position.
        book.take_partition(3, vec![("u".to_owned(), (2, 0))]);
        assert_eq!(book.expected("s", 3), None);
        assert_eq!(book.expected("u", 3), Some((2, 0)));
        assert!(book.is_known("u"));
    }
}
