//! The receiving end of the migration stream, and how a receive under way
//! is handed on to another owner of the device ([`Resume`]).

use std::io::{self, BufRead, Read, Write};
use std::time::{Duration, Instant};

use super::empty;
use super::record::Record;
use super::stream::{
    bad, message, poll_tag, refuse, MigrateError, RecordTag, Reply, StreamHeader, VerdictTag,
    HEADER_LEN, MAX_CODEC_ID, SILENCE, VERDICT_POLL,
};
use crate::cells::Progress;
use crate::context::Context;
use crate::device::Device;
use crate::PAGE_SIZE;

/// How often a receive that may be handed on, and finds the stream idle,
/// asks whether it should be.
const HAND_ON_POLL: Duration = Duration::from_millis(50);
/// Records between two asks while the stream flows.
const HAND_ON_EVERY: u64 = 64;

/// Reads the stream, checking every field before it is used.
struct In<R: Read> {
    r: io::BufReader<R>,
    crc: crc32fast::Hasher,
    slots: u64,
    records: u64,
    bytes: u64,
    data: Box<[u8; PAGE_SIZE]>,
    /// The checksum of everything before the final marker, once it came.
    got_crc: u32,
    /// The stream is to be handed on: reads take what is buffered and no
    /// more, so that the next owner finds the rest in the socket.
    draining: bool,
}

/// One item of the stream after the header.
enum Item {
    Empty(u64),
    Same(u64, u64),
    Compressed { slot: u64, codec: u8, len: usize },
    Raw(u64),
    Pass(u32),
    Final,
}

impl<R: Read> In<R> {
    /// Fills `b`; while draining, past the buffer straight from the
    /// socket (a refill would read beyond the record).
    fn fill(&mut self, b: &mut [u8]) -> io::Result<()> {
        if !self.draining {
            return self.r.read_exact(b);
        }
        let have = self.r.buffer();
        let n = have.len().min(b.len());
        b[..n].copy_from_slice(&have[..n]);
        self.r.consume(n);
        self.r.get_mut().read_exact(&mut b[n..])
    }

    fn get(&mut self, b: &mut [u8]) -> Result<(), MigrateError> {
        self.fill(b).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                MigrateError::Bad("the stream ended before its final marker".into())
            }
            _ => MigrateError::Io(e),
        })?;
        self.crc.update(b);
        self.bytes += b.len() as u64;
        Ok(())
    }

    fn u64(&mut self) -> Result<u64, MigrateError> {
        let mut b = [0u8; 8];
        self.get(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn slot(&mut self) -> Result<u64, MigrateError> {
        let s = self.u64()?;
        if s >= self.slots {
            return bad(format!(
                "slot {s} is past the end of the device ({} slots)",
                self.slots
            ));
        }
        self.records += 1;
        Ok(s)
    }

    fn next(&mut self) -> Result<Item, MigrateError> {
        let mut tag = [0u8];
        self.get(&mut tag)?;
        let tag = RecordTag::try_from(tag[0])
            .or_else(|t| bad(format!("unknown record type {t:#04x}")))?;
        Ok(match tag {
            RecordTag::Empty => Item::Empty(self.slot()?),
            RecordTag::Same => {
                let s = self.slot()?;
                Item::Same(s, self.u64()?)
            }
            RecordTag::Compressed => {
                let slot = self.slot()?;
                let mut h = [0u8; 3];
                self.get(&mut h)?;
                let codec = h[0];
                let len = usize::from(u16::from_le_bytes([h[1], h[2]]));
                if codec > MAX_CODEC_ID {
                    return bad(format!("slot {slot}: unknown codec id {codec}"));
                }
                if len == 0 || len >= PAGE_SIZE {
                    return bad(format!(
                        "slot {slot}: a compressed page of {len} bytes (1 to {} allowed)",
                        PAGE_SIZE - 1
                    ));
                }
                let mut data = std::mem::replace(&mut self.data, Box::new([0; PAGE_SIZE]));
                let r = self.get(&mut data[..len]);
                self.data = data;
                r?;
                Item::Compressed { slot, codec, len }
            }
            RecordTag::Raw => {
                let slot = self.slot()?;
                let mut data = std::mem::replace(&mut self.data, Box::new([0; PAGE_SIZE]));
                let r = self.get(&mut data[..]);
                self.data = data;
                r?;
                Item::Raw(slot)
            }
            RecordTag::Pass => {
                let mut b = [0u8; 4];
                self.get(&mut b)?;
                Item::Pass(u32::from_le_bytes(b))
            }
            // Not checksummed: the source calls the move off mid-stream.
            RecordTag::Abort => {
                let why =
                    message(&mut self.r).unwrap_or_else(|e| format!("(its reason was cut: {e})"));
                return Err(MigrateError::Aborted(format!("by the source: {why}")));
            }
            RecordTag::Final => {
                let records = self.u64()?;
                let expect = self.crc.clone().finalize();
                let mut b = [0u8; 4];
                self.fill(&mut b).map_err(|_| {
                    MigrateError::Bad("the stream ended inside its final marker".into())
                })?;
                self.bytes += 4;
                let got = u32::from_le_bytes(b);
                if got != expect {
                    return bad(format!(
                        "checksum mismatch (sent {got:#010x}, received data gives {expect:#010x})"
                    ));
                }
                if records != self.records {
                    return bad(format!(
                        "the source sent {records} records, {} arrived",
                        self.records
                    ));
                }
                self.got_crc = expect;
                Item::Final
            }
        })
    }
}

/// What the destination's stream asks of its caller.
pub struct ReceiveHooks<'a> {
    pub progress: &'a dyn Fn(Progress),
    /// Every page is here and checked (run again when a receive is taken
    /// up past that point).
    pub prepared: &'a dyn Fn(),
    /// Whether the VM runs here (its frontend started the rings), asked
    /// every [`VERDICT_POLL`] while the verdict is open.
    pub started: &'a dyn Fn() -> bool,
    /// The source committed: store that before it is confirmed.
    pub commit: &'a dyn Fn(),
    /// As [`super::SendHooks::patience`].
    pub patience: &'a dyn Fn(Option<Duration>),
}

