//! The migration stream: its header, records and replies (the format is in
//! the module documentation), and the sending and receiving ends.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use thiserror::Error;

use super::record::{ExportBuf, Record};
use crate::cells::Progress;
use crate::context::Context;
use crate::device::Device;
use crate::error::StoreError;
use crate::PAGE_SIZE;

const MAGIC: [u8; 8] = *b"VZRAMMIG";
/// Bumped when the stream changes incompatibly (2: the two-phase end; 3:
/// the destination says when its VM runs, and only that or an operator
/// commits).
pub const VERSION: u32 = 3;
pub(super) const HEADER_LEN: usize = 48;
const CODEC_NAME_LEN: usize = 15;

/// Defines a one-byte tag set: an enum whose values are the bytes on the
/// wire, read back with `TryFrom<u8>` (the unknown byte as the error).
macro_rules! tags {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $b:literal,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(u8)]
        pub(super) enum $name {
            $($(#[$vm])* $v = $b,)*
        }

        impl TryFrom<u8> for $name {
            type Error = u8;

            fn try_from(b: u8) -> Result<$name, u8> {
                match b {
                    $($b => Ok($name::$v),)*
                    other => Err(other),
                }
            }
        }

        impl From<$name> for u8 {
            fn from(t: $name) -> u8 {
                t as u8
            }
        }
    };
}

tags! {
    /// What the source sends before its final marker (checksummed), and
    /// its abort in their place.
    RecordTag {
        Empty = b'E',
        Same = b'S',
        Compressed = b'C',
        Raw = b'R',
        Pass = b'P',
        Final = b'F',
        /// Not checksummed: the source calls the move off mid-stream.
        Abort = b'B',
    }
}

tags! {
    /// What the source sends after the destination prepared: its verdict.
    VerdictTag {
        /// Still there, undecided.
        Wait = b'W',
        Commit = b'C',
        Abort = b'B',
    }
}

tags! {
    /// What the destination sends back.
    Reply {
        Accept = b'A',
        Prepared = b'K',
        Committed = b'D',
        /// The destination's frontend started its rings after the last
        /// delta: the VM runs there (the source's evidence for a commit).
        Started = b'S',
        Refuse = b'X',
    }
}

/// How often a source waiting for its verdict tells the destination it
/// is still there (the destination gives up after [`SILENCE`]).
const KEEPALIVE: Duration = Duration::from_secs(2);
/// How often a side waiting for the verdict looks at its frontend and the
/// operator (the longest one read waits then).
pub const VERDICT_POLL: Duration = Duration::from_millis(10);
/// How long the destination waits for the source's verdict without
/// hearing from it (it says it is there every [`KEEPALIVE`]).
pub(super) const SILENCE: Duration = Duration::from_secs(60);
/// Longest refusal message either side sends or reads.
const MAX_MESSAGE: usize = 1024;
/// Highest codec id a slot word can hold that names a codec (lz4, zstd).
pub(super) const MAX_CODEC_ID: u8 = 1;

#[derive(Debug, Error)]
pub enum MigrateError {
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    /// The stream broke a rule: a bad header, record, length or checksum.
    #[error("bad migration stream: {0}")]
    Bad(String),
    /// The other end refused, with its reason.
    #[error("the other end refused: {0}")]
    Refused(String),
    /// Storing or reading a page failed here.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The move was called off before it was committed; both ends are as
    /// they were before it (the destination empty, the source whole).
    #[error("aborted: {0}")]
    Aborted(String),
    /// The source sent its commit but did not hear the destination take
    /// it: the destination may or may not serve the pages now.
    #[error("the commit was sent, but the destination's answer did not come ({0})")]
    Unconfirmed(String),
}

/// What the source decides once the destination holds every page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not yet: the VM may still run here.
    Wait,
    /// The VM has moved: the destination serves, this end may drop.
    Commit,
    /// The VM runs here again: the destination drops its copy.
    Abort(String),
}

pub(super) fn bad<T>(msg: impl Into<String>) -> Result<T, MigrateError> {
    Err(MigrateError::Bad(msg.into()))
}

/// What the header says about the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamHeader {
    pub version: u32,
    pub block_size: u32,
    pub size_bytes: u64,
    pub slots: u64,
    pub codec_id: u8,
    pub codec: String,
}

