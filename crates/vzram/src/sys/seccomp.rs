//! The sandbox: a seccomp filter, installed on every thread once set-up is
//! done (sockets bound, pool reserved, logging running), that allows only
//! the system calls serving needs.
//!
//! What serving needs: accepting frontends on already bound sockets,
//! vhost-user messages with file descriptors (guest memory, eventfds),
//! mapping guest memory and the pool, epoll and eventfds in the queue
//! threads, threads per connection and per queue, and removing our own
//! socket files at shutdown. Not allowed, among others: opening files,
//! creating sockets, `execve`, `fork` (only thread clones), `ptrace`,
//! executable mappings, signalling other processes.
//!
//! A call outside the list raises SIGSYS. The handler (in
//! [`super::signals`], installed with the filter) writes the call's number
//! to stderr and the process then dies of SIGSYS; the
//! call itself never runs. `--seccomp log` allows everything but has the
//! kernel log what would have been refused (dmesg / audit: `type=1326`),
//! which is how to find a missing call; `--seccomp off` installs nothing.

use std::collections::BTreeMap;
use std::os::fd::RawFd;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use thiserror::Error;

use super::signals::{report_sigsys, HandlerError};
use crate::proto::worker_spec::SeccompMode as Mode;

/// Which process the filter is for. They differ in what only one needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Accepts frontends, hands them to workers, answers control requests.
    Supervisor,
    /// Serves one frontend connection.
    Worker,
}

#[derive(Debug, Error)]
pub enum Error {
    #[error("cannot build the seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("cannot install the seccomp filter ({0}); --seccomp off runs without it")]
    Install(#[from] seccompiler::Error),
    #[error(transparent)]
    Handler(#[from] HandlerError),
}

/// The allow-list: system call → rules, any one of which lets it through
/// (no rules: whatever the arguments).
struct Rules(BTreeMap<i64, Vec<SeccompRule>>);

impl Rules {
    /// Allowed whatever the arguments.
    fn allow(&mut self, nrs: &[libc::c_long]) {
        for &nr in nrs {
            self.0.insert(nr, Vec::new());
        }
    }

    /// Allowed when any one of `rules` matches (each rule: all its conditions).
    fn allow_if(&mut self, nr: libc::c_long, rules: Vec<SeccompRule>) {
        self.0.insert(nr, rules);
    }
}

/// Argument `arg` equals `v`.
fn eq(arg: u8, v: u64) -> Result<SeccompRule, Error> {
    Ok(SeccompRule::new(vec![SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::Eq,
        v,
    )?])?)
}

/// Each argument `arg` (a 32-bit int) equals its `v`.
fn all_eq(conds: &[(u8, u64)]) -> Result<SeccompRule, Error> {
    let conds = conds
        .iter()
        .map(|&(arg, v)| SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, v))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SeccompRule::new(conds)?)
}

/// The bits `mask` of argument `arg` (a 32-bit int) equal `v`.
fn masked(arg: u8, mask: u64, v: u64) -> Result<SeccompRule, Error> {
    Ok(SeccompRule::new(vec![SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(mask),
        v,
    )?])?)
}