/// What a finished receive stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReceiveReport {
    pub bytes: u64,
    pub records: u64,
    pub passes: u32,
    /// Slots that hold a page now.
    pub pages: u64,
    pub micros: u64,
}

/// How far a receive had come when it was handed on: at a record
/// boundary, with nothing read past it, so that the next owner of the
/// device reads on from the same socket and neither loses nor repeats a
/// byte. The pages received so far are in the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Resume {
    stage: Stage,
    records: u64,
    bytes: u64,
    pass: u32,
    /// The checksum of the stream so far (a crc32 state goes on from its
    /// value).
    crc: u32,
    /// The final marker's checksum, once it came.
    got_crc: u32,
    micros: u64,
}

impl Resume {
    /// Records received so far.
    pub fn records(&self) -> u64 {
        self.records
    }
}

/// Where the stream was when it was handed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum Stage {
    /// Among the records.
    Records,
    /// Every page here and confirmed; the verdict open. `told`: the source
    /// has heard that the VM runs here.
    Verdict { told: bool },
}

/// How a receive ended.
#[derive(Debug)]
pub enum Received {
    /// The source committed.
    Done(ReceiveReport),
    /// Handed on: the socket, untouched past `Resume`, goes to the next
    /// owner, which carries on with [`receive_from`].
    HandedOn(Resume),
}

/// Receives a stream into `dev` over `r`/`w`. A header that does not fit
/// the device is refused and changes nothing; anything wrong after it (a
/// bad record, a checksum mismatch, a store error, a broken connection)
/// empties the device again and is refused too. The device's previous
/// content is dropped once a valid header has arrived.
///
/// Once everything is stored and checked, `prepared` runs and the source
/// is told (with the record count and checksum); then the source decides,
/// told once `started` says the VM runs here. Its commit runs `commit`
/// (which stores it) before it is confirmed; its abort, or its going away
/// first, empties the device again.
pub fn receive(
    dev: &Device,
    r: impl Read,
    w: impl Write,
    hooks: &ReceiveHooks<'_>,
) -> Result<ReceiveReport, MigrateError> {
    match receive_from(dev, r, w, hooks, None, None)? {
        Received::Done(rep) => Ok(rep),
        Received::HandedOn(_) => unreachable!("a receive that may not be handed on was"),
    }
}