impl StreamHeader {
    pub fn of(dev: &Device) -> StreamHeader {
        StreamHeader {
            version: VERSION,
            block_size: PAGE_SIZE as u32,
            size_bytes: dev.size_bytes(),
            slots: dev.num_slots(),
            codec_id: dev.codec().id(),
            codec: dev.codec().to_string(),
        }
    }

    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.block_size.to_le_bytes());
        b[16..24].copy_from_slice(&self.size_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.slots.to_le_bytes());
        b[32] = self.codec_id;
        let n = self.codec.len().min(CODEC_NAME_LEN);
        b[33..33 + n].copy_from_slice(&self.codec.as_bytes()[..n]);
        b
    }

    pub(super) fn decode(b: &[u8; HEADER_LEN]) -> Result<StreamHeader, MigrateError> {
        if b[0..8] != MAGIC {
            return bad("not a vzram migration stream (bad magic)");
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let name = &b[33..33 + CODEC_NAME_LEN];
        let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
        Ok(StreamHeader {
            version: u32_at(8),
            block_size: u32_at(12),
            size_bytes: u64_at(16),
            slots: u64_at(24),
            codec_id: b[32],
            codec: String::from_utf8_lossy(&name[..end]).into_owned(),
        })
    }

    /// Whether a stream with this header can go into `dev`; why not if not.
    pub fn check(&self, dev: &Device) -> Result<(), String> {
        if self.version != VERSION {
            return Err(format!(
                "stream format version {}, this vzram speaks version {VERSION}",
                self.version
            ));
        }
        if self.block_size as usize != PAGE_SIZE {
            return Err(format!(
                "block size {}, this vzram's is {PAGE_SIZE}",
                self.block_size
            ));
        }
        if self.size_bytes != dev.size_bytes() {
            return Err(format!(
                "the source device holds {} bytes, this one {}; their sizes must match",
                self.size_bytes,
                dev.size_bytes()
            ));
        }
        if self.slots != self.size_bytes / PAGE_SIZE as u64 {
            return Err(format!(
                "{} slots do not make {} bytes",
                self.slots, self.size_bytes
            ));
        }
        if self.codec_id > MAX_CODEC_ID {
            return Err(format!("unknown codec id {}", self.codec_id));
        }
        Ok(())
    }
}

/// Writes the stream, keeping its checksum and counts.
struct Out<W: Write> {
    w: io::BufWriter<W>,
    crc: crc32fast::Hasher,
    records: u64,
    bytes: u64,
    /// The checksum sent in the final marker.
    sent_crc: u32,
}

impl<W: Write> Out<W> {
    fn new(w: W) -> Out<W> {
        Out {
            w: io::BufWriter::with_capacity(256 << 10, w),
            crc: crc32fast::Hasher::new(),
            records: 0,
            bytes: 0,
            sent_crc: 0,
        }
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.crc.update(b);
        self.bytes += b.len() as u64;
        self.w.write_all(b)
    }

    fn record(&mut self, slot: u64, rec: Record<'_>) -> io::Result<()> {
        self.records += 1;
        let s = slot.to_le_bytes();
        match rec {
            Record::Empty => {
                self.put(&[RecordTag::Empty.into()])?;
                self.put(&s)
            }
            Record::Same(v) => {
                self.put(&[RecordTag::Same.into()])?;
                self.put(&s)?;
                self.put(&v.to_le_bytes())
            }
            Record::Compressed { codec, data } => {
                self.put(&[RecordTag::Compressed.into()])?;
                self.put(&s)?;
                self.put(&[codec])?;
                self.put(&(data.len() as u16).to_le_bytes())?;
                self.put(data)
            }
            Record::Raw(page) => {
                self.put(&[RecordTag::Raw.into()])?;
                self.put(&s)?;
                self.put(page)
            }
        }
    }

    fn pass(&mut self, n: u32) -> io::Result<()> {
        self.put(&[RecordTag::Pass.into()])?;
        self.put(&n.to_le_bytes())
    }