/// The allow-list. `socket_dirs` are the directories (O_PATH descriptors)
/// of our socket files: `unlinkat` is allowed relative to them only.
fn rules(role: Role, socket_dirs: &[RawFd]) -> Result<Rules, Error> {
    use libc::*;
    let mut r = Rules(BTreeMap::new());

    // Memory: the allocator, the pool arena (MADV_DONTNEED / POPULATE_WRITE),
    // guest memory tables and the dirty log (mmap of the frontend's memfds),
    // thread stacks.
    // Never executable: no PROT_EXEC in mmap or mprotect.
    r.allow(&[SYS_munmap, SYS_madvise, SYS_mremap, SYS_brk, SYS_mincore]);
    let no_exec = || masked(2, PROT_EXEC as u64, 0);
    r.allow_if(SYS_mmap, vec![no_exec()?]);
    r.allow_if(SYS_mprotect, vec![no_exec()?]);

    // Threads: per connection and per queue. clone only with CLONE_THREAD
    // (a thread, never a new process); clone3 hides its flags in memory the
    // filter cannot read, so it fails with ENOSYS (see [`ERRNO_CALLS`]) and
    // glibc falls back to clone.
    r.allow_if(
        SYS_clone,
        vec![masked(
            0,
            (CLONE_THREAD | CLONE_VM) as u64,
            (CLONE_THREAD | CLONE_VM) as u64,
        )?],
    );
    r.allow(&[
        SYS_futex,
        SYS_set_robust_list,
        SYS_rseq,
        SYS_sched_yield,
        SYS_sched_getaffinity,
        SYS_gettid,
        SYS_getpid,
        SYS_exit,
        SYS_exit_group,
    ]);
    // Thread names (`listen-vm1`, `vhost-vm1`...): prctl(PR_SET_NAME) only.
    r.allow_if(SYS_prctl, vec![eq(0, PR_SET_NAME as u64)?]);
    // A worker's queue and compress threads each add the queue filter on
    // themselves ([`QueueFilter::enter`]): one more filter, on the calling
    // thread only (flags 0: no TSYNC, no listener). A filter only ever
    // takes calls away.
    if role == Role::Worker {
        r.allow_if(
            SYS_seccomp,
            vec![all_eq(&[(0, SECCOMP_SET_MODE_FILTER as u64), (1, 0)])?],
        );
    }

    // Signals: the shutdown sigwait, Rust's per-thread alternate stack for
    // stack-overflow reports, and abort() on our own process only. A timed
    // wait cut short by SIGSTOP/SIGCONT (job control, a debugger) resumes
    // through restart_syscall: refused, stopping a process killed it.
    r.allow(&[
        SYS_rt_sigprocmask,
        SYS_rt_sigreturn,
        SYS_rt_sigtimedwait,
        SYS_sigaltstack,
        SYS_restart_syscall,
    ]);
    // A fault that is not a stack overflow makes Rust's SIGSEGV handler
    // restore the default action and return, so the fault kills us with its
    // real signal. Refused, that showed up as SIGSYS and hid the cause.
    r.allow_if(
        SYS_rt_sigaction,
        [SIGSEGV, SIGBUS]
            .iter()
            .map(|&sig| eq(0, sig as u64))
            .collect::<Result<_, _>>()?,
    );
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { getpid() } as u64;
    r.allow_if(SYS_tgkill, vec![eq(0, pid)?]);

    // Sockets that are already bound: accept frontends and control clients,
    // vhost-user messages with SCM_RIGHTS (guest memory, eventfds), control
    // requests and replies, closing a frontend's connection. No bind(),
    // listen() or connect(): nothing new is offered to the network or the
    // file system, and nothing is reached. The supervisor makes one
    // socket pair per worker it starts (the worker's control channel), and
    // a stream pair per TLS migration stream (it relays the plaintext to
    // the device's owner, keeping the keys).
    if role == Role::Supervisor {
        let pair = |kind: i32| {
            all_eq(&[
                (0, AF_UNIX as u64),
                (1, (kind | SOCK_CLOEXEC) as u64),
                (2, 0),
            ])
        };
        r.allow_if(
            SYS_socketpair,
            vec![pair(SOCK_SEQPACKET)?, pair(SOCK_STREAM)?],
        );
    }
    // What kind of socket a passed descriptor is: the vhost crate asks
    // before it looks at a socket a frontend sent (the guard refuses those
    // messages first; this keeps the filter and the crate in agreement).
    // The supervisor also asks who a frontend is (SO_PEERCRED), to name
    // it when it refuses to remove or reset a device in use.
    let peer: &[i32] = if role == Role::Supervisor {
        &[SO_DOMAIN, SO_TYPE, SO_PEERCRED]
    } else {
        &[SO_DOMAIN, SO_TYPE]
    };
    r.allow_if(
        SYS_getsockopt,
        peer.iter()
            .map(|&o| all_eq(&[(1, SOL_SOCKET as u64), (2, o as u64)]))
            .collect::<Result<_, _>>()?,
    );
    r.allow(&[
        SYS_accept4,
        SYS_recvmsg,
        SYS_sendmsg,
        SYS_recvfrom,
        SYS_sendto,
        SYS_shutdown,
    ]);

    // Descriptors: eventfds (kick, call, worker exit), epoll in every
    // worker, plain I/O on sockets and eventfds, logs on stderr; pread of
    // a device state's header handed over as a descriptor (a device added
    // at run time) and of a backing file.
    r.allow(&[
        SYS_read,
        SYS_pread64,
        SYS_write,
        SYS_readv,
        SYS_writev,
        SYS_close,
        SYS_eventfd2,
        SYS_epoll_create1,
        SYS_epoll_ctl,
        SYS_epoll_pwait,
        SYS_ppoll,
    ]);
    // epoll_wait in the queue threads; poll while a listener waits for a
    // frontend.
    #[cfg(target_arch = "x86_64")]
    r.allow(&[SYS_epoll_wait, SYS_poll]);
    // The size and type of a descriptor the frontend sent (a guest memory
    // file): metadata only, never contents. Rust's File::metadata is statx
    // with AT_EMPTY_PATH, then fstat(at).
    r.allow(&[SYS_fstat, SYS_newfstatat, SYS_statx, SYS_lseek]);
    // Allocating a new span's (or slot-table page's) blocks in a state
    // file before storing there: a full tmpfs fails the write instead of
    // raising SIGBUS. Only files this process holds; it opens none.
    r.allow(&[SYS_fallocate]);
    // The backing file, handed over already open: pages written back and
    // read in at offsets (pwrite64, pread64 above), its header made durable
    // when a device first claims it (fdatasync), the page cache dropped
    // behind writes where O_DIRECT is refused (fadvise64), and its lock
    // taken again on the descriptor that already holds it: flock only as
    // LOCK_EX|LOCK_NB, never LOCK_UN or a blocking wait.
    r.allow(&[SYS_pwrite64, SYS_fdatasync, SYS_fadvise64]);
    r.allow_if(SYS_flock, vec![all_eq(&[(1, (LOCK_EX | LOCK_NB) as u64)])?]);
    // fcntl: descriptor and status flags, and duplicating (try_clone).
    r.allow_if(
        SYS_fcntl,
        [F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_DUPFD_CLOEXEC]
            .iter()
            .map(|&c| eq(1, c as u64))
            .collect::<Result<_, _>>()?,
    );

    // Time and randomness (hash map keys).
    r.allow(&[
        SYS_clock_gettime,
        SYS_clock_nanosleep,
        SYS_nanosleep,
        SYS_getrandom,
    ]);

    // Shutdown: removing our socket files, relative to their directories.
    if !socket_dirs.is_empty() {
        r.allow_if(
            SYS_unlinkat,
            socket_dirs
                .iter()
                .map(|&fd| eq(0, fd as u64))
                .collect::<Result<_, _>>()?,
        );
    }

    // Let through here; the errno filters below fail them (see `install`).
    let errno_calls: Vec<_> = ERRNO_CALLS.iter().map(|&(nr, _)| nr).collect();
    r.allow(&errno_calls);
    Ok(r)
}

