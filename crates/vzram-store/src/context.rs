//! A caller's working state for the store's I/O calls: its allocator shard
//! and the buffers and codec contexts a read or write needs. Each queue
//! thread owns one and passes it down, so the I/O path neither allocates nor
//! reaches for thread-locals, and which shard a queue uses is the caller's
//! choice, not an accident of thread start order.

use std::fmt;

use crate::backing::AlignedPages;
use crate::codec::{CodecState, MAX_COMPRESSED};
use crate::{Page, PAGE_SIZE};

/// One queue's store context. Not shared: every I/O call takes it `&mut`.
/// It belongs to no device, so one context may serve several devices.
pub struct Context {
    /// The allocator shard and counter set to use, modulo each device's
    /// shard count.
    pub(crate) shard: usize,
    /// The page a read-modify-write expands into and edits.
    pub(crate) page: Box<Page>,
    pub(crate) work: Work,
}

/// What encoding and decoding use; apart from `page` so that a partial
/// write can encode the page it just edited.
pub(crate) struct Work {
    pub(crate) cbuf: Box<[u8; MAX_COMPRESSED]>,
    pub(crate) codec: CodecState,
    /// A page-aligned page for backing-file reads, made on the first one.
    pub(crate) io: Option<AlignedPages>,
}

impl Context {
    /// A context on allocator shard `shard` (any number: devices take it
    /// modulo their shard count). Queues of one device should have distinct
    /// shards, e.g. their queue index, so they never meet on a shard lock.
    pub fn new(shard: usize) -> Context {
        Context {
            shard,
            page: Box::new([0; PAGE_SIZE]),
            work: Work {
                cbuf: Box::new([0; MAX_COMPRESSED]),
                codec: CodecState::default(),
                io: None,
            },
        }
    }

    pub fn shard(&self) -> usize {
        self.shard
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("shard", &self.shard)
            .field("codec", &self.work.codec)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_can_move_to_its_queue_thread() {
        fn send<T: Send>() {}
        send::<Context>();
    }
}
