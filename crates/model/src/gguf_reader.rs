//! The byte-level GGUF parser: header, metadata and tensor directory from the bytes of a file
//! (the memory map), with every length, count, offset and size checked before it is used.
//!
//! What it guarantees: nothing is allocated from a count before the count is checked against
//! a documented bound and against the bytes left in the file; all arithmetic on offsets, sizes,
//! element counts and alignment is checked; every tensor it returns lies inside the file, on
//! the file's alignment, with a byte size that matches its type and shape. What it is not for:
//! interpreting the metadata (that is `gguf.rs` and the loader) or writing files.
//!
//! No integer operator here may overflow (the lint below refuses one that could), so release
//! builds, which do not check overflow, read a file exactly as the `ci` profile's do.

#![deny(clippy::arithmetic_side_effects)]

use std::collections::HashMap;

/// Most tensors a file may list (the largest real models list a few tens of thousands).
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata entries a file may hold (real files: a few dozen).
pub const MAX_METADATA_ENTRIES: u64 = 1 << 16;
/// Longest metadata key, in bytes (llama.cpp's limit).
pub const MAX_KEY_LEN: u64 = 65_535;
/// Longest string value (tensor names and keys included), in bytes: chat templates are the
/// longest real ones, at tens of KiB.
pub const MAX_STRING_LEN: u64 = 16 << 20;
/// Most elements in one metadata array (vocabularies and merge lists: a few hundred thousand).
pub const MAX_ARRAY_LEN: u64 = 1 << 23;
/// Most array elements in all metadata together (bounds the memory the values take).
pub const MAX_METADATA_ELEMENTS: u64 = 1 << 24;
/// Deepest nesting of arrays in arrays.
pub const MAX_ARRAY_DEPTH: u32 = 2;
/// Most dimensions of a tensor (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Largest `general.alignment` accepted (a power of two; the default is 32).
pub const MAX_ALIGNMENT: u64 = 1 << 16;
/// Alignment of the tensor data when the file does not say (`general.alignment`).
pub const DEFAULT_ALIGNMENT: u64 = 32;

const MAGIC: &[u8; 4] = b"GGUF";

/// Why a file is not a GGUF file we can read; each names what was wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("it does not start with the GGUF magic (got {0:02x?})")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (1, 2 and 3 are){1}")]
    BadVersion(u32, &'static str),
    #[error("{what} at byte {at} needs {need} bytes but only {left} are left (truncated download?)")]
    Truncated { what: String, at: usize, need: u64, left: u64 },
    #[error("{what} is {value}, over the limit of {limit}")]
    OverLimit { what: String, value: u64, limit: u64 },
    #[error("{0}")]
    Invalid(String),
}

/// A ggml tensor type: every id llama.cpp's `ggml_type` has had in a GGUF file, with the
/// elements per block and bytes per block of its storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// (type, ggml id, elements per block, bytes per block), as in ggml.h and ggml-common.h.
const TYPES: &[(GgmlType, u32, u64, u64)] = &[
    (GgmlType::F32, 0, 1, 4),
    (GgmlType::F16, 1, 1, 2),
    (GgmlType::Q4_0, 2, 32, 18),
    (GgmlType::Q4_1, 3, 32, 20),
    (GgmlType::Q5_0, 6, 32, 22),
    (GgmlType::Q5_1, 7, 32, 24),
    (GgmlType::Q8_0, 8, 32, 34),
    (GgmlType::Q8_1, 9, 32, 36),
    (GgmlType::Q2_K, 10, 256, 84),
    (GgmlType::Q3_K, 11, 256, 110),
    (GgmlType::Q4_K, 12, 256, 144),
    (GgmlType::Q5_K, 13, 256, 176),
    (GgmlType::Q6_K, 14, 256, 210),
    (GgmlType::Q8_K, 15, 256, 292),
    (GgmlType::IQ2_XXS, 16, 256, 66),
    (GgmlType::IQ2_XS, 17, 256, 74),
    (GgmlType::IQ3_XXS, 18, 256, 98),
    (GgmlType::IQ1_S, 19, 256, 50),
    (GgmlType::IQ4_NL, 20, 32, 18),
    (GgmlType::IQ3_S, 21, 256, 110),
    (GgmlType::IQ2_S, 22, 256, 82),
    (GgmlType::IQ4_XS, 23, 256, 136),
    (GgmlType::I8, 24, 1, 1),
    (GgmlType::I16, 25, 1, 2),
    (GgmlType::I32, 26, 1, 4),
    (GgmlType::I64, 27, 1, 8),
    (GgmlType::F64, 28, 1, 8),
    (GgmlType::IQ1_M, 29, 256, 56),
    (GgmlType::BF16, 30, 1, 2),
    (GgmlType::TQ1_0, 34, 256, 54),
    (GgmlType::TQ2_0, 35, 256, 66),
    (GgmlType::MXFP4, 39, 32, 17),
    (GgmlType::NVFP4, 40, 64, 36),
    (GgmlType::Q1_0, 41, 128, 18),
];