/// Calls that fail with an error instead of killing us: their callers cope.
/// - clone3: its flags sit in memory the filter cannot read; on ENOSYS
///   glibc falls back to clone, whose flags the allow-list checks.
/// - openat, open: glibc reads /sys/devices/system/cpu/online the first
///   time a thread needs a new malloc arena, and falls back to
///   sched_getaffinity when that fails.
/// - readlink(at), getcwd: a panic with RUST_BACKTRACE set looks for the
///   binary (/proc/self/exe) to symbolise, and prints bare addresses when
///   it cannot.
#[cfg(target_arch = "x86_64")]
const ERRNO_CALLS: &[(libc::c_long, libc::c_int)] = &[
    (libc::SYS_clone3, libc::ENOSYS),
    (libc::SYS_openat, libc::EACCES),
    (libc::SYS_open, libc::EACCES),
    (libc::SYS_readlinkat, libc::EACCES),
    (libc::SYS_readlink, libc::EACCES),
    (libc::SYS_getcwd, libc::EACCES),
];
#[cfg(not(target_arch = "x86_64"))]
const ERRNO_CALLS: &[(libc::c_long, libc::c_int)] = &[
    (libc::SYS_clone3, libc::ENOSYS),
    (libc::SYS_openat, libc::EACCES),
    (libc::SYS_readlinkat, libc::EACCES),
    (libc::SYS_getcwd, libc::EACCES),
];

