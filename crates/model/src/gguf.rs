//! Reading a GGUF file: metadata and tensor directory through our own checked parser
//! (`gguf_reader`), tensor bytes straight from a memory map (no copy). Every failure names the
//! file and the key or tensor.

use crate::gguf_reader::{self, GgmlType, GgufHeader, TensorInfo, Value};
use crate::ModelError;
use memmap2::Mmap;
use specula_kernels::{QMatrix, WeightBytes, WeightFormat};
use std::sync::Arc;

pub struct GgufFile {
    pub path: String,
    /// Metadata and tensor directory; every tensor lies inside `mmap`.
    pub header: GgufHeader,
    mmap: Arc<Mmap>,
    /// Expert matrices (`matrix_stack`, `expert_matrix`) are read in place from the map instead
    /// of repacked; the map's pages are then kept (`release_resident_pages` does nothing).
    pub experts_in_place: bool,
}

impl GgufFile {
    pub fn open(path: &std::path::Path) -> Result<Self, ModelError> {
        Self::open_with(path, false)
    }

    /// `open`, with every page of the file read and mapped now (`MAP_POPULATE`) when `populate`:
    /// for weights read in place, which would otherwise fault in a page at a time during the
    /// first requests.
    pub fn open_with(path: &std::path::Path, populate: bool) -> Result<Self, ModelError> {
        let p = path.display().to_string();
        let f = std::fs::File::open(path).map_err(|e| ModelError::Io { path: p.clone(), source: e })?;
        let mut options = memmap2::MmapOptions::new();
        if populate {
            options.populate();
        }
        // SAFETY: the file is opened read-only; specula never writes model files while running.
        let mmap = unsafe { options.map(&f) }.map_err(|e| ModelError::Io { path: p.clone(), source: e })?;
        let header = gguf_reader::parse(&mmap).map_err(|e| ModelError::BadGguf { path: p.clone(), message: e.to_string() })?;
        Ok(Self { path: p, header, mmap: Arc::new(mmap), experts_in_place: false })
    }

