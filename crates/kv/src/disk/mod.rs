//! The disk tier of the prefix cache: full KV blocks that leave RAM, one
//! file each, under a directory shared across restarts (docs/architecture.md,
//! "The disk tier").
//!
//! A file is named `<key>-<hash>-g<group>.kvb` (hex), a recurrent-state
//! snapshot's `<key>-<hash>-state.kvb` (under the hash of the block that
//! ends where it was taken; [`format::SNAPSHOT_GROUP`]): the tier key hashes
//! everything that makes a block valid besides its content hash (model
//! fingerprint, dtype, block size, the KV groups' layers and windows, the
//! recurrent layers, the storage layout, the format version), so files of another model or
//! configuration in the same directory are never looked up (counted as
//! foreign at start). Each file carries a header with the same fields and a
//! checksum ([`format`]): a corrupt, truncated, foreign or unreadable file
//! is skipped, counted and deleted, never served.
//!
//! Writes are atomic: a temporary file in the directory, `fsync`, then a
//! rename over the final name. The store keeps at most `max_bytes` of its
//! own files, least recently used (written or read) first out; the order
//! survives a restart through the files' modification times, which a read
//! refreshes. A failed write (a full disk, a read-only directory) turns
//! writes off with one warning: the server goes on with RAM only.
//!
//! One process owns a directory at a time: [`DiskStore::open`] takes an
//! advisory lock on `<dir>/lock` (released when the store is dropped, or
//! the process dies) and refuses a directory another store holds, naming
//! the holder's process id.

pub mod format;

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::hash::BlockHash;
use format::{BlockMeta, SNAPSHOT_GROUP};

/// The extension of block files.
const EXT: &str = "kvb";

/// Most threads [`DiskStore::get_many`] reads files on.
pub const READ_THREADS: usize = 8;

/// Why the disk tier could not open its directory.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// Another store (this process or another) holds the directory.
    #[error("prompt cache directory {dir} is in use by another server ({holder})")]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// What the lock file says about its holder (`pid=...`).
        holder: String,
    },
    /// The cache can't have a disk tier (no prefix cache).
    #[error("{0}")]
    Unsupported(String),
    /// The directory or its lock file could not be created or read.
    #[error("prompt cache directory {dir}: {source}")]
    Io {
        /// The directory.
        dir: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
}

/// Counters and sizes of the disk tier, plain data for `/v1/cache/stats`
/// and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskTierStats {
    /// KV block files of this configuration on disk.
    pub blocks: u64,
    /// Recurrent-state snapshot files of this configuration on disk.
    pub snapshots: u64,
    /// The size of both kinds of files, in bytes.
    pub bytes: u64,
    /// The size bound, in bytes.
    pub capacity_bytes: u64,
    /// Blocks read back from disk into the pool (served).
    pub hits: u64,
    /// Snapshots read back from disk (served).
    pub snapshot_hits: u64,
    /// Files written (blocks and snapshots).
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Files removed to stay within the size bound.
    pub evictions: u64,
    /// Files skipped: corrupt, truncated, foreign header or unreadable.
    pub skipped: u64,
    /// Files of another key (model or configuration) found at start.
    pub foreign: u64,
    /// Writes that failed (the first one turns writes off).
    pub write_errors: u64,
    /// Whether writes are still on (false after a failed write).
    pub writable: bool,
}

/// One file of the index.
#[derive(Debug, Clone, Copy)]
struct Entry {
    bytes: u64,
    /// Place in the LRU order (higher: used more recently).
    tick: u64,
}

/// The block files of one tier key in one directory; see the module docs.
#[derive(Debug)]
pub struct DiskStore {
    dir: PathBuf,
    key: u64,
    max_bytes: u64,
    index: HashMap<(BlockHash, u32), Entry>,
    lru: BTreeMap<u64, (BlockHash, u32)>,
    tick: u64,
    stats: DiskTierStats,
    /// Held for the store's life: the advisory lock.
    _lock: File,
    /// Test-only: every write fails with this OS error.
    #[cfg(any(test, feature = "fault-injection"))]
    fail_writes: Option<i32>,
}

fn io_err(dir: &Path) -> impl FnOnce(std::io::Error) -> DiskError + '_ {
    move |source| DiskError::Io {
        dir: dir.to_path_buf(),
        source,
    }
}

