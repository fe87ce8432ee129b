//! Recovery: a device whose state existed is rebuilt from its slot table.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

use super::{footprint, Device, Recovery};
use crate::codec::Codec;
use crate::error::{Result, StoreError};
use crate::pool::class::{class_of, BLOCK_BYTES};
use crate::slot::{self, Slot};
use crate::state::{self, StateFiles};
use crate::stats::Footprint;
use crate::PAGE_SIZE;

impl Device {
    /// Rebuilds everything but the slot table from the slot table: spans,
    /// free lists, budgets and gauges. An object no slot references is free.
    /// A locked word (a writer or a move cut short) keeps the content it
    /// had: its new object, if any, was never published, so it is free.
    pub(super) fn recover(&self, st: &StateFiles) -> Result<Recovery> {
        let t0 = std::time::Instant::now();
        // The budget and gauges are recomputed below. The host budget holds
        // the old charge only if it is the one this device was charged to
        // (a worker restarted under the same daemon), not a new daemon's.
        let cells = &self.cells;
        if cells.charged_to.load(Relaxed) == self.pool.host_id {
            self.pool.host().uncharge(cells.budget.used());
            self.pool
                .host_staging()
                .uncharge(cells.staged_bytes.load(Relaxed));
        }
        // At once, as the budget: a recovery cut short and tried again
        // must not take the same pages back from the host twice.
        cells.staged_bytes.store(0, Relaxed);
        cells.budget.reset_used();
        cells.charged_to.store(self.pool.host_id, Relaxed);
        for c in &cells.counters {
            c.clear_gauges();
        }
        let corrupt = |slot: u64, what: &str| {
            StoreError::state(
                format_args!(
                    "{}: slot {slot} {what}; the state is damaged (start with {})",
                    st.dir.join("table").display(),
                    crate::state::fresh_hint(&st.dir)
                ),
                None,
            )
        };
        // block -> (class, indices of live objects)
        let mut spans: HashMap<u32, (usize, Vec<u16>)> = HashMap::new();
        let mut rec = Recovery {
            slots: 0,
            spans: 0,
            unlocked: 0,
            backed: 0,
            staged: 0,
            micros: 0,
        };
        let mut staged = Vec::new();
        if let Some(b) = &self.backing {
            b.clear();
        }
        let mut owner_checked = false;
        let ctr = &self.counters()[0];
        for range in state::data_ranges(&st.table) {
            let first = range.start / 8;
            let end = range.end.div_ceil(8).min(self.table.len());
            for s in first..end {
                let w = self.table.word(s);
                let mut word = w.load(Relaxed);
                if word & slot::LOCK != 0 {
                    word &= !slot::LOCK;
                    w.store(word, Relaxed);
                    rec.unlocked += 1;
                }
                if word == 0 {
                    continue;
                }
                check_word(word).map_err(|what| corrupt(s, what))?;
                self.table.mark(s)?;
                rec.slots += 1;
                ctr.apply(Footprint::default(), footprint(word));
                if let Slot::Backed { block } = Slot::decode(word) {
                    let Some(b) = &self.backing else {
                        return Err(StoreError::state(
                            format_args!(
                                "{}: slot {s} is in a backing file, but the device has none \
                                 (give it its --backing-file, or start with {})",
                                st.dir.join("table").display(),
                                crate::state::fresh_hint(&st.dir)
                            ),
                            None,
                        ));
                    };
                    if !owner_checked {
                        b.check_owner(st.header.creation_id).map_err(|e| {
                            StoreError::state(
                                format_args!(
                                    "{}: {e} (start with {})",
                                    st.dir.display(),
                                    crate::state::fresh_hint(&st.dir)
                                ),
                                None,
                            )
                        })?;
                        owner_checked = true;
                    }
                    if block >= b.blocks() {
                        return Err(corrupt(
                            s,
                            &format!(
                                "names backing block {block}, past the file's {}",
                                b.blocks()
                            ),
                        ));
                    }
                    if !b.mark(block) {
                        let mut named = self.slots_where(st, |x| x == Slot::Backed { block });
                        return Err(corrupt(
                            s,
                            &format!(
                                "names backing block {block}, as slot {} does",
                                named.next().unwrap_or(s)
                            ),
                        ));
                    }
                    rec.backed += 1;
                    continue;
                }
                let Slot::Object { offset, len, .. } = Slot::decode(word) else {
                    continue;
                };
                if self.staged(word) {
                    staged.push(s);
                }
                // `len` fits its class's size and the index is below the
                // span's capacity, so the object ends inside its span.
                let class = class_of(len as usize);
                let c = self.pool.classes[class];
                let block = offset / BLOCK_BYTES as u64;
                let rel = offset % BLOCK_BYTES as u64;
                if offset + u64::from(len) > self.heap.arena().bytes()
                    || !rel.is_multiple_of(u64::from(c.size))
                    || rel / u64::from(c.size) >= u64::from(c.capacity)
                {
                    return Err(corrupt(s, "points outside any object"));
                }
                let e = spans.entry(block as u32).or_insert((class, Vec::new()));
                if e.0 != class {
                    return Err(corrupt(s, "shares a span with objects of another size"));
                }
                e.1.push((rel / u64::from(c.size)) as u16);
            }
        }
        let mut next = 0;
        for (&block, (class, live)) in spans.iter_mut() {
            live.sort_unstable();
            if let Some(w) = live.windows(2).find(|w| w[0] == w[1]) {
                // Rare, so the slots are found again here rather than kept
                // beside every object (8 bytes more each).
                let c = self.pool.classes[*class];
                let at =
                    u64::from(block) * BLOCK_BYTES as u64 + u64::from(w[0]) * u64::from(c.size);
                let mut named = self.slots_where(
                    st,
                    |x| matches!(x, Slot::Object { offset, .. } if offset == at),
                );
                let first = named.next().unwrap_or(0);
                let second = named.next().unwrap_or(first);
                return Err(corrupt(
                    second,
                    &format!("shares its object with slot {first}"),
                ));
            }
            self.heap
                .restore_span(&self.pool, self.budget(), block, *class, live);
            next = next.max(block + 1);
        }
        self.heap.arena().restore(next, |b| spans.contains_key(&b));
        rec.spans = spans.len() as u64;
        rec.staged = staged.len() as u64;
        self.restore_staged(staged);
        rec.micros = t0.elapsed().as_micros() as u64;
        Ok(rec)
    }

