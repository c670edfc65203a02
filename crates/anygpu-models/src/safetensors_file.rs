//! Hugging Face `.safetensors` files, memory-mapped and validated by the `safetensors` crate.
//!
//! A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
//! (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then
//! the data section, which the tensors must tile exactly: sorted by offset, each one starts
//! where the previous ends, holds exactly `numel x dtype size` bytes, and the last ends at the
//! end of the file.
//!
//! The crate checks all of that but its errors do not always say which tensor broke the rule
//! (`TensorInvalidInfo`, `MetadataIncompleteBuffer`, overflows); [`diagnose`] re-reads the
//! JSON header to name it, so every error a user sees names the file and the tensor.
//!
//! ```no_run
//! use anygpu_core::Device;
//! use anygpu_models::safetensors_file::SafetensorsFile;
//! let f = SafetensorsFile::open("models/all-MiniLM-L6-v2/model.safetensors")?;
//! let w = f.load_f32("embeddings.word_embeddings.weight", Some(&[30522, 384]), &Device::Cpu)?;
//! # let _ = w; Ok::<(), anygpu_core::Error>(())
//! ```

use std::fs::File;
use std::path::{Path, PathBuf};

use anygpu_core::{DType, Device, Error, Result, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Metadata, SafeTensorError};
use safetensors::{Dtype, SafeTensors};

/// An open, validated safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    map: Mmap,
    /// Where the data section starts (8 + header length).
    data_start: usize,
    metadata: Metadata,
    names: Vec<String>,
}

/// What the header says about one tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMeta {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range inside the data section.
    pub data_offsets: (usize, usize),
}

impl SafetensorsFile {
    /// Maps and validates the file: a bad header, overlapping or gapped offsets, a byte size
    /// that does not match a tensor's shape and dtype, or a data section that is not the rest
    /// of the file are errors naming the file (and the tensor where there is one).
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref().to_path_buf();
        let fail = |msg: String| Error::Format(format!("{}: {msg}", path.display()));
        let file = File::open(&path).map_err(|e| fail(e.to_string()))?;
        let meta = file.metadata().map_err(|e| fail(e.to_string()))?;
        if meta.is_dir() {
            return Err(fail("a directory, not a safetensors file".to_string()));
        }
        let len = meta.len();
        if len < 8 {
            return Err(fail(format!("the file is {len} bytes, too short for the 8-byte header length")));
        }
        // SAFETY: the map is read-only. As with every mmap-based reader, a file truncated or
        // rewritten by another process while mapped is outside what we can guard.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| fail(e.to_string()))?;
        let (n, metadata) = SafeTensors::read_metadata(&map).map_err(|e| fail(describe(&e, &map)))?;
        // The crate keeps the last of two equal names; a file that says two things about one
        // tensor is refused rather than read one way.
        if let Some(dup) = duplicate_name(&map[8..8 + n]) {
            return Err(fail(format!("tensor '{dup}' appears twice in the header")));
        }
        let mut names = metadata.offset_keys();
        names.sort_unstable();
        Ok(SafetensorsFile { path, data_start: 8 + n, map, metadata, names })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn contains(&self, name: &str) -> bool {
        self.metadata.info(name).is_some()
    }

    /// Header facts of one tensor, if present.
    pub fn meta(&self, name: &str) -> Option<TensorMeta> {
        self.metadata.info(name).map(|i| TensorMeta {
            dtype: i.dtype,
            shape: i.shape.clone(),
            data_offsets: i.data_offsets,
        })
    }

    fn err(&self, name: &str, msg: impl std::fmt::Display) -> Error {
        Error::Format(format!("{}: tensor '{name}': {msg}", self.path.display()))
    }

    /// The tensor's raw little-endian bytes (a slice of the map), dtype and shape.
    pub fn bytes(&self, name: &str) -> Result<(&[u8], Dtype, Vec<usize>)> {
        let info = self.metadata.info(name).ok_or_else(|| self.err(name, "missing from the file"))?;
        let (b, e) = info.data_offsets;
        // Validated at open; checked again so a logic slip is an error, not a panic.
        let bytes = self
            .map
            .get(self.data_start + b..self.data_start + e)
            .ok_or_else(|| self.err(name, format!("bytes {b}..{e} lie outside the data section")))?;
        Ok((bytes, info.dtype, info.shape.clone()))
    }

    /// A float tensor (stored as F32, F16 or BF16) converted to f32 on `device`. With
    /// `expect`, a different shape is an error naming both shapes.
    pub fn load_f32(&self, name: &str, expect: Option<&[usize]>, device: &Device) -> Result<Tensor> {
        let (bytes, dtype, shape) = self.bytes(name)?;
        if let Some(want) = expect {
            if shape != want {
                return Err(self.err(name, format!("shape {shape:?} where the config implies {want:?}")));
            }
        }
        let data: Vec<f32> = match dtype {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => return Err(self.err(name, format!("dtype {other:?} is not a float type (F32, F16, BF16)"))),
        };
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
        if matches!(device, Device::Cpu) {
            Ok(t)
        } else {
            t.to_device(device)
        }
    }

    /// The tensor in its own dtype when anygpu has it (F32, F16, BF16, I32, U32).
    pub fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        let (bytes, dtype, shape) = self.bytes(name)?;
        let dt = match dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::I32 => DType::I32,
            Dtype::U32 => DType::U32,
            other => return Err(self.err(name, format!("dtype {other:?} has no anygpu equivalent"))),
        };
        Tensor::from_bytes(bytes, dt, shape, device)
    }
}

