//! What the engine asks of the machine it runs on: the Apple chip
//! generation (for the prefill tile), physical memory (for the automatic
//! KV budget), and a stable hash for the prefix cache's model identity.

/// `--prefill-tile auto`: 32 on Apple M5 and newer (GPU Neural
/// Accelerators prefer 32-token tiles), 0 elsewhere.
pub(crate) fn auto_prefill_tile(gpu: bool) -> usize {
    if gpu && apple_chip_generation().is_some_and(|g| g >= 5) {
        32
    } else {
        0
    }
}

/// The `N` of an "Apple MN ..." CPU brand string (macOS only).
fn apple_chip_generation() -> Option<u32> {
    if !cfg!(target_os = "macos") {
        return None;
    }
    let out = std::process::Command::new("sysctl")
        .args(["-n", "machdep.cpu.brand_string"])
        .output()
        .ok()?;
    chip_generation(&String::from_utf8_lossy(&out.stdout))
}

/// The `N` of a CPU brand string "Apple MN ..." (`None` for others).
fn chip_generation(brand: &str) -> Option<u32> {
    let rest = brand.trim().strip_prefix("Apple M")?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Physical memory in bytes (Linux `/proc/meminfo`, macOS `hw.memsize`);
/// 8 GiB when unknown.
pub(crate) fn physical_memory_bytes() -> usize {
    const FALLBACK: usize = 8 << 30;
    if let Ok(info) = std::fs::read_to_string("/proc/meminfo") {
        if let Some(bytes) = meminfo_total_bytes(&info) {
            return bytes;
        }
    }
    std::process::Command::new("sysctl")
        .args(["-n", "hw.memsize"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(FALLBACK)
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn meminfo_total_bytes(info: &str) -> Option<usize> {
    let kib = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())?;
    Some(kib * 1024)
}

/// A 64-bit hash of `s`, stable across builds, platforms and Rust
/// releases (xxh3 with the KV crate's block-hash seed): the prefix cache's
/// model identity key, so that blocks of one model and dtype never match
/// another's.
pub(crate) fn stable_hash(s: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(s.as_bytes(), mlxcel_kv::BLOCK_HASH_SEED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apple_brand_strings_give_the_chip_generation() {
        assert_eq!(chip_generation("Apple M5 Max"), Some(5));
        assert_eq!(chip_generation("Apple M10"), Some(10));
        assert_eq!(chip_generation("Intel(R) Xeon(R)"), None);
        assert_eq!(chip_generation("Apple Mx"), None);
    }

    #[test]
    fn meminfo_total_is_read_in_bytes() {
        let info = "MemFree: 10 kB\nMemTotal:       24576000 kB\n";
        assert_eq!(meminfo_total_bytes(info), Some(24_576_000 * 1024));
        assert_eq!(meminfo_total_bytes("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn the_identity_hash_is_stable_and_separates_inputs() {
        // XXH3-64 of "mlxcel" with the block-hash seed, as the Python
        // `xxhash` package computes it: the key of cached blocks must not
        // change with the build or the Rust release.
        assert_eq!(stable_hash("mlxcel"), 0x2ea2_8e6d_303e_152a);
        assert_ne!(
            stable_hash("model|Float32|llama"),
            stable_hash("model|Float16|llama")
        );
    }
}
