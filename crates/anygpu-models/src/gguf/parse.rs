//! Parsing and validation of the header, metadata and tensor infos. Nothing read from the
//! file is trusted before it is checked against the bytes that are left.

use std::collections::HashMap;

use super::reader::{KeyValue, TensorInfo};
use super::value::{Array, Value, ValueType};
use super::{
    align_up, check_alignment, tensor_size, GgmlType, GgufError, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS,
};

type Result<T> = std::result::Result<T, GgufError>;

/// Fewest bytes a tensor info can take: name length, n_dims, one dim, type, offset.
const MIN_TENSOR_INFO: u64 = 8 + 4 + 8 + 4 + 8;
/// Fewest bytes a key-value pair can take: key length, value type, a one-byte value.
const MIN_KEY_VALUE: u64 = 8 + 4 + 1;
/// Vectors sized from counts in the file start at most this long and grow as elements are
/// actually read, so a count that passes the bytes-left check still cannot reserve a lot
/// of memory up front.
const MAX_PRESIZE: u64 = 1 << 16;

/// A read that ran past the end of the buffer, or a string that is not UTF-8; named by the
/// caller, who knows which field it was reading.
#[derive(Clone, Copy)]
enum ReadError {
    Short { offset: u64, need: u64, left: u64 },
    NotUtf8 { offset: u64, len: u64 },
}

impl ReadError {
    fn named(self, field: impl Into<String>) -> GgufError {
        match self {
            ReadError::Short { offset, need, left } => GgufError::invalid(
                field,
                offset,
                format!("needs {need} bytes but only {left} are left (truncated file or bad length)"),
            ),
            ReadError::NotUtf8 { offset, len } => {
                GgufError::invalid(field, offset, format!("the {len}-byte string is not UTF-8"))
            }
        }
    }
}

/// A bounds-checked little-endian cursor.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn pos(&self) -> u64 {
        self.pos as u64
    }

    fn left(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64) -> std::result::Result<&'a [u8], ReadError> {
        let left = self.left();
        if n > left {
            return Err(ReadError::Short { offset: self.pos(), need: n, left });
        }
        // n <= left, which is a usize.
        let end = self.pos + n as usize;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], ReadError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N as u64)?);
        Ok(a)
    }

    fn u32(&mut self) -> std::result::Result<u32, ReadError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> std::result::Result<u64, ReadError> {
        self.array().map(u64::from_le_bytes)
    }

    /// A u64 length followed by that many bytes of UTF-8.
    fn string(&mut self) -> std::result::Result<String, ReadError> {
        let len = self.u64()?;
        let offset = self.pos();
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ReadError::NotUtf8 { offset, len })
    }
}

/// Decodes `bytes` (a whole number of `N`-byte little-endian values) with `f`.
fn decode<const N: usize, T>(bytes: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect()
}

pub(super) struct Parsed {
    pub(super) version: u32,
    pub(super) alignment: u64,
    pub(super) data_offset: u64,
    pub(super) metadata: Vec<KeyValue>,
    pub(super) keys: HashMap<String, usize>,
    pub(super) tensors: Vec<TensorInfo>,
    pub(super) names: HashMap<String, usize>,
}

pub(super) struct Parser<'a> {
    r: Cursor<'a>,
}

/// A tensor info as read, before its data range is checked against the file.
struct RawTensor {
    info: TensorInfo,
    /// Where its offset field is, for error messages.
    offset_field: u64,
}

