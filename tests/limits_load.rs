//! Memory limits under load: four clients write incompressible data at full
//! speed (queue depth 32) into devices whose limits add up to more than the
//! host limit. Throughout, the daemon's RSS is sampled every 20 ms and must
//! stay under the host limit plus a fixed overhead:
//!
//! - `RssAnon` (memory the daemon itself owns) ≤ its idle value with the
//!   clients connected + the host limit + [`SLACK`];
//! - `VmRSS` additionally counts the guests' shared buffers once the daemon
//!   touches them (they belong to the VMMs and are mapped, not allocated):
//!   ≤ idle + host limit + the guest buffers offered + [`SLACK`].
//!
//! [`SLACK`] covers what grows with load but not with stored data: malloc
//! arenas and stack pages of the busy queue threads, slot-table pages
//! (8 bytes per written 4 KiB slot: 48 KiB per device here), the span
//! directory, and spans being populated while another is given back.
//!
//! Writes past a limit get IOERR; every write that succeeded reads back;
//! discarding gives the memory back, and writes succeed again.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkio::{Completion, ReqFlags};
use vzram_tests::*;

const HOST_LIMIT: u64 = 64 * MIB;
const DEVICES: usize = 4;
const DEV_SIZE: u64 = 48 * MIB;
/// Per device: 4 × 24 MiB = 96 MiB of device limits against 64 MiB for the host.
const DEV_LIMIT: u64 = 24 * MIB;
const CHUNK: usize = 64 * 1024;
const QD: usize = 32;
const CHUNKS: usize = (DEV_SIZE as usize) / CHUNK;
/// Fixed overhead allowed on top of the idle RSS and the host limit.
const SLACK: u64 = 8 * MIB;
const SAMPLE_EVERY: Duration = Duration::from_millis(20);
/// How long each round writes, and at least how many passes.
const LOAD_TIME: Duration = Duration::from_secs(3);
const MIN_PASSES: u64 = 4;

#[derive(Default, Clone, Copy, Debug)]
struct Mem {
    rss: u64,
    anon: u64,
    shmem: u64,
}

/// The memory of the daemon and every process it started, added up.
fn mem_of(pid: u32) -> Option<Mem> {
    let mut m = Mem {
        rss: proc_status_bytes(pid, "VmRSS")?,
        anon: proc_status_bytes(pid, "RssAnon")?,
        shmem: proc_status_bytes(pid, "RssShmem")?,
    };
    for p in process_tree(pid).into_iter().skip(1) {
        m.rss += proc_status_bytes(p, "VmRSS").unwrap_or(0);
        m.anon += proc_status_bytes(p, "RssAnon").unwrap_or(0);
        m.shmem += proc_status_bytes(p, "RssShmem").unwrap_or(0);
    }
    Some(m)
}

/// Samples the daemon's memory until stopped; keeps the peaks.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<Mutex<(Mem, usize)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(pid: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(Mutex::new((Mem::default(), 0)));
        let (s, p) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(m) = mem_of(pid) {
                    let mut p = p.lock().unwrap();
                    p.0.rss = p.0.rss.max(m.rss);
                    p.0.anon = p.0.anon.max(m.anon);
                    p.0.shmem = p.0.shmem.max(m.shmem);
                    p.1 += 1;
                }
                std::thread::sleep(SAMPLE_EVERY);
            }
        });
        Sampler {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (Mem, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        *self.peak.lock().unwrap()
    }
}

/// The data written to chunk `c` of device `dev` in generation `gen`.
fn chunk_data(gen: u64, dev: usize, c: usize) -> Vec<u8> {
    noise((gen << 32) ^ ((dev as u64) << 24) ^ c as u64, CHUNK)
}

/// What a chunk may hold: the last generation written successfully (None:
/// never, or discarded since: zeros), and the generations whose writes
/// failed after it (a failed write may have stored some of its pages).
#[derive(Default, Clone)]
struct ChunkState {
    ok: Option<u64>,
    failed: Vec<u64>,
}

