//! Moving a device's pages to another daemon: which slots changed since a
//! point in time (the dirty log), what one slot holds as it travels (a
//! [`Record`]), and the stream that carries them.
//!
//! The stream runs over any byte pipe (the daemon gives it a socket):
//!
//! ```text
//! source → destination
//!   header   "VZRAMMIG"  version u32  block size u32 (4096)
//!            device size u64  slots u64  codec id u8  codec name [u8; 15]
//!   records  'E' slot u64                       empty (discarded)
//!            'S' slot u64 value u64             every 8-byte word is value
//!            'C' slot u64 codec u8 len u16 [len] a compressed page, as stored
//!            'R' slot u64 [4096]                a raw page
//!            'P' pass u32                       a pass over the device begins
//!                                               (sent again, same number, every
//!                                               2 s while nothing is dirty)
//!   final    'F' records u64 crc32 u32          crc32 of every byte before it
//! destination → source
//!   after the header       'A' (accepted)  or  'X' len u16 message
//!   after the final marker 'K' pages u64 records u64 crc32 u32
//!                          or  'X' len u16 message
//!   while the verdict is open
//!                          'S'  its frontend started the rings: the VM runs there
//!   after the commit       'D' pages u64   or  'X' len u16 message
//! source → destination, after 'K' (the verdict)
//!            'W' still there   'C' commit   'B' len u16 message (abort)
//! ```
//!
//! The source commits only on evidence that the VM runs on the
//! destination ('S', or an operator's commit after the last delta); the
//! destination drops its copy on an abort, or when the source goes away
//! or falls silent before its commit.
//!
//! Integers are little-endian. The first pass sends every slot that holds
//! something; later passes send the slots written or discarded since the
//! pass before (empty ones as 'E'). Compressed pages travel as they are
//! stored, with their codec id; huge and written-back pages travel raw.
//!
//! The destination trusts nothing: a header that does not describe its
//! device is refused before anything is stored, and every record is checked
//! (slot in range, known codec, length, a compressed page that expands to
//! exactly one page) before it is. A stream that fails part-way, or whose
//! checksum does not match, is undone: the device is emptied again.
//!
//! A receive may be handed on between processes at a record boundary
//! ([`Resume`], [`receive_from`]): the daemon's supervisor, receiving for
//! a device no VM uses yet, hands the stream to the worker of the VM that
//! connects meanwhile.

mod receive;
pub(crate) mod record;
mod stream;

pub use crate::cells::Progress;
pub use receive::{receive, receive_from, ReceiveHooks, ReceiveReport, Received, Resume};
pub use record::{DirtyLog, ExportBuf, Record};
pub use stream::{
    empty, send, MigrateError, SendHooks, SendReport, StreamHeader, Verdict, VERDICT_POLL, VERSION,
};
