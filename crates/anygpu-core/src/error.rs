//! One error type for the engine. Every variant carries what a user needs to act: the op, the
//! shapes, the device, the file offset.

use thiserror::Error;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, Error)]
pub enum Error {
    /// Shapes or layouts that do not fit the op.
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    /// Mixing tensors of different dtypes or devices, or an op that has no kernel for a dtype.
    #[error("{op}: {msg}")]
    Mismatch { op: &'static str, msg: String },
    /// The device cannot run this: a missing feature, a limit exceeded.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A GPU failure (validation, out of memory, device lost), turned into a message.
    #[error("GPU error in {op}: {msg}")]
    Gpu { op: String, msg: String },
    /// Device discovery or selection failed.
    #[error("{0}")]
    Device(String),
    /// A malformed input (model file, block data).
    #[error("{0}")]
    Format(String),
    /// An index out of range (embedding ids, gathers).
    #[error("{op}: index {index} out of range 0..{len}")]
    Index { op: &'static str, index: i64, len: usize },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Error {
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Error {
        Error::Shape { op, msg: msg.into() }
    }
    pub fn mismatch(op: &'static str, msg: impl Into<String>) -> Error {
        Error::Mismatch { op, msg: msg.into() }
    }
    pub fn gpu(op: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Gpu { op: op.into(), msg: msg.into() }
    }
}
