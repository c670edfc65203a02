//! The GGUF writer (version 3). Metadata and tensor declarations are collected first; the
//! header and tensor infos are then written in one go, and tensor data follows in declaration
//! order, either from bytes held by the writer or streamed one tensor at a time through a
//! [`TensorStream`], so a multi-gigabyte file never has to be in memory.
//!
//! ```
//! # fn main() -> Result<(), anygpu_models::gguf::GgufError> {
//! use anygpu_models::gguf::{GgmlType, GgufFile, GgufWriter};
//! let mut w = GgufWriter::new();
//! w.add_string("general.architecture", "llama").add_u32("llama.block_count", 2);
//! w.declare_tensor("output_norm.weight", &[4], GgmlType::F32)?;
//! let mut stream = w.start(Vec::new())?;
//! stream.write_tensor("output_norm.weight", &[0u8; 16])?;
//! let file = GgufFile::from_bytes(stream.finish()?)?;
//! assert_eq!(file.get_u32("llama.block_count")?, 2);
//! # Ok(()) }
//! ```

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use super::value::{Array, Value};
use super::{align_up, check_alignment, tensor_size, GgmlType, GgufError, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};

type Result<T> = std::result::Result<T, GgufError>;

/// The version the writer produces.
const VERSION: u32 = 3;

struct Planned {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    n_bytes: u64,
    data: Option<Vec<u8>>,
}

/// Builds a GGUF v3 file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<Planned>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to `value`; a key set twice keeps its first position and its last value.
    pub fn add(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        let value = value.into();
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key.to_string(), value)),
        }
        self
    }

    pub fn add_u32(&mut self, key: &str, value: u32) -> &mut Self {
        self.add(key, value)
    }

    pub fn add_u64(&mut self, key: &str, value: u64) -> &mut Self {
        self.add(key, value)
    }

    pub fn add_i32(&mut self, key: &str, value: i32) -> &mut Self {
        self.add(key, value)
    }

    pub fn add_f32(&mut self, key: &str, value: f32) -> &mut Self {
        self.add(key, value)
    }

    pub fn add_bool(&mut self, key: &str, value: bool) -> &mut Self {
        self.add(key, value)
    }

    pub fn add_string(&mut self, key: &str, value: &str) -> &mut Self {
        self.add(key, value)
    }

    pub fn add_string_array<S: AsRef<str>>(&mut self, key: &str, values: &[S]) -> &mut Self {
        let strings = values.iter().map(|s| s.as_ref().to_string()).collect();
        self.add(key, Array::String(strings))
    }

    pub fn add_f32_array(&mut self, key: &str, values: &[f32]) -> &mut Self {
        self.add(key, values.to_vec())
    }

    pub fn add_i32_array(&mut self, key: &str, values: &[i32]) -> &mut Self {
        self.add(key, values.to_vec())
    }

    /// Sets `general.alignment` (checked when writing: a non-zero power of two).
    pub fn set_alignment(&mut self, alignment: u32) -> &mut Self {
        self.add(ALIGNMENT_KEY, alignment)
    }

    /// Declares a tensor whose bytes will be streamed after [`GgufWriter::start`]. `dims` are
    /// in ggml order (`dims[0]` is the row).
    pub fn declare_tensor(&mut self, name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<&mut Self> {
        self.plan(name, dims, ggml_type, None)
    }

    /// Adds a tensor with its bytes (which must be exactly its size).
    pub fn add_tensor(&mut self, name: &str, dims: &[u64], ggml_type: GgmlType, data: Vec<u8>) -> Result<&mut Self> {
        self.plan(name, dims, ggml_type, Some(data))
    }

    fn plan(&mut self, name: &str, dims: &[u64], ggml_type: GgmlType, data: Option<Vec<u8>>) -> Result<&mut Self> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::Writer(format!("tensor '{name}' added twice")));
        }
        let (_, n_bytes) =
            tensor_size(dims, ggml_type).map_err(|msg| GgufError::Writer(format!("tensor '{name}': {msg}")))?;
        if let Some(d) = &data {
            check_len(name, n_bytes, d.len())?;
        }
        self.tensors.push(Planned { name: name.to_string(), dims: dims.to_vec(), ggml_type, n_bytes, data });
        Ok(self)
    }

    fn alignment(&self) -> Result<u64> {
        match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, Value::U32(a))) => {
                check_alignment(u64::from(*a)).map_err(|m| GgufError::Writer(format!("{ALIGNMENT_KEY}: {m}")))
            }
            Some((_, v)) => Err(GgufError::Writer(format!("{ALIGNMENT_KEY} must be a u32, not {}", v.type_name()))),
        }
    }

    /// Writes the header, metadata and tensor infos (with padding) to `out` and returns the
    /// stream that takes each declared tensor's bytes, in declaration order.
    pub fn start<W: Write>(&self, out: W) -> Result<TensorStream<W>> {
        let alignment = self.alignment()?;
        let mut w = Counting { inner: out, pos: 0 };
        w.write_all(&MAGIC)?;
        w.write_all(&VERSION.to_le_bytes())?;
        w.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        w.write_all(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in &self.metadata {
            write_string(&mut w, key)?;
            w.write_all(&value.value_type().id().to_le_bytes())?;
            write_value(&mut w, value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            write_string(&mut w, &t.name)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                w.write_all(&d.to_le_bytes())?;
            }
            w.write_all(&t.ggml_type.id().to_le_bytes())?;
            w.write_all(&offset.to_le_bytes())?;
            offset = offset
                .checked_add(t.n_bytes)
                .and_then(|end| align_up(end, alignment))
                .ok_or_else(|| GgufError::Writer("total tensor size overflows".into()))?;
        }
        pad(&mut w, alignment)?;
        Ok(TensorStream {
            w,
            pending: self.tensors.iter().map(|t| (t.name.clone(), t.n_bytes)).collect(),
            next: 0,
            alignment,
        })
    }

    /// Writes the whole file; every tensor must have been added with its bytes.
    pub fn write_to<W: Write>(&self, out: W) -> Result<W> {
        if let Some(t) = self.tensors.iter().find(|t| t.data.is_none()) {
            return Err(GgufError::Writer(format!(
                "tensor '{}' was declared without data; stream it through start()",
                t.name
            )));
        }
        let mut stream = self.start(out)?;
        for t in &self.tensors {
            stream.write_tensor(&t.name, t.data.as_deref().unwrap_or_default())?;
        }
        stream.finish()
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.write_to(Vec::new())
    }

    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let in_file = |e: GgufError| GgufError::File { path: path.to_owned(), source: Box::new(e) };
        let file = File::create(path).map_err(|e| in_file(e.into()))?;
        self.write_to(BufWriter::new(file)).map_err(in_file)?;
        Ok(())
    }
}