/// Writes every chunk of the device once with generation `gen`, QD
/// requests in flight; updates each chunk's state and returns
/// (successful, IOERR) counts. Any other status fails the test.
fn write_pass(q: &mut Queue, gen: u64, dev: usize, state: &mut [ChunkState]) -> (usize, usize) {
    let base = q.buf_ptr();
    let mut free: Vec<usize> = (0..QD).collect();
    let mut done: [MaybeUninit<Completion>; QD] = std::array::from_fn(|_| MaybeUninit::uninit());
    let (mut next, mut inflight, mut ok, mut eio) = (0, 0, 0, 0);
    while next < CHUNKS || inflight > 0 {
        while next < CHUNKS {
            let Some(slot) = free.pop() else { break };
            let data = chunk_data(gen, dev, next);
            // SAFETY: slot `slot` of the queue's buffer (QD × CHUNK ≤
            // QUEUE_BUF) is ours until its request completes.
            let buf = unsafe { base.add(slot * CHUNK) };
            // SAFETY: as above; the slot holds CHUNK bytes.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, CHUNK) };
            q.raw().write(
                (next * CHUNK) as u64,
                buf,
                CHUNK,
                (slot << 32) | next,
                ReqFlags::empty(),
            );
            next += 1;
            inflight += 1;
        }
        let mut timeout = Duration::from_secs(30);
        let n = q
            .raw()
            .do_io(&mut done, 1, Some(&mut timeout), None)
            .expect("do_io");
        assert!(n > 0, "no completion within 30 s");
        for c in &done[..n] {
            // SAFETY: do_io filled in the first n completions.
            let c = unsafe { c.assume_init_read() };
            let chunk = c.user_data & 0xffff_ffff;
            match c.ret {
                0 => {
                    state[chunk] = ChunkState {
                        ok: Some(gen),
                        failed: Vec::new(),
                    };
                    ok += 1;
                }
                e if e == -libc::EIO => {
                    state[chunk].failed.push(gen);
                    eio += 1;
                }
                e => panic!("device {dev} chunk {chunk}: status {e}, not OK or IOERR"),
            }
            free.push(c.user_data >> 32);
            inflight -= 1;
        }
    }
    (ok, eio)
}

/// Reads every chunk back: a chunk whose last write succeeded reads exactly
/// that; otherwise each page is the last good data or one of the failed
/// writes' (never anything else, never another device's).
fn verify(q: &mut Queue, dev: usize, state: &[ChunkState]) {
    for (c, st) in state.iter().enumerate() {
        let got = q
            .read((c * CHUNK) as u64, CHUNK)
            .unwrap_or_else(|e| panic!("device {dev} read chunk {c}: {e}"));
        let good = match st.ok {
            Some(g) => chunk_data(g, dev, c),
            None => vec![0; CHUNK],
        };
        if st.failed.is_empty() {
            assert!(
                got == good,
                "device {dev} chunk {c}: a successful write reads back wrong"
            );
            continue;
        }
        let failed: Vec<Vec<u8>> = st.failed.iter().map(|&g| chunk_data(g, dev, c)).collect();
        for (p, g) in got.chunks(PAGE).enumerate() {
            let page = |d: &Vec<u8>| &d[p * PAGE..(p + 1) * PAGE] == g;
            assert!(
                page(&good) || failed.iter().any(page),
                "device {dev} chunk {c} page {p}: neither the last good data nor a failed write's"
            );
        }
    }
}

/// What one device's writer did in a round.
#[derive(Default)]
struct Load {
    passes: u64,
    ok: usize,
    eio: usize,
    discards: usize,
}

