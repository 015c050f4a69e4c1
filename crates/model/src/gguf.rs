//! Reading a GGUF file: metadata and tensor directory through candle's parser, tensor bytes
//! straight from a memory map (no copy). Every failure names the file and the key or tensor.

use crate::ModelError;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::GgmlDType;
use memmap2::Mmap;
use specula_kernels::{QMatrix, WeightBytes, WeightFormat};
use std::sync::Arc;

pub struct GgufFile {
    pub path: String,
    pub content: Content,
    mmap: Arc<Mmap>,
}

impl GgufFile {
    pub fn open(path: &std::path::Path) -> Result<Self, ModelError> {
        let p = path.display().to_string();
        let mut f = std::fs::File::open(path).map_err(|e| ModelError::Io { path: p.clone(), source: e })?;
        let content = Content::read(&mut f).map_err(|e| ModelError::BadGguf { path: p.clone(), message: e.to_string() })?;
        // SAFETY: the file is opened read-only; specula never writes model files while running.
        let mmap = unsafe { Mmap::map(&f) }.map_err(|e| ModelError::Io { path: p.clone(), source: e })?;
        let file = Self { path: p, content, mmap: Arc::new(mmap) };
        file.check_extents()?;
        Ok(file)
    }

    /// Every tensor must lie inside the file (catches truncated downloads before any compute).
    fn check_extents(&self) -> Result<(), ModelError> {
        let len = self.mmap.len() as u64;
        for (name, info) in &self.content.tensor_infos {
            let elems = info.shape.elem_count() as u64;
            let bytes = elems / info.ggml_dtype.block_size() as u64 * info.ggml_dtype.type_size() as u64;
            let end = self.content.tensor_data_offset + info.offset + bytes;
            if end > len {
                return Err(ModelError::BadGguf {
                    path: self.path.clone(),
                    message: format!("tensor '{name}' ends at byte {end} but the file has {len} bytes (truncated download?)"),
                });
            }
        }
        Ok(())
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingMetadata(format!("cannot find {key} in the metadata of {}", self.path))
    }

