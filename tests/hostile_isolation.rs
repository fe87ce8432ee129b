//! Hostile vhost-user frontends against the real daemon (issue 6): isolation
//! across devices (part 6).
//! The fixture and the checks after each hostile request are in
//! `tests/support/hostile.rs`; `hostile.rs` says what every test proves.

use vzram_tests::frontend::*;
use vzram_tests::hostile::*;
use vzram_tests::*;

// ---------------------------------------------------------------------------
// Part 6: isolation across devices
// ---------------------------------------------------------------------------

/// A page of partly incompressible data, so objects come in many sizes.
fn mixed_page(seed: u64, page: u64) -> Vec<u8> {
    let mut p = pattern(seed, page * PAGE as u64, PAGE);
    let n = 512 * (1 + (page % 8) as usize);
    p[..n].copy_from_slice(&noise(seed ^ (page << 16), n));
    p
}

/// Where `got` differs from `want`, and whether the bytes there are
/// another device's.
fn first_difference(got: &[u8], want: &[u8], foreign: &[u8]) -> Option<String> {
    let i = got.iter().zip(want).position(|(a, b)| a != b)?;
    let page = i / PAGE;
    let theirs = foreign
        .chunks(PAGE)
        .position(|c| c == &got[page * PAGE..(page + 1) * PAGE]);
    Some(format!(
        "first difference at byte {i} (page {page}); that page is {}",
        match theirs {
            Some(p) => format!("the other device's page {p}"),
            None => "not any page of the other device".into(),
        }
    ))
}