impl DiskStore {
    /// Opens (creating it if needed) `dir` for blocks of tier `key`, at
    /// most `max_bytes` of them: takes the directory's lock, removes this
    /// key's leftover temporary files, and indexes this key's block files
    /// by modification time (files over the bound are removed, oldest
    /// first). No file is read whole: each is checked when served.
    ///
    /// # Errors
    /// [`DiskError::Locked`] when another store holds `dir`;
    /// [`DiskError::Io`] when it can't be created, listed or locked (a
    /// read-only place: the caller runs with RAM only).
    pub fn open(dir: &Path, key: u64, max_bytes: u64) -> Result<DiskStore, DiskError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let lock = lock_dir(dir)?;
        let mut store = DiskStore {
            dir: dir.to_path_buf(),
            key,
            max_bytes,
            index: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            stats: DiskTierStats {
                capacity_bytes: max_bytes,
                writable: true,
                ..DiskTierStats::default()
            },
            _lock: lock,
            #[cfg(any(test, feature = "fault-injection"))]
            fail_writes: None,
        };
        store.scan()?;
        store.make_room(0);
        Ok(store)
    }

    /// Test-only: makes every later write fail with OS error `errno`
    /// (e.g. 28, no space left on device).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn fail_writes_with(&mut self, errno: i32) {
        self.fail_writes = Some(errno);
    }

    fn scan(&mut self) -> Result<(), DiskError> {
        let prefix = format!("{:016x}-", self.key);
        let mut found = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_err(&self.dir))? {
            let Ok(entry) = entry else { continue };
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.contains(".tmp") && name.starts_with(&prefix) {
                // A write that never reached its rename.
                let _ = fs::remove_file(entry.path());
                continue;
            }
            let Some(stem) = name.strip_suffix(&format!(".{EXT}")) else {
                continue;
            };
            let Some(rest) = stem.strip_prefix(&prefix) else {
                self.stats.foreign += 1;
                continue;
            };
            let Some((hash, group)) = parse_name(rest) else {
                self.stats.foreign += 1;
                continue;
            };
            let Ok(meta) = entry.metadata() else {
                self.stats.skipped += 1;
                continue;
            };
            let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            found.push((mtime, hash, group, meta.len()));
        }
        found.sort_by_key(|f| f.0);
        for (_, hash, group, bytes) in found {
            self.insert(hash, group, bytes);
        }
        Ok(())
    }

    fn insert(&mut self, hash: BlockHash, group: u32, bytes: u64) {
        self.tick += 1;
        if let Some(old) = self.index.insert(
            (hash, group),
            Entry {
                bytes,
                tick: self.tick,
            },
        ) {
            self.lru.remove(&old.tick);
            self.count(group, old.bytes, false);
        }
        self.lru.insert(self.tick, (hash, group));
        self.count(group, bytes, true);
    }

    /// Counts a file of `group` of `bytes` in (`add`) or out of the stats.
    fn count(&mut self, group: u32, bytes: u64, add: bool) {
        let files = if group == SNAPSHOT_GROUP {
            &mut self.stats.snapshots
        } else {
            &mut self.stats.blocks
        };
        if add {
            *files += 1;
            self.stats.bytes += bytes;
        } else {
            *files -= 1;
            self.stats.bytes -= bytes;
        }
    }

    fn forget(&mut self, hash: BlockHash, group: u32) -> Option<u64> {
        let e = self.index.remove(&(hash, group))?;
        self.lru.remove(&e.tick);
        self.count(group, e.bytes, false);
        Some(e.bytes)
    }

    fn path(&self, hash: BlockHash, group: u32) -> PathBuf {
        let key = self.key;
        self.dir.join(if group == SNAPSHOT_GROUP {
            format!("{key:016x}-{hash}-state.{EXT}")
        } else {
            format!("{key:016x}-{hash}-g{group}.{EXT}")
        })
    }

    /// The tier key this store serves.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// Whether a file of block `hash` of group `group` is indexed.
    pub fn contains(&self, hash: BlockHash, group: u32) -> bool {
        self.index.contains_key(&(hash, group))
    }

    /// Whether writes are on (off after a failed write).
    pub fn writable(&self) -> bool {
        self.stats.writable
    }

    /// The counters and sizes.
    pub fn stats(&self) -> DiskTierStats {
        self.stats
    }

    /// Removes least recently used files until `extra` more bytes fit.
    fn make_room(&mut self, extra: u64) {
        while self.stats.bytes + extra > self.max_bytes {
            let Some((_, (hash, group))) = self.lru.pop_first() else {
                break;
            };
            let path = self.path(hash, group);
            if let Some(e) = self.index.remove(&(hash, group)) {
                self.count(group, e.bytes, false);
            }
            let _ = fs::remove_file(path);
            self.stats.evictions += 1;
        }
    }

    /// Writes block (or snapshot) `meta.hash` of group `meta.group` with
    /// `payload`
    /// atomically (temporary file, `fsync`, rename), after removing least
    /// recently used files until it fits the bound; does nothing when the
    /// block is already on disk, writes are off, or the block alone is
    /// over the bound. A failed write turns writes off with one warning
    /// and is counted; it never fails the caller. Returns whether the
    /// block was written.
    pub fn put(&mut self, meta: &BlockMeta, payload: &[u8]) -> bool {
        if !self.stats.writable || self.contains(meta.hash, meta.group) {
            return false;
        }
        let size = (format::HEADER_BYTES + payload.len()) as u64;
        if size > self.max_bytes {
            return false;
        }
        self.make_room(size);
        let path = self.path(meta.hash, meta.group);
        let tmp = path.with_extension(format!("{EXT}.tmp.{}", std::process::id()));
        match self.write_file(&tmp, &path, meta, payload) {
            Ok(()) => {
                self.insert(meta.hash, meta.group, size);
                self.stats.writes += 1;
                self.stats.write_bytes += size;
                true
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                self.stats.write_errors += 1;
                self.stats.writable = false;
                tracing::warn!(
                    dir = %self.dir.display(),
                    error = %e,
                    "writing a prompt cache block to disk failed; the disk tier stops writing \
                     (blocks already on disk are still read)"
                );
                false
            }
        }
    }

    fn write_file(
        &self,
        tmp: &Path,
        path: &Path,
        meta: &BlockMeta,
        payload: &[u8],
    ) -> std::io::Result<()> {
        #[cfg(any(test, feature = "fault-injection"))]
        if let Some(errno) = self.fail_writes {
            return Err(std::io::Error::from_raw_os_error(errno));
        }
        let mut f = File::create(tmp)?;
        f.write_all(&meta.encode(payload))?;
        f.write_all(payload)?;
        f.sync_all()?;
        drop(f);
        fs::rename(tmp, path)
    }

    /// The payload of block `want.hash` of group `want.group`, read and
    /// checked (header fields, size, checksum); `None` when it is not on
    /// disk or the file is unusable (then it is counted as skipped,
    /// removed from the index and deleted). A served file becomes the
    /// most recently used.
    pub fn get(&mut self, want: &BlockMeta) -> Option<Vec<u8>> {
        self.get_many(std::slice::from_ref(want)).pop().flatten()
    }

    /// [`DiskStore::get`] of the run of blocks `wants`, in order: the
    /// files are read and checked on up to [`READ_THREADS`] threads at
    /// once (reads of a long prefix are bound by the storage's queue depth
    /// and the checksum, not by one thread's `read`), then counted and
    /// refreshed in order. The run ends at the first block missing or
    /// unusable: later entries are `None` and not counted as hits (a
    /// prefix can't use them); unusable files among them are still
    /// skipped and deleted. The run is refreshed last block first, so its
    /// first block is the most recently used.
    pub fn get_many(&mut self, wants: &[BlockMeta]) -> Vec<Option<Vec<u8>>> {
        let paths: Vec<Option<PathBuf>> = wants
            .iter()
            .map(|w| {
                self.contains(w.hash, w.group)
                    .then(|| self.path(w.hash, w.group))
            })
            .collect();
        let mut checked: Vec<Option<Result<Vec<u8>, String>>> = vec![None; wants.len()];
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(READ_THREADS)
            .min(wants.len());
        let read = |wants: &[BlockMeta], paths: &[Option<PathBuf>], out: &mut [Option<_>]| {
            for ((want, path), slot) in wants.iter().zip(paths).zip(out) {
                *slot = path.as_deref().map(|p| read_checked(p, want));
            }
        };
        if threads <= 1 {
            read(wants, &paths, &mut checked);
        } else {
            let chunk = wants.len().div_ceil(threads);
            std::thread::scope(|s| {
                for ((w, p), out) in wants
                    .chunks(chunk)
                    .zip(paths.chunks(chunk))
                    .zip(checked.chunks_mut(chunk))
                {
                    s.spawn(move || read(w, p, out));
                }
            });
        }
        let mut out = Vec::with_capacity(wants.len());
        // A run: nothing after the first block missing or unusable is
        // served (or counted, or refreshed); bad files there are still
        // skipped and deleted.
        let mut served = true;
        let mut refresh = Vec::new();
        for ((want, path), result) in wants.iter().zip(paths).zip(checked) {
            let (Some(path), Some(result)) = (path, result) else {
                served = false;
                out.push(None);
                continue;
            };
            match result {
                Ok(_) if !served => out.push(None),
                Ok(payload) => {
                    if want.is_snapshot() {
                        self.stats.snapshot_hits += 1;
                    } else {
                        self.stats.hits += 1;
                    }
                    let bytes = (format::HEADER_BYTES + payload.len()) as u64;
                    refresh.push((want.hash, want.group, bytes, path));
                    out.push(Some(payload));
                }
                Err(why) => {
                    served = false;
                    tracing::warn!(file = %path.display(), error = %why, "skipping an unusable prompt cache file");
                    self.stats.skipped += 1;
                    self.forget(want.hash, want.group);
                    let _ = fs::remove_file(&path);
                    out.push(None);
                }
            }
        }
        // Most recently used last first: the run's first block becomes the
        // newest, so the size bound removes a prefix from its end (a run
        // missing its first block serves nothing).
        for (hash, group, bytes, path) in refresh.into_iter().rev() {
            self.insert(hash, group, bytes);
            if let Ok(f) = File::options().write(true).open(&path) {
                let _ = f.set_modified(SystemTime::now());
            }
        }
        out
    }

    /// Skips the file of `meta` that [`DiskStore::get`] served but its
    /// reader found unusable (`why`): counted as skipped, no longer a hit,
    /// deleted.
    pub fn discard(&mut self, meta: &BlockMeta, why: &str) {
        tracing::warn!(hash = %meta.hash, group = meta.group, error = why, "skipping an unusable prompt cache file");
        if meta.is_snapshot() {
            self.stats.snapshot_hits = self.stats.snapshot_hits.saturating_sub(1);
        } else {
            self.stats.hits = self.stats.hits.saturating_sub(1);
        }
        self.stats.skipped += 1;
        self.forget(meta.hash, meta.group);
        let _ = fs::remove_file(self.path(meta.hash, meta.group));
    }

    /// Deletes every file of this key (blocks and snapshots); returns
    /// (files, bytes) removed. Other keys' files stay.
    pub fn clear(&mut self) -> (u64, u64) {
        let (files, bytes) = (self.stats.blocks + self.stats.snapshots, self.stats.bytes);
        let keys: Vec<(BlockHash, u32)> = self.index.keys().copied().collect();
        for (hash, group) in keys {
            let _ = fs::remove_file(self.path(hash, group));
        }
        self.index.clear();
        self.lru.clear();
        self.stats.blocks = 0;
        self.stats.snapshots = 0;
        self.stats.bytes = 0;
        (files, bytes)
    }
}