/// [`receive`], taken up where `from` left it if given (the header read
/// and answered, the device holding what came before). With `hand_on`,
/// asked at record boundaries (every [`HAND_ON_EVERY`] records, and every
/// [`HAND_ON_POLL`] while the stream is idle) and while the verdict is
/// open: once it says so, the receive reads what it has buffered and
/// nothing more, and returns [`Received::HandedOn`] at the next boundary,
/// leaving the device as it is (not emptied) for the next owner.
pub fn receive_from(
    dev: &Device,
    r: impl Read,
    mut w: impl Write,
    hooks: &ReceiveHooks<'_>,
    hand_on: Option<&dyn Fn() -> bool>,
    from: Option<Resume>,
) -> Result<Received, MigrateError> {
    let (progress, prepared) = (hooks.progress, hooks.prepared);
    let t0 = Instant::now();
    let mut inp = In {
        r: io::BufReader::with_capacity(256 << 10, r),
        crc: crc32fast::Hasher::new_with_initial(from.map_or(0, |f| f.crc)),
        slots: dev.num_slots(),
        records: from.map_or(0, |f| f.records),
        bytes: from.map_or(0, |f| f.bytes),
        data: Box::new([0; PAGE_SIZE]),
        got_crc: from.map_or(0, |f| f.got_crc),
        draining: false,
    };
    let micros0 = from.map_or(0, |f| f.micros);
    let cx = &mut Context::new(0);
    if from.is_none() {
        let mut h = [0u8; HEADER_LEN];
        inp.get(&mut h).map_err(|e| match e {
            MigrateError::Bad(_) => MigrateError::Bad("the stream ended inside its header".into()),
            e => e,
        })?;
        let header = match StreamHeader::decode(&h).and_then(|hd| {
            hd.check(dev).map_err(MigrateError::Bad)?;
            Ok(hd)
        }) {
            Ok(hd) => hd,
            Err(e) => {
                refuse(&mut w, &e.to_string());
                return Err(e);
            }
        };
        tracing::info!(
            size = header.size_bytes,
            codec = %header.codec,
            "migration stream accepted"
        );
        w.write_all(&[Reply::Accept.into()])?;
        w.flush()?;
        empty(dev, cx)?;
    }
    let mut pass = from.map_or(0, |f| f.pass);
    let resume = |inp: &In<_>, pass: u32, stage: Stage| Resume {
        stage,
        records: inp.records,
        bytes: inp.bytes,
        pass,
        crc: inp.crc.clone().finalize(),
        got_crc: inp.got_crc,
        micros: micros0 + t0.elapsed().as_micros() as u64,
    };
    let records_stage = !matches!(
        from,
        Some(Resume {
            stage: Stage::Verdict { .. },
            ..
        })
    );
    let result = (|| -> Result<Option<Resume>, MigrateError> {
        if records_stage {
            loop {
                if let Some(h) = hand_on {
                    if inp.r.buffer().is_empty() {
                        if inp.draining || h() || idle_until(&mut inp, hooks, h)? {
                            return Ok(Some(resume(&inp, pass, Stage::Records)));
                        }
                    } else if !inp.draining && inp.records % HAND_ON_EVERY == 0 && h() {
                        inp.draining = true;
                    }
                }
                match inp.next()? {
                    Item::Final => break,
                    Item::Pass(n) => {
                        pass = n;
                        progress(Progress {
                            bytes: inp.bytes,
                            records: inp.records,
                            pass,
                            dirty: 0,
                        });
                    }
                    Item::Empty(s) => dev.import(cx, s, Record::Empty)?,
                    Item::Same(s, v) => dev.import(cx, s, Record::Same(v))?,
                    Item::Raw(s) => dev.import(cx, s, Record::Raw(&inp.data))?,
                    Item::Compressed { slot, codec, len } => dev.import(
                        cx,
                        slot,
                        Record::Compressed {
                            codec,
                            data: &inp.data[..len],
                        },
                    )?,
                }
                if inp.records % 4096 == 0 {
                    progress(Progress {
                        bytes: inp.bytes,
                        records: inp.records,
                        pass,
                        dirty: 0,
                    });
                }
            }
        }
        prepared();
        let mut told = false;
        match from {
            Some(Resume {
                stage: Stage::Verdict { told: t },
                ..
            }) => told = t,
            None
            | Some(Resume {
                stage: Stage::Records,
                ..
            }) => {
                let pages = dev.stats().orig_data_size / PAGE_SIZE as u64;
                let mut b = vec![u8::from(Reply::Prepared)];
                b.extend_from_slice(&pages.to_le_bytes());
                b.extend_from_slice(&inp.records.to_le_bytes());
                b.extend_from_slice(&inp.got_crc.to_le_bytes());
                w.write_all(&b)?;
                w.flush()?;
            }
        }
        (hooks.patience)(Some(VERDICT_POLL));
        let v = verdict(&mut inp.r, &mut w, hooks.started, hand_on, told);
        (hooks.patience)(None);
        Ok(v?.map(|told| resume(&inp, pass, Stage::Verdict { told })))
    })();
    match result {
        Ok(Some(r)) => return Ok(Received::HandedOn(r)),
        Ok(None) => {}
        Err(e) => {
            refuse(&mut w, &e.to_string());
            // Undo: the device holds nothing from a stream that failed.
            let _ = empty(dev, cx);
            return Err(e);
        }
    }
    (hooks.commit)();
    let pages = dev.stats().orig_data_size / PAGE_SIZE as u64;
    let mut b = vec![u8::from(Reply::Committed)];
    b.extend_from_slice(&pages.to_le_bytes());
    // The commit stands even if the source does not hear of it: it keeps
    // its copy then, and says so.
    let _ = w.write_all(&b).and_then(|()| w.flush());
    Ok(Received::Done(ReceiveReport {
        bytes: inp.bytes,
        records: inp.records,
        passes: pass,
        pages,
        micros: micros0 + t0.elapsed().as_micros() as u64,
    }))
}

