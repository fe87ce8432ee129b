//! Multi-page reads through the compress pool, through the real daemon:
//! every read of 2 to 64 pages gets its pages in place, byte for byte,
//! completes in the order submitted, and sees the writes submitted before
//! it; the pool threads take part (with `--compress-threads 0`, none exist
//! and the queue thread reads alone). Pages written back to a backing file
//! read the same way.

use std::path::PathBuf;

use blkio::ReqFlags;
use vzram_tests::*;

/// Slots the tests write and read.
const SLOTS: u64 = 640;

/// What slot `i` holds after the set-up: compressible (stamped with its
/// slot), incompressible, zeroes, same-filled, or never written, by turns;
/// `None` for unwritten (reads as zeroes).
fn content(i: u64) -> Option<Vec<u8>> {
    match mix(i) % 5 {
        0 => {
            let mut p = pattern(i, i * PAGE as u64, PAGE);
            p[..8].copy_from_slice(&i.to_le_bytes());
            Some(p)
        }
        1 => Some(noise(i + 1, PAGE)),
        2 => Some(vec![0; PAGE]),
        3 => Some(vec![(i as u8) | 1; PAGE]),
        _ => None,
    }
}

fn want(i: u64) -> Vec<u8> {
    content(i).unwrap_or_else(|| vec![0; PAGE])
}

/// Writes every slot that has content, in runs of up to 32 pages.
fn fill(q: &mut Queue) {
    let mut i = 0;
    while i < SLOTS {
        if content(i).is_none() {
            i += 1;
            continue;
        }
        let mut run = Vec::new();
        let start = i;
        while i < SLOTS && run.len() < 32 * PAGE {
            let Some(p) = content(i) else { break };
            run.extend_from_slice(&p);
            i += 1;
        }
        q.write(start * PAGE as u64, &run).unwrap();
    }
}

fn daemon(tag: &str, threads: &str, extra: &[&str]) -> (TempDir, Daemon, Client) {
    let dir = TempDir::new(tag);
    let sock = dir.join("d.sock");
    let mut args = vec![
        "--socket",
        s(&sock),
        "--size",
        "16M",
        "--name",
        "vm1",
        "--queues",
        "1",
        "--compress-threads",
        threads,
    ];
    args.extend(extra);
    let d = Daemon::start(&dir, &args, &[&sock]);
    let c = Client::connect(&sock, 1).unwrap_or_else(|e| panic!("connect: {e}\n{}", d.log_text()));
    (dir, d, c)
}

/// One request of a submission.
enum Io {
    /// Read `pages` from `slot`.
    Read(u64, usize),
    /// Write `pages` of `fill` byte at `slot`.
    Write(u64, usize, u8),
}

/// Submits `ios` in one go, each into its own part of the queue's buffer
/// (read buffers poisoned first), waits for all and checks they complete
/// in the order submitted. Returns what each read got (empty for writes).
fn submit(q: &mut Queue, ios: &[Io]) -> Vec<Vec<u8>> {
    let base = q.buf_ptr();
    let mut at = 0;
    let mut spans = Vec::new();
    for (id, io) in ios.iter().enumerate() {
        let (slot, pages) = match *io {
            Io::Read(s, n) | Io::Write(s, n, _) => (s, n),
        };
        let len = pages * PAGE;
        assert!(at + len <= q.buf().len());
        let byte = match *io {
            Io::Read(..) => 0xa5,
            Io::Write(_, _, b) => b,
        };
        q.buf()[at..at + len].fill(byte);
        // SAFETY: inside the queue's slice of the buffer (the fill checked it).
        let ptr = unsafe { base.add(at) };
        let off = slot * PAGE as u64;
        match io {
            Io::Read(..) => q.raw().read(off, ptr, len, id, ReqFlags::empty()),
            Io::Write(..) => q.raw().write(off, ptr, len, id, ReqFlags::empty()),
        }
        spans.push(at..at + len);
        at += len;
    }
    for want_id in 0..ios.len() {
        let (id, ret) = q.wait_one();
        assert_eq!(ret, 0, "request {id} failed");
        assert_eq!(id, want_id, "completions out of submission order");
    }
    ios.iter()
        .zip(spans)
        .map(|(io, span)| match io {
            Io::Read(..) => q.buf()[span].to_vec(),
            Io::Write(..) => Vec::new(),
        })
        .collect()
}

