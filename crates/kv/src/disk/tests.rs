use super::*;

/// A fresh directory under the system's temporary directory.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mlxcel-disk-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn meta(key: u64, hash: u128) -> BlockMeta {
    BlockMeta {
        key,
        hash: BlockHash(hash),
        group: 0,
        block_size: 4,
        layers: 2,
        kv_heads: 1,
        head_dim: 2,
        dtype: 10,
        bits: 0,
        group_size: 0,
    }
}

fn payload(m: &BlockMeta, seed: u8) -> Vec<u8> {
    (0..m.payload_bytes())
        .map(|i| (i as u8).wrapping_add(seed))
        .collect()
}

#[test]
fn blocks_survive_a_reopen_and_lru_keeps_the_bound() {
    let dir = temp_dir("lru");
    let m = meta(1, 10);
    let size = m.file_bytes();
    let mut store = DiskStore::open(&dir, 1, 3 * size).unwrap();
    for h in 10..13 {
        assert!(store.put(&meta(1, h), &payload(&meta(1, h), h as u8)));
    }
    // Reading 10 makes 11 the least recently used.
    assert_eq!(store.get(&m).unwrap(), payload(&m, 10));
    assert!(store.put(&meta(1, 13), &payload(&meta(1, 13), 13)));
    assert!(!store.contains(BlockHash(11), 0));
    let s = store.stats();
    assert_eq!(
        (s.blocks, s.bytes, s.writes, s.evictions),
        (3, 3 * size, 4, 1)
    );
    // Writing a block again is a no-op.
    assert!(!store.put(&m, &payload(&m, 10)));
    drop(store);

    // A restart rebuilds the index from the directory, in the same order.
    let mut store = DiskStore::open(&dir, 1, 3 * size).unwrap();
    assert_eq!(store.stats().blocks, 3);
    assert_eq!(store.get(&meta(1, 13)).unwrap(), payload(&meta(1, 13), 13));
    assert!(store.get(&meta(1, 11)).is_none());
    // Another key's files are foreign: indexed by neither.
    drop(store);
    let mut other = DiskStore::open(&dir, 2, 3 * size).unwrap();
    assert_eq!((other.stats().blocks, other.stats().foreign), (0, 3));
    assert!(other.get(&meta(2, 13)).is_none());
    drop(other);
    let _ = fs::remove_dir_all(&dir);
}