    fn finish(&mut self) -> io::Result<()> {
        self.put(&[RecordTag::Final.into()])?;
        let records = self.records;
        self.put(&records.to_le_bytes())?;
        let crc = self.crc.clone().finalize();
        self.sent_crc = crc;
        self.w.write_all(&crc.to_le_bytes())?;
        self.bytes += 4;
        self.w.flush()
    }

    /// A control byte after the final marker (and what follows it): not
    /// part of the checksummed stream.
    fn control(&mut self, t: VerdictTag) -> io::Result<()> {
        self.w.write_all(&[t.into()])?;
        self.w.flush()
    }
}

pub(super) fn refuse(w: &mut impl Write, msg: &str) {
    say(w, Reply::Refuse.into(), msg)
}

/// Sends `tag` with a message (a refusal, an abort), best effort.
fn say(w: &mut impl Write, tag: u8, msg: &str) {
    let m = &msg.as_bytes()[..msg.len().min(MAX_MESSAGE)];
    let mut b = vec![tag];
    b.extend_from_slice(&(m.len() as u16).to_le_bytes());
    b.extend_from_slice(m);
    // Best effort: the peer may be gone already.
    let _ = w.write_all(&b).and_then(|()| w.flush());
}

/// Reads the peer's reply: `want` and what follows it (`extra` bytes), or
/// its refusal as an error.
fn reply(r: &mut impl Read, want: Reply, extra: &mut [u8]) -> Result<(), MigrateError> {
    let mut tag = [0u8];
    r.read_exact(&mut tag).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => {
            MigrateError::Refused("the other end closed the connection without a reply".into())
        }
        _ => MigrateError::Io(e),
    })?;
    match Reply::try_from(tag[0]) {
        Ok(Reply::Refuse) => return Err(MigrateError::Refused(message(r)?)),
        Ok(t) if t == want => {}
        Ok(Reply::Accept | Reply::Prepared | Reply::Committed | Reply::Started) | Err(_) => {
            return bad(format!("unexpected reply {:#04x}", tag[0]))
        }
    }
    r.read_exact(extra)?;
    Ok(())
}

/// The message after a refusal or an abort tag.
pub(super) fn message(r: &mut impl Read) -> io::Result<String> {
    let mut n = [0u8; 2];
    r.read_exact(&mut n)?;
    let n = usize::from(u16::from_le_bytes(n));
    if n > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a message of {n} bytes (at most {MAX_MESSAGE})"),
        ));
    }
    let mut m = vec![0u8; n];
    r.read_exact(&mut m)?;
    Ok(String::from_utf8_lossy(&m).into_owned())
}

/// What a finished send did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SendReport {
    pub bytes: u64,
    pub records: u64,
    pub passes: u32,
    /// Slots the destination says it now holds.
    pub pages: u64,
    /// From the moment the device was quiet to the destination's
    /// confirmation: what the last delta adds to the downtime.
    pub final_micros: u64,
    pub total_micros: u64,
    /// Pages sent in the last pass.
    pub final_records: u64,
}

/// How long the sender waits between passes while nothing is dirty.
const IDLE_PAUSE: Duration = Duration::from_millis(20);

/// What the source's stream asks of its caller.
pub struct SendHooks<'a> {
    /// Nothing can write to the device any more (the last delta is due).
    pub quiet: &'a dyn Fn() -> bool,
    /// Once the destination holds every page, asked every
    /// [`VERDICT_POLL`]: whether the destination has said its VM runs
    /// there is its argument.
    pub verdict: &'a dyn Fn(bool) -> Verdict,
    /// Before the last delta: the move is called off, with why.
    pub cancelled: &'a dyn Fn() -> Option<String>,
    pub progress: &'a dyn Fn(Progress),
    /// Sets how long one read may wait for nothing before it fails with
    /// `WouldBlock` (None: reads wait as usual).
    pub patience: &'a dyn Fn(Option<Duration>),
}

