//! A device's state handed between processes' pools (a supervisor and its
//! workers): each attach recovers it, and the shared counters stay right.

use vzram_store::{Codec, Context, DeviceConfig, Pool, PoolConfig, StateSpec};

mod common;
use common::noise;

#[test]
fn attach_write_detach_attach_discard() {
    let mut cx = Context::new(0);
    let root = std::env::temp_dir().join(format!("vzram-handover-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let host = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(root.join("host"))
        .unwrap();
    let mut dc = DeviceConfig::new(16 << 20, Codec::Lz4);
    dc.shards = 1;
    dc.state = Some(StateSpec {
        root: root.clone(),
        name: "d".into(),
        ..StateSpec::default()
    });
    let sup = Pool::with_host_file(PoolConfig::default(), &host).unwrap();
    let dev = sup.create_device(dc.clone()).unwrap();
    let files = dev.state_files().unwrap().try_clone().unwrap();
    drop(dev);

    // A worker: its own pool over the same host file.
    let worker = Pool::with_host_file(PoolConfig::default(), &host).unwrap();
    let dev = worker
        .attach_device(dc.clone(), files.try_clone().unwrap(), None)
        .unwrap();
    for s in 0..512 {
        dev.write_page(&mut cx, s, &noise(s)).unwrap();
    }
    let used = dev.stats().mem_used_total;
    assert!(used >= 512 * 4096);
    drop(dev);
    drop(worker);
    assert_eq!(sup.host_cells().budget().used(), used);

    // Back in the supervisor: recovered, then every page dropped.
    let dev = sup
        .attach_device(dc.clone(), files.try_clone().unwrap(), None)
        .unwrap();
    assert_eq!(dev.recovery().unwrap().slots, 512);
    for s in (0..512).step_by(97) {
        let mut out = [0u8; 4096];
        dev.read_page(&mut cx, s, &mut out).unwrap();
        assert_eq!(out, noise(s));
    }
    dev.discard(&mut cx, 0..dev.num_slots()).unwrap();
    assert_eq!(dev.stats().mem_used_total, 0);
    assert_eq!(sup.host_cells().budget().used(), 0);
    drop(dev);
    std::fs::remove_dir_all(&root).unwrap();
}
