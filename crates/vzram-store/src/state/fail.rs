//! The state module's errors, each naming the file it is about.

use std::path::Path;

use crate::error::StoreError;

pub(super) fn err(path: &Path, msg: impl std::fmt::Display) -> StoreError {
    StoreError::state(format_args!("{}: {msg}", path.display()), None)
}

/// `doing` on the file failed with `e`.
pub(super) fn os_err(path: &Path, doing: &str, e: std::io::Error) -> StoreError {
    StoreError::state(format_args!("{}: {doing}", path.display()), e)
}