#[test]
fn devices_never_see_each_others_data() {
    let dir = TempDir::new("isolation");
    let a_sock = dir.join("a.sock");
    let b_sock = dir.join("b.sock");
    let a_spec = format!("socket={},size={DEV_SIZE},name=a", s(&a_sock));
    let b_spec = format!("socket={},size={DEV_SIZE},name=b", s(&b_sock));
    let d = Daemon::start(
        &dir,
        &["--device", &a_spec, "--device", &b_spec],
        &[&a_sock, &b_sock],
    );
    // a: the raw frontend; b: blkio.
    let mut a = RawDev::connect(&a_sock);
    let mut b = blkio(&b_sock);
    let len = DEV_SIZE as usize;
    let pages = DEV_SIZE / PAGE as u64;
    let range = |p: u64| p as usize * PAGE..(p as usize + 1) * PAGE;

    let read_b = |b: &mut Client| -> Vec<u8> {
        let mut v = Vec::with_capacity(len);
        for off in (0..DEV_SIZE).step_by(1 << 20) {
            v.extend(b.q(0).read(off, 1 << 20).expect("read b"));
        }
        v
    };
    let write_b = |b: &mut Client, p: u64, data: &[u8]| {
        b.q(0).write(p * PAGE as u64, data).expect("write b");
    };
    let discard_b = |b: &mut Client, p: u64, n: u64| {
        b.q(0)
            .discard(p * PAGE as u64, n * PAGE as u64)
            .expect("discard b");
    };
    let discard_a = |a: &mut RawDev, pages: &[u64]| {
        for chunk in pages.chunks(256) {
            let segs: Vec<_> = chunk.iter().map(|&p| (p * 8, 8u32, 0u32)).collect();
            assert_eq!(a.dwz(T_DISCARD, &segs), S_OK);
        }
    };
    let check = |what: &str, a: &mut RawDev, b: &mut Client, ma: &[u8], mb: &[u8]| {
        let ga = a.read_all(0, len);
        if let Some(e) = first_difference(&ga, ma, mb) {
            panic!("{what}: device a: {e}");
        }
        let gb = read_b(b);
        if let Some(e) = first_difference(&gb, mb, ma) {
            panic!("{what}: device b: {e}");
        }
    };
    let compact = || -> u64 {
        let r: Compacted = d.request(json!({"cmd": "compact"}));
        r.pages_compacted
    };

    // Unwritten space reads as zeros on both.
    let mut ma = vec![0u8; len];
    let mut mb = vec![0u8; len];
    check("fresh", &mut a, &mut b, &ma, &mb);

    // Both full of their own data.
    for p in 0..pages {
        ma[range(p)].copy_from_slice(&mixed_page(0xa, p));
        mb[range(p)].copy_from_slice(&mixed_page(0xb, p));
    }
    a.write_all(0, &ma);
    for (i, c) in mb.chunks(1 << 20).enumerate() {
        b.q(0).write((i << 20) as u64, c).expect("write b");
    }
    check("written", &mut a, &mut b, &ma, &mb);

    // a discards about three pages of every four, leaving its spans sparse.
    // Picked by a hash, not by p % 4: the compress pool spreads a write's
    // pages over its threads' shards in turn, and a regular pattern can
    // empty whole spans (freed at once, nothing left to compact).
    let gone: Vec<u64> = (0..pages)
        .filter(|p| (p.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 62) != 0)
        .collect();
    discard_a(&mut a, &gone);
    for &p in &gone {
        ma[range(p)].fill(0);
    }
    // And zeroes a few unaligned sector ranges in place.
    assert_eq!(
        a.dwz(T_WRITE_ZEROES, &[(1, 3, 0), (4 * 8 * 100 + 5, 2, 1)]),
        S_OK
    );
    ma[512..4 * 512].fill(0);
    let at = (4 * 8 * 100 + 5) * 512;
    ma[at..at + 1024].fill(0);
    check("after discards on a", &mut a, &mut b, &ma, &mb);

    // b rewrites its second half with new data: new objects, likely in
    // the holes a left.
    for p in pages / 2..pages {
        let page = mixed_page(0xbb, p);
        write_b(&mut b, p, &page);
        mb[range(p)].copy_from_slice(&page);
    }
    check("after b rewrote", &mut a, &mut b, &ma, &mb);

    // Compaction moves objects of both devices between spans.
    let moved = compact();
    check("after compaction", &mut a, &mut b, &ma, &mb);

    // b discards three pages of every four (runs of three), then a writes
    // 512 bytes into 256 of its discarded pages and whole new pages into
    // others: fresh slots whose memory may well be b's old spans. The rest
    // of a partly written page reads as zeros, not as anyone's old bytes.
    for p in (0..pages).step_by(4) {
        discard_b(&mut b, p + 1, 3);
        for q in p + 1..p + 4 {
            mb[range(q)].fill(0);
        }
    }
    for p in gone.iter().copied().filter(|p| p % 4 == 1).take(256) {
        let at = p as usize * PAGE + 2048;
        let s = noise(0xa00 + p, 512);
        assert_eq!(a.write(at as u64 / 512, &s), S_OK);
        ma[at..at + 512].copy_from_slice(&s);
    }
    for p in gone.iter().copied().filter(|p| p % 4 == 2).take(256) {
        let page = mixed_page(0xaa, p);
        assert_eq!(a.write(p * 8, &page), S_OK);
        ma[range(p)].copy_from_slice(&page);
    }
    check("after b discarded, a refilled", &mut a, &mut b, &ma, &mb);
    let moved2 = compact();
    check("after the second compaction", &mut a, &mut b, &ma, &mb);

    // a discards everything: it reads zeros, b is untouched.
    discard_a(&mut a, &(0..pages).collect::<Vec<_>>());
    ma.fill(0);
    let moved3 = compact();
    check("after a discarded everything", &mut a, &mut b, &ma, &mb);
    eprintln!("compaction gave back {moved}, {moved2}, {moved3} pages");
    assert!(
        moved + moved2 + moved3 > 0,
        "compaction never moved anything, so this test proved less than it says"
    );

    let st = d.stat();
    assert_eq!(
        st.counters("a").orig_data_size,
        0,
        "a still holds data: {}",
        st
    );
    assert!(st.counters("b").orig_data_size > 0);
}