    pub fn meta_u32(&self, key: &str) -> Result<u32, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        value_to_u64(v).map(|x| x as u32).ok_or_else(|| ModelError::MissingMetadata(format!("{key} in {} is not an integer", self.path)))
    }

    pub fn meta_f32(&self, key: &str) -> Result<f32, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        match v {
            Value::F32(x) => Ok(*x),
            Value::F64(x) => Ok(*x as f32),
            other => value_to_u64(other).map(|x| x as f32).ok_or_else(|| ModelError::MissingMetadata(format!("{key} in {} is not a number", self.path))),
        }
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
        let arr = v.to_vec().map_err(|_| ModelError::MissingMetadata(format!("{key} in {} is not an array", self.path)))?;
        arr.iter().map(|x| x.to_string().cloned().map_err(|_| ModelError::MissingMetadata(format!("{key} in {} holds a non-string", self.path)))).collect()
    }

    pub fn meta_i32s(&self, key: &str) -> Result<Vec<i32>, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        let arr = v.to_vec().map_err(|_| ModelError::MissingMetadata(format!("{key} in {} is not an array", self.path)))?;
        Ok(arr.iter().map(|x| value_to_u64(x).unwrap_or(0) as i32).collect())
    }

    pub fn meta_f32s(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        let v = self.meta(key).ok_or_else(|| self.missing(key))?;
        let arr = v.to_vec().map_err(|_| ModelError::MissingMetadata(format!("{key} in {} is not an array", self.path)))?;
        arr.iter()
            .map(|x| match x {
                Value::F32(x) => Ok(*x),
                Value::F64(x) => Ok(*x as f32),
                _ => Err(ModelError::MissingMetadata(format!("{key} in {} holds a non-float", self.path))),
            })
            .collect()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn tensor_info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.content.tensor_infos.get(name).ok_or_else(|| ModelError::BadTensor { name: name.to_string(), message: format!("missing from {}", self.path) })
    }

    /// A 2-D tensor as a weight matrix over the memory map.
    pub fn matrix(&self, name: &str) -> Result<QMatrix, ModelError> {
        let info = self.tensor_info(name)?;
        let format = weight_format(name, info.ggml_dtype)?;
        let dims = info.shape.dims();
        let (rows, cols) = match dims {
            [r, c] => (*r, *c),
            [c] => (1, *c),
            _ => return Err(ModelError::BadTensor { name: name.into(), message: format!("expected 2 dimensions, got shape {dims:?}") }),
        };
        let start = (self.content.tensor_data_offset + info.offset) as usize;
        let len = rows * format.row_bytes(cols);
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.mmap.clone();
        QMatrix::new(format, rows, cols, WeightBytes::new(owner, start, len), name)
            .map_err(|e| ModelError::BadTensor { name: name.into(), message: e.to_string() })
    }

    /// Rows `first..first + rows` of a 2-D tensor as their own weight matrix (a fused tensor's
    /// part: Phi-3's `attn_qkv` holds Q, K and V one after the other, its `ffn_up` gate and up).
    pub fn matrix_rows(&self, name: &str, first: usize, rows: usize) -> Result<QMatrix, ModelError> {
        let info = self.tensor_info(name)?;
        let format = weight_format(name, info.ggml_dtype)?;
        let (total, cols) = match info.shape.dims() {
            [r, c] => (*r, *c),
            dims => return Err(ModelError::BadTensor { name: name.into(), message: format!("expected 2 dimensions, got shape {dims:?}") }),
        };
        if first.checked_add(rows).is_none_or(|end| end > total) {
            return Err(ModelError::BadTensor {
                name: name.into(),
                message: format!("rows {first}..{} asked of a tensor with {total}", first.saturating_add(rows)),
            });
        }
        let row_bytes = format.row_bytes(cols);
        let start = (self.content.tensor_data_offset + info.offset) as usize + first * row_bytes;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.mmap.clone();
        QMatrix::new(format, rows, cols, WeightBytes::new(owner, start, rows * row_bytes), name)
            .map_err(|e| ModelError::BadTensor { name: name.into(), message: e.to_string() })
    }

    /// A 3-D stack of `[n x rows x cols]` weight matrices (llama.cpp's `ffn_*_exps` expert
    /// tensors) as `n` matrices over the memory map, expert 0 first.
    pub fn matrix_stack(&self, name: &str, n: usize) -> Result<Vec<QMatrix>, ModelError> {
        let info = self.tensor_info(name)?;
        let format = weight_format(name, info.ggml_dtype)?;
        let dims = info.shape.dims();
        let (count, rows, cols) = match dims {
            [e, r, c] => (*e, *r, *c),
            _ => return Err(ModelError::BadTensor { name: name.into(), message: format!("expected 3 dimensions [experts, rows, cols], got shape {dims:?}") }),
        };
        if count != n {
            return Err(ModelError::BadTensor { name: name.into(), message: format!("stacks {count} experts but the metadata says {n}") });
        }
        let start = (self.content.tensor_data_offset + info.offset) as usize;
        let len = rows * format.row_bytes(cols);
        (0..n)
            .map(|e| {
                let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.mmap.clone();
                QMatrix::new(format, rows, cols, WeightBytes::new(owner, start + e * len, len), name)
                    .map_err(|er| ModelError::BadTensor { name: name.into(), message: er.to_string() })
            })
            .collect()
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

fn value_to_u64(v: &Value) -> Option<u64> {
    Some(match v {
        Value::U8(x) => *x as u64,
        Value::I8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::I16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::I32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I64(x) => *x as u64,
        _ => return None,
    })
}

pub fn weight_format(name: &str, dtype: GgmlDType) -> Result<WeightFormat, ModelError> {
    Ok(match dtype {
        GgmlDType::F32 => WeightFormat::F32,
        GgmlDType::F16 => WeightFormat::F16,
        GgmlDType::BF16 => WeightFormat::BF16,
        GgmlDType::Q4_0 => WeightFormat::Q4_0,
        GgmlDType::Q4_1 => WeightFormat::Q4_1,
        GgmlDType::Q8_0 => WeightFormat::Q8_0,
        GgmlDType::Q5_0 => WeightFormat::Q5_0,
        GgmlDType::Q5_1 => WeightFormat::Q5_1,
        GgmlDType::Q2K => WeightFormat::Q2K,
        GgmlDType::Q3K => WeightFormat::Q3K,
        GgmlDType::Q4K => WeightFormat::Q4K,
        GgmlDType::Q5K => WeightFormat::Q5K,
        GgmlDType::Q6K => WeightFormat::Q6K,
        other => return Err(ModelError::UnsupportedTensorType { name: name.to_string(), dtype: format!("{other:?}") }),
    })
}