/// Sends `dev` over `r`/`w` (two ends of one connection): a full pass,
/// then passes over what was written meanwhile, until `quiet` says nothing
/// can write any more; then the last delta and the final marker. Once the
/// destination has checked and stored everything (its confirmation must
/// carry the record count and checksum sent), `verdict` decides, told
/// whether the destination said its VM runs there: commit (the
/// destination serves) or abort (it drops its copy). `cancelled`, asked
/// between batches of records before that, ends the stream with an abort
/// at once (an operator's `vzram migrate --cancel` after the VMM's own
/// migration was called off while the guest still runs). Returns Ok only
/// once the destination has taken the commit. Drops nothing itself: that
/// is the caller's choice once this returns Ok.
pub fn send(
    dev: &Device,
    mut r: impl Read,
    w: impl Write,
    h: &SendHooks<'_>,
) -> Result<SendReport, MigrateError> {
    let t0 = Instant::now();
    let mut out = Out::new(w);
    let header = StreamHeader::of(dev);
    out.put(&header.encode())?;
    out.w.flush()?;
    reply(&mut r, Reply::Accept, &mut [])?;
    dev.dirty.start(dev.num_slots());
    let result = send_passes(dev, &mut out, h.quiet, h.cancelled, h.progress);
    dev.dirty.stop();
    let (passes, quiet_at, final_records) = match result {
        Err(MigrateError::Aborted(why)) => {
            // Mid-stream: the destination reads the tag where a record
            // would be, and drops what it took.
            say(&mut out.w, RecordTag::Abort.into(), &why);
            return Err(MigrateError::Aborted(why));
        }
        r => r?,
    };
    out.finish()?;
    let mut b = [0u8; 20];
    reply(&mut r, Reply::Prepared, &mut b)?;
    let final_micros = quiet_at.elapsed().as_micros() as u64;
    let records = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes"));
    if (records, crc) != (out.records, out.sent_crc) {
        let why = format!(
            "the destination confirmed {records} records with checksum {crc:#010x}, but {} were sent with checksum {:#010x}",
            out.records, out.sent_crc
        );
        say(&mut out.w, VerdictTag::Abort.into(), &why);
        return bad(why);
    }
    (h.patience)(Some(VERDICT_POLL));
    let waited = await_verdict(&mut r, &mut out, h.verdict);
    (h.patience)(None);
    waited?;
    out.control(VerdictTag::Commit)?;
    let mut pages = [0u8; 8];
    reply(&mut r, Reply::Committed, &mut pages).map_err(|e| match e {
        // A refusal is an answer: it did not commit.
        MigrateError::Refused(m) => MigrateError::Refused(m),
        e => MigrateError::Unconfirmed(e.to_string()),
    })?;
    Ok(SendReport {
        bytes: out.bytes,
        records: out.records,
        passes,
        pages: u64::from_le_bytes(pages),
        final_micros,
        total_micros: t0.elapsed().as_micros() as u64,
        final_records,
    })
}

/// The source's wait for its verdict: it listens for the destination's
/// word that its VM runs, asks `verdict`, and says it is still there.
/// Ok once the verdict is to commit.
fn await_verdict<W: Write>(
    r: &mut impl Read,
    out: &mut Out<W>,
    verdict: &dyn Fn(bool) -> Verdict,
) -> Result<(), MigrateError> {
    let mut started_there = false;
    let mut told = Instant::now();
    loop {
        match verdict(started_there) {
            Verdict::Commit => return Ok(()),
            Verdict::Abort(why) => {
                say(&mut out.w, VerdictTag::Abort.into(), &why);
                return Err(MigrateError::Aborted(why));
            }
            Verdict::Wait => {}
        }
        if told.elapsed() >= KEEPALIVE {
            out.control(VerdictTag::Wait)?;
            told = Instant::now();
        }
        match poll_tag(r)?.map(Reply::try_from) {
            None => {}
            Some(Ok(Reply::Started)) => started_there = true,
            Some(Ok(Reply::Refuse)) => return Err(MigrateError::Refused(message(r)?)),
            Some(Ok(t @ (Reply::Accept | Reply::Prepared | Reply::Committed))) => {
                let why = format!("unexpected {:#04x} while the verdict was open", u8::from(t));
                say(&mut out.w, VerdictTag::Abort.into(), &why);
                return bad(why);
            }
            Some(Err(t)) => {
                let why = format!("unexpected {t:#04x} while the verdict was open");
                say(&mut out.w, VerdictTag::Abort.into(), &why);
                return bad(why);
            }
        }
    }
}

