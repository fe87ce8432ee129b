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
//! A call outside the list raises SIGSYS. The handler installed here writes
//! the call's number to stderr and the process then dies of SIGSYS; the
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
    #[error("cannot install a signal handler: {0}")]
    Handler(std::io::Error),
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

/// The allow-list filter for this architecture.
fn allow_list(mode: Mode, role: Role, socket_dirs: &[RawFd]) -> Result<BpfProgram, Error> {
    let mismatch = match mode {
        Mode::Log => SeccompAction::Log,
        _ => SeccompAction::Trap,
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
/// removing files.
pub fn install_worker(mode: Mode) -> Result<(), Error> {
    install_as(mode, Role::Worker, &[])
}

fn install_as(mode: Mode, role: Role, socket_dirs: &[RawFd]) -> Result<(), Error> {
    let allow = match mode {
        Mode::Off => return Ok(()),
        Mode::On => {
            install_sigsys_handler()?;
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

/// The part of `siginfo_t` a SIGSYS from seccomp fills in (`_sigsys`).
#[repr(C)]
struct SigsysInfo {
    signo: libc::c_int,
    errno: libc::c_int,
    code: libc::c_int,
    _pad: libc::c_int,
    call_addr: *mut libc::c_void,
    syscall: libc::c_int,
    arch: libc::c_uint,
}

/// A line built on the stack and written with write(2): all a signal
/// handler may do.
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Line {
    fn new() -> Line {
        Line {
            buf: [0; 256],
            len: 0,
        }
    }

    fn put(&mut self, b: &[u8]) -> &mut Line {
        let n = b.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&b[..n]);
        self.len += n;
        self
    }

    fn num(&mut self, mut v: u64, radix: u64) -> &mut Line {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b"0123456789abcdef"[(v % radix) as usize];
            v /= radix;
            if v == 0 {
                break;
            }
        }
        self.put(&digits[i..])
    }

    fn write(&self) {
        // SAFETY: write(2) on stderr from a buffer we own.
        unsafe { libc::write(2, self.buf.as_ptr().cast(), self.len) };
    }
}

/// Writes which call was refused, then dies of SIGSYS. Only
/// async-signal-safe work here: formatting on the stack and write(2).
extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t, and for SIGSYS with
    // SYS_SECCOMP its union holds the `_sigsys` fields laid out as above.
    let nr = unsafe { (*(info as *const SigsysInfo)).syscall };
    let mut line = Line::new();
    line.put(b"vzram: seccomp: system call ");
    if nr < 0 {
        line.put(b"-");
    }
    line.num(u64::from(nr.unsigned_abs()), 10)
        .put(b" is not allowed; exiting (--seccomp off or log to debug)\n")
        .write();
    // SA_RESETHAND made SIGSYS fatal again and SA_NODEFER left it unblocked:
    // a second refused call (kexec_load is never on the list) kills us with
    // SIGSYS and a core dump, without running anything.
    // SAFETY: the filter refuses the call before the kernel looks at it.
    unsafe { libc::syscall(libc::SYS_kexec_load, 0, 0, 0, 0) };
    // Not reached with the filter in place; be sure anyway.
    // SAFETY: _exit ends the process and is async-signal-safe.
    unsafe { libc::_exit(128 + libc::SIGSYS) };
}

/// Names the cause of a SIGBUS, then lets it kill us: returning re-runs
/// the faulting access with the default action back in place. A SIGBUS is a file mapping whose pages are gone: one of
/// vzram's own state files (registered in [`super::fault`], named here;
/// one registered as repairable gets a zero page and the process goes on),
/// else a frontend's guest memory file.
extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t; si_addr is set for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as u64;
    let mut line = Line::new();
    line.put(b"vzram: SIGBUS at 0x").num(addr, 16);
    match super::fault::on_fault(addr as usize) {
        super::fault::Fault::Unknown => {
            line.put(b": a mapped file has no page there (a frontend's guest memory file was truncated, or its huge pages ran out); exiting\n");
        }
        super::fault::Fault::Named(path) => {
            line.put(b" in ").put(path).put(
                b": the file lost its pages (truncated, or its file system is full); exiting\n",
            );
        }
        super::fault::Fault::Repaired(path) => {
            line.put(b" in ")
                .put(path)
                .put(b": the file lost its pages (truncated?); reading zeros there, the device is marked damaged\n");
            line.write();
            return;
        }
    }
    line.write();
    // Fatal: the default action back, so the access, run again on return,
    // kills us with SIGBUS. (The handler stays installed until then, so a
    // repairable fault on another thread meanwhile is still repaired.)
    // SAFETY: a zeroed sigaction is SIG_DFL with no flags; sigaction is
    // async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

/// Reports a SIGBUS's cause before it kills the daemon (see [`on_sigbus`]).
/// Installed whatever the seccomp mode: the cause matters either way.
pub fn report_sigbus() -> Result<(), Error> {
    // Not SA_RESETHAND: two threads may fault on one repairable page at
    // once; the handler itself puts the default back when a fault is fatal.
    set_handler_flags(
        libc::SIGBUS,
        on_sigbus as *const () as usize,
        libc::SA_SIGINFO | libc::SA_NODEFER,
    )
}

fn set_handler(sig: libc::c_int, handler: usize) -> Result<(), Error> {
    set_handler_flags(
        sig,
        handler,
        libc::SA_SIGINFO | libc::SA_RESETHAND | libc::SA_NODEFER,
    )
}

fn set_handler_flags(sig: libc::c_int, handler: usize, flags: libc::c_int) -> Result<(), Error> {
    // SAFETY: a zeroed sigaction is valid; we fill in a handler with the
    // SA_SIGINFO signature and install it for `sig` only.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler;
        sa.sa_flags = flags;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
            return Err(Error::Handler(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

fn install_sigsys_handler() -> Result<(), Error> {
    set_handler(libc::SIGSYS, on_sigsys as *const () as usize)
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
        if install_sigsys_handler().is_err()
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

    #[test]
    fn a_truncated_file_under_a_repairable_mapping_reads_zeros() {
        use std::os::fd::AsRawFd;
        report_sigbus().unwrap();
        let path = std::env::temp_dir().join(format!("vzram-fault-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(8192).unwrap();
        // SAFETY: a new shared mapping of a file we hold.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let g = super::super::fault::register(p.cast(), 8192, &path, true).unwrap();
        // SAFETY: inside the mapping.
        unsafe { p.cast::<u8>().write_volatile(7) };
        f.set_len(0).unwrap();
        // SAFETY: inside the mapping; the page is gone from the file, so
        // this faults and the handler puts a zero page in its place.
        let v = unsafe { p.cast::<u8>().add(4096).read_volatile() };
        assert_eq!(v, 0);
        assert!(g.hit());
        drop(g);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, 8192) };
        std::fs::remove_file(&path).unwrap();
    }
}
