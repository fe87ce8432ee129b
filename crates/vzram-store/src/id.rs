//! Random identities: a state's creation id and a host budget's id, which
//! tell apart files and budgets that look alike.

/// A random 64-bit value (the clock's nanoseconds if getrandom fails).
pub(crate) fn random_id() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom fills the buffer we own; on failure the time is used.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 8 {
        u64::from_ne_bytes(b)
    } else {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    }
}