/// Ids ggml used once and removed from GGUF files (repacked layouts now made at load time).
const REMOVED_TYPES: &[(u32, &str)] =
    &[(4, "Q4_2"), (5, "Q4_3"), (31, "Q4_0_4_4"), (32, "Q4_0_4_8"), (33, "Q4_0_8_8"), (36, "IQ4_NL_4_4"), (37, "IQ4_NL_4_8"), (38, "IQ4_NL_8_8")];

impl GgmlType {
    /// Every type, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TYPES.iter().map(|t| t.0)
    }

    fn row(self) -> &'static (GgmlType, u32, u64, u64) {
        // Every variant has exactly one row (checked by a test); the fallback is never taken.
        TYPES.iter().find(|t| t.0 == self).unwrap_or(&TYPES[0])
    }

    /// The type with ggml id `id`, if any file may carry it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().find(|t| t.1 == id).map(|t| t.0)
    }

    /// Its id in ggml's `ggml_type`.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// Elements per block.
    pub fn block_size(self) -> u64 {
        self.row().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        self.row().3
    }

    /// llama.cpp's name for it (`Q4_K`, `IQ4_XS`, `BF16`).
    pub fn name(self) -> String {
        format!("{self:?}")
    }

    /// Bytes of `elements` elements along a row, or `None` when they are not whole blocks or
    /// the size overflows.
    pub fn bytes_for(self, elements: u64) -> Option<u64> {
        if !elements.is_multiple_of(self.block_size()) {
            return None;
        }
        elements.checked_div(self.block_size())?.checked_mul(self.block_bytes())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// A metadata value (GGUF value types 0..=12).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value as a non-negative integer, if it is an integer that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(x) => Some(x as u64),
            Value::U16(x) => Some(x as u64),
            Value::U32(x) => Some(x as u64),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U64(x) => i64::try_from(x).ok(),
            Value::I8(x) => Some(x as i64),
            Value::I16(x) => Some(x as i64),
            Value::I32(x) => Some(x as i64),
            Value::I64(x) => Some(x),
            _ => self.as_u64().map(|x| x as i64),
        }
    }
}

/// One entry of the tensor directory, checked against the file it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions outermost first (`[rows, cols]` for a matrix; GGUF stores them innermost
    /// first). Each is at least 1; their product fits an i64.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the first element in the file (aligned; `offset + n_bytes`
    /// lies inside the file).
    pub offset: u64,
    /// Bytes the tensor takes: whole blocks of its type.
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        // The product was checked when the entry was read.
        self.dims.iter().product()
    }
}

/// A parsed GGUF header: everything but the tensor bytes.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    /// The tensor directory in file order.
    pub tensors: Vec<TensorInfo>,
    /// Name -> index in `tensors` (names are unique).
    index: HashMap<String, usize>,
    pub alignment: u64,
    /// Where the tensor data starts (the end of the header, rounded up to `alignment`).
    pub data_offset: u64,
}

impl GgufHeader {
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }
}

