//! Crash test of a migration's destination: a child process receives a
//! real stream (a full pass, then passes that rewrite or discard most
//! slots) into a device whose state lives in files; the parent SIGKILLs it
//! at a random moment of the arrival, recovers the device and reads every
//! slot. The device must hold what the stream's records up to some point
//! made of it (while the receive was still emptying the device: each slot
//! empty or as before). Every slot then reads empty or a page the stream
//! sent for it, never a corrupt or a wrong one: a slot word published ahead
//! of its object shows. The next child receives into the recovered state.
//!
//! `VZRAM_IMPORT_KILLS` sets the number of kills (default 40),
//! `VZRAM_IMPORT_SEED` the seed; the seed is printed so a failure replays.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use vzram_store::migrate::{self, Verdict};
use vzram_store::{Codec, Context, Device, DeviceConfig, Pool, PoolConfig, StateSpec, PAGE_SIZE};

mod common;
use common::stream::{receive_on, send_on};
use common::{mix, Rng};

const SLOTS: u64 = 512;
/// Passes with records: the full one and the rewrites after it.
const PASSES: usize = 4;
const CHILD_ENV: &str = "VZRAM_IMPORT_CHILD";

/// Version `v` of slot `s`'s page, never all zeros. Mostly pages lz4
/// shrinks only a little, to 3.6 to 4 KiB: one object per span, so an
/// import that replaces one frees a span (a system call) after publishing
/// its word, and a kill often lands where a word published ahead of its
/// object would show. Some raw, some same-filled. The compressed ones name
/// their slot and version, so a page in the wrong place shows.
fn page(s: u64, v: u64) -> Vec<u8> {
    let mut r = Rng(mix(s << 8 | v));
    let mut p = vec![0u8; PAGE_SIZE];
    match r.below(16) {
        0 => p.fill(r.next_u64() as u8 | 1),
        1 => p.iter_mut().for_each(|b| *b = r.next_u64() as u8 | 1),
        _ => {
            // lz4 makes n + 43 bytes of n random ones and zeros.
            let n = 3650 + r.below(350) as usize;
            p[..n].iter_mut().for_each(|b| *b = r.next_u64() as u8);
            p[..16].copy_from_slice(&[s.to_le_bytes(), v.to_le_bytes()].concat());
        }
    }
    p
}

/// What the source holds in each pass: every slot written, then each pass
/// rewrites or discards most of them (slots 0 mod 8 never change).
fn versions() -> Vec<Vec<Vec<u8>>> {
    let mut v = vec![(0..SLOTS).map(|s| page(s, 0)).collect::<Vec<_>>()];
    for k in 1..PASSES as u64 {
        let prev = &v[k as usize - 1];
        let next = (0..SLOTS)
            .map(|s| match s % 8 {
                0 => prev[s as usize].clone(),
                _ if (s + k) % 7 == 0 => vec![0; PAGE_SIZE],
                _ => page(s, k),
            })
            .collect();
        v.push(next);
    }
    v
}

/// The stream's records in order, as (slot, pass whose version it
/// carries): the first pass sends every slot, each later one the slots
/// that changed, in slot order.
fn records(v: &[Vec<Vec<u8>>]) -> Vec<(u64, usize)> {
    let mut out: Vec<_> = (0..SLOTS).map(|s| (s, 0)).collect();
    for k in 1..v.len() {
        out.extend(
            (0..SLOTS)
                .filter(|&s| v[k][s as usize] != v[k - 1][s as usize])
                .map(|s| (s, k)),
        );
    }
    out
}

/// A real stream of `v` from a source device, written pass by pass while
/// the send runs.
fn stream_of(v: &[Vec<Vec<u8>>]) -> Vec<u8> {
    let pool = Pool::new(PoolConfig {
        host_mem_limit: 0,
        arena_bytes: 1 << 30,
        ..PoolConfig::default()
    })
    .unwrap();
    let mut cfg = DeviceConfig::new(SLOTS * PAGE_SIZE as u64, Codec::Lz4);
    // Everything lz4 shrinks at all travels compressed.
    cfg.huge_threshold = PAGE_SIZE;
    let src = pool.create_device(cfg).unwrap();
    let cx = &mut Context::new(0);
    for (s, p) in v[0].iter().enumerate() {
        src.write_page(cx, s as u64, p[..].try_into().unwrap())
            .unwrap();
    }
    let (a, b) = UnixStream::pair().unwrap();
    std::thread::scope(|sc| {
        // A destination stand-in: accepts, refuses to confirm (so the
        // sender returns), and keeps everything sent.
        let rec = sc.spawn(move || {
            (&b).write_all(b"AX\x04\x00stop").unwrap();
            let mut all = Vec::new();
            (&b).read_to_end(&mut all).unwrap();
            all
        });
        // Called before each pass after the first: the next version.
        let pass = std::cell::Cell::new(1);
        let quiet = || {
            let k = pass.get();
            if k == v.len() {
                return true;
            }
            pass.set(k + 1);
            let cx = &mut Context::new(0);
            for s in 0..SLOTS {
                let (old, new) = (&v[k - 1][s as usize], &v[k][s as usize]);
                if old == new {
                    continue;
                }
                if new.iter().all(|&b| b == 0) {
                    src.discard(cx, s..s + 1).unwrap();
                } else {
                    src.write_page(cx, s, new[..].try_into().unwrap()).unwrap();
                }
            }
            false
        };
        let r = send_on(&src, &a, &quiet, &|| Verdict::Commit, &|| None, &|_| {});
        assert!(r.unwrap_err().to_string().contains("stop"));
        a.shutdown(std::net::Shutdown::Write).unwrap();
        rec.join().unwrap()
    })
}