    /// Unmaps this process's resident pages of the file: once the weights are repacked, the
    /// file's pages are only read again for an embedding row now and then, and keeping them
    /// mapped would count the model twice in the resident set (a 30B MoE file is most of a 24 GB
    /// machine). They stay in the page cache until memory is needed; a later read faults the page
    /// back in from the file. Called per layer while loading, so the peak stays near one copy.
    pub fn release_resident_pages(&self) {
        if self.experts_in_place {
            return;
        }
        #[cfg(unix)]
        {
            // SAFETY: the map is read-only and never written, so no page holds data that is not
            // in the file: a page read after this faults in again with the same bytes. Nothing
            // borrows a dropped page's contents across the call (the loader copies what it packs).
            if let Err(e) = unsafe { self.mmap.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) } {
                tracing::debug!("madvise(DONTNEED) on {}: {e}", self.path);
            }
        }
    }

    /// Bytes of all tensors together.
    pub fn tensor_bytes(&self) -> u64 {
        self.header.tensors.iter().map(|t| t.n_bytes).fold(0, u64::saturating_add)
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingMetadata(format!("cannot find {key} in the metadata of {}", self.path))
    }

    pub fn meta_u32(&self, key: &str) -> Result<u32, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        match v.as_u64() {
            Some(x) => u32::try_from(x).map_err(|_| ModelError::MissingMetadata(format!("{key} in {} is {x}, which does not fit 32 bits", self.path))),
            None => Err(ModelError::MissingMetadata(format!("{key} in {} is not a non-negative integer", self.path))),
        }
    }

    pub fn meta_f32(&self, key: &str) -> Result<f32, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        match v {
            Value::F32(x) => Ok(*x),
            Value::F64(x) => Ok(*x as f32),
            other => other.as_i64().map(|x| x as f32).ok_or_else(|| ModelError::MissingMetadata(format!("{key} in {} is not a number", self.path))),
        }
    }

    /// An optional integer: `default` when the key is absent, an error when it is present but
    /// not a 32-bit unsigned integer (a bad value is never silently replaced by the default).
    pub fn meta_u32_or(&self, key: &str, default: u32) -> Result<u32, ModelError> {
        match self.meta(key) {
            None => Ok(default),
            Some(_) => self.meta_u32(key),
        }
    }

    /// An optional number: `None` when the key is absent, an error when it is not a number.
    pub fn meta_f32_opt(&self, key: &str) -> Result<Option<f32>, ModelError> {
        match self.meta(key) {
            None => Ok(None),
            Some(_) => self.meta_f32(key).map(Some),
        }
    }

    /// An optional number with its default (see `meta_u32_or`).
    pub fn meta_f32_or(&self, key: &str, default: f32) -> Result<f32, ModelError> {
        Ok(self.meta_f32_opt(key)?.unwrap_or(default))
    }

    pub fn meta_str(&self, key: &str) -> Result<&str, ModelError> {
        match self.meta(key) {
            Some(Value::String(s)) => Ok(s),
            Some(_) => Err(ModelError::MissingMetadata(format!("{key} in {} is not a string", self.path))),
            None => Err(self.missing(key)),
        }
    }

    pub fn meta_bool(&self, key: &str) -> Option<bool> {
        match self.meta(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    pub fn meta_strings(&self, key: &str) -> Result<Vec<String>, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        let Value::Array(arr) = v else { return Err(ModelError::MissingMetadata(format!("{key} in {} is not an array", self.path))) };
        arr.iter()
            .map(|x| match x {
                Value::String(s) => Ok(s.clone()),
                _ => Err(ModelError::MissingMetadata(format!("{key} in {} holds a non-string", self.path))),
            })
            .collect()
    }

    pub fn meta_i32s(&self, key: &str) -> Result<Vec<i32>, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        let Value::Array(arr) = v else { return Err(ModelError::MissingMetadata(format!("{key} in {} is not an array", self.path))) };
        arr.iter()
            .map(|x| x.as_i64().and_then(|x| i32::try_from(x).ok()))
            .collect::<Option<Vec<i32>>>()
            .ok_or_else(|| ModelError::MissingMetadata(format!("{key} in {} holds a value that is not a 32-bit integer", self.path)))
    }

    pub fn meta_f32s(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        let Value::Array(arr) = v else { return Err(ModelError::MissingMetadata(format!("{key} in {} is not an array", self.path))) };
        arr.iter()
            .map(|x| match x {
                Value::F32(x) => Ok(*x),
                Value::F64(x) => Ok(*x as f32),
                _ => Err(ModelError::MissingMetadata(format!("{key} in {} holds a non-float", self.path))),
            })
            .collect()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.header.tensor(name).is_some()
    }

    fn tensor_info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.header.tensor(name).ok_or_else(|| ModelError::BadTensor { name: name.to_string(), message: format!("missing from {}", self.path) })
    }

    /// One expert's 2-D tensor (files with a tensor per expert): `matrix`, read in place when
    /// `experts_in_place`.
    pub fn expert_matrix(&self, name: &str) -> Result<QMatrix, ModelError> {
        self.matrix_placed(name, self.experts_in_place)
    }

    /// A 2-D tensor as a weight matrix over the memory map.
    pub fn matrix(&self, name: &str) -> Result<QMatrix, ModelError> {
        self.matrix_placed(name, false)
    }

    fn matrix_placed(&self, name: &str, in_place: bool) -> Result<QMatrix, ModelError> {
        let info = self.tensor_info(name)?;
        let format = weight_format(name, info.ggml_type)?;
        let (rows, cols) = match info.dims[..] {
            [r, c] => (to_usize(r), to_usize(c)),
            [c] => (1, to_usize(c)),
            _ => return Err(ModelError::BadTensor { name: name.into(), message: format!("expected 2 dimensions, got shape {:?}", info.dims) }),
        };
        let (start, len) = self.extent(info, format, 1, rows, cols)?;
        self.window_matrix(name, format, rows, cols, start..start + len, in_place)
    }

    /// The matrix over the map's bytes `at`, repacked or read in place.
    fn window_matrix(
        &self,
        name: &str,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        at: std::ops::Range<usize>,
        in_place: bool,
    ) -> Result<QMatrix, ModelError> {
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.mmap.clone();
        let bytes = WeightBytes::new(owner, at.start, at.len());
        match in_place {
            true => QMatrix::new_in_place(format, rows, cols, bytes, name),
            false => QMatrix::new(format, rows, cols, bytes, name),
        }
        .map_err(|e| ModelError::BadTensor { name: name.into(), message: e.to_string() })
    }

    /// Rows `first..first + rows` of a 2-D tensor as their own weight matrix (a fused tensor's
    /// part: Phi-3's `attn_qkv` holds Q, K and V one after the other, its `ffn_up` gate and up).
    pub fn matrix_rows(&self, name: &str, first: usize, rows: usize) -> Result<QMatrix, ModelError> {
        let info = self.tensor_info(name)?;
        let format = weight_format(name, info.ggml_type)?;
        let (total, cols) = match info.dims[..] {
            [r, c] => (to_usize(r), to_usize(c)),
            _ => return Err(ModelError::BadTensor { name: name.into(), message: format!("expected 2 dimensions, got shape {:?}", info.dims) }),
        };
        if first.checked_add(rows).is_none_or(|end| end > total) {
            return Err(ModelError::BadTensor {
                name: name.into(),
                message: format!("rows {first}..{} asked of a tensor with {total}", first.saturating_add(rows)),
            });
        }
        let (start, _) = self.extent(info, format, 1, total, cols)?;
        let row_bytes = format.row_bytes(cols);
        self.window_matrix(name, format, rows, cols, start + first * row_bytes..start + (first + rows) * row_bytes, false)
    }

    /// A 3-D stack of `[n x rows x cols]` weight matrices (llama.cpp's `ffn_*_exps` expert
    /// tensors) as `n` matrices over the memory map, expert 0 first.
    pub fn matrix_stack(&self, name: &str, n: usize) -> Result<Vec<QMatrix>, ModelError> {
        let info = self.tensor_info(name)?;
        let format = weight_format(name, info.ggml_type)?;
        let (count, rows, cols) = match info.dims[..] {
            [e, r, c] => (to_usize(e), to_usize(r), to_usize(c)),
            _ => {
                return Err(ModelError::BadTensor {
                    name: name.into(),
                    message: format!("expected 3 dimensions [experts, rows, cols], got shape {:?}", info.dims),
                })
            }
        };
        if count != n {
            return Err(ModelError::BadTensor { name: name.into(), message: format!("stacks {count} experts but the metadata says {n}") });
        }
        let (start, len) = self.extent(info, format, n, rows, cols)?;
        (0..n).map(|e| self.window_matrix(name, format, rows, cols, start + e * len..start + (e + 1) * len, self.experts_in_place)).collect()
    }

    /// A 1-D tensor (norm weights) as f32, whatever its stored type.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let m = self.matrix(name)?;
        let mut out = vec![0f32; m.rows * m.cols];
        for r in 0..m.rows {
            m.dequantize_row_into(r, &mut out[r * m.cols..(r + 1) * m.cols]);
        }
        Ok(out)
    }
}

