//! Where things are: the repository, the `vzram` binary, a test's
//! temporary directory and the daemon state kept for it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The daemon binary: `$VZRAM_BIN`, else `vzram` in the target directory
/// (`$CARGO_TARGET_DIR`, or the one this test binary lives in, or
/// `<repo>/target`) after a `cargo build -p vzram`, which is a no-op when
/// the binary is fresh and so never runs a stale daemon.
pub fn vzram_bin() -> PathBuf {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(find_or_build)
        .clone()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn find_or_build() -> Result<PathBuf, String> {
    if let Some(b) = std::env::var_os("VZRAM_BIN") {
        let b = PathBuf::from(b);
        return if b.is_file() {
            Ok(b)
        } else {
            Err(format!("VZRAM_BIN={} does not exist", b.display()))
        };
    }
    // This test binary is <target>/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let profile_dir = exe.parent().and_then(Path::parent).map(Path::to_path_buf);
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            profile_dir
                .as_ref()
                .and_then(|p| p.parent())
                .map(Path::to_path_buf)
        })
        .unwrap_or_else(|| root().join("target"));
    let release = profile_dir
        .as_ref()
        .and_then(|p| p.file_name())
        .is_some_and(|n| n == "release");
    let bin = target_dir
        .join(if release { "release" } else { "debug" })
        .join("vzram");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(root())
        .args(["build", "-p", "vzram"])
        .env("CARGO_TARGET_DIR", &target_dir);
    if release {
        cmd.arg("--release");
    }
    match cmd.stdin(Stdio::null()).output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(format!(
                "cargo build -p vzram failed ({}):\n{}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            ))
        }
        // No cargo (the test binary was run by hand): use what is there.
        Err(e) => eprintln!("cannot run {cargo} ({e}); using {} as is", bin.display()),
    }
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("no vzram binary at {}", bin.display()))
    }
}

/// A directory under the system temp dir, removed on drop. Kept short:
/// unix socket paths are limited to 108 bytes.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        // A long $TMPDIR would push socket paths past 108 bytes.
        let mut base = std::env::temp_dir();
        if base.as_os_str().len() > 40 {
            base = PathBuf::from("/tmp");
        }
        let p = base.join(format!(
            "vz-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        // The state of daemons started for it or for a directory inside it.
        let state = state_dir_for(&self.0);
        let (Some(base), Some(prefix)) = (state.parent(), state.file_name()) else {
            return;
        };
        let prefix = prefix.to_string_lossy();
        let inside = format!("{prefix}_");
        for e in std::fs::read_dir(base).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == prefix || name.starts_with(&inside) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Where daemons started for a test directory keep their device state: on
/// tmpfs as in production, named after the directory's whole path, and
/// removed with it (see [`TempDir`]'s drop). Daemons get it as
/// `VZRAM_STATE_DIR`.
pub fn state_dir_for(test_dir: &Path) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    base.join(format!(
        "vzstate{}",
        test_dir.to_string_lossy().replace('/', "_")
    ))
}

/// A path as the `&str` an argument list wants (test paths are UTF-8).
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}
