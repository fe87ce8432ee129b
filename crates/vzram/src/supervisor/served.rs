//! A configured device as the supervisor holds it: its socket, its
//! locked state and backing file, its worker's slot and its migrations.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{
    AtomicBool, Ordering::AcqRel, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::sync::{Mutex, MutexGuard};

use vzram_store::{Backing, Cells, DeviceCells, StateFiles, StoreError};

use crate::config::DeviceSpec;
use crate::owner::migration::Listener;

use super::worker_slot::{Phase, WorkerSlot};

/// A device's backing file as the supervisor keeps it open: holding the
/// descriptor holds the file's lock (taken when it was opened) for as long
/// as the device exists, and each worker gets a copy.
pub struct BackingFile {
    pub file: std::fs::File,
    pub path: PathBuf,
    /// Opened with O_DIRECT (false: a file system that refuses it, such as
    /// tmpfs; buffered I/O with the cache dropped after each write).
    pub direct: bool,
    /// Page blocks (the header block not counted).
    pub blocks: u64,
}

impl BackingFile {
    /// Keeps `b`'s file (a second descriptor of the same open file, so the
    /// lock stays with it when `b` goes).
    pub fn of(b: &Backing) -> io::Result<BackingFile> {
        Ok(BackingFile {
            file: b.file().try_clone()?,
            path: b.path().to_path_buf(),
            direct: b.direct(),
            blocks: b.blocks(),
        })
    }

    /// A [`Backing`] over another descriptor of the same file, for a
    /// device served in this process.
    pub(super) fn open(&self) -> Result<Backing, StoreError> {
        let file = self
            .file
            .try_clone()
            .map_err(|e| StoreError::backing(self.path.display(), e))?;
        Backing::from_file(file, self.path.clone(), self.direct)
    }
}

/// A configured device as the supervisor holds it.
pub struct Served {
    pub spec: DeviceSpec,
    pub(super) listener: UnixListener,
    /// The state, opened and locked once; each worker gets clones.
    pub(super) files: StateFiles,
    /// The backing file, if the device has one.
    pub backing: Option<BackingFile>,
    /// A SIGBUS on `cells` (its file truncated) gives a zero page and
    /// marks the device damaged instead of killing every device. Declared
    /// before `cells`, so it is unregistered before the mapping goes.
    pub stats_guard: Option<crate::sys::fault::Guarded>,
    pub cells: Cells<DeviceCells>,
    /// Added at run time (`vzram add`): its socket is the launcher's to remove.
    pub added: bool,
    /// Its worker.
    pub worker: WorkerSlot,
    /// Its migrations, in and out.
    pub migration: MigrationSlot,
}

/// A device's migrations as the supervisor tracks them: one `vzram
/// migrate` at a time, the incoming listener until its thread takes it,
/// the stream arriving, and why the last move failed.
#[derive(Default)]
pub struct MigrationSlot {
    sending: AtomicBool,
    /// The owner carries out a send: a failure it marks is not recorded
    /// here yet.
    settling: AtomicBool,
    listener: Mutex<Option<Listener>>,
    /// A copy of the arriving stream's socket, so `reset` and `remove` can
    /// cut it.
    arriving: Mutex<Option<OwnedFd>>,
    error: Mutex<Option<String>>,
}

/// A `vzram migrate` of the device under way, or the owner's part of it
/// ([`MigrationSlot::settle`]); it ends when this drops.
pub struct Sending<'a>(&'a AtomicBool);

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        self.0.store(false, Release);
    }
}