/// One round: every device is written over and over at full speed by its
/// own thread for [`LOAD_TIME`] (and [`MIN_PASSES`] passes); after each pass a quarter of the device is
/// discarded, so memory churns at the limit (spans given back, new ones
/// populated). Then everything is read back and checked.
fn round(clients: &mut [Client], states: &mut [Vec<ChunkState>], round: u64) -> Load {
    let start = Instant::now();
    let loads: Vec<Load> = std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter_mut()
            .zip(states.iter_mut())
            .enumerate()
            .map(|(dev, (c, st))| {
                s.spawn(move || {
                    let q = c.q(0);
                    let mut l = Load::default();
                    while l.passes < MIN_PASSES || start.elapsed() < LOAD_TIME {
                        l.passes += 1;
                        let gen = round * 1_000_000 + l.passes;
                        let (ok, eio) = write_pass(q, gen, dev, st);
                        l.ok += ok;
                        l.eio += eio;
                        let quarter = CHUNKS / 4;
                        let first = ((l.passes as usize + dev) % 4) * quarter;
                        q.discard((first * CHUNK) as u64, (quarter * CHUNK) as u64)
                            .unwrap();
                        for cs in &mut st[first..first + quarter] {
                            *cs = ChunkState::default();
                        }
                        l.discards += 1;
                    }
                    l
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let total = loads.iter().fold(Load::default(), |a, l| Load {
        passes: a.passes + l.passes,
        ok: a.ok + l.ok,
        eio: a.eio + l.eio,
        discards: a.discards + l.discards,
    });
    let offered = ((total.ok + total.eio) * CHUNK) as f64 / MIB as f64;
    eprintln!(
        "round {round}: {} passes over 4 × {} MiB in {secs:.2} s: {offered:.0} MiB offered ({:.0} MiB/s), \
         {} MiB written, {} writes IOERR, {} discards",
        total.passes,
        DEV_SIZE / MIB,
        offered / secs,
        total.ok * CHUNK / MIB as usize,
        total.eio,
        total.discards
    );
    assert!(total.eio > 0, "writes past the limit never got IOERR");
    // The host limit is what stops the writes, again and again.
    assert!(
        (total.ok * CHUNK) as u64 > 2 * HOST_LIMIT,
        "only {} MiB written",
        total.ok * CHUNK / MIB as usize
    );
    std::thread::scope(|s| {
        for (dev, (c, st)) in clients.iter_mut().zip(states.iter()).enumerate() {
            s.spawn(move || verify(c.q(0), dev, st));
        }
    });
    total
}

#[test]
fn rss_stays_under_the_host_limit_while_clients_write_past_it() {
    let dir = TempDir::new("load");
    let socks: Vec<_> = (0..DEVICES)
        .map(|i| dir.join(&format!("d{i}.sock")))
        .collect();
    let specs: Vec<String> = socks
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "socket={},size={},queues=1,name=d{i},mem-limit={}",
                p.display(),
                DEV_SIZE,
                DEV_LIMIT
            )
        })
        .collect();
    let mut args = vec!["--host-mem-limit", "64M"];
    for sp in &specs {
        args.extend(["--device", sp.as_str()]);
    }
    let sock_refs: Vec<&std::path::Path> = socks.iter().map(|p| p.as_path()).collect();
    let d = Daemon::start(&dir, &args, &sock_refs);
    let pid = d.pid();
    let sampler = Sampler::start(pid);

    let mut clients: Vec<Client> = socks
        .iter()
        .map(|p| Client::connect(p, 1).unwrap_or_else(|e| panic!("connect: {e}\n{}", d.log_text())))
        .collect();
    // Idle, with every client connected: the baseline.
    std::thread::sleep(Duration::from_millis(200));
    let idle = (0..5)
        .map(|_| {
            std::thread::sleep(SAMPLE_EVERY);
            mem_of(pid).expect("daemon status")
        })
        .fold(Mem::default(), |a, m| Mem {
            rss: a.rss.max(m.rss),
            anon: a.anon.max(m.anon),
            shmem: a.shmem.max(m.shmem),
        });
    let guest_bufs = (DEVICES * QUEUE_BUF) as u64;
    eprintln!(
        "idle: VmRSS {:.1} MiB, RssAnon {:.1} MiB, RssShmem {:.1} MiB; guest buffers offered {:.0} MiB",
        mib(idle.rss),
        mib(idle.anon),
        mib(idle.shmem),
        mib(guest_bufs)
    );

    let mut states = vec![vec![ChunkState::default(); CHUNKS]; DEVICES];
    round(&mut clients, &mut states, 1);
    let st = d.stat();
    let used = st.pool().mem_used_total;
    eprintln!(
        "after round 1: mem_used_total {:.1} MiB, mem_used_max {:.1} MiB, per device {:?} MiB",
        mib(used),
        mib(st.pool().mem_used_max),
        (0..DEVICES)
            .map(|i| st.counters(&format!("d{i}")).mem_used_total / MIB)
            .collect::<Vec<_>>()
    );
    assert!(st.pool().mem_used_max <= HOST_LIMIT);
    for i in 0..DEVICES {
        let name = format!("d{i}");
        assert!(st.counters(&name).mem_used_max <= DEV_LIMIT, "{}", st);
    }
    assert!(
        (0..DEVICES)
            .map(|i| st.counters(&format!("d{i}")).failed_writes)
            .sum::<u64>()
            > 0,
        "failed writes not counted: {}",
        st
    );

    // Discard everything: the memory goes back, writes succeed again.
    for (c, s) in clients.iter_mut().zip(states.iter_mut()) {
        c.q(0).discard(0, DEV_SIZE).unwrap();
        s.fill(ChunkState::default());
    }
    let freed = d.stat().pool().mem_used_total;
    eprintln!(
        "after discarding all: mem_used_total {:.1} MiB -> {:.2} MiB",
        mib(used),
        mib(freed)
    );
    assert!(freed < used && freed < MIB, "discard did not free: {freed}");
    for (dev, (c, s)) in clients.iter_mut().zip(states.iter_mut()).enumerate() {
        let data = chunk_data(7, dev, 0);
        c.q(0).write(0, &data).unwrap();
        assert_eq!(c.q(0).read(0, CHUNK).unwrap(), data);
        s[0].ok = Some(7);
    }
    round(&mut clients, &mut states, 2);
    let st = d.stat();
    assert!(st.pool().mem_used_max <= HOST_LIMIT);

    let (peak, samples) = sampler.finish();
    let anon_cap = idle.anon + HOST_LIMIT + SLACK;
    let rss_cap = idle.rss + HOST_LIMIT + guest_bufs + SLACK;
    eprintln!(
        "PEAK over {samples} samples: VmRSS {:.1} MiB (cap {:.1} = idle {:.1} + limit 64 + guest buffers {:.0} + slack {:.0}), \
         RssAnon {:.1} MiB (cap {:.1} = idle {:.1} + limit 64 + slack {:.0}), RssShmem {:.1} MiB; host limit {:.0} MiB; \
         RssAnon above idle: {:.1} MiB",
        mib(peak.rss),
        mib(rss_cap),
        mib(idle.rss),
        mib(guest_bufs),
        mib(SLACK),
        mib(peak.anon),
        mib(anon_cap),
        mib(idle.anon),
        mib(SLACK),
        mib(peak.shmem),
        mib(HOST_LIMIT),
        mib(peak.anon.saturating_sub(idle.anon))
    );
    assert!(samples >= 100, "only {samples} RSS samples");
    assert!(
        peak.anon <= anon_cap,
        "daemon RssAnon {:.1} MiB passed {:.1} MiB",
        mib(peak.anon),
        mib(anon_cap)
    );
    assert!(
        peak.rss <= rss_cap,
        "daemon VmRSS {:.1} MiB passed {:.1} MiB",
        mib(peak.rss),
        mib(rss_cap)
    );
}