/// The crate's error in words, naming the tensor when the crate does not.
fn describe(e: &SafeTensorError, file: &[u8]) -> String {
    use SafeTensorError::*;
    match e {
        HeaderTooLarge => {
            format!("header length {} is larger than the 100 MB safetensors allows", header_len(file))
        }
        InvalidHeaderLength => {
            format!("header length {} runs past the end of the {}-byte file", header_len(file), file.len())
        }
        HeaderTooSmall => "the file is too short for the 8-byte header length".into(),
        InvalidHeader(u) => format!("the JSON header is not UTF-8 ({u})"),
        InvalidHeaderStart => "the header does not start with '{'".into(),
        InvalidHeaderDeserialization(j) | JsonError(j) => format!("the JSON header is malformed: {j}"),
        TensorNotFound(name) => format!("tensor '{name}' is missing"),
        // Offsets, sizes and overflows: the crate names the tensor at best; say what is wrong.
        InvalidOffset(name) => diagnose(file).unwrap_or_else(|| format!("tensor '{name}': invalid data_offsets")),
        other => diagnose(file).unwrap_or_else(|| format!("{other}")),
    }
}

fn header_len(file: &[u8]) -> u64 {
    file.get(..8).map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])).unwrap_or(0)
}

/// The header's top-level keys in file order (serde_json maps keep only the last of two equal
/// keys, which would hide a duplicate).
struct Keys(Vec<String>);

impl<'de> serde::Deserialize<'de> for Keys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Keys, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Keys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> std::result::Result<Keys, A::Error> {
                let mut keys = Vec::new();
                while let Some((k, _)) = m.next_entry::<String, serde::de::IgnoredAny>()? {
                    keys.push(k);
                }
                Ok(Keys(keys))
            }
        }
        d.deserialize_map(V)
    }
}

/// The first top-level key of the JSON header that appears twice.
fn duplicate_name(header: &[u8]) -> Option<String> {
    let keys: Keys = serde_json::from_slice(header).ok()?;
    let mut seen = std::collections::HashSet::new();
    keys.0.into_iter().find(|k| !seen.insert(k.clone()))
}

/// Bits per element of a safetensors dtype name (0 if unknown).
fn dtype_bits(dtype: &str) -> u64 {
    match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" => 64,
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        _ => 0,
    }
}

/// Re-reads the header and says which tensor breaks which rule: a duplicate name, offsets
/// that end before they begin, overlap the previous tensor or leave a gap after it, a byte
/// size that does not match shape x dtype, or a data section longer or shorter than the
/// tensors. None when it finds nothing (the caller then uses the crate's own message).
fn diagnose(file: &[u8]) -> Option<String> {
    let n = usize::try_from(header_len(file)).ok()?;
    let text = file.get(8..8usize.checked_add(n)?)?;
    if let Some(dup) = duplicate_name(text) {
        return Some(format!("tensor '{dup}' appears twice in the header"));
    }
    let header: serde_json::Value = serde_json::from_slice(text).ok()?;
    struct Entry<'a> {
        name: &'a str,
        dtype: &'a str,
        shape: Vec<u64>,
        b: u64,
        e: u64,
    }
    let mut entries = Vec::new();
    for (name, v) in header.as_object()?.iter().filter(|(k, _)| k.as_str() != "__metadata__") {
        let o = v.get("data_offsets")?.as_array()?;
        entries.push(Entry {
            name,
            dtype: v.get("dtype")?.as_str()?,
            shape: v.get("shape")?.as_array()?.iter().map(|d| d.as_u64()).collect::<Option<_>>()?,
            b: o.first()?.as_u64()?,
            e: o.get(1)?.as_u64()?,
        });
    }
    // The crate's order: by (begin, end).
    entries.sort_by_key(|t| (t.b, t.e));
    let data_len = (file.len() - 8 - n) as u64;
    let mut prev: Option<&Entry> = None;
    for t in &entries {
        let (name, b, e) = (t.name, t.b, t.e);
        if e < b {
            return Some(format!("tensor '{name}': data_offsets [{b}, {e}] end before they begin"));
        }
        let end = prev.map_or(0, |p| p.e);
        if b < end {
            let p = prev?;
            return Some(format!(
                "tensor '{name}': data_offsets [{b}, {e}] overlap tensor '{}' at [{}, {}]",
                p.name, p.b, p.e
            ));
        }
        if b > end {
            let after = prev.map_or("the start of the data section".to_string(), |p| format!("tensor '{}'", p.name));
            return Some(format!(
                "tensor '{name}': data_offsets [{b}, {e}] leave a gap of {} bytes after {after}",
                b - end
            ));
        }
        let bits = dtype_bits(t.dtype);
        let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let Some(nbytes) = numel.and_then(|n| n.checked_mul(bits)).map(|b| b / 8) else {
            return Some(format!("tensor '{name}': the byte size of shape {:?} x {} overflows", t.shape, t.dtype));
        };
        if bits > 0 && e - b != nbytes {
            return Some(format!(
                "tensor '{name}': data_offsets [{b}, {e}] hold {} bytes, but shape {:?} x {} needs {nbytes}",
                e - b,
                t.shape,
                t.dtype
            ));
        }
        prev = Some(t);
    }
    let end = prev.map_or(0, |p| p.e);
    if end != data_len {
        return Some(format!(
            "the tensors cover {end} bytes of data but the file holds {data_len} after the header ({})",
            if end > data_len { "truncated" } else { "trailing bytes" }
        ));
    }
    None
}