/// The stream is idle at a record boundary: waits for more of it, asking
/// `hand_on` every [`HAND_ON_POLL`]; true once it says to.
fn idle_until<R: Read>(
    inp: &mut In<R>,
    hooks: &ReceiveHooks<'_>,
    hand_on: &dyn Fn() -> bool,
) -> Result<bool, MigrateError> {
    (hooks.patience)(Some(HAND_ON_POLL));
    let r = loop {
        match inp.r.fill_buf() {
            Ok(_) => break Ok(false),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                if hand_on() {
                    break Ok(true);
                }
            }
            Err(e) => break Err(e.into()),
        }
    };
    (hooks.patience)(None);
    r
}

/// Waits for the source's verdict, telling it once `started` says the VM
/// runs here (unless `told` already): Ok(None) on its commit, an error on
/// its abort, on its going away or falling silent, or on anything else.
/// Ok(Some(told)) once `hand_on` says to, with nothing buffered.
fn verdict<R: Read>(
    r: &mut io::BufReader<R>,
    w: &mut impl Write,
    started: &dyn Fn() -> bool,
    hand_on: Option<&dyn Fn() -> bool>,
    mut told: bool,
) -> Result<Option<bool>, MigrateError> {
    let mut heard = Instant::now();
    loop {
        if !told && started() {
            w.write_all(&[Reply::Started.into()])?;
            w.flush()?;
            told = true;
            tracing::info!("the VM runs here: the source is told");
        }
        if r.buffer().is_empty() && hand_on.is_some_and(|h| h()) {
            return Ok(Some(told));
        }
        let tag = match poll_tag(r) {
            Ok(Some(t)) => t,
            Ok(None) if heard.elapsed() < SILENCE => continue,
            Ok(None) => {
                return Err(MigrateError::Aborted(format!(
                    "the source said nothing for {SILENCE:?} before it committed"
                )))
            }
            Err(e) => {
                return Err(MigrateError::Aborted(format!(
                    "the source went away before it committed ({e})"
                )))
            }
        };
        heard = Instant::now();
        match VerdictTag::try_from(tag) {
            Ok(VerdictTag::Wait) => {}
            Ok(VerdictTag::Commit) => return Ok(None),
            Ok(VerdictTag::Abort) => {
                let why = message(r).unwrap_or_else(|e| format!("(its reason was cut: {e})"));
                return Err(MigrateError::Aborted(format!("by the source: {why}")));
            }
            Err(t) => return bad(format!("unexpected {t:#04x} while waiting for the commit")),
        }
    }
}