fn pool() -> Arc<Pool> {
    Pool::new(PoolConfig::default()).unwrap()
}

fn open(pool: &Arc<Pool>, root: &Path) -> Arc<Device> {
    let mut cfg = DeviceConfig::new(SLOTS * PAGE_SIZE as u64, Codec::Lz4);
    cfg.shards = 1;
    cfg.state = Some(StateSpec {
        root: root.to_path_buf(),
        name: "dst".into(),
        ..StateSpec::default()
    });
    pool.create_device(cfg).unwrap()
}

/// Receives a recorded stream, and the source's commit after it.
fn receive(dev: &Device, stream: &[u8]) -> migrate::ReceiveReport {
    let whole = [stream, b"C"].concat();
    receive_on(dev, &whole[..], std::io::sink(), &|_| {}, &|| {}, &|| {}).unwrap()
}

/// The child: recover, say so, then receive the stream file until killed.
#[test]
fn import_child() {
    let Ok(arg) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (root, stream) = arg.split_once(':').unwrap();
    let bytes = std::fs::read(stream).unwrap();
    let pool = pool();
    let dev = open(&pool, Path::new(root));
    let mut out = std::io::stdout().lock();
    // Ends the harness's "test import_child ... " line first.
    writeln!(out, "\nready").unwrap();
    out.flush().unwrap();
    let r = receive(&dev, &bytes);
    writeln!(out, "received {}", r.micros).unwrap();
    out.flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

/// Whether `seen` is what the first R records leave, for some R: for each
/// slot, the R its content allows are intervals; some R must be in one of
/// every slot's.
fn a_prefix(seen: &[Vec<u8>], v: &[Vec<Vec<u8>>], recs: &[(u64, usize)]) -> bool {
    let mut updates = vec![Vec::new(); SLOTS as usize];
    for (i, &(s, k)) in recs.iter().enumerate() {
        updates[s as usize].push((i, k));
    }
    // count[r] - count[r - 1]: slots whose content fits r applied records.
    let mut diff = vec![0i64; recs.len() + 2];
    for (s, ups) in updates.iter().enumerate() {
        let mut from = 0;
        let mut content: &[u8] = &[0; PAGE_SIZE];
        for &(i, k) in ups.iter().chain(std::iter::once(&(recs.len(), 0))) {
            if seen[s][..] == *content {
                diff[from] += 1;
                diff[i + 1] -= 1;
            }
            from = i + 1;
            if i < recs.len() {
                content = &v[k][s];
            }
        }
    }
    let mut n = 0;
    diff.iter().any(|d| {
        n += d;
        n == SLOTS as i64
    })
}

fn state_root() -> PathBuf {
    // tmpfs when there is one, as in production.
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!("vzram-import-crash-{}", std::process::id()))
}