/// The queue filter's allow-list: what a worker's queue threads (the vhost
/// crate's `vring_worker`s, which run the requests of one virtqueue) and
/// its compress-pool threads call once they serve requests, measured with
/// `strace -f` on workers under the blkio and raw-frontend tests, QEMU
/// guests, tiering and migration. No sockets, no descriptors made or
/// changed, no files but the backing file (`backing`, when the device has
/// one) and the arena's state file (`arena`: staged pages are written
/// through it), no threads started: those stay with the worker's other
/// threads.
fn queue_rules(backing: Option<RawFd>, arena: Option<RawFd>) -> Result<Rules, Error> {
    use libc::*;
    let mut r = Rules(BTreeMap::new());
    // Memory: the allocator (a new arena on a thread's first allocation,
    // then growing it), the pool arena (MADV_POPULATE_WRITE, DONTNEED),
    // and the thread's own stack at its end. Never executable.
    r.allow(&[SYS_munmap, SYS_madvise, SYS_mremap, SYS_brk]);
    let no_exec = || masked(2, PROT_EXEC as u64, 0);
    r.allow_if(SYS_mmap, vec![no_exec()?]);
    r.allow_if(SYS_mprotect, vec![no_exec()?]);
    // Locks, hash map keys, the poller's short sleeps, a new malloc arena
    // sizing itself; the thread's end (its signal mask and alternate stack
    // taken down) and a panic's exit.
    r.allow(&[
        SYS_futex,
        SYS_getrandom,
        SYS_clock_gettime,
        SYS_clock_nanosleep,
        SYS_nanosleep,
        SYS_sched_yield,
        SYS_sched_getaffinity,
        SYS_gettid,
        SYS_getpid,
        SYS_rt_sigprocmask,
        SYS_rt_sigreturn,
        SYS_sigaltstack,
        SYS_restart_syscall,
        SYS_exit,
        SYS_exit_group,
    ]);
    // As the process filter: SIGSEGV/SIGBUS put back to their default to
    // die of them, abort() on this process only.
    r.allow_if(
        SYS_rt_sigaction,
        [SIGSEGV, SIGBUS]
            .iter()
            .map(|&sig| eq(0, sig as u64))
            .collect::<Result<_, _>>()?,
    );
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { getpid() } as u64;
    r.allow_if(SYS_tgkill, vec![eq(0, pid)?]);
    // The ring: waiting for a kick (epoll_wait in the vhost crate's loop),
    // reading the kick eventfd, writing the call eventfd; log lines on
    // stderr. Closing: the thread's epoll descriptor when it ends, and a
    // replaced guest memory table's files when a queue thread held the
    // last reference (std checks a descriptor with F_GETFD as it drops it).
    r.allow(&[SYS_read, SYS_write, SYS_writev, SYS_close, SYS_epoll_pwait]);
    r.allow_if(SYS_fcntl, vec![eq(1, F_GETFD as u64)?]);
    #[cfg(target_arch = "x86_64")]
    r.allow(&[SYS_epoll_wait]);
    // A state file's blocks allocated before a page is stored there
    // (mmap.rs: FALLOC_FL_KEEP_SIZE only).
    r.allow_if(
        SYS_fallocate,
        vec![all_eq(&[(1, FALLOC_FL_KEEP_SIZE as u64)])?],
    );
    // The backing file: a page read in, pages spilled to it when the
    // device is over its memory limit, the cache dropped behind them. On
    // its descriptor only.
    let mut pwrite = Vec::new();
    if let Some(fd) = backing {
        for nr in [SYS_pread64, SYS_fadvise64] {
            r.allow_if(nr, vec![all_eq(&[(0, fd as u64)])?]);
        }
        pwrite.push(all_eq(&[(0, fd as u64)])?);
    }
    // The arena's state file: a staged page stored into a span not backed
    // yet (heap.rs `write_page`). On its descriptor only.
    if let Some(fd) = arena {
        pwrite.push(all_eq(&[(0, fd as u64)])?);
    }
    if !pwrite.is_empty() {
        r.allow_if(SYS_pwrite64, pwrite);
    }
    // Through to the errno filters below, as in the process filter.
    let errno_calls: Vec<_> = ERRNO_CALLS.iter().map(|&(nr, _)| nr).collect();
    r.allow(&errno_calls);
    Ok(r)
}

/// The narrower filter a worker's queue and compress-pool threads put on
/// themselves, over the process filter ([`install_worker`]).
///
/// A filter installed without TSYNC applies to the calling thread (and
/// threads it starts later) alone, and TSYNC fails once any thread has a
/// filter of its own. So the process filter goes on first, on every
/// thread, and each of these threads adds this one before it takes its
/// first request ([`QueueFilter::enter`], run through
/// `vzram_blk::ThreadHook`). A call it lacks is refused as the process
/// filter refuses one: SIGSYS, named and fatal (`--seccomp on`), or logged
/// by the kernel (`--seccomp log`).
pub struct QueueFilter {
    prog: BpfProgram,
}

/// Set once the worker's process filter is in: [`QueueFilter::enter`]
/// waits for it (a filter of a thread's own would make TSYNC fail).
static PROCESS_FILTER_IN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl QueueFilter {
    /// The filter for a worker whose device's backing file is `backing`
    /// and arena file `arena`; None with `--seccomp off`.
    pub fn new(
        mode: Mode,
        backing: Option<RawFd>,
        arena: Option<RawFd>,
    ) -> Result<Option<QueueFilter>, Error> {
        let mismatch = match mode {
            Mode::Off => return Ok(None),
            Mode::Log => SeccompAction::Log,
            Mode::On => SeccompAction::Trap,
        };
        let prog = SeccompFilter::new(
            queue_rules(backing, arena)?.0,
            mismatch,
            SeccompAction::Allow,
            arch(),
        )?
        .try_into()?;
        Ok(Some(QueueFilter { prog }))
    }

    /// Puts the filter on the calling thread. False while the process
    /// filter is not in yet (ask again later); true once done, or once it
    /// failed (logged: the thread goes on under the process filter).
    pub fn enter(&self) -> bool {
        if !PROCESS_FILTER_IN.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        if let Err(e) = apply_to_this_thread(&self.prog) {
            tracing::error!(
                "cannot narrow this thread's seccomp filter ({e}); it keeps the worker's"
            );
        }
        true
    }
}

