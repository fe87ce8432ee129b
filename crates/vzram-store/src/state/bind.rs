//! Each data file of a state (table, arena, stats) carries the state's
//! creation id, so that files of two states mixed offline (two devices'
//! `table` files swapped, a file restored from another state) are refused
//! at open instead of serving one device's slots over another's arena. The
//! header holds the id; the backing file holds it in its block 0.
//!
//! The id is a 32-byte trailer past the file's data, at the next 64 KiB
//! boundary, so that no mapping of the data (rounded up to the host's page,
//! at most 64 KiB) ever covers it and the layout of the data is unchanged:
//!
//! ```text
//! magic "VZRAMID\0" | creation id (le u64) | kind ("table", ...) | zero
//! ```
//!
//! A state from before version 4 has no trailers: it is bound on its first
//! open (the trailers written, then the header rewritten as version 4), so
//! a crash part way leaves a version 3 header and some files bound, which
//! the next open finishes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::fail::{err, os_err};
use crate::error::Result;

/// A state's data files as [`check`] and [`bind`] see them: each with its
/// kind and the length of its data, in the state `dir` of creation `id`.
pub(crate) struct Files<'a> {
    pub dir: &'a Path,
    pub id: u64,
    pub files: [(Kind, &'a File, u64); 3],
}

const MAGIC: [u8; 8] = *b"VZRAMID\0";
const ALIGN: u64 = 1 << 16;
const LEN: usize = 32;

/// Which file of a state a trailer is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Table,
    Arena,
    Stats,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Table => "table",
            Kind::Arena => "arena",
            Kind::Stats => "stats",
        }
    }

    fn from_name(b: &[u8]) -> Option<Kind> {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        [Kind::Table, Kind::Arena, Kind::Stats]
            .into_iter()
            .find(|k| k.name().as_bytes() == &b[..end])
    }
}

/// Where the trailer of a file holding `data_len` bytes of data starts.
fn trailer_at(data_len: u64) -> u64 {
    data_len.div_ceil(ALIGN) * ALIGN
}

/// The length of a bound file holding `data_len` bytes of data.
pub(crate) fn bound_len(data_len: u64) -> u64 {
    trailer_at(data_len) + LEN as u64
}

/// Writes the trailer binding `f` (of `kind`, `data_len` bytes of data)
/// to the state `id`.
pub(crate) fn write(f: &File, path: &Path, kind: Kind, data_len: u64, id: u64) -> Result<()> {
    let mut b = [0u8; LEN];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..16].copy_from_slice(&id.to_le_bytes());
    b[16..16 + kind.name().len()].copy_from_slice(kind.name().as_bytes());
    f.write_all_at(&b, trailer_at(data_len))
        .map_err(|e| os_err(path, "cannot record its state's creation id", e))
}

/// What a file's trailer says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// None: the file ends with its data (a state from before version 4).
    Unbound,
    Bound {
        id: u64,
        kind: Kind,
    },
}

fn read(f: &File, path: &Path, data_len: u64) -> Result<Found> {
    let len = f
        .metadata()
        .map_err(|e| os_err(path, "cannot stat", e))?
        .len();
    if len < bound_len(data_len) {
        return Ok(Found::Unbound);
    }
    let mut b = [0u8; LEN];
    f.read_exact_at(&mut b, trailer_at(data_len))
        .map_err(|e| os_err(path, "cannot read its state's creation id", e))?;
    let kind = Kind::from_name(&b[16..24]);
    match kind {
        Some(kind) if b[0..8] == MAGIC => Ok(Found::Bound {
            id: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            kind,
        }),
        _ => Err(err(
            path,
            format!(
                "its creation id (at byte {}) is damaged: not a vzram state file, or overwritten",
                trailer_at(data_len)
            ),
        )),
    }
}

/// Checks that every data file of `st` carries its header's creation id,
/// refusing a file of another state (naming both) or, in a state of
/// `version` 4 or later, one with no id. `fresh_stats`: the stats file was
/// just made (a missing one is zeroed counters, not data). Returns the
/// files to bind (those of an older state, or that stats file).
pub(crate) fn check(
    st: &Files<'_>,
    version: u32,
    fresh_stats: bool,
    whose: impl Fn(u64) -> Option<PathBuf>,
) -> Result<Vec<(Kind, u64)>> {
    let id = st.id;
    let hpath = st.dir.join("header");
    let mut unbound = Vec::new();
    for &(kind, f, data_len) in &st.files {
        let path = st.dir.join(kind.name());
        match read(f, &path, data_len)? {
            Found::Bound { id: got, kind: k } if got == id && k == kind => {}
            Found::Bound { id: got, kind: k } => {
                let other = whose(got)
                    .filter(|o| *o != st.dir)
                    .map(|o| {
                        format!(
                            ", the id of the state {} (see {})",
                            o.display(),
                            o.join("header").display()
                        )
                    })
                    .unwrap_or_default();
                let of = if k == kind {
                    String::new()
                } else {
                    format!(" and is a {} file", k.name())
                };
                return Err(err(
                    &path,
                    format!(
                        "belongs to another state: it carries creation id {got:016x}{other}{of}, while {} says {id:016x}: \
                         the files of two states were mixed (swapped or copied); put each file back in its own state, \
                         or discard this state (fresh=true on the device)",
                        hpath.display()
                    ),
                ));
            }
            Found::Unbound if version < 4 || (kind == Kind::Stats && fresh_stats) => {
                unbound.push((kind, data_len));
            }
            Found::Unbound => {
                return Err(err(
                    &path,
                    format!(
                        "carries no creation id, while {} (version {version}) says every file of the state does: \
                         a file of an older state was put in its place; put the right one back, \
                         or discard this state (fresh=true on the device)",
                        hpath.display()
                    ),
                ))
            }
        }
    }
    Ok(unbound)
}

/// Writes the trailers [`check`] found missing.
pub(crate) fn bind(st: &Files<'_>, unbound: &[(Kind, u64)]) -> Result<()> {
    let id = st.id;
    for &(kind, data_len) in unbound {
        let f = st
            .files
            .iter()
            .find(|(k, _, _)| *k == kind)
            .map(|&(_, f, _)| f)
            .expect("every kind has a file");
        let path = st.dir.join(kind.name());
        write(f, &path, kind, data_len, id)?;
        f.sync_data()
            .map_err(|e| os_err(&path, "cannot record its state's creation id", e))?;
    }
    Ok(())
}