impl MigrationSlot {
    /// The device's send, unless one is under way already.
    pub fn begin_send(&self) -> Option<Sending<'_>> {
        (!self.sending.swap(true, AcqRel)).then_some(Sending(&self.sending))
    }

    pub fn sending(&self) -> bool {
        self.sending.load(Acquire)
    }

    /// The owner is told to send; dropped once its outcome is recorded
    /// (the error set), so that `stat` never shows a failure without it.
    pub fn settle(&self) -> Sending<'_> {
        self.settling.store(true, Release);
        Sending(&self.settling)
    }

    /// Whether a send's outcome is still to be recorded.
    pub fn settling(&self) -> bool {
        self.settling.load(Acquire)
    }

    pub fn set_listener(&self, l: Option<Listener>) {
        *lock(&self.listener) = l;
    }

    /// The incoming listener, for the thread that accepts on it.
    pub fn take_listener(&self) -> Option<Listener> {
        lock(&self.listener).take()
    }

    /// A stream arrives (Some) or has ended (None).
    pub fn set_arriving(&self, stream: Option<OwnedFd>) {
        *lock(&self.arriving) = stream;
    }

    pub fn arriving(&self) -> bool {
        lock(&self.arriving).is_some()
    }

    /// Shuts the arriving stream down, if there is one: its receiver's
    /// next read or write fails and it undoes what it applied.
    pub fn cut(&self) -> bool {
        let arriving = lock(&self.arriving);
        let Some(fd) = arriving.as_ref() else {
            return false;
        };
        // SAFETY: shutdown of a socket we own a descriptor of.
        unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
        true
    }

    /// Why the last move failed, for `vzram stat`.
    pub fn error(&self) -> Option<String> {
        lock(&self.error).clone()
    }

    pub fn set_error(&self, e: Option<String>) {
        *lock(&self.error) = e;
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Served {
    pub fn new(
        spec: DeviceSpec,
        listener: UnixListener,
        files: StateFiles,
        backing: Option<BackingFile>,
    ) -> Result<Served, StoreError> {
        let cells = Cells::<DeviceCells>::shared(&files.stats)?;
        let (ptr, len) = cells.mapping();
        let stats_guard = crate::sys::fault::register(ptr, len, &files.dir.join("stats"), true);
        // Counted per daemon run (the worker adds to it).
        cells.connections.store(0, Relaxed);
        Ok(Served {
            spec,
            listener,
            files,
            backing,
            stats_guard,
            cells,
            added: false,
            worker: WorkerSlot::default(),
            migration: MigrationSlot::default(),
        })
    }

    /// Gives an incoming device its listener (taken by
    /// [`Supervisor::start_incoming`]).
    pub fn with_incoming(self, l: Option<Listener>) -> Served {
        self.migration.set_listener(l);
        self
    }

    pub fn state_dir(&self) -> &std::path::Path {
        &self.files.dir
    }

    pub fn state_bytes(&self) -> u64 {
        self.files.bytes()
    }

    /// The frontend connected (or connecting) to the device, as a refusal
    /// names it: its process, by the socket's peer credentials, and since
    /// when. None while no frontend is there.
    pub(super) fn frontend(&self) -> Option<String> {
        self.frontend_in(&self.worker.phase())
    }

    /// [`Served::frontend`] under a phase lock the caller holds.
    pub(super) fn frontend_in(&self, ph: &Phase) -> Option<String> {
        let (conn, since, how) = match ph {
            Phase::Running {
                frontend: Some(f),
                started,
                ..
            } => (f, *started, "connected"),
            Phase::Pending { conn, since, .. } => (conn, *since, "connecting"),
            Phase::Running { frontend: None, .. } | Phase::Idle | Phase::Busy => return None,
        };
        // One that has hung up is going: its worker ends by itself.
        if crate::sys::socket::hung_up(std::os::fd::AsRawFd::as_raw_fd(conn)) {
            return None;
        }
        let who = match peer(conn) {
            Some((pid, uid)) => format!("frontend pid {pid} (uid {uid})"),
            None => "a frontend".to_string(),
        };
        Some(format!(
            "{who} on {}, {how} for {}s",
            self.spec.socket.display(),
            since.elapsed().as_secs()
        ))
    }

    /// Requests served so far (reads, writes and discards), from the
    /// shared counters.
    pub(super) fn requests_served(&self) -> u64 {
        self.cells.latencies().iter().map(|(_, l)| l.count).sum()
    }
}

/// The process and user at the other end of `s` (SO_PEERCRED).
fn peer(s: &UnixStream) -> Option<(i32, u32)> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which we own.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some((cred.pid, cred.uid))
}

#[cfg(test)]
mod migration_slot_tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    use super::MigrationSlot;

    #[test]
    fn one_send_at_a_time_until_the_first_ends() {
        let m = MigrationSlot::default();
        let first = m.begin_send().expect("the first send");
        assert!(m.sending());
        assert!(m.begin_send().is_none(), "a second send while one runs");
        drop(first);
        assert!(!m.sending());
        assert!(m.begin_send().is_some());
    }

    #[test]
    fn a_cut_ends_the_arriving_stream_for_its_sender() {
        let m = MigrationSlot::default();
        assert!(!m.cut(), "nothing arrives");
        let (ours, mut sender) = UnixStream::pair().unwrap();
        m.set_arriving(Some(ours.into()));
        assert!(m.arriving());
        assert!(m.cut());
        let mut buf = [0u8; 1];
        assert_eq!(sender.read(&mut buf).unwrap(), 0, "the sender sees the end");
        m.set_arriving(None);
        assert!(!m.arriving());
    }
}