/// seccomp(SECCOMP_SET_MODE_FILTER) with no flags: this thread only. Not
/// seccompiler's `apply_filter`, which first sets no_new_privs with a
/// prctl the process filter refuses; TSYNC already set it on every thread.
fn apply_to_this_thread(prog: &BpfProgram) -> std::io::Result<()> {
    let fprog = libc::sock_fprog {
        len: u16::try_from(prog.len()).map_err(std::io::Error::other)?,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `fprog` points to `prog`'s instructions (seccompiler's
    // sock_filter has the kernel's layout), alive for the call; the kernel
    // copies them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            &fprog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The allow-list filter for this architecture.
fn allow_list(mode: Mode, role: Role, socket_dirs: &[RawFd]) -> Result<BpfProgram, Error> {
    let mismatch = match mode {
        Mode::Log => SeccompAction::Log,
        Mode::On | Mode::Off => SeccompAction::Trap,
    };
    Ok(SeccompFilter::new(
        rules(role, socket_dirs)?.0,
        mismatch,
        SeccompAction::Allow,
        arch(),
    )?
    .try_into()?)
}

/// The filters below the allow-list: one per errno in [`ERRNO_CALLS`],
/// failing those calls with it and allowing everything else. The kernel
/// runs every installed filter and takes the strictest answer, so with the
/// allow-list on top (which lets these calls through) they fail instead of
/// killing the daemon. (A seccompiler filter has a single action on match.)
fn errno_filters() -> Result<Vec<BpfProgram>, Error> {
    let mut by_errno: BTreeMap<libc::c_int, Vec<libc::c_long>> = BTreeMap::new();
    for &(nr, errno) in ERRNO_CALLS {
        by_errno.entry(errno).or_default().push(nr);
    }
    by_errno
        .into_iter()
        .map(|(errno, nrs)| {
            let rules = nrs.into_iter().map(|nr| (nr, Vec::new())).collect();
            Ok(SeccompFilter::new(
                rules,
                SeccompAction::Allow,
                SeccompAction::Errno(errno as u32),
                arch(),
            )?
            .try_into()?)
        })
        .collect()
}

#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "riscv64"
)))]
compile_error!("the seccomp filter knows x86_64, aarch64 and riscv64 only");

fn arch() -> TargetArch {
    #[cfg(target_arch = "x86_64")]
    return TargetArch::x86_64;
    #[cfg(target_arch = "aarch64")]
    return TargetArch::aarch64;
    #[cfg(target_arch = "riscv64")]
    return TargetArch::riscv64;
}

/// Installs the filter on every thread of the process (TSYNC: threads that
/// already run, such as auto-compaction, get it too; later threads inherit
/// it). Call it once set-up is done.
pub fn install(mode: Mode, socket_dirs: &[RawFd]) -> Result<(), Error> {
    install_as(mode, Role::Supervisor, socket_dirs)
}

/// The worker's filter: the supervisor's without making sockets or
/// removing files. Its queue and compress threads then narrow theirs
/// ([`QueueFilter`]).
pub fn install_worker(mode: Mode) -> Result<(), Error> {
    install_as(mode, Role::Worker, &[])?;
    PROCESS_FILTER_IN.store(true, std::sync::atomic::Ordering::Release);
    Ok(())
}