/// Takes the tensor data of a file whose header [`GgufWriter::start`] wrote: each declared
/// tensor once, in declaration order.
pub struct TensorStream<W: Write> {
    w: Counting<W>,
    pending: Vec<(String, u64)>,
    next: usize,
    alignment: u64,
}

impl<W: Write> TensorStream<W> {
    /// The next tensor the stream expects, if any.
    pub fn next_tensor(&self) -> Option<&str> {
        self.pending.get(self.next).map(|(n, _)| n.as_str())
    }

    fn expect(&self, name: &str) -> Result<u64> {
        match self.pending.get(self.next) {
            Some((n, size)) if n == name => Ok(*size),
            Some((n, _)) => Err(GgufError::Writer(format!("tensor '{name}' written out of order; '{n}' comes next"))),
            None => Err(GgufError::Writer(format!("tensor '{name}' written after all declared tensors"))),
        }
    }

    /// Writes the bytes of the next tensor, which must be called `name`.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let size = self.expect(name)?;
        check_len(name, size, data.len())?;
        self.w.write_all(data)?;
        self.end_tensor()
    }

    /// Copies the bytes of the next tensor, `name`, from `reader`, which must hold at least
    /// its size; nothing past the size is read.
    pub fn write_tensor_from(&mut self, name: &str, reader: impl Read) -> Result<()> {
        let size = self.expect(name)?;
        let copied = std::io::copy(&mut reader.take(size), &mut self.w)?;
        if copied != size {
            return Err(GgufError::Writer(format!("tensor '{name}' needs {size} bytes but its reader gave {copied}")));
        }
        self.end_tensor()
    }

    fn end_tensor(&mut self) -> Result<()> {
        pad(&mut self.w, self.alignment)?;
        self.next += 1;
        Ok(())
    }

    /// Checks every declared tensor was written, flushes, and returns the writer.
    pub fn finish(mut self) -> Result<W> {
        if let Some(name) = self.next_tensor() {
            return Err(GgufError::Writer(format!("finished before tensor '{name}' was written")));
        }
        self.w.flush()?;
        Ok(self.w.inner)
    }
}

/// A writer that knows how many bytes went through it, for padding.
struct Counting<W> {
    inner: W,
    pos: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.pos += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn check_len(name: &str, n_bytes: u64, len: usize) -> Result<()> {
    if len as u64 != n_bytes {
        return Err(GgufError::Writer(format!("tensor '{name}' needs {n_bytes} bytes, got {len}")));
    }
    Ok(())
}

fn pad<W: Write>(w: &mut Counting<W>, alignment: u64) -> Result<()> {
    const ZEROS: [u8; 256] = [0; 256];
    let target = align_up(w.pos, alignment).ok_or_else(|| GgufError::Writer("file size overflows".into()))?;
    let mut n = target - w.pos;
    while n > 0 {
        let chunk = n.min(ZEROS.len() as u64);
        w.write_all(&ZEROS[..chunk as usize])?;
        n -= chunk;
    }
    Ok(())
}

fn write_string(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// Writes a value's payload (its type id is written by the caller).
fn write_value(w: &mut impl Write, value: &Value) -> std::io::Result<()> {
    match value {
        Value::U8(v) => w.write_all(&v.to_le_bytes()),
        Value::I8(v) => w.write_all(&v.to_le_bytes()),
        Value::U16(v) => w.write_all(&v.to_le_bytes()),
        Value::I16(v) => w.write_all(&v.to_le_bytes()),
        Value::U32(v) => w.write_all(&v.to_le_bytes()),
        Value::I32(v) => w.write_all(&v.to_le_bytes()),
        Value::U64(v) => w.write_all(&v.to_le_bytes()),
        Value::I64(v) => w.write_all(&v.to_le_bytes()),
        Value::F32(v) => w.write_all(&v.to_le_bytes()),
        Value::F64(v) => w.write_all(&v.to_le_bytes()),
        Value::Bool(v) => w.write_all(&[u8::from(*v)]),
        Value::String(s) => write_string(w, s),
        Value::Array(a) => write_array(w, a),
    }
}

fn write_array(w: &mut impl Write, a: &Array) -> std::io::Result<()> {
    w.write_all(&a.element_type().id().to_le_bytes())?;
    w.write_all(&(a.len() as u64).to_le_bytes())?;
    // Elements are written through a buffer: one write_all per element would be slow on an
    // unbuffered writer.
    let mut buf = Vec::new();
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                buf.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => buf.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::F64(v) => le!(v),
        Array::Bool(v) => buf.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => {
            for s in v {
                buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
                buf.extend_from_slice(s.as_bytes());
            }
        }
    }
    w.write_all(&buf)
}
