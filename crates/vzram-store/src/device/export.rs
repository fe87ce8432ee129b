//! A migration's view of the device: each slot exported as stored and
//! imported after checks, and the dirty log's count.

use super::{fill, Device, Spilled};
use crate::backing::AlignedPages;
use crate::codec::Codec;
use crate::context::Context;
use crate::error::{Result, StoreError};
use crate::migrate::record::{ExportBuf, Record};
use crate::pool::heap::AllocError;
use crate::slot::{self, Slot, SlotGuard};
use crate::PAGE_SIZE;

impl Device {
    /// Reads what `slot` holds for a migration, as it is stored: the
    /// compressed bytes of an object (not expanded), the raw page of a huge
    /// or written-back one. Not an access: idle marks stay.
    pub fn export<'b>(&self, buf: &'b mut ExportBuf, slot: u64) -> Result<Record<'b>> {
        self.check(slot)?;
        if !self.table.is_marked(slot) {
            return Ok(Record::Empty);
        }
        let w = self.table.word(slot);
        let snap = w.load(std::sync::atomic::Ordering::Acquire);
        if snap & slot::LOCK == 0 {
            match Slot::decode(snap) {
                Slot::Empty => return Ok(Record::Empty),
                Slot::Same(v) => return Ok(Record::Same(v)),
                _ => {}
            }
        }
        let g = SlotGuard::lock(w);
        Ok(match Slot::decode(g.old()) {
            Slot::Empty => Record::Empty,
            Slot::Same(v) => Record::Same(v),
            Slot::Object { huge, codec, .. } => {
                let src = self.object_bytes(slot, &g)?;
                let n = src.len();
                buf.page[..n].copy_from_slice(src);
                drop(g);
                if huge {
                    Record::Raw(&buf.page)
                } else {
                    Record::Compressed {
                        codec,
                        data: &buf.page[..n],
                    }
                }
            }
            Slot::Backed { block } => {
                let Some(b) = &self.backing else {
                    return Err(StoreError::Corrupt { slot });
                };
                let io = match &mut buf.io {
                    Some(p) => p,
                    None => buf.io.insert(AlignedPages::new(1)?),
                };
                b.read(block, io.page_mut(0))?;
                drop(g);
                buf.page.copy_from_slice(io.page_mut(0));
                Record::Raw(&buf.page)
            }
        })
    }

    /// Stores a migrated record in `slot`. Compressed bytes are stored as
    /// they came, once checked: a known codec, a length below a page, and
    /// they expand to exactly one page. On any error the slot keeps its
    /// old content.
    pub fn import(&self, ctx: &mut Context, slot: u64, rec: Record<'_>) -> Result<()> {
        self.check(slot)?;
        let sh = self.shard(ctx);
        match rec {
            Record::Empty => self.discard(ctx, slot..slot + 1),
            Record::Same(v) => {
                if let Some(word) = Slot::Same(v).encode() {
                    self.table.mark(slot)?;
                    self.put_word(slot, word, sh);
                    Ok(())
                } else {
                    let mut page = [0u8; PAGE_SIZE];
                    fill(&mut page, v);
                    self.write_page(ctx, slot, &page)
                }
            }
            Record::Raw(page) => self.write_page(ctx, slot, page),
            Record::Compressed { codec, data } => {
                if codec > 1 {
                    return Err(StoreError::BadRecord(format!(
                        "slot {slot}: unknown codec id {codec}"
                    )));
                }
                if data.is_empty() || data.len() >= PAGE_SIZE {
                    return Err(StoreError::BadRecord(format!(
                        "slot {slot}: a compressed page of {} bytes",
                        data.len()
                    )));
                }
                let Context { page, work, .. } = ctx;
                if !Codec::from_id(codec).decompress(data, page, &mut work.codec) {
                    return Err(StoreError::BadRecord(format!(
                        "slot {slot}: the compressed page does not expand to exactly {PAGE_SIZE} bytes"
                    )));
                }
                self.table.mark(slot)?;
                let mut obj = match self.heap.alloc(&self.pool, self.budget(), data.len(), sh) {
                    Ok(obj) => obj,
                    Err(AllocError::Device | AllocError::Host) if self.backing.is_some() => {
                        match self.spill(data.len(), sh, page)? {
                            Spilled::Room(obj) => obj,
                            Spilled::Direct(word) => {
                                self.put_word(slot, word, sh);
                                return Ok(());
                            }
                        }
                    }
                    Err(e) => return Err(e.into()),
                };
                self.heap.write(&mut obj, data);
                let word = Slot::Object {
                    offset: obj.offset(),
                    len: data.len() as u32,
                    huge: false,
                    codec,
                }
                .encode()
                .expect("objects always encode");
                self.put_word(slot, word, sh);
                Ok(())
            }
        }
    }

    /// Publishes `word` (marked already) in `slot` and retires the old one.
    fn put_word(&self, slot: u64, word: u64, shard: usize) {
        let g = SlotGuard::lock(self.table.word(slot));
        let old = g.old();
        g.publish(word);
        self.dirty.mark(slot);
        self.retire(old, word, shard);
    }

    /// Slots written or discarded since the last pass of a migration.
    pub fn dirty_slots(&self) -> u64 {
        self.dirty.count()
    }
}