/// Reads the header of the GGUF file whose whole contents are `bytes`.
pub fn parse(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
    let mut r = Reader { bytes, pos: 0, elements: 0 };
    let magic: [u8; 4] = r.array("the magic")?;
    if &magic != MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = r.u32("the version")?;
    let wide = match version {
        1 => false,
        2 | 3 => true,
        v if v.swap_bytes() <= 3 => return Err(GgufError::BadVersion(v, " (this looks like a big-endian file; only little-endian is)")),
        v => return Err(GgufError::BadVersion(v, "")),
    };
    let n_tensors = r.count(wide, "the tensor count")?;
    let n_meta = r.count(wide, "the metadata count")?;
    limit("the tensor count", n_tensors, MAX_TENSORS)?;
    limit("the metadata count", n_meta, MAX_METADATA_ENTRIES)?;
    // smallest entry: a key length and a value type
    r.fits(n_meta, if wide { 12 } else { 8 }, "the metadata entries")?;

    let mut metadata = HashMap::with_capacity(n_meta as usize);
    for i in 0..n_meta {
        let key = r.string(wide, MAX_KEY_LEN, &format!("metadata key {i}"))?;
        let label = shown(&key);
        let ty = r.u32(&format!("the type of {label}"))?;
        let value = r.value(wide, ty, 0, &label)?;
        if metadata.insert(key, value).is_some() {
            return Err(GgufError::Invalid(format!("metadata key {label} appears twice")));
        }
    }

    // smallest entry: a name length, a dimension count, a type and an offset
    r.fits(n_tensors, if wide { 24 } else { 16 }, "the tensor directory")?;
    let mut raw = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        raw.push(r.tensor_entry(wide, i)?);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= MAX_ALIGNMENT => a,
            _ => return Err(GgufError::Invalid(format!("general.alignment is {v:?}; it must be a power of two up to {MAX_ALIGNMENT}"))),
        },
    };
    let header_end = r.pos as u64;
    let data_offset = header_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| GgufError::Invalid(format!("the header end {header_end} cannot be aligned to {alignment}")))?;
    let file_len = bytes.len() as u64;

    let mut tensors = Vec::with_capacity(raw.len());
    let mut index = HashMap::with_capacity(raw.len());
    // llama.cpp's rule: tensors are stored in directory order, each padded to the alignment, so
    // each starts exactly where the one before it ends (no gaps, no overlaps, no reordering).
    let mut expected = 0u64;
    for (name, dims, ggml_type, rel) in raw {
        let label = shown(&name);
        let bad = |m: String| GgufError::Invalid(format!("tensor {label} {m}"));
        if !rel.is_multiple_of(alignment) {
            return Err(bad(format!("has offset {rel}, not a multiple of the alignment {alignment}")));
        }
        let cols = dims.last().copied().unwrap_or(1);
        let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&n| n <= i64::MAX as u64);
        let Some(n_elements) = n_elements else {
            return Err(bad(format!("has dimensions {dims:?}, whose product overflows")));
        };
        if !cols.is_multiple_of(ggml_type.block_size()) {
            return Err(bad(format!("has rows of {cols} elements, not whole {ggml_type} blocks of {}", ggml_type.block_size())));
        }
        let n_bytes = ggml_type.bytes_for(n_elements).ok_or_else(|| bad(format!("of {n_elements} {ggml_type} elements overflows a byte count")))?;
        if rel != expected {
            return Err(bad(format!("has offset {rel}, but the tensors before it end at {expected} (tensors are stored packed, in directory order)")));
        }
        expected = rel
            .checked_add(n_bytes)
            .and_then(|e| e.checked_next_multiple_of(alignment))
            .ok_or_else(|| bad(format!("at offset {rel} with {n_bytes} bytes ends past any file")))?;
        let offset = data_offset.checked_add(rel).ok_or_else(|| bad(format!("has offset {rel}, past any file")))?;
        let end = offset.checked_add(n_bytes).ok_or_else(|| bad(format!("at offset {rel} with {n_bytes} bytes ends past any file")))?;
        if end > file_len {
            return Err(bad(format!("ends at byte {end} but the file has {file_len} bytes (truncated download?)")));
        }
        if index.insert(name.clone(), tensors.len()).is_some() {
            return Err(GgufError::Invalid(format!("tensor {label} appears twice in the directory")));
        }
        tensors.push(TensorInfo { name, dims, ggml_type, offset, n_bytes });
    }
    Ok(GgufHeader { version, metadata, tensors, index, alignment, data_offset })
}

/// A key or tensor name as error messages show it: quoted, control characters escaped, cut
/// to 64 characters (the file controls it, and an error must stay one short line).
pub fn shown(s: &str) -> String {
    const MAX: usize = 64;
    let cut: String = s.chars().take(MAX).collect();
    let more = if cut.len() < s.len() { "..." } else { "" };
    format!("{:?}{more}", cut)
}

fn limit(what: &str, value: u64, limit: u64) -> Result<(), GgufError> {
    if value > limit {
        return Err(GgufError::OverLimit { what: what.into(), value, limit });
    }
    Ok(())
}