/// Checks a read of `pages` from `slot` page by page against `want`.
fn check(got: &[u8], slot: u64, pages: usize, want: impl Fn(u64) -> Vec<u8>, what: &str) {
    assert_eq!(got.len(), pages * PAGE);
    for (k, p) in got.chunks(PAGE).enumerate() {
        let i = slot + k as u64;
        assert!(
            p == want(i),
            "{what}: read of {pages} pages from {slot}: page {i} differs"
        );
    }
}

/// For every size from 2 to 64 pages: four reads of that size at once, at
/// drawn slots over every kind of page, each checked byte for byte.
fn read_every_size(q: &mut Queue, seed: u64, want: &impl Fn(u64) -> Vec<u8>, what: &str) {
    let mut rng = Rng::new(seed);
    for pages in 2..=64usize {
        let ios: Vec<Io> = (0..4)
            .map(|_| Io::Read(rng.below(SLOTS - pages as u64 + 1), pages))
            .collect();
        let got = submit(q, &ios);
        for (io, g) in ios.iter().zip(&got) {
            let Io::Read(slot, n) = *io else {
                unreachable!()
            };
            check(g, slot, n, want, what);
        }
    }
}

#[test]
fn reads_of_2_to_64_pages_get_their_pages_in_order_with_and_without_the_pool() {
    for threads in ["2", "0"] {
        let (_dir, d, mut c) = daemon(&format!("reads{threads}"), threads, &[]);
        let q = c.q(0);
        fill(q);
        // Let the pool threads that compressed the set-up's writes sleep.
        std::thread::sleep(std::time::Duration::from_millis(200));
        let sleeps = d.pool_sleeps();
        let pooled = d.stat().sole().stats.pool_pages;
        read_every_size(q, 5, &want, &format!("threads {threads}"));
        let after = d.pool_sleeps();
        let pooled_after = d.stat().sole().stats.pool_pages;

        // A read, a write over the same pages and the same read again, in
        // one submission: the first sees the old pages, the second the new.
        for pages in [2usize, 7, 64] {
            let slot = 100 + pages as u64;
            let got = submit(
                q,
                &[
                    Io::Read(slot, pages),
                    Io::Write(slot, pages, 0x3c),
                    Io::Read(slot, pages),
                    Io::Read(slot + 1, pages),
                ],
            );
            let what = format!("threads {threads}, around a write");
            check(&got[0], slot, pages, want, &what);
            check(&got[2], slot, pages, |_| vec![0x3c; PAGE], &what);
            let end = slot + pages as u64;
            let new = |i: u64| if i < end { vec![0x3c; PAGE] } else { want(i) };
            check(&got[3], slot + 1, pages, new, &what);
            // Put them back for the next size.
            let old: Vec<u8> = (slot..end).flat_map(want).collect();
            q.write(slot * PAGE as u64, &old).unwrap();
        }

        let st = d.stat();
        assert_eq!(st.sole().stats.failed_reads, 0, "threads {threads}");
        if threads == "0" {
            assert!(
                d.compress_tasks().is_empty(),
                "--compress-threads 0 has no pool"
            );
            assert_eq!(after, 0);
            assert_eq!(pooled_after, 0, "no pool, no pooled pages");
        } else {
            assert!(after > sleeps, "the reads never woke the pool threads");
            // The pool threads themselves decompressed some of the pages,
            // not only the queue thread that helps them.
            assert!(
                pooled_after > pooled,
                "the pool threads decompressed none of the reads' pages"
            );
        }
    }
}

/// A directory on the target's file system (O_DIRECT, not /dev/shm).
struct DiskDir(PathBuf);

impl Drop for DiskDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Pages written back to the backing file read back through the pool,
/// several pool threads reading the file at once.
#[test]
fn written_back_pages_read_through_the_pool() {
    let disk = DiskDir(
        PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("vz-readpool-{}", std::process::id())),
    );
    std::fs::create_dir_all(&disk.0).unwrap();
    let backing = disk.0.join("vm1.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let (_dir, d, mut c) = daemon("readsbk", "2", &["--backing-file", s(&backing)]);
    fill(c.q(0));
    let o = Vzram::new(&["writeback", "--device", "vm1", "--control"])
        .arg(&d.control)
        .output();
    assert!(
        o.status.success(),
        "writeback: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let backed = d.stat().sole().stats.backed_pages;
    assert!(backed > 0, "nothing was written back");
    let reads = d.stat().sole().stats.backed_reads;
    read_every_size(c.q(0), 9, &want, "backed");
    let st = d.stat();
    assert!(
        st.sole().stats.backed_reads > reads,
        "no read reached the backing file"
    );
    assert_eq!(st.sole().stats.failed_reads, 0);
}
