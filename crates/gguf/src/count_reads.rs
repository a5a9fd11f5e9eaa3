//! How many times each file's header was read (feature `count-reads`, for
//! tests that check a start-up reads a GGUF header once).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Every path [`crate::GgufHeader::read`] was called with, once per call.
static READS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Records a read of `path`'s header.
pub(crate) fn record(path: &Path) {
    READS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(path.to_path_buf());
}

/// How many times the header of `path` (as the reader was given it, not
/// canonicalized) has been read in this process.
pub fn header_reads(path: &Path) -> usize {
    READS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|p| p.as_path() == path)
        .count()
}
