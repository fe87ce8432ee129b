//! The state files: identity, tombstones, roots, left-overs.
use super::*;

fn root(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("vzram-state-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

#[test]
fn header_round_trips_and_refuses_what_it_is_not() {
    let h = Header {
        size_bytes: 1 << 30,
        arena_bytes: 1 << 32,
        codec: "zstd:3".into(),
        name: "vm1".into(),
        creation_id: 42,
        socket: Some("/run/vzram/vm1.sock".into()),
    };
    let b = h.encode();
    assert_eq!(Header::decode(&b).unwrap(), (h.clone(), VERSION));
    let mut bad = b;
    bad[0] = b'X';
    assert!(Header::decode(&bad).unwrap_err().contains("magic"));
    let mut newer = b;
    newer[8] = 5;
    assert!(Header::decode(&newer).unwrap_err().contains("version 5"));
    // Before version 3 the header was its fixed part, with no socket.
    let mut older = b;
    older[8] = 2;
    let old = Header {
        socket: None,
        ..h.clone()
    };
    assert_eq!(Header::decode(&older[..FIXED_LEN]).unwrap(), (old, 2));
    assert!(Header::decode(&b[..FIXED_LEN]).unwrap_err().contains("512"));
}

#[test]
fn create_reopen_lock_and_size_mismatch() {
    let r = root("open");
    let spec = StateSpec {
        root: r.clone(),
        name: "d".into(),
        ..StateSpec::default()
    };
    let a = open(&spec, 1 << 20, 1 << 22, Codec::Lz4).unwrap();
    assert!(!a.existing);
    // A second opener while the first holds it.
    let busy = open(&spec, 1 << 20, 1 << 22, Codec::Lz4).err().unwrap();
    assert!(busy.to_string().contains("in use"), "{busy}");
    let id = a.header.creation_id;
    drop(a);
    let b = open(&spec, 1 << 20, 1 << 22, Codec::Lz4).unwrap();
    assert!(b.existing);
    assert_eq!(b.header.creation_id, id);
    drop(b);
    let e = open(&spec, 2 << 20, 1 << 22, Codec::Lz4).err().unwrap();
    assert!(e.to_string().contains("--fresh"), "{e}");
    assert!(e.to_string().contains("header"), "{e}");
    let fresh = StateSpec {
        existing: Existing::Discard,
        ..spec.clone()
    };
    let c = open(&fresh, 2 << 20, 1 << 22, Codec::Lz4).unwrap();
    assert!(!c.existing);
    assert_ne!(c.header.creation_id, id);
    drop(c);
    assert!(open(
        &StateSpec {
            name: "../x".into(),
            ..spec
        },
        1 << 20,
        1 << 22,
        Codec::Lz4
    )
    .is_err());
    std::fs::remove_dir_all(&r).unwrap();
}

#[test]
fn data_ranges_skip_holes() {
    let r = root("sparse");
    std::fs::create_dir_all(&r).unwrap();
    let p = r.join("f");
    let f = open_rw(&p, true).unwrap();
    f.set_len(1 << 20).unwrap();
    assert!(data_ranges(&f).is_empty());
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[1; 4096], 64 << 10).unwrap();
    let ranges = data_ranges(&f);
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    assert!(ranges[0].contains(&(64 << 10)));
    std::fs::remove_dir_all(&r).unwrap();
}

fn spec(root: &Path, name: &str, socket: &str) -> StateSpec {
    StateSpec {
        root: root.to_path_buf(),
        name: name.into(),
        socket: Some(socket.into()),
        ..StateSpec::default()
    }
}

fn open_err(spec: &StateSpec) -> String {
    open(spec, 1 << 20, 1 << 22, Codec::Lz4)
        .err()
        .expect("open should fail")
        .to_string()
}

#[test]
fn a_state_serves_only_the_device_it_was_made_for() {
    let r = root("identity");
    let a = spec(&r, "a", "/run/a.sock");
    drop(open(&a, 1 << 20, 1 << 22, Codec::Lz4).unwrap());
    // Another socket under the same name.
    let other = spec(&r, "a", "/run/b.sock");
    let e = open_err(&other);
    assert!(
        e.contains("made for socket /run/a.sock, not /run/b.sock"),
        "{e}"
    );
    assert!(e.contains("--adopt"), "{e}");
    // A state directory renamed to another device's name.
    std::fs::rename(r.join("a"), r.join("b")).unwrap();
    let e = open_err(&spec(&r, "b", "/run/a.sock"));
    assert!(
        e.contains("holds the state of device \"a\", not \"b\""),
        "{e}"
    );
    // Adopting takes it, and records the new owner.
    let adopt = StateSpec {
        adopt: true,
        ..spec(&r, "b", "/run/b.sock")
    };
    let st = open(&adopt, 1 << 20, 1 << 22, Codec::Lz4).unwrap();
    assert!(st.existing);
    drop(st);
    let st = open(&spec(&r, "b", "/run/b.sock"), 1 << 20, 1 << 22, Codec::Lz4).unwrap();
    assert_eq!(st.header.name, "b");
    assert_eq!(st.header.socket.as_deref(), Some(Path::new("/run/b.sock")));
    drop(st);
    // A runtime add that did not ask for it.
    let refuse = StateSpec {
        existing: Existing::Refuse,
        ..spec(&r, "b", "/run/b.sock")
    };
    let e = open_err(&refuse);
    assert!(e.contains("has state left in"), "{e}");
    assert!(e.contains("vzram forget b"), "{e}");
    std::fs::remove_dir_all(&r).unwrap();
}

#[test]
fn a_state_from_before_sockets_is_bound_to_the_first_socket_it_serves() {
    let r = root("v2");
    drop(open(&spec(&r, "a", "/run/a.sock"), 1 << 20, 1 << 22, Codec::Lz4).unwrap());
    let hp = r.join("a/header");
    let mut raw = std::fs::read(&hp).unwrap();
    raw.truncate(FIXED_LEN);
    raw[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&hp, &raw).unwrap();
    let st = open(
        &spec(&r, "a", "/run/new.sock"),
        1 << 20,
        1 << 22,
        Codec::Lz4,
    )
    .unwrap();
    assert!(st.existing);
    drop(st);
    assert_eq!(std::fs::metadata(&hp).unwrap().len(), HEADER_LEN as u64);
    let e = open_err(&spec(&r, "a", "/run/a.sock"));
    assert!(e.contains("made for socket /run/new.sock"), "{e}");
    std::fs::remove_dir_all(&r).unwrap();
}

#[test]
fn removal_leaves_a_tombstone_that_the_next_open_finishes() {
    let r = root("tomb");
    let a = spec(&r, "a", "/run/a.sock");
    drop(open(&a, 1 << 20, 1 << 22, Codec::Lz4).unwrap());
    // What a crash in the middle of a removal leaves: the renamed
    // state, part deleted.
    let tomb = r.join(format!(".a{GONE_TAG}4194305-2"));
    std::fs::rename(r.join("a"), &tomb).unwrap();
    std::fs::remove_file(tomb.join("arena")).unwrap();
    let st = open(&a, 1 << 20, 1 << 22, Codec::Lz4).unwrap();
    assert!(!st.existing, "the name is free again");
    assert!(!tomb.exists());
    drop(st);
    remove(&r.join("a")).unwrap();
    assert!(!r.join("a").exists());
    assert_eq!(std::fs::read_dir(&r).unwrap().count(), 0);
    assert!(remove(&r).unwrap_err().to_string().contains("left alone"));
    std::fs::remove_dir_all(&r).unwrap();
}

#[test]
fn roots_inside_a_state_or_under_a_missing_parent_are_refused() {
    let r = root("nest");
    drop(open(&spec(&r, "a", "/run/a.sock"), 1 << 20, 1 << 22, Codec::Lz4).unwrap());
    let e = open_err(&spec(&r.join("a"), "b", "/run/b.sock"));
    assert!(e.contains("inside the state of another device"), "{e}");
    let e = open_err(&spec(&r.join("a/deeper"), "b", "/run/b.sock"));
    assert!(e.contains("inside the state of another device"), "{e}");
    let e = open_err(&spec(&r.join("no/such"), "b", "/run/b.sock"));
    assert!(e.contains("parent directory does not exist"), "{e}");
    assert_eq!(enclosing_state(&r.join("a/arena")), Some(r.join("a")));
    assert_eq!(enclosing_state(&r), None);
    std::fs::remove_dir_all(&r).unwrap();
}

#[test]
fn leftovers_are_the_states_nobody_holds() {
    let r = root("left");
    let held = open(
        &spec(&r, "held", "/run/h.sock"),
        1 << 20,
        1 << 22,
        Codec::Lz4,
    )
    .unwrap();
    drop(
        open(
            &spec(&r, "idle", "/run/i.sock"),
            1 << 20,
            1 << 22,
            Codec::Lz4,
        )
        .unwrap(),
    );
    drop(
        open(
            &spec(&r, "mine", "/run/m.sock"),
            1 << 20,
            1 << 22,
            Codec::Lz4,
        )
        .unwrap(),
    );
    std::fs::create_dir(r.join("not-a-state")).unwrap();
    let l = leftovers(&r, &["mine"]);
    assert_eq!(l.len(), 1, "{l:?}");
    assert_eq!(l[0].name, "idle");
    assert_eq!(l[0].size_bytes, 1 << 20);
    assert_eq!(l[0].socket.as_deref(), Some(Path::new("/run/i.sock")));
    assert!(l[0].bytes > 0);
    drop(held);
    std::fs::remove_dir_all(&r).unwrap();
}

#[test]
fn the_counters_and_a_truncated_stats_file() {
    let r = root("stats");
    let a = spec(&r, "a", "/run/a.sock");
    let st = open(&a, 1 << 20, 1 << 22, Codec::Lz4).unwrap();
    use std::os::unix::fs::MetadataExt;
    let m = st.stats.metadata().unwrap();
    assert!(m.blocks() * 512 >= stats_len(), "allocated, not sparse");
    drop(st);
    let f = OpenOptions::new()
        .write(true)
        .open(r.join("a/stats"))
        .unwrap();
    f.set_len(100).unwrap();
    let e = open_err(&a);
    assert!(e.contains("truncated"), "{e}");
    std::fs::remove_dir_all(&r).unwrap();
}
