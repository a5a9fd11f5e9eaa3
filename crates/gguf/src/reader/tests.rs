use super::*;

/// A GGUF v3 file: `meta` as (key, type id, value bytes), then tensors
/// (name, dimensions innermost first, type id, data bytes).
fn file(meta: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, usize)]) -> Vec<u8> {
    let mut b: Vec<u8> = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, ty, v) in meta {
        b.extend(string(k));
        b.extend(ty.to_le_bytes());
        b.extend(v);
    }
    let mut offset = 0u64;
    for (name, dims, ty, bytes) in tensors {
        b.extend(string(name));
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (*bytes as u64).div_ceil(32) * 32;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.resize(b.len() + offset as usize, 0);
    b
}

fn string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

#[test]
fn a_valid_header_reads_typed_metadata_and_row_major_shapes() {
    let mut array = 5u32.to_le_bytes().to_vec();
    array.extend(2u64.to_le_bytes());
    array.extend((-1i32).to_le_bytes());
    array.extend(7i32.to_le_bytes());
    let bytes = file(
        &[
            ("general.architecture", 8, string("llama")),
            ("llama.block_count", 4, 2u32.to_le_bytes().to_vec()),
            ("llama.eps", 6, 0.5f32.to_le_bytes().to_vec()),
            ("flag", 7, vec![1]),
            ("ids", 9, array),
        ],
        &[
            ("token_embd.weight", &[8, 16], 0, 8 * 16 * 4),
            ("output.weight", &[32, 16], 8, 16 * 34),
        ],
    );
    let h = GgufHeader::parse_bytes(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(
        h.get("general.architecture").and_then(Value::as_str),
        Some("llama")
    );
    assert_eq!(h.get("llama.block_count").and_then(Value::as_u64), Some(2));
    assert_eq!(h.get("llama.eps").and_then(Value::as_f64), Some(0.5));
    assert_eq!(h.get("flag").and_then(Value::as_bool), Some(true));
    assert_eq!(
        h.get("ids").and_then(Value::as_array),
        Some(&[Value::Int(-1), Value::Int(7)][..])
    );
    let embed = h.tensor("token_embd.weight").unwrap();
    assert_eq!(embed.shape, vec![16, 8]);
    assert_eq!(embed.ty, TensorType::F32);
    assert_eq!(h.tensor("output.weight").unwrap().ty, TensorType::Q8_0);
    assert_eq!(h.tensor("output.weight").unwrap().offset, 512);
    assert!(h.data_start.is_multiple_of(32));
}

#[test]
fn invalid_headers_name_the_problem() {
    let good = file(&[], &[("t.weight", &[8], 0, 32)]);
    let mut magic = good.clone();
    magic[0] = b'X';
    assert_eq!(
        GgufHeader::parse_bytes(&magic).unwrap_err(),
        HeaderError::BadMagic
    );
    let mut version = good.clone();
    version[4] = 4;
    assert_eq!(
        GgufHeader::parse_bytes(&version).unwrap_err().to_string(),
        "GGUF version 4 (supported: 2 and 3)"
    );
    assert_eq!(
        GgufHeader::parse_bytes(&good[..6]).unwrap_err(),
        HeaderError::Truncated(4)
    );
    let e = GgufHeader::parse_bytes(&good[..good.len() - 1]).unwrap_err();
    assert!(e.to_string().contains("lies outside the file"), "{e}");
    let unknown = file(&[], &[("t.weight", &[8], 5, 32)]);
    assert_eq!(
        GgufHeader::parse_bytes(&unknown).unwrap_err().to_string(),
        "tensor t.weight has unknown type id 5"
    );
    let partial = file(&[], &[("t.weight", &[16], 8, 34)]);
    assert_eq!(
        GgufHeader::parse_bytes(&partial).unwrap_err().to_string(),
        "tensor t.weight: row of 16 elements is not a whole number of Q8_0 blocks"
    );
    let bad_value = file(&[("k", 13, vec![0; 8])], &[]);
    assert_eq!(
        GgufHeader::parse_bytes(&bad_value).unwrap_err().to_string(),
        "metadata k: unknown value type 13"
    );
}

#[test]
fn read_names_the_file() {
    let dir = std::env::temp_dir().join(format!("mlxcel-gguf-reader-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.gguf");
    let e = GgufHeader::read(&missing).unwrap_err();
    assert!(matches!(e, GgufError::Io { .. }), "{e:?}");
    assert!(
        e.to_string().starts_with(&missing.display().to_string()),
        "{e}"
    );
    let bad = dir.join("bad.gguf");
    std::fs::write(&bad, b"{\"model_type\": \"llama\"}").unwrap();
    let e = GgufHeader::read(&bad).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{}: not a GGUF file (no GGUF magic)", bad.display())
    );
    std::fs::remove_dir_all(dir).unwrap();
}
