//! The GGUF reader: a parsed, validated file (see `parse.rs`) over its memory map, with typed
//! metadata getters and zero-copy tensor data.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use super::parse::Parser;
use super::value::{Array, Value};
use super::{GgmlType, GgufError};

type Result<T> = std::result::Result<T, GgufError>;

/// One metadata entry, with the byte offset of its value (for error messages).
#[derive(Clone, Debug, PartialEq)]
pub struct KeyValue {
    pub key: String,
    pub value: Value,
    pub offset: u64,
}

/// One tensor as the file describes it, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row (innermost, contiguous) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed, validated GGUF file. Metadata is kept in file order.
pub struct GgufFile {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<KeyValue>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    names: HashMap<String, usize>,
    storage: Storage,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.storage.bytes().len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates the file at `path`. Errors carry the path.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let in_file = |e: GgufError| GgufError::File { path: path.to_owned(), source: Box::new(e) };
        let file = File::open(path).map_err(|e| in_file(e.into()))?;
        let meta = file.metadata().map_err(|e| in_file(e.into()))?;
        if meta.is_dir() {
            // Mapping a directory fails with ENODEV ("No such device"), which says nothing.
            let e = std::io::Error::new(std::io::ErrorKind::IsADirectory, "a directory, not a GGUF file");
            return Err(in_file(e.into()));
        }
        let len = meta.len();
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only. As with every mmap-based reader, a file truncated
            // or rewritten by another process while mapped is outside what we can guard.
            Storage::Mapped(unsafe { Mmap::map(&file) }.map_err(|e| in_file(e.into()))?)
        };
        Self::parse(storage).map_err(in_file)
    }

    /// Parses a file held in memory (tests, fuzzing, small files).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self> {
        let p = Parser::new(storage.bytes()).parse()?;
        Ok(GgufFile {
            version: p.version,
            alignment: p.alignment,
            data_offset: p.data_offset,
            metadata: p.metadata,
            keys: p.keys,
            tensors: p.tensors,
            names: p.names,
            storage,
        })
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where the tensor data section starts; tensor offsets in the file are relative to it.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[KeyValue] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entry(key).map(|kv| &kv.value)
    }

    fn entry(&self, key: &str) -> Option<&KeyValue> {
        self.keys.get(key).map(|&i| &self.metadata[i])
    }

    /// Looks `key` up and converts it with `convert`; a missing key or a value `convert`
    /// refuses is an error naming the key, the expected type and the type found.
    fn typed<'s, T>(&'s self, key: &str, want: &str, convert: impl FnOnce(&'s Value) -> Option<T>) -> Result<T> {
        let kv = self.entry(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        convert(&kv.value).ok_or_else(|| {
            let found = match kv.value.as_int() {
                Some(i) => format!("{} {i} (out of range)", kv.value.type_name()),
                None => kv.value.type_name(),
            };
            GgufError::invalid(format!("metadata '{key}'"), kv.offset, format!("expected {want}, found {found}"))
        })
    }

    /// An integer of any type whose value fits in a u32.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.typed(key, "u32", |v| v.as_int()?.try_into().ok())
    }

    /// `get_u32`, or `default` when the key is absent (a wrong type is still an error).
    pub fn get_u32_or(&self, key: &str, default: u32) -> Result<u32> {
        self.or_default(key, default, Self::get_u32)
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "u64", |v| v.as_int()?.try_into().ok())
    }

    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.typed(key, "i32", |v| v.as_int()?.try_into().ok())
    }

    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.typed(key, "i64", |v| v.as_int()?.try_into().ok())
    }

    /// An f32, or an f64 narrowed to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.typed(key, "f32", |v| match *v {
            Value::F32(x) => Some(x),
            Value::F64(x) => Some(x as f32),
            _ => None,
        })
    }

    pub fn get_f32_or(&self, key: &str, default: f32) -> Result<f32> {
        self.or_default(key, default, Self::get_f32)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.typed(key, "bool", |v| match *v {
            Value::Bool(b) => Some(b),
            _ => None,
        })
    }

    pub fn get_bool_or(&self, key: &str, default: bool) -> Result<bool> {
        self.or_default(key, default, Self::get_bool)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.typed(key, "string", |v| match v {
            Value::String(s) => Some(s.as_str()),
            _ => None,
        })
    }

    pub fn get_string_array(&self, key: &str) -> Result<&[String]> {
        self.typed(key, "array of string", |v| match v {
            Value::Array(Array::String(a)) => Some(a.as_slice()),
            _ => None,
        })
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        self.typed(key, "array of f32", |v| match v {
            Value::Array(Array::F32(a)) => Some(a.as_slice()),
            _ => None,
        })
    }

    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        self.typed(key, "array of i32", |v| match v {
            Value::Array(Array::I32(a)) => Some(a.as_slice()),
            _ => None,
        })
    }

    fn or_default<T>(&self, key: &str, default: T, get: impl FnOnce(&Self, &str) -> Result<T>) -> Result<T> {
        if self.keys.contains_key(key) {
            get(self, key)
        } else {
            Ok(default)
        }
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.names.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor: a slice of the map, never a copy.
    pub fn tensor_data(&self, info: &TensorInfo) -> Result<&[u8]> {
        let bytes = self.storage.bytes();
        let range = usize::try_from(info.offset).ok().and_then(|start| {
            let end = start.checked_add(usize::try_from(info.n_bytes).ok()?)?;
            bytes.get(start..end)
        });
        range.ok_or_else(|| {
            GgufError::invalid(
                format!("tensor '{}' data", info.name),
                info.offset,
                format!("{} bytes do not fit in the {}-byte file", info.n_bytes, bytes.len()),
            )
        })
    }

    /// The bytes of the tensor called `name`.
    pub fn tensor_data_by_name(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        self.tensor_data(info)
    }
}
