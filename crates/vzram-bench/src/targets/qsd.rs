//! qemu-storage-daemon exporting a tmpfs file over vhost-user-blk: the baseline.
//!
//! Its fastest configuration here: io_uring on the file blockdev (tmpfs takes it with
//! the page cache on, cache.direct=off) and the export on its own iothread; with
//! aio=threads and no iothread it is about 25% slower.

use super::target::{BlockTarget, Env, Memory};
use crate::error::{Context, Result};
use crate::sys::{daemon_rss, proc_mem, Daemon};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub struct Qsd {
    daemon: Daemon,
    socket: PathBuf,
    image: PathBuf,
}

impl Qsd {
    pub fn start(env: &Env, queues: u32, size: u64, seq: usize) -> Result<Qsd> {
        let image = env
            .shm_dir
            .join(format!("vzram-bench-{}-{seq}.img", std::process::id()));
        // Sparse: tmpfs allocates pages as they are written, like the guest's data.
        let f = std::fs::File::create(&image).context(format!("creating {}", image.display()))?;
        f.set_len(size)?;
        drop(f);
        let blockdev = format!(
            "driver=file,filename={},aio=io_uring,cache.direct=off",
            image.display()
        );
        match spawn(env, "qsd", &blockdev, queues, seq) {
            Ok((daemon, socket)) => Ok(Qsd {
                daemon,
                socket,
                image,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&image);
                Err(e)
            }
        }
    }
}

/// qemu-storage-daemon exporting `blockdev` (its options but the node name) over
/// vhost-user-blk on its own iothread, once its socket is there. `tag` names the
/// socket and the log in the work dir.
pub(super) fn spawn(
    env: &Env,
    tag: &str,
    blockdev: &str,
    queues: u32,
    seq: usize,
) -> Result<(Daemon, PathBuf)> {
    let socket = env.work_dir.join(format!("{tag}-{seq}.sock"));
    let _ = std::fs::remove_file(&socket);
    let mut cmd = Command::new(&env.qsd_bin);
    cmd.arg("--blockdev")
        .arg(format!("{blockdev},node-name=disk0"))
        .args(["--object", "iothread,id=io0", "--export"])
        .arg(format!(
            "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path={},\
             writable=on,num-queues={queues},iothread=io0",
            socket.display()
        ));
    let mut daemon = Daemon::spawn(
        "qemu-storage-daemon",
        &mut cmd,
        env.work_dir.join(format!("{tag}-{seq}.log")),
    )?;
    daemon.wait_for_paths(std::slice::from_ref(&socket), Duration::from_secs(15))?;
    Ok((daemon, socket))
}

impl BlockTarget for Qsd {
    fn socket(&self) -> &Path {
        &self.socket
    }

    fn daemon(&mut self) -> &mut Daemon {
        &mut self.daemon
    }

    fn memory(&mut self) -> Result<Memory> {
        let proc = proc_mem(self.daemon.pid())?;
        let tree = daemon_rss(self.daemon.pid())?;
        // Allocated tmpfs pages, not the apparent (sparse) size.
        let extra = std::fs::metadata(&self.image)?.blocks() * 512;
        Ok(Memory {
            host_bytes: tree.own() + extra,
            proc,
            extra_bytes: extra,
            tree,
            details: serde_json::json!({ "tmpfs_bytes": extra }),
            stat_sizes: None,
        })
    }
}

impl Drop for Qsd {
    fn drop(&mut self) {
        let _ = self.daemon.stop();
        let _ = std::fs::remove_file(&self.image);
        let _ = std::fs::remove_file(&self.socket);
    }
}
