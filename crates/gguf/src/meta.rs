//! Typed access to an architecture's metadata keys (`{arch}.{key}`).

use crate::{GgufError, GgufHeader};

/// Typed access to the metadata keys of architecture `arch` in `header`
/// (`llama.block_count` is `Meta { arch: "llama", .. }.uint("block_count")`).
pub struct Meta<'a> {
    pub header: &'a GgufHeader,
    /// `general.architecture`: the prefix of the keys.
    pub arch: &'a str,
}

impl Meta<'_> {
    /// `{arch}.{key}` as an unsigned integer, if present.
    ///
    /// # Errors
    /// [`GgufError::KeyType`] when the value is not a non-negative integer.
    pub fn uint(&self, key: &str) -> Result<Option<u64>, GgufError> {
        let full = format!("{}.{key}", self.arch);
        match self.header.get(&full) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or(GgufError::KeyType {
                key: full,
                expected: "an integer",
            }),
        }
    }

    /// `{arch}.{key}` as an unsigned integer.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] when absent; as [`Meta::uint`].
    pub fn required_uint(&self, key: &str) -> Result<u64, GgufError> {
        self.uint(key)?
            .ok_or_else(|| GgufError::MissingKey(format!("{}.{key}", self.arch)))
    }

    /// `{arch}.{key}` as a float, if present.
    ///
    /// # Errors
    /// [`GgufError::KeyType`] when the value is not a number.
    pub fn float(&self, key: &str) -> Result<Option<f64>, GgufError> {
        let full = format!("{}.{key}", self.arch);
        match self.header.get(&full) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or(GgufError::KeyType {
                key: full,
                expected: "a number",
            }),
        }
    }

    /// `{arch}.{key}` as a string, if present (and a string).
    pub fn string(&self, key: &str) -> Option<&str> {
        self.header
            .get(&format!("{}.{key}", self.arch))
            .and_then(|v| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::Value;

    #[test]
    fn keys_are_read_under_the_architecture_with_their_types() {
        let metadata = BTreeMap::from([
            ("llama.block_count".to_string(), Value::UInt(2)),
            ("llama.rope.freq_base".to_string(), Value::Float(1e4)),
            ("llama.name".to_string(), Value::String("x".into())),
        ]);
        let header = GgufHeader {
            version: 3,
            metadata,
            tensors: Vec::new(),
            data_start: 0,
        };
        let meta = Meta {
            header: &header,
            arch: "llama",
        };
        assert_eq!(meta.required_uint("block_count").unwrap(), 2);
        assert_eq!(meta.float("block_count").unwrap(), Some(2.0));
        assert_eq!(meta.float("rope.freq_base").unwrap(), Some(1e4));
        assert_eq!(meta.string("name"), Some("x"));
        assert_eq!(meta.uint("context_length").unwrap(), None);
        let e = meta.required_uint("context_length").unwrap_err();
        assert_eq!(e.to_string(), "GGUF metadata has no llama.context_length");
        let e = meta.uint("name").unwrap_err();
        assert_eq!(e.to_string(), "GGUF llama.name is not an integer");
        let e = meta.float("name").unwrap_err();
        assert_eq!(e.to_string(), "GGUF llama.name is not a number");
    }
}