impl<'a> Parser<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Parser { r: Cursor { buf, pos: 0 } }
    }

    pub(super) fn parse(mut self) -> Result<Parsed> {
        let version = self.header()?;
        let n_tensors_at = self.r.pos();
        let n_tensors = self.r.u64().map_err(|e| e.named("tensor count"))?;
        let n_kv_at = self.r.pos();
        let n_kv = self.r.u64().map_err(|e| e.named("metadata count"))?;
        self.check_counts(n_tensors, n_tensors_at, n_kv, n_kv_at)?;

        let (metadata, keys) = self.metadata(n_kv)?;
        let alignment = match keys.get(ALIGNMENT_KEY).map(|&i| &metadata[i]) {
            None => DEFAULT_ALIGNMENT,
            Some(KeyValue { value: Value::U32(a), offset, .. }) => {
                check_alignment(u64::from(*a)).map_err(|msg| GgufError::invalid(ALIGNMENT_KEY, *offset, msg))?
            }
            Some(kv) => {
                return Err(GgufError::invalid(
                    ALIGNMENT_KEY,
                    kv.offset,
                    format!("expected u32, found {}", kv.value.type_name()),
                ))
            }
        };

        let (raw, names) = self.tensor_infos(n_tensors, alignment)?;
        let end_of_infos = self.r.pos();
        let data_offset = align_up(end_of_infos, alignment)
            .ok_or_else(|| GgufError::invalid("data section", end_of_infos, "alignment overflows"))?;
        let tensors = self.place_tensors(raw, data_offset)?;
        Ok(Parsed { version, alignment, data_offset, metadata, keys, tensors, names })
    }

    fn header(&mut self) -> Result<u32> {
        let magic = self.r.array::<4>().map_err(|e| e.named("magic"))?;
        if magic != MAGIC {
            return Err(GgufError::invalid(
                "magic",
                0,
                format!("expected \"GGUF\", found {:?}; not a GGUF file", String::from_utf8_lossy(&magic)),
            ));
        }
        let version = self.r.u32().map_err(|e| e.named("version"))?;
        match version {
            2 | 3 => Ok(version),
            1 => Err(GgufError::invalid(
                "version",
                4,
                "version 1 is not supported (only 2 and 3); convert the model again with a current llama.cpp",
            )),
            v if matches!(v.swap_bytes(), 2 | 3) => Err(GgufError::invalid(
                "version",
                4,
                format!("version {v} looks like a big-endian GGUF v{}, which is not supported", v.swap_bytes()),
            )),
            v => Err(GgufError::invalid("version", 4, format!("version {v} is not supported (only 2 and 3)"))),
        }
    }

    /// Counts that the rest of the file cannot hold are lies; refuse them before they size
    /// anything.
    fn check_counts(&self, n_tensors: u64, n_tensors_at: u64, n_kv: u64, n_kv_at: u64) -> Result<()> {
        let left = self.r.left();
        let tensor_bytes = n_tensors.checked_mul(MIN_TENSOR_INFO).filter(|&b| b <= left).ok_or_else(|| {
            GgufError::invalid(
                "tensor count",
                n_tensors_at,
                format!("{n_tensors} tensors need at least {MIN_TENSOR_INFO} bytes each but only {left} bytes follow"),
            )
        })?;
        n_kv.checked_mul(MIN_KEY_VALUE)
            .and_then(|b| b.checked_add(tensor_bytes))
            .filter(|&b| b <= left)
            .ok_or_else(|| {
                GgufError::invalid(
                    "metadata count",
                    n_kv_at,
                    format!(
                        "{n_kv} key-value pairs (at least {MIN_KEY_VALUE} bytes each) and {n_tensors} tensors cannot fit in the {left} bytes that follow"
                    ),
                )
            })?;
        Ok(())
    }

    fn metadata(&mut self, n_kv: u64) -> Result<(Vec<KeyValue>, HashMap<String, usize>)> {
        let presize = n_kv.min(MAX_PRESIZE) as usize;
        let mut metadata = Vec::with_capacity(presize);
        let mut keys = HashMap::with_capacity(presize);
        for i in 0..n_kv {
            let key_at = self.r.pos();
            let key = self.r.string().map_err(|e| e.named(format!("metadata key {i}")))?;
            if keys.contains_key(&key) {
                return Err(GgufError::invalid(format!("metadata key '{key}'"), key_at, "duplicate key"));
            }
            let type_at = self.r.pos();
            let type_id = self.r.u32().map_err(|e| e.named(format!("metadata '{key}' value type")))?;
            let ty = ValueType::from_id(type_id).ok_or_else(|| {
                GgufError::invalid(
                    format!("metadata '{key}' value type"),
                    type_at,
                    format!("unknown value type {type_id}"),
                )
            })?;
            let offset = self.r.pos();
            let value = self.value(ty, &key)?;
            keys.insert(key.clone(), metadata.len());
            metadata.push(KeyValue { key, value, offset });
        }
        Ok((metadata, keys))
    }

    fn value(&mut self, ty: ValueType, key: &str) -> Result<Value> {
        let short = |e: ReadError| e.named(format!("metadata '{key}'"));
        let r = &mut self.r;
        let at = r.pos();
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(r.array().map_err(short)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(r.array().map_err(short)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(r.array().map_err(short)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(r.array().map_err(short)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(r.array().map_err(short)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(r.array().map_err(short)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(r.array().map_err(short)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(r.array().map_err(short)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(r.array().map_err(short)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(r.array().map_err(short)?)),
            ValueType::Bool => {
                let [b] = r.array().map_err(short)?;
                Value::Bool(bool_from(b).ok_or_else(|| bad_bool(format!("metadata '{key}'"), at, b))?)
            }
            ValueType::String => Value::String(r.string().map_err(short)?),
            ValueType::Array => Value::Array(self.array(key)?),
        })
    }

    fn array(&mut self, key: &str) -> Result<Array> {
        let r = &mut self.r;
        let type_at = r.pos();
        let type_id = r.u32().map_err(|e| e.named(format!("metadata '{key}' array type")))?;
        let ty = ValueType::from_id(type_id).ok_or_else(|| {
            GgufError::invalid(format!("metadata '{key}' array type"), type_at, format!("unknown value type {type_id}"))
        })?;
        let len_at = r.pos();
        let len = r.u64().map_err(|e| e.named(format!("metadata '{key}' array length")))?;
        let left = r.left();
        // A string takes at least its 8-byte length.
        let min_size = ty.fixed_size().unwrap_or(8);
        let too_long = || {
            GgufError::invalid(
                format!("metadata '{key}' array length"),
                len_at,
                format!(
                    "{len} elements of type {ty} need at least {min_size} bytes each but only {left} bytes are left"
                ),
            )
        };
        let min_bytes = len.checked_mul(min_size).filter(|&b| b <= left).ok_or_else(too_long)?;

        let elements_at = r.pos();
        let bytes = match ty.fixed_size() {
            Some(_) => r.take(min_bytes).map_err(|e| e.named(format!("metadata '{key}' array")))?,
            None => &[],
        };
        Ok(match ty {
            ValueType::U8 => Array::U8(bytes.to_vec()),
            ValueType::I8 => Array::I8(decode(bytes, i8::from_le_bytes)),
            ValueType::U16 => Array::U16(decode(bytes, u16::from_le_bytes)),
            ValueType::I16 => Array::I16(decode(bytes, i16::from_le_bytes)),
            ValueType::U32 => Array::U32(decode(bytes, u32::from_le_bytes)),
            ValueType::I32 => Array::I32(decode(bytes, i32::from_le_bytes)),
            ValueType::U64 => Array::U64(decode(bytes, u64::from_le_bytes)),
            ValueType::I64 => Array::I64(decode(bytes, i64::from_le_bytes)),
            ValueType::F32 => Array::F32(decode(bytes, f32::from_le_bytes)),
            ValueType::F64 => Array::F64(decode(bytes, f64::from_le_bytes)),
            ValueType::Bool => {
                let mut bools = Vec::with_capacity(bytes.len());
                for (i, &b) in bytes.iter().enumerate() {
                    let at = elements_at + i as u64;
                    let field = || format!("metadata '{key}'[{i}]");
                    bools.push(bool_from(b).ok_or_else(|| bad_bool(field(), at, b))?);
                }
                Array::Bool(bools)
            }
            ValueType::String => {
                let mut strings = Vec::with_capacity(len.min(MAX_PRESIZE) as usize);
                for i in 0..len {
                    let s = r.string().map_err(|e| e.named(format!("metadata '{key}'[{i}]")))?;
                    strings.push(s);
                }
                Array::String(strings)
            }
            ValueType::Array => {
                return Err(GgufError::invalid(
                    format!("metadata '{key}' array type"),
                    type_at,
                    "arrays of arrays are not supported",
                ))
            }
        })
    }

    fn tensor_infos(&mut self, n_tensors: u64, alignment: u64) -> Result<(Vec<RawTensor>, HashMap<String, usize>)> {
        let presize = n_tensors.min(MAX_PRESIZE) as usize;
        let mut tensors = Vec::with_capacity(presize);
        let mut names = HashMap::with_capacity(presize);
        for i in 0..n_tensors {
            let r = &mut self.r;
            let name_at = r.pos();
            let name = r.string().map_err(|e| e.named(format!("tensor {i} name")))?;
            if names.contains_key(&name) {
                return Err(GgufError::invalid(format!("tensor '{name}'"), name_at, "duplicate tensor name"));
            }
            let field = |what: &str| format!("tensor '{name}' {what}");

            let n_dims_at = r.pos();
            let n_dims = r.u32().map_err(|e| e.named(field("n_dims")))?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(GgufError::invalid(
                    field("n_dims"),
                    n_dims_at,
                    format!("n_dims {n_dims} is not in 1..={}", MAX_DIMS),
                ));
            }
            let dims_at = r.pos();
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64().map_err(|e| e.named(field("dims")))?);
            }

            let type_at = r.pos();
            let type_id = r.u32().map_err(|e| e.named(field("type")))?;
            let ggml_type =
                GgmlType::from_id(type_id).map_err(|e| GgufError::invalid(field("type"), type_at, e.to_string()))?;

            let offset_field = r.pos();
            let offset = r.u64().map_err(|e| e.named(field("offset")))?;

            let (n_elements, n_bytes) =
                tensor_size(&dims, ggml_type).map_err(|msg| GgufError::invalid(field("dims"), dims_at, msg))?;
            if !offset.is_multiple_of(alignment) {
                return Err(GgufError::invalid(
                    field("offset"),
                    offset_field,
                    format!("offset {offset} is not a multiple of the alignment {alignment}"),
                ));
            }
            names.insert(name.clone(), tensors.len());
            tensors.push(RawTensor {
                info: TensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes },
                offset_field,
            });
        }
        Ok((tensors, names))
    }

    /// Turns relative offsets into absolute ones and checks every tensor lies inside the
    /// file and no two overlap.
    fn place_tensors(&self, mut raw: Vec<RawTensor>, data_offset: u64) -> Result<Vec<TensorInfo>> {
        let file_len = self.r.buf.len() as u64;
        let mut ends = Vec::with_capacity(raw.len());
        for t in &mut raw {
            let rel = t.info.offset;
            let range = data_offset
                .checked_add(rel)
                .and_then(|start| Some((start, start.checked_add(t.info.n_bytes)?)))
                .filter(|&(_, end)| end <= file_len);
            let Some((start, end)) = range else {
                return Err(GgufError::invalid(
                    format!("tensor '{}' offset", t.info.name),
                    t.offset_field,
                    format!(
                        "{} bytes at offset {rel} from the data section (byte {data_offset}) run past the end of the {file_len}-byte file",
                        t.info.n_bytes
                    ),
                ));
            };
            t.info.offset = start;
            ends.push(end);
        }
        let mut order: Vec<usize> = (0..raw.len()).collect();
        order.sort_by_key(|&i| raw[i].info.offset);
        for pair in order.windows(2) {
            let (a, b) = (&raw[pair[0]], &raw[pair[1]]);
            if ends[pair[0]] > b.info.offset {
                return Err(GgufError::invalid(
                    format!("tensor '{}' offset", b.info.name),
                    b.offset_field,
                    format!(
                        "data at bytes {}..{} overlaps tensor '{}' at bytes {}..{}",
                        b.info.offset,
                        b.info.offset + b.info.n_bytes,
                        a.info.name,
                        a.info.offset,
                        ends[pair[0]],
                    ),
                ));
            }
        }
        Ok(raw.into_iter().map(|t| t.info).collect())
    }
}

fn bool_from(b: u8) -> Option<bool> {
    match b {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

fn bad_bool(field: String, offset: u64, b: u8) -> GgufError {
    GgufError::invalid(field, offset, format!("bool byte {b} is neither 0 nor 1"))
}