/// `<hash>-g<group>` (or `<hash>-state`) of a file name.
fn parse_name(rest: &str) -> Option<(BlockHash, u32)> {
    let (hash, group) = match rest.strip_suffix("-state") {
        Some(hash) => (hash, SNAPSHOT_GROUP),
        None => {
            let (hash, group) = rest.split_once("-g")?;
            (hash, group.parse().ok().filter(|&g| g != SNAPSHOT_GROUP)?)
        }
    };
    if hash.len() != 32 {
        return None;
    }
    Some((BlockHash(u128::from_str_radix(hash, 16).ok()?), group))
}

/// The payload of the file at `path`, checked against `want`
/// ([`format::decode`]); the reason it is unusable otherwise.
fn read_checked(path: &Path, want: &BlockMeta) -> Result<Vec<u8>, String> {
    // A block file of another size is not read (a torn write, or
    // garbage); a snapshot's size is in its header.
    let len = fs::metadata(path).map_err(|e| e.to_string())?.len();
    if let Some(size) = want.expected_file_bytes().filter(|&s| s != len) {
        return Err(format::FormatError::Truncated {
            got: len,
            want: size,
        }
        .to_string());
    }
    let mut bytes = fs::read(path).map_err(|e| e.to_string())?;
    format::decode(&bytes, want).map_err(|e| e.to_string())?;
    bytes.drain(..format::HEADER_BYTES);
    Ok(bytes)
}

/// Takes an exclusive advisory lock (`flock`) on `f` without waiting;
/// `Ok(false)` when another open file holds it. The lock goes with the
/// file (closed, or the process gone).
fn try_lock(f: &File) -> std::io::Result<bool> {
    // SAFETY: `flock` reads only the descriptor, which `f` keeps open for
    // the duration of the call.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Takes the advisory lock of `dir` and writes this process's id in it.
fn lock_dir(dir: &Path) -> Result<File, DiskError> {
    let path = dir.join("lock");
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_err(dir))?;
    if !try_lock(&f).map_err(io_err(dir))? {
        let mut holder = String::new();
        let _ = f.read_to_string(&mut holder);
        return Err(DiskError::Locked {
            dir: dir.to_path_buf(),
            holder: holder.trim().to_string(),
        });
    }
    f.set_len(0).map_err(io_err(dir))?;
    writeln!(f, "pid={}", std::process::id()).map_err(io_err(dir))?;
    Ok(f)
}

#[cfg(test)]
mod tests;