/// Dimensions were checked to fit an i64, and files are memory-mapped, so they fit a usize on
/// the 64-bit targets specula builds for; saturate rather than wrap anywhere else.
fn to_usize(x: u64) -> usize {
    usize::try_from(x).unwrap_or(usize::MAX)
}

impl GgufFile {
    /// Where `count` matrices of `rows x cols` in `format` start, and the bytes of one; they
    /// must be exactly the tensor's bytes (checked against the file when it was parsed).
    fn extent(&self, info: &TensorInfo, format: WeightFormat, count: usize, rows: usize, cols: usize) -> Result<(usize, usize), ModelError> {
        let one = rows.checked_mul(format.row_bytes(cols));
        match one.and_then(|b| b.checked_mul(count)) {
            Some(total) if total as u64 == info.n_bytes => Ok((to_usize(info.offset), one.unwrap_or(0))),
            _ => Err(ModelError::BadTensor {
                name: info.name.clone(),
                message: format!("{count} x [{rows}, {cols}] {} does not fill its {} bytes", info.ggml_type, info.n_bytes),
            }),
        }
    }
}

/// The kernel format of a tensor type, or the "not supported" error naming the tensor.
pub fn weight_format(name: &str, ty: GgmlType) -> Result<WeightFormat, ModelError> {
    Ok(match ty {
        GgmlType::F32 => WeightFormat::F32,
        GgmlType::F16 => WeightFormat::F16,
        GgmlType::BF16 => WeightFormat::BF16,
        GgmlType::Q4_0 => WeightFormat::Q4_0,
        GgmlType::Q4_1 => WeightFormat::Q4_1,
        GgmlType::Q8_0 => WeightFormat::Q8_0,
        GgmlType::Q5_0 => WeightFormat::Q5_0,
        GgmlType::Q5_1 => WeightFormat::Q5_1,
        GgmlType::Q2_K => WeightFormat::Q2K,
        GgmlType::Q3_K => WeightFormat::Q3K,
        GgmlType::Q4_K => WeightFormat::Q4K,
        GgmlType::Q5_K => WeightFormat::Q5K,
        GgmlType::Q6_K => WeightFormat::Q6K,
        GgmlType::IQ4_NL => WeightFormat::IQ4NL,
        GgmlType::IQ4_XS => WeightFormat::IQ4XS,
        GgmlType::MXFP4 => WeightFormat::MXFP4,
        other => return Err(ModelError::UnsupportedTensorType { name: name.to_string(), dtype: other.name() }),
    })
}
