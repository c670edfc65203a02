//! GGUF v2/v3 reader (memory-mapped, validated) and writer.
//!
//! A GGUF file is a header (magic `GGUF`, version, tensor count, metadata count), typed
//! key-value metadata, one info record per tensor (name, dims, type, offset), then the tensor
//! data, each tensor starting at a multiple of `general.alignment` (default 32).
//!
//! The reader trusts nothing: every length and count is checked against the bytes that are
//! left, sizes are computed with overflow checks, and tensors must lie inside the file, aligned
//! and without overlapping. Errors name the field and the byte offset where it starts.
//!
//! ```no_run
//! # fn main() -> Result<(), anygpu_models::gguf::GgufError> {
//! use anygpu_models::gguf::GgufFile;
//! let file = GgufFile::open("model.gguf")?;
//! let n_layers = file.get_u32("llama.block_count")?;
//! let tokens = file.get_string_array("tokenizer.ggml.tokens")?;
//! let info = file.tensor("token_embd.weight").expect("present");
//! let bytes: &[u8] = file.tensor_data(info)?; // a slice of the memory map
//! # let _ = (n_layers, tokens, bytes); Ok(()) }
//! ```

mod parse;
mod reader;
mod value;
mod writer;

use std::path::PathBuf;

pub use anygpu_core::quant::GgmlType;
pub use reader::{GgufFile, KeyValue, TensorInfo};
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, TensorStream};

/// The first four bytes of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the alignment (a u32 power of two).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;

/// What went wrong reading or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Bytes that break the format: the field, the byte where it starts, what is wrong.
    #[error("GGUF {field} at byte {offset}: {msg}")]
    Invalid { field: String, offset: u64, msg: String },
    #[error("GGUF metadata key '{0}' is missing")]
    MissingKey(String),
    #[error("GGUF tensor '{0}' is missing")]
    MissingTensor(String),
    /// The writer was asked for something a valid file cannot hold.
    #[error("GGUF writer: {0}")]
    Writer(String),
    #[error("GGUF I/O: {0}")]
    Io(#[from] std::io::Error),
    /// Any of the above, for a file opened from a path.
    #[error("{}: {source}", .path.display())]
    File { path: PathBuf, source: Box<GgufError> },
}

impl GgufError {
    pub(crate) fn invalid(field: impl Into<String>, offset: u64, msg: impl Into<String>) -> Self {
        GgufError::Invalid { field: field.into(), offset, msg: msg.into() }
    }
}

impl From<GgufError> for anygpu_core::Error {
    fn from(e: GgufError) -> Self {
        anygpu_core::Error::Format(e.to_string())
    }
}

/// `pos` rounded up to a multiple of `alignment` (a power of two), or None on overflow.
pub(crate) fn align_up(pos: u64, alignment: u64) -> Option<u64> {
    Some(pos.checked_add(alignment - 1)? & !(alignment - 1))
}

/// Checks `alignment` is a usable `general.alignment` value.
pub(crate) fn check_alignment(alignment: u64) -> Result<u64, String> {
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(format!("alignment {alignment} is not a non-zero power of two"));
    }
    Ok(alignment)
}

/// Validates a tensor's dims (ggml order, `dims[0]` the row) for `ty`, and returns its
/// element count and byte size. Shared by the reader and the writer.
pub(crate) fn tensor_size(dims: &[u64], ty: GgmlType) -> Result<(u64, u64), String> {
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(format!("n_dims {} is not in 1..={MAX_DIMS}", dims.len()));
    }
    let mut n_elements: u64 = 1;
    for (d, &n) in dims.iter().enumerate() {
        if n == 0 {
            return Err(format!("dimension {d} is 0 (dims {dims:?})"));
        }
        // ggml counts elements in i64.
        n_elements = n_elements
            .checked_mul(n)
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| format!("element count of dims {dims:?} overflows"))?;
    }
    let block = ty.block_size() as u64;
    if !dims[0].is_multiple_of(block) {
        return Err(format!("row length {} is not a multiple of the {ty} block size {block}", dims[0]));
    }
    let n_bytes = ty.byte_size(n_elements).map_err(|e| e.to_string())?;
    Ok((n_elements, n_bytes))
}