/// A run read back is refreshed from its end: the size bound then
/// removes its last block first, also after a restart (modification
/// times), never the first one its prefix needs.
#[test]
fn a_run_read_back_loses_its_last_block_first() {
    let dir = temp_dir("run-lru");
    let (a, b, c, d, e) = (meta(1, 1), meta(1, 2), meta(1, 3), meta(1, 4), meta(1, 5));
    let size = a.file_bytes();
    let mut store = DiskStore::open(&dir, 1, 3 * size).unwrap();
    for m in [&a, &b, &c] {
        assert!(store.put(m, &payload(m, 0)));
    }
    assert!(store.get_many(&[a, b, c]).iter().all(Option::is_some));
    // A write's modification time comes from the kernel's coarse clock
    // (milliseconds behind the exact times a read sets).
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(store.put(&d, &payload(&d, 0)));
    assert!(store.contains(a.hash, 0) && !store.contains(c.hash, 0));
    drop(store);
    let mut store = DiskStore::open(&dir, 1, 3 * size).unwrap();
    assert!(store.put(&e, &payload(&e, 0)));
    assert!(!store.contains(b.hash, 0), "b was the oldest left");
    assert!(store.contains(a.hash, 0) && store.contains(d.hash, 0));
    drop(store);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn corrupt_truncated_and_renamed_files_are_skipped_and_counted() {
    let dir = temp_dir("corrupt");
    let mut store = DiskStore::open(&dir, 1, 1 << 20).unwrap();
    let (a, b, c) = (meta(1, 1), meta(1, 2), meta(1, 3));
    for m in [&a, &b, &c] {
        assert!(store.put(m, &payload(m, 0)));
    }
    // A flipped byte in a's payload; b cut short; c's bytes under the
    // name of another hash (its header names c).
    let mut bytes = fs::read(store.path(a.hash, 0)).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(store.path(a.hash, 0), &bytes).unwrap();
    let bytes = fs::read(store.path(b.hash, 0)).unwrap();
    fs::write(store.path(b.hash, 0), &bytes[..bytes.len() / 2]).unwrap();
    let d = meta(1, 4);
    fs::copy(store.path(c.hash, 0), store.path(d.hash, 0)).unwrap();
    drop(store);
    let mut store = DiskStore::open(&dir, 1, 1 << 20).unwrap();
    assert_eq!(store.stats().blocks, 4);
    assert!(store.get(&a).is_none());
    assert!(store.get(&b).is_none());
    assert!(store.get(&d).is_none());
    assert_eq!(store.get(&c).unwrap(), payload(&c, 0));
    let s = store.stats();
    assert_eq!((s.skipped, s.hits, s.blocks), (3, 1, 1));
    assert!(!store.path(a.hash, 0).exists(), "a skipped file is deleted");
    assert_eq!(store.clear(), (1, c.file_bytes()));
    assert_eq!(store.stats().blocks, 0);
    drop(store);
    let _ = fs::remove_dir_all(&dir);
}

/// A file its reader finds unusable after the store served it (a
/// snapshot that checks out but describes other states): no longer a
/// hit, counted as skipped, deleted.
#[test]
fn a_discarded_file_is_skipped_and_deleted() {
    let dir = temp_dir("discard");
    let mut store = DiskStore::open(&dir, 1, 1 << 20).unwrap();
    let snap = BlockMeta::snapshot(1, BlockHash(5), 4, 2);
    assert!(store.put(&snap, &[1, 2, 3]));
    let s = store.stats();
    assert_eq!((s.snapshots, s.blocks), (1, 0));
    assert!(store.path(snap.hash, snap.group).ends_with(format!(
        "{:016x}-{}-state.kvb",
        1,
        BlockHash(5)
    )));
    assert_eq!(store.get(&snap).unwrap(), vec![1, 2, 3]);
    assert_eq!(store.stats().snapshot_hits, 1);
    store.discard(&snap, "describes other states");
    let s = store.stats();
    assert_eq!(
        (s.snapshot_hits, s.skipped, s.snapshots, s.bytes),
        (0, 1, 0, 0)
    );
    assert!(!store.path(snap.hash, snap.group).exists());
    drop(store);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_second_store_on_one_directory_is_refused() {
    let dir = temp_dir("lock");
    let store = DiskStore::open(&dir, 1, 1 << 20).unwrap();
    let err = DiskStore::open(&dir, 1, 1 << 20).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, DiskError::Locked { .. }), "{msg}");
    assert!(
        msg.contains(&format!("pid={}", std::process::id())),
        "{msg}"
    );
    drop(store);
    // Released with the store.
    drop(DiskStore::open(&dir, 1, 1 << 20).unwrap());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_full_disk_turns_writes_off_once_and_reads_go_on() {
    let dir = temp_dir("full");
    let mut store = DiskStore::open(&dir, 1, 1 << 20).unwrap();
    let (a, b, c) = (meta(1, 1), meta(1, 2), meta(1, 3));
    assert!(store.put(&a, &payload(&a, 0)));
    store.fail_writes_with(28); // ENOSPC
    assert!(!store.put(&b, &payload(&b, 0)));
    assert!(!store.put(&c, &payload(&c, 0)));
    let s = store.stats();
    assert_eq!((s.write_errors, s.writable, s.blocks), (1, false, 1));
    assert_eq!(store.get(&a).unwrap(), payload(&a, 0));
    // Nothing half-written is left behind.
    let names: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}"); // the lock and a's file
    drop(store);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_that_cannot_be_created_is_an_io_error() {
    // A path under a regular file: no directory can exist there (unlike
    // permissions, this holds for root too).
    let file = std::env::temp_dir().join(format!("mlxcel-disk-{}-file", std::process::id()));
    fs::write(&file, b"not a directory").unwrap();
    let err = DiskStore::open(&file.join("cache"), 1, 1 << 20).unwrap_err();
    assert!(matches!(err, DiskError::Io { .. }), "{err}");
    let _ = fs::remove_file(&file);
}

#[test]
fn get_many_serves_a_run_in_order_and_stops_at_the_first_bad_file() {
    let dir = temp_dir("many");
    let mut store = DiskStore::open(&dir, 1, 1 << 20).unwrap();
    // Twenty blocks (more than one reading thread's share), each with its
    // own payload; 13 corrupt, 17 missing.
    let metas: Vec<BlockMeta> = (0..20).map(|h| meta(1, 100 + h)).collect();
    for (i, m) in metas.iter().enumerate() {
        if i != 17 {
            assert!(store.put(m, &payload(m, i as u8)));
        }
    }
    let good = store.get_many(&metas[..13]);
    for (i, p) in good.iter().enumerate() {
        assert_eq!(
            p.as_deref(),
            Some(&payload(&metas[i], i as u8)[..]),
            "block {i}"
        );
    }
    assert_eq!(store.stats().hits, 13);
    let path = store.path(metas[13].hash, 0);
    let mut bytes = fs::read(&path).unwrap();
    bytes[format::HEADER_BYTES] ^= 1;
    fs::write(&path, &bytes).unwrap();
    // A bad file ends the run: 10..13 served; 14.. neither served nor
    // counted, though readable; the corrupt file skipped and deleted.
    let got = store.get_many(&metas[10..]);
    assert_eq!(got.iter().filter(|p| p.is_some()).count(), 3);
    assert!(got[..3].iter().all(Option::is_some));
    let s = store.stats();
    assert_eq!((s.hits, s.skipped), (16, 1), "{s:?}");
    assert!(!path.exists() && !store.contains(metas[13].hash, 0));
    // Blocks after the bad one are still there for a later lookup.
    assert_eq!(store.get(&metas[14]).unwrap(), payload(&metas[14], 14));
    let _ = fs::remove_dir_all(&dir);
}