/// A byte, if one comes within the read's patience (None if none did).
pub(super) fn poll_tag(r: &mut impl Read) -> Result<Option<u8>, MigrateError> {
    let mut t = [0u8];
    match r.read(&mut t) {
        Ok(0) => Err(MigrateError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the other end closed the connection",
        ))),
        Ok(_) => Ok(Some(t[0])),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

fn send_passes<W: Write>(
    dev: &Device,
    out: &mut Out<W>,
    quiet: &dyn Fn() -> bool,
    cancelled: &dyn Fn() -> Option<String>,
    progress: &dyn Fn(Progress),
) -> Result<(u32, Instant, u64), MigrateError> {
    let stop = || match cancelled() {
        Some(why) => Err(MigrateError::Aborted(why)),
        None => Ok(()),
    };
    let mut buf = ExportBuf::new()?;
    let mut pass = 1;
    out.pass(pass)?;
    // The destination starts empty: the first pass skips empty slots.
    for range in dev.stored_ranges() {
        stop()?;
        for s in range {
            if s % 4096 == 0 {
                stop()?;
            }
            let rec = dev.export(&mut buf, s)?;
            if rec != Record::Empty {
                out.record(s, rec)?;
            }
        }
        progress(Progress {
            bytes: out.bytes,
            records: out.records,
            pass,
            dirty: dev.dirty.count(),
        });
    }
    let mut said = Instant::now();
    loop {
        stop()?;
        // Looked at before the dirty slots are taken: whatever was written
        // before the device went quiet is in this pass.
        let was_quiet = quiet();
        let quiet_at = Instant::now();
        let dirty = dev.dirty.take();
        let before = out.records;
        if dirty.is_empty() && !was_quiet && said.elapsed() >= KEEPALIVE {
            // A guest that writes nothing for a while: the pass marker
            // again, so that the destination (which gives up on a silent
            // stream) knows the source is there. libvirt's destination
            // QEMU takes its RAM for as long as it needs meanwhile.
            out.pass(pass)?;
            said = Instant::now();
        }
        if !dirty.is_empty() || was_quiet {
            said = Instant::now();
            pass += 1;
            out.pass(pass)?;
            for &s in &dirty {
                let rec = dev.export(&mut buf, s)?;
                out.record(s, rec)?;
            }
        }
        progress(Progress {
            bytes: out.bytes,
            records: out.records,
            pass,
            dirty: dev.dirty.count(),
        });
        if was_quiet {
            return Ok((pass, quiet_at, out.records - before));
        }
        out.w.flush()?;
        if dirty.is_empty() {
            std::thread::sleep(IDLE_PAUSE);
        }
    }
}

/// Discards every slot and gives the memory back.
pub fn empty(dev: &Device, cx: &mut Context) -> Result<(), StoreError> {
    dev.discard(cx, 0..dev.num_slots())?;
    dev.compact();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes are the wire format: pinned here, and read back only in
    /// their own context (b'C' is a compressed record among the records,
    /// a commit in the verdict, nothing from the destination).
    #[test]
    fn each_context_reads_its_own_tags() {
        use RecordTag as T;
        for (t, b) in [
            (T::Empty, b'E'),
            (T::Same, b'S'),
            (T::Compressed, b'C'),
            (T::Raw, b'R'),
            (T::Pass, b'P'),
            (T::Final, b'F'),
            (T::Abort, b'B'),
        ] {
            assert_eq!((u8::from(t), T::try_from(b)), (b, Ok(t)));
        }
        for (t, b) in [
            (VerdictTag::Wait, b'W'),
            (VerdictTag::Commit, b'C'),
            (VerdictTag::Abort, b'B'),
        ] {
            assert_eq!((u8::from(t), VerdictTag::try_from(b)), (b, Ok(t)));
        }
        for (t, b) in [
            (Reply::Accept, b'A'),
            (Reply::Prepared, b'K'),
            (Reply::Committed, b'D'),
            (Reply::Started, b'S'),
            (Reply::Refuse, b'X'),
        ] {
            assert_eq!((u8::from(t), Reply::try_from(b)), (b, Ok(t)));
        }
        assert_eq!(VerdictTag::try_from(b'E'), Err(b'E'));
        assert_eq!(Reply::try_from(b'C'), Err(b'C'));
        assert_eq!(RecordTag::try_from(b'W'), Err(b'W'));
    }
}