/// A cursor over the file's bytes; every read is bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Array elements read so far (against `MAX_METADATA_ELEMENTS`).
    elements: u64,
}

impl<'a> Reader<'a> {
    fn left(&self) -> u64 {
        // `pos` never passes the end (`take` checks)
        self.bytes.len().saturating_sub(self.pos) as u64
    }

    /// Errors unless `count` items of at least `min_bytes` each can still follow.
    fn fits(&self, count: u64, min_bytes: u64, what: &str) -> Result<(), GgufError> {
        match count.checked_mul(min_bytes) {
            Some(need) if need <= self.left() => Ok(()),
            need => Err(GgufError::Truncated { what: format!("{what} ({count} of them)"), at: self.pos, need: need.unwrap_or(u64::MAX), left: self.left() }),
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.left() {
            return Err(GgufError::Truncated { what: what.into(), at: self.pos, need: n, left: self.left() });
        }
        let start = self.pos;
        // within the bytes left (checked above), so no overflow
        self.pos = start.saturating_add(n as usize);
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count or length: u64 from version 2 on, u32 in version 1.
    fn count(&mut self, wide: bool, what: &str) -> Result<u64, GgufError> {
        if wide {
            self.u64(what)
        } else {
            self.u32(what).map(u64::from)
        }
    }

    fn string(&mut self, wide: bool, max: u64, what: &str) -> Result<String, GgufError> {
        let len = self.count(wide, &format!("the length of {what}"))?;
        limit(&format!("the length of {what}"), len, max)?;
        let bytes = self.take(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, wide: bool, ty: u32, depth: u32, key: &str) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(GgufError::Invalid(format!("{key} is a bool stored as {b}, not 0 or 1"))),
            },
            8 => Value::String(self.string(wide, MAX_STRING_LEN, key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::OverLimit {
                        what: format!("the array nesting of {key}"),
                        value: (depth as u64).saturating_add(1),
                        limit: MAX_ARRAY_DEPTH as u64,
                    });
                }
                let elem = self.u32(&format!("the element type of {key}"))?;
                let len = self.count(wide, &format!("the length of {key}"))?;
                limit(&format!("the length of {key}"), len, MAX_ARRAY_LEN)?;
                let min = min_value_bytes(elem, wide).ok_or_else(|| GgufError::Invalid(format!("{key} is an array of unknown value type {elem}")))?;
                self.fits(len, min, &format!("the elements of {key}"))?;
                self.elements = self.elements.saturating_add(len);
                limit("the array elements in all metadata", self.elements, MAX_METADATA_ELEMENTS)?;
                let mut out = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    out.push(self.value(wide, elem, depth.saturating_add(1), key)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            other => return Err(GgufError::Invalid(format!("{key} has unknown value type {other}"))),
        })
    }

    /// One directory entry: name, dimensions (returned outermost first), type and the offset
    /// relative to the data section (checked against the file by the caller).
    fn tensor_entry(&mut self, wide: bool, i: u64) -> Result<(String, Vec<u64>, GgmlType, u64), GgufError> {
        let name = self.string(wide, MAX_KEY_LEN, &format!("the name of tensor {i}"))?;
        let label = shown(&name);
        let n_dims = self.u32(&format!("the dimension count of {label}"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::Invalid(format!("tensor {label} has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = self.count(wide, &format!("the dimensions of {label}"))?;
            if d == 0 || d > i64::MAX as u64 {
                return Err(GgufError::Invalid(format!("tensor {label} has a dimension of {d}")));
            }
            dims.push(d);
        }
        dims.reverse();
        let id = self.u32(&format!("the type of {label}"))?;
        let ggml_type = GgmlType::from_id(id).ok_or_else(|| match REMOVED_TYPES.iter().find(|r| r.0 == id) {
            Some((_, old)) => {
                GgufError::Invalid(format!("tensor {label} has type {old} (id {id}), which ggml removed from GGUF files; convert the model again"))
            }
            None => GgufError::Invalid(format!("tensor {label} has unknown ggml type id {id}")),
        })?;
        let offset = self.u64(&format!("the offset of {label}"))?;
        Ok((name, dims, ggml_type, offset))
    }
}

/// The fewest bytes one value of GGUF type `ty` takes (None: no such type).
fn min_value_bytes(ty: u32, wide: bool) -> Option<u64> {
    let len = if wide { 8 } else { 4 };
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => len,
        // an array: its element type (4) and its length
        9 => {
            if wide {
                12
            } else {
                8
            }
        }
        10..=12 => 8,
        _ => return None,
    })
}

#[cfg(test)]
// the tests build files with plain arithmetic on small, known sizes
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    /// A minimal GGUF v3 writer for these tests, independent of the parser.
    struct W(Vec<u8>);
    impl W {
        fn new(n_tensors: u64, n_meta: u64) -> Self {
            let mut v = b"GGUF".to_vec();
            v.extend(3u32.to_le_bytes());
            v.extend(n_tensors.to_le_bytes());
            v.extend(n_meta.to_le_bytes());
            W(v)
        }
        fn str(&mut self, s: &str) -> &mut Self {
            self.0.extend((s.len() as u64).to_le_bytes());
            self.0.extend(s.as_bytes());
            self
        }
        fn u32(&mut self, x: u32) -> &mut Self {
            self.0.extend(x.to_le_bytes());
            self
        }
        fn u64(&mut self, x: u64) -> &mut Self {
            self.0.extend(x.to_le_bytes());
            self
        }
        /// A tensor entry with `ne` innermost first, as GGUF stores it.
        fn tensor(&mut self, name: &str, ne: &[u64], ty: u32, offset: u64) -> &mut Self {
            self.str(name).u32(ne.len() as u32);
            for &d in ne {
                self.u64(d);
            }
            self.u32(ty).u64(offset)
        }
        /// Pads to 32 and appends `data` zero bytes.
        fn data(&mut self, data: usize) -> Vec<u8> {
            let mut v = self.0.clone();
            v.resize(v.len().next_multiple_of(32) + data, 0);
            v
        }
    }