fn install_as(mode: Mode, role: Role, socket_dirs: &[RawFd]) -> Result<(), Error> {
    let allow = match mode {
        Mode::Off => return Ok(()),
        Mode::On => {
            report_sigsys()?;
            // The errno filters go first: installing the allow-list is
            // itself a seccomp() call, which only they are asked about.
            for f in errno_filters()? {
                seccompiler::apply_filter_all_threads(&f)?;
            }
            allow_list(mode, role, socket_dirs)?
        }
        // Nothing refused, not even the errno calls: the kernel logs every
        // call the allow-list lacks.
        Mode::Log => allow_list(mode, role, socket_dirs)?,
    };
    seccompiler::apply_filter_all_threads(&allow)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!("on".parse(), Ok(Mode::On));
        assert_eq!("off".parse(), Ok(Mode::Off));
        assert_eq!("false".parse(), Ok(Mode::Off));
        assert_eq!("log".parse(), Ok(Mode::Log));
        assert!("maybe".parse::<Mode>().is_err());
        assert_eq!(Mode::default(), Mode::On);
    }

    #[test]
    fn filters_compile() {
        for mode in [Mode::On, Mode::Log] {
            let p = allow_list(mode, Role::Supervisor, &[3, 4]).unwrap();
            assert!(!p.is_empty() && p.len() < 4096, "{} instructions", p.len());
        }
        assert_eq!(errno_filters().unwrap().len(), 2);
    }

    /// Puts this process under the worker's filters (built before, so a
    /// forked child need not allocate); exits 99 if it cannot.
    fn enter(allow: &BpfProgram, errno: &[BpfProgram]) {
        if report_sigsys().is_err()
            || errno
                .iter()
                .any(|f| seccompiler::apply_filter_all_threads(f).is_err())
            || seccompiler::apply_filter_all_threads(allow).is_err()
        {
            // SAFETY: ends this process.
            unsafe { libc::_exit(99) };
        }
    }

    /// Runs `f` in a forked child under the filter; returns its wait status
    /// and what it wrote to stderr.
    fn in_child(f: fn()) -> (libc::c_int, String) {
        in_child_with(None, f)
    }

    /// [`in_child`], with `queue` put on the child after the worker's
    /// filter as a queue thread puts it on itself.
    fn in_child_with(queue: Option<&QueueFilter>, f: fn()) -> (libc::c_int, String) {
        // Built before fork: the child must not allocate (another test
        // thread may hold the allocator's lock at fork time).
        let allow = allow_list(Mode::On, Role::Worker, &[]).unwrap();
        let errno = errno_filters().unwrap();
        let mut pipe = [0; 2];
        // SAFETY: pipe fills in two descriptors we own.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child only makes raw system calls and exits with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: the child's stderr becomes the pipe's write end.
            unsafe { libc::dup2(pipe[1], 2) };
            enter(&allow, &errno);
            if queue.is_some_and(|q| apply_to_this_thread(&q.prog).is_err()) {
                // SAFETY: ends the child.
                unsafe { libc::_exit(98) };
            }
            f();
            // SAFETY: ends the child.
            unsafe { libc::_exit(0) };
        }
        // SAFETY: our copy of the write end; the child holds its own.
        unsafe { libc::close(pipe[1]) };
        let mut status = 0;
        // SAFETY: waiting for our own child.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(rc, pid);
        let mut out = vec![0u8; 4096];
        // SAFETY: reading into our buffer from the pipe's read end, then closing it.
        let n = unsafe {
            let n = libc::read(pipe[0], out.as_mut_ptr().cast(), out.len());
            libc::close(pipe[0]);
            n
        };
        out.truncate(n.max(0) as usize);
        (status, String::from_utf8_lossy(&out).into_owned())
    }

    /// [`in_child`] for a child that uses std's panic and backtrace
    /// machinery: a fork would inherit their locks as another test thread
    /// held them (a panicking test with RUST_BACKTRACE set) and hang. This
    /// test binary is run again instead, for the test `name` alone, and
    /// runs `f` under the filter in that fresh process.
    fn in_fresh_process(name: &str, f: fn()) -> (libc::c_int, String) {
        use std::os::unix::process::ExitStatusExt;
        const CHILD: &str = "VZRAM_SECCOMP_TEST_CHILD";
        if std::env::var(CHILD).as_deref() == Ok(name) {
            let allow = allow_list(Mode::On, Role::Worker, &[]).unwrap();
            let errno = errno_filters().unwrap();
            enter(&allow, &errno);
            f();
            // SAFETY: ends this process.
            unsafe { libc::_exit(0) };
        }
        let test = format!(
            "{}::{name}",
            module_path!().split_once("::").map_or("", |(_, m)| m)
        );
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, name)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        (
            out.status.into_raw(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn killed_by_sigsys(status: libc::c_int) -> bool {
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS
    }

    #[test]
    fn a_panic_with_a_backtrace_is_reported_not_killed() {
        // A panic in a queue thread ends that thread and is logged; with
        // RUST_BACKTRACE set, std also captures and symbolises a backtrace
        // (opening the binary fails with EACCES, so addresses only).
        let (st, err) = in_fresh_process("a_panic_with_a_backtrace_is_reported_not_killed", || {
            // The test harness captures eprintln! and the default panic
            // hook's output; write to the real stderr instead.
            fn raw(s: &str) {
                // SAFETY: write(2) from a buffer we own.
                unsafe { libc::write(2, s.as_ptr().cast(), s.len()) };
            }
            std::panic::set_hook(Box::new(|info| {
                let bt = std::backtrace::Backtrace::force_capture();
                raw(&format!("{info}\n{bt}\n"));
            }));
            let t = std::thread::spawn(|| panic!("test panic"));
            let ok = t.join().is_err();
            // SAFETY: ends the child.
            unsafe { libc::_exit(if ok { 7 } else { 8 }) };
        });
        assert!(
            libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 7,
            "status {st:#x}: {err}"
        );
        assert!(err.contains("test panic") && err.contains("0: "), "{err}");
    }

    /// A file the children of [`backing_file_calls`] inherit (a plain
    /// `fn` cannot capture it).
    static BACKING_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

    #[test]
    fn backing_file_calls() {
        let path = std::env::temp_dir().join(format!("vzram-seccomp-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        BACKING_FD.store(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            std::sync::atomic::Ordering::Relaxed,
        );
        // Writeback and its header (pwrite64, fdatasync), dropping cached
        // pages where O_DIRECT is refused (fadvise64), re-taking the lock.
        let (st, err) = in_child(|| {
            let fd = BACKING_FD.load(std::sync::atomic::Ordering::Relaxed);
            let page = [7u8; 64];
            // SAFETY: plain calls on a descriptor the child inherited.
            let ok = unsafe {
                libc::pwrite(fd, page.as_ptr().cast(), page.len(), 4096) == 64
                    && libc::fdatasync(fd) == 0
                    && libc::posix_fadvise(fd, 0, 8192, libc::POSIX_FADV_DONTNEED) == 0
                    && libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) == 0
            };
            // SAFETY: ends the child.
            unsafe { libc::_exit(if ok { 7 } else { 8 }) };
        });
        assert!(
            libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 7,
            "status {st:#x}: {err}"
        );
        // Letting go of the lock, or waiting for one, is not needed: refused.
        for f in [
            (|| {
                let fd = BACKING_FD.load(std::sync::atomic::Ordering::Relaxed);
                // SAFETY: a refused call never runs.
                unsafe { libc::flock(fd, libc::LOCK_UN) };
            }) as fn(),
            || {
                let fd = BACKING_FD.load(std::sync::atomic::Ordering::Relaxed);
                // SAFETY: as above.
                unsafe { libc::flock(fd, libc::LOCK_EX) };
            },
        ] {
            let (st, err) = in_child(f);
            assert!(killed_by_sigsys(st), "status {st:#x}: {err}");
        }
        drop(f);
    }

    #[test]
    fn allowed_calls_run_and_others_kill() {
        // Allowed: eventfd, write, an anonymous mapping, a thread clone;
        // clone3 and open fail with ENOSYS and EACCES.
        let (st, _) = in_child(|| {
            // SAFETY: plain system calls on resources the child owns; the
            // thread clone below is a raw clone whose child exits at once.
            unsafe {
                let fd = libc::eventfd(0, 0);
                let one = 1u64;
                let mut ok = fd >= 0 && libc::write(fd, (&one as *const u64).cast(), 8) == 8;
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                ok &= p != libc::MAP_FAILED;
                ok &= libc::syscall(libc::SYS_clone3, 0, 0) == -1
                    && *libc::__errno_location() == libc::ENOSYS;
                ok &= libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) == -1
                    && *libc::__errno_location() == libc::EACCES;
                libc::_exit(if ok { 7 } else { 8 });
            }
        });
        assert!(
            libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 7,
            "status {st:#x}"
        );

        // Refused: a new socket, a process clone (fork), executable memory,
        // unlinking outside the socket directories, execve.
        for (what, f) in [
            (
                "socket",
                (|| {
                    // SAFETY: a refused call never runs.
                    unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
                }) as fn(),
            ),
            ("fork", || {
                // SAFETY: as above; a process clone without CLONE_THREAD.
                unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) };
            }),
            ("mmap exec", || {
                // SAFETY: as above.
                unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        4096,
                        libc::PROT_READ | libc::PROT_EXEC,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
            }),
            ("unlinkat", || {
                // SAFETY: as above.
                unsafe { libc::unlinkat(libc::AT_FDCWD, c"/nonexistent".as_ptr(), 0) };
            }),
            ("execve", || {
                let argv = [c"/bin/true".as_ptr(), std::ptr::null()];
                // SAFETY: as above.
                unsafe { libc::execv(c"/bin/true".as_ptr(), argv.as_ptr()) };
            }),
        ] {
            let (st, err) = in_child(f);
            assert!(killed_by_sigsys(st), "{what}: status {st:#x}");
            assert!(
                err.starts_with("vzram: seccomp: system call ") && err.contains("is not allowed"),
                "{what}: {err:?}"
            );
            eprintln!("{what}: {}", err.trim());
        }
    }

    /// The descriptor the queue children below treat as the backing file.
    static QUEUE_BACKING: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
    /// And the one they treat as the device's arena file.
    static QUEUE_ARENA: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
    /// An eventfd the queue children below inherit: a kick, or a call.
    static KICK: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

    fn queue_filter(backing: Option<RawFd>, arena: Option<RawFd>) -> QueueFilter {
        QueueFilter::new(Mode::On, backing, arena).unwrap().unwrap()
    }

    fn kick() -> RawFd {
        KICK.load(std::sync::atomic::Ordering::Relaxed)
    }

    #[test]
    fn queue_threads_keep_what_a_ring_needs_and_lose_the_rest() {
        // A file of the test's own, unlinked at once: open for the children.
        let scratch = |what: &str| {
            let path =
                std::env::temp_dir().join(format!("vzram-queue-{what}-{}", std::process::id()));
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .unwrap();
            let _ = std::fs::remove_file(&path);
            f
        };
        let f = scratch("backing");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        QUEUE_BACKING.store(fd, std::sync::atomic::Ordering::Relaxed);
        let arena = scratch("arena");
        let afd = std::os::fd::AsRawFd::as_raw_fd(&arena);
        QUEUE_ARENA.store(afd, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: a new eventfd, kept open for the test's children.
        let ev = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(ev >= 0);
        KICK.store(ev, std::sync::atomic::Ordering::Relaxed);
        // A kick read and a call written on an eventfd, an allocation, a
        // state file's blocks (fallocate KEEP_SIZE), a page spilled to
        // and read back from the backing file, a staged page written
        // through the arena file; open fails (EACCES) as on every worker
        // thread, for malloc's arena sizing.
        let (st, err) = in_child_with(Some(&queue_filter(Some(fd), Some(afd))), || {
            let b = QUEUE_BACKING.load(std::sync::atomic::Ordering::Relaxed);
            let a = QUEUE_ARENA.load(std::sync::atomic::Ordering::Relaxed);
            // SAFETY: plain calls on descriptors and memory the child owns.
            unsafe {
                let one = 1u64;
                let mut v = 0u64;
                let ok = libc::write(kick(), (&one as *const u64).cast(), 8) == 8
                    && libc::read(kick(), (&mut v as *mut u64).cast(), 8) == 8;
                if !ok {
                    libc::_exit(10);
                }
                let ok = libc::pwrite(b, (&one as *const u64).cast(), 8, 4096) == 8
                    && libc::pread(b, (&mut v as *mut u64).cast(), 8, 4096) == 8
                    && v == 1;
                if !ok {
                    libc::_exit(11);
                }
                if libc::posix_fadvise(b, 0, 8192, libc::POSIX_FADV_DONTNEED) != 0 {
                    libc::_exit(12);
                }
                if libc::pwrite(a, (&one as *const u64).cast(), 8, 4096) != 8 {
                    libc::_exit(13);
                }
                let mut ok = libc::fallocate(b, libc::FALLOC_FL_KEEP_SIZE, 0, 8192) == 0;
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                ok &= p != libc::MAP_FAILED && libc::munmap(p, 4096) == 0;
                ok &= libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) == -1
                    && *libc::__errno_location() == libc::EACCES;
                libc::_exit(if ok { 7 } else { 8 });
            }
        });
        assert!(
            libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 7,
            "status {st:#x}: {err}"
        );

        // What the worker's other threads may do and a queue thread may
        // not: accept a connection, receive descriptors, write a file
        // that is neither the backing file nor the arena (here the
        // eventfd), sync one, make an eventfd. The worker's filter alone
        // lets each through (the calls fail on an eventfd, but run); the
        // queue filter kills.
        let calls: [(&str, fn()); 5] = [
            ("accept4", || {
                // SAFETY: on an eventfd: fails, or is refused before it runs.
                unsafe { libc::accept4(kick(), std::ptr::null_mut(), std::ptr::null_mut(), 0) };
            }),
            ("recvmsg", || {
                // SAFETY: as above.
                unsafe { libc::recvmsg(kick(), std::ptr::null_mut(), libc::MSG_DONTWAIT) };
            }),
            ("pwrite64", || {
                let one = 1u64;
                // SAFETY: as above.
                unsafe { libc::pwrite(kick(), (&one as *const u64).cast(), 8, 0) };
            }),
            ("fdatasync", || {
                // SAFETY: as above.
                unsafe { libc::fdatasync(kick()) };
            }),
            ("eventfd2", || {
                // SAFETY: a new eventfd, or refused.
                unsafe { libc::eventfd(0, 0) };
            }),
        ];
        for (what, f) in calls {
            let (st, err) = in_child(f);
            assert!(
                libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
                "{what} under the worker's filter: status {st:#x}: {err}"
            );
            let (st, err) = in_child_with(Some(&queue_filter(Some(fd), Some(afd))), f);
            assert!(killed_by_sigsys(st), "{what}: status {st:#x}: {err}");
            assert!(
                err.starts_with("vzram: seccomp: system call ") && err.contains("is not allowed"),
                "{what}: {err:?}"
            );
            eprintln!("{what} on a queue thread: {}", err.trim());
        }
        // SAFETY: the eventfd made above.
        unsafe { libc::close(ev) };
        drop(f);
        drop(arena);
    }
}