    /// The slots whose words `f` takes, in order: the other holders a
    /// refusal names (found again, as refusals are rare).
    fn slots_where<'a>(
        &'a self,
        st: &StateFiles,
        f: impl Fn(Slot) -> bool + 'a,
    ) -> impl Iterator<Item = u64> + 'a {
        let n = self.table.len();
        state::data_ranges(&st.table)
            .into_iter()
            .flat_map(move |r| r.start / 8..r.end.div_ceil(8).min(n))
            .filter(move |&s| f(Slot::decode(self.table.word(s).load(Relaxed))))
    }
}

/// Object codec ids this build can expand. Any of them may be in the table
/// whatever the device's codec: recompression and migrated pages keep
/// theirs.
const CODECS: [Codec; 2] = [
    Codec::Lz4,
    Codec::Zstd {
        level: Codec::DEFAULT_ZSTD_LEVEL,
    },
];

/// Checks that `word` (unlocked, not 0) is one the writers make, so that
/// nothing read from it later can be inconsistent: a huge object is a raw
/// page, a compressed one is shorter than a page in a known codec, and no
/// bit is set that its kind of slot does not use (decoding would silently
/// drop it). An object's access and TRIED bits are free to take any value.
fn check_word(word: u64) -> std::result::Result<(), &'static str> {
    let s = Slot::decode(word);
    if let Slot::Object {
        len, huge, codec, ..
    } = s
    {
        if huge && len as usize != PAGE_SIZE {
            return Err("is a raw page (huge) whose object is not one page long");
        }
        if !huge && (len == 0 || len as usize >= PAGE_SIZE) {
            return Err("has a compressed object of impossible length");
        }
        if !CODECS.iter().any(|c| c.id() == codec) {
            return Err("has an object in an unknown codec");
        }
    }
    let used = if slot::is_object(word) {
        word & !(slot::ACCESS | slot::TRIED)
    } else {
        word
    };
    if s.encode() != Some(used) {
        return Err("has bits set that its kind of slot never uses");
    }
    Ok(())
}