    fn err(bytes: &[u8]) -> String {
        match parse(bytes) {
            Ok(h) => panic!("parsed: {h:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn every_type_has_one_row_and_llama_cpp_block_sizes() {
        for t in GgmlType::all() {
            assert_eq!(TYPES.iter().filter(|r| r.0 == t).count(), 1, "{t}");
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        let ids: Vec<u32> = TYPES.iter().map(|r| r.1).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids unique and sorted: {ids:?}");
        // (id, block, bytes) from ggml-common.h's static asserts
        for (t, id, block, bytes) in [
            (GgmlType::Q2_K, 10, 256, 84),
            (GgmlType::Q3_K, 11, 256, 110),
            (GgmlType::Q4_K, 12, 256, 144),
            (GgmlType::Q6_K, 14, 256, 210),
            (GgmlType::IQ4_NL, 20, 32, 18),
            (GgmlType::IQ4_XS, 23, 256, 136),
            (GgmlType::BF16, 30, 1, 2),
            (GgmlType::MXFP4, 39, 32, 17),
        ] {
            assert_eq!((t.id(), t.block_size(), t.block_bytes()), (id, block, bytes), "{t}");
        }
        assert_eq!(GgmlType::from_id(31), None);
        assert_eq!(GgmlType::Q4_K.name(), "Q4_K");
    }

    #[test]
    fn a_small_file_parses_with_absolute_aligned_offsets() {
        let mut w = W::new(2, 2);
        w.str("general.architecture").u32(8).str("llama");
        w.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(2).str("a").str("bc");
        w.tensor("a", &[32, 2], 8, 0).tensor("b", &[4], 0, 96);
        let bytes = w.data(96 + 16);
        let h = parse(&bytes).unwrap();
        assert_eq!(h.metadata["general.architecture"], Value::String("llama".into()));
        assert_eq!(h.metadata["tokenizer.ggml.tokens"], Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]));
        let a = h.tensor("a").unwrap();
        assert_eq!((a.dims.as_slice(), a.ggml_type, a.n_bytes, a.offset), (&[2u64, 32][..], GgmlType::Q8_0, 68, h.data_offset));
        assert_eq!(h.tensor("b").unwrap().offset, h.data_offset + 96);
        assert_eq!(h.data_offset % 32, 0);
    }

    #[test]
    fn an_offset_near_u64_max_is_an_error_not_a_wrap() {
        for off in [u64::MAX - 15, u64::MAX - 31, 1 << 40] {
            let mut w = W::new(1, 0);
            w.tensor("t", &[32], 0, off);
            let e = err(&w.data(128));
            assert!(e.contains("tensor \"t\"") && e.contains(&off.to_string()), "{off}: {e}");
        }
        // a size that runs past the end of the file
        let mut w = W::new(1, 0);
        w.tensor("t", &[1 << 20], 0, 0);
        assert!(err(&w.data(128)).contains("ends at byte"));
    }

    #[test]
    fn tensors_must_be_packed_in_directory_order() {
        // b before a, a gap, an overlap: each is an error naming the tensor and the expected offset
        for (a, b, bad) in [(96, 0, "a"), (0, 128, "b"), (0, 64, "b")] {
            let mut w = W::new(2, 0);
            w.tensor("a", &[32, 2], 8, a).tensor("b", &[4], 0, b);
            let e = err(&w.data(512));
            assert!(e.contains(&format!("tensor \"{bad}\"")) && e.contains("end at"), "{a} {b}: {e}");
        }
    }

    #[test]
    fn huge_counts_fail_before_allocating() {
        for (t, m) in [(u64::MAX, 0), (0, u64::MAX), (MAX_TENSORS, 0), (0, MAX_METADATA_ENTRIES)] {
            let e = err(&W::new(t, m).data(64));
            assert!(e.contains("limit") || e.contains("left"), "{t} {m}: {e}");
        }
        // an array claiming 2^23 strings in a small file
        let mut w = W::new(0, 1);
        w.str("k").u32(9).u32(8).u64(MAX_ARRAY_LEN);
        assert!(err(&w.data(0)).contains("only"), "{}", err(&w.data(0)));
        let mut w = W::new(0, 1);
        w.str("k").u32(9).u32(0).u64(u64::MAX);
        assert!(err(&w.data(0)).contains("limit"));
        let mut w = W::new(0, 1);
        w.str("k").u32(8).u64(u64::MAX - 1);
        assert!(err(&w.data(0)).contains("limit"));
    }

    #[test]
    fn impossible_tensor_entries_are_named_errors() {
        let cases: [(&[u64], u32, u64, &str); 7] = [
            (&[0, 32], 0, 0, "dimension of 0"),
            (&[1 << 32, 1 << 32], 0, 0, "overflows"),
            (&[u64::MAX], 0, 0, "dimension of"),
            (&[31], 8, 0, "not whole Q8_0 blocks"),
            (&[32], 31, 0, "Q4_0_4_4"),
            (&[32], 1000, 0, "unknown ggml type id 1000"),
            (&[32], 0, 8, "not a multiple of the alignment"),
        ];
        for (ne, ty, off, want) in cases {
            let mut w = W::new(1, 0);
            w.tensor("t", ne, ty, off);
            let e = err(&w.data(4096));
            assert!(e.contains(want), "{ne:?} {ty} {off}: {e}");
        }
        let mut w = W::new(1, 0);
        w.str("t").u32(5);
        assert!(err(&w.data(4096)).contains("5 dimensions"));
        let mut w = W::new(2, 0);
        w.tensor("t", &[8], 0, 0).tensor("t", &[8], 0, 32);
        assert!(err(&w.data(4096)).contains("twice"));
    }

    #[test]
    fn alignment_must_be_a_power_of_two() {
        for (a, ok) in [(0u32, false), (3, false), (48, false), (1 << 20, false), (1, true), (64, true)] {
            let mut w = W::new(0, 1);
            w.str("general.alignment").u32(4).u32(a);
            assert_eq!(parse(&w.data(0)).is_ok(), ok, "alignment {a}");
        }
    }

    #[test]
    fn bad_magic_version_and_values_are_errors() {
        assert!(err(b"GGUX\x03\0\0\0").contains("magic"));
        assert!(err(b"GGUF\0\0\0\x03").contains("big-endian"));
        assert!(err(b"GGUF\x07\0\0\0").contains("version 7"));
        let mut w = W::new(0, 1);
        w.str("k").u32(13);
        assert!(err(&w.data(0)).contains("unknown value type 13"));
        let mut w = W::new(0, 1);
        w.str("k").u32(7);
        w.0.push(2);
        assert!(err(&w.data(0)).contains("bool"));
        let mut w = W::new(0, 2);
        w.str("k").u32(4).u32(1).str("k").u32(4).u32(2);
        assert!(err(&w.data(0)).contains("twice"));
        // arrays of arrays of arrays
        let mut w = W::new(0, 1);
        w.str("k").u32(9).u32(9).u64(1).u32(9).u64(1).u32(0).u64(0);
        assert!(err(&w.data(0)).contains("nesting"));
    }
}