#[test]
fn a_receiver_killed_at_random_points_holds_a_prefix_of_the_stream() {
    let kills: usize = std::env::var("VZRAM_IMPORT_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let seed: u64 = std::env::var("VZRAM_IMPORT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("VZRAM_IMPORT_SEED={seed} VZRAM_IMPORT_KILLS={kills}");
    let base = state_root();
    let _ = std::fs::remove_dir_all(&base);
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(base.clone());
    let root = base.join("state");
    std::fs::create_dir_all(&root).unwrap();

    let v = versions();
    let recs = records(&v);
    let stream = stream_of(&v);
    let stream_file = base.join("stream");
    std::fs::write(&stream_file, &stream).unwrap();

    // How long a child's receive takes (over a full device, which it
    // empties first), so the kills spread over one.
    let mut span_us = {
        let pool = pool();
        let dev = open(&pool, &base.join("calibration"));
        let r = receive(&dev, &stream);
        assert_eq!(
            r.records as usize,
            recs.len(),
            "the stream is not as modelled"
        );
        receive(&dev, &stream).micros.max(100)
    };

    let mut rng = Rng(seed | 1);
    let exe = std::env::current_exe().unwrap();
    let zero = vec![0u8; PAGE_SIZE];
    // What the last recovery found; all empty before the first child.
    let mut before = vec![zero.clone(); SLOTS as usize];
    let (mut mid_stream, mut emptying, mut finished) = (0, 0, 0);
    for k in 0..kills {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "import_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(
                CHILD_ENV,
                format!("{}:{}", root.display(), stream_file.display()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.trim() == "ready");
        if ready {
            // Anywhere in the receive, and now and then after it.
            std::thread::sleep(Duration::from_micros(rng.below(span_us * 11 / 10)));
        }
        // SAFETY: kill sends a signal to our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
        let status = child.wait().unwrap();
        let received = lines
            .map_while(Result::ok)
            .find_map(|l| l.trim().strip_prefix("received ")?.parse::<u64>().ok());
        if !ready || status.signal() != Some(libc::SIGKILL) {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("kill {k} (seed {seed}): the child ended on its own ({status:?}):\n{err}");
        }
        if let Some(us) = received {
            finished += 1;
            span_us = us.max(100);
        }

        let pool = pool();
        let dev = open(&pool, &root);
        assert!(dev.recovery().is_some(), "kill {k}: no state recovered");
        let cx = &mut Context::new(0);
        let mut buf = [0u8; PAGE_SIZE];
        let mut seen = Vec::with_capacity(SLOTS as usize);
        for s in 0..SLOTS {
            dev.read_page(cx, s, &mut buf).unwrap_or_else(|e| {
                panic!("kill {k} (seed {seed}, received {received:?}): slot {s}: {e}")
            });
            let sent = v.iter().any(|p| buf[..] == p[s as usize][..]);
            assert!(
                buf[..] == zero[..] || sent,
                "kill {k} (seed {seed}, received {received:?}): slot {s} holds a page never sent for it"
            );
            seen.push(buf.to_vec());
        }
        let prefix = a_prefix(&seen, &v, &recs);
        if !prefix {
            // Killed while the receive emptied the device first.
            let old_or_empty = (0..SLOTS as usize).all(|s| seen[s] == zero || seen[s] == before[s]);
            assert!(
                old_or_empty,
                "kill {k} (seed {seed}): the device holds no prefix of the stream"
            );
            emptying += 1;
        } else if received.is_none() && seen[..] != v[PASSES - 1][..] {
            mid_stream += 1;
        }
        if received.is_some() {
            assert!(
                seen[..] == v[PASSES - 1][..],
                "kill {k}: a finished receive lost pages"
            );
        }
        assert_eq!(dev.stats().mem_used_total, pool.stats().mem_used_total);
        before = seen;
    }

    // The recovered heap takes a whole stream.
    let pool = pool();
    let dev = open(&pool, &root);
    receive(&dev, &stream);
    let mut buf = [0u8; PAGE_SIZE];
    for s in 0..SLOTS {
        dev.read_page(&mut Context::new(0), s, &mut buf).unwrap();
        assert!(
            buf[..] == v[PASSES - 1][s as usize][..],
            "slot {s} after a last receive"
        );
    }
    eprintln!(
        "{kills} kills: {mid_stream} mid-stream, {emptying} while emptying, {finished} after the receive; a receive takes {span_us} us, {} records, {} bytes",
        recs.len(),
        stream.len()
    );
}

/// The destination stores its commit (the `commit` hook: the daemon's
/// received phase in the shared cells) before it confirms it ('D'): a
/// destination killed between the two would come back waiting for its
/// pages, emptied, while the source, told of the commit, dropped them.
#[test]
fn the_commit_is_stored_before_it_is_confirmed() {
    let base = state_root().join("order");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let pool = pool();
    let dev = open(&pool, &base);
    let whole = [&stream_of(&versions())[..], b"C"].concat();
    let events = std::cell::RefCell::new(Vec::new());
    /// Records when the confirmation is written.
    struct Out<'a>(&'a std::cell::RefCell<Vec<&'static str>>);
    impl Write for Out<'_> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if b.first() == Some(&b'D') {
                self.0.borrow_mut().push("confirmed");
            }
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    receive_on(&dev, &whole[..], Out(&events), &|_| {}, &|| {}, &|| {
        events.borrow_mut().push("stored")
    })
    .unwrap();
    drop(dev);
    let _ = std::fs::remove_dir_all(&base);
    assert_eq!(*events.borrow(), ["stored", "confirmed"]);
}
