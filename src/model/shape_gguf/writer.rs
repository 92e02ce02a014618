//! A GGUF (version 3) writer that streams tensor data: the header (metadata and every tensor's name,
//! shape, type and offset) is written first from the declared shapes, then each tensor's bytes in order,
//! so a model never has to be in memory whole.
//!
//! candle's `gguf_file::write` takes every tensor at once, which for an 8B model is 5-9 GB of quantised
//! data held together; here a tensor is written as it is made, chunk by chunk.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use std::io::{Seek, Write};

/// GGUF's default data alignment (llama.cpp's `GGUF_DEFAULT_ALIGNMENT`); no `general.alignment` key is
/// written, so readers assume it.
pub const ALIGNMENT: u64 = 32;

/// One tensor as the header declares it.
#[derive(Debug, Clone)]
pub struct TensorDecl {
    pub name: String,
    /// Outermost dimension first, as candle and PyTorch write shapes (`[rows, cols]`); GGUF stores them
    /// innermost first, which the writer does.
    pub dims: Vec<usize>,
    pub dtype: GgmlDType,
}

impl TensorDecl {
    /// Bytes of the tensor's data: its elements in blocks of the type's block size.
    pub fn size_in_bytes(&self) -> Result<u64> {
        let elems: usize = self.dims.iter().product();
        let cols = *self
            .dims
            .last()
            .context("a tensor needs at least one dimension")?;
        if !cols.is_multiple_of(self.dtype.block_size()) {
            bail!(
                "tensor {}: {cols} columns are not a multiple of {:?}'s block of {}",
                self.name,
                self.dtype,
                self.dtype.block_size()
            );
        }
        Ok((elems / self.dtype.block_size() * self.dtype.type_size()) as u64)
    }
}

/// ggml's type ids (`enum ggml_type`) of the types this writer is asked for.
fn ggml_type_id(t: GgmlDType) -> Result<u32> {
    Ok(match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        other => bail!("writing {other:?} tensors is not supported"),
    })
}

fn pad_to_alignment(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT - n
}

fn write_string<W: Write>(w: &mut W, s: &str) -> Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())?;
    Ok(())
}

/// GGUF's value type ids.
fn value_type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn write_value<W: Write>(w: &mut W, v: &Value) -> Result<()> {
    match v {
        Value::U8(x) => w.write_all(&x.to_le_bytes())?,
        Value::I8(x) => w.write_all(&x.to_le_bytes())?,
        Value::U16(x) => w.write_all(&x.to_le_bytes())?,
        Value::I16(x) => w.write_all(&x.to_le_bytes())?,
        Value::U32(x) => w.write_all(&x.to_le_bytes())?,
        Value::I32(x) => w.write_all(&x.to_le_bytes())?,
        Value::U64(x) => w.write_all(&x.to_le_bytes())?,
        Value::I64(x) => w.write_all(&x.to_le_bytes())?,
        Value::F32(x) => w.write_all(&x.to_le_bytes())?,
        Value::F64(x) => w.write_all(&x.to_le_bytes())?,
        Value::Bool(x) => w.write_all(&[u8::from(*x)])?,
        Value::String(s) => write_string(w, s)?,
        Value::Array(items) => {
            // An empty array's element type is never read; GGUF arrays hold one type.
            let elem = items.first().map(value_type_id).unwrap_or(4);
            if items.iter().any(|x| value_type_id(x) != elem) {
                bail!("a GGUF array must hold values of one type");
            }
            w.write_all(&elem.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            for x in items {
                write_value(w, x)?;
            }
        }
    }
    Ok(())
}

/// A GGUF file being written: header done, tensor data arriving in declaration order.
pub struct GgufStream<W: Write + Seek> {
    w: W,
    sizes: Vec<u64>,
    /// The tensor whose data is being written, and how many of its bytes are in.
    current: usize,
    written: u64,
}

impl<W: Write + Seek> GgufStream<W> {
    /// Writes the header: metadata, then the tensor table with offsets computed from the declared
    /// shapes, then padding up to the aligned start of the data.
    pub fn begin(mut w: W, metadata: &[(String, Value)], tensors: &[TensorDecl]) -> Result<Self> {
        w.write_all(&0x4655_4747u32.to_le_bytes())?; // "GGUF"
        w.write_all(&3u32.to_le_bytes())?;
        w.write_all(&(tensors.len() as u64).to_le_bytes())?;
        w.write_all(&(metadata.len() as u64).to_le_bytes())?;
        for (key, value) in metadata {
            write_string(&mut w, key)?;
            w.write_all(&value_type_id(value).to_le_bytes())?;
            write_value(&mut w, value).with_context(|| format!("metadata {key}"))?;
        }
        let mut sizes = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for t in tensors {
            let size = t.size_in_bytes()?;
            write_string(&mut w, &t.name)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for &d in t.dims.iter().rev() {
                w.write_all(&(d as u64).to_le_bytes())?;
            }
            w.write_all(&ggml_type_id(t.dtype)?.to_le_bytes())?;
            w.write_all(&offset.to_le_bytes())?;
            offset += size + pad_to_alignment(size);
            sizes.push(size);
        }
        let pos = w.stream_position()?;
        w.write_all(&vec![0u8; pad_to_alignment(pos) as usize])?;
        Ok(GgufStream {
            w,
            sizes,
            current: 0,
            written: 0,
        })
    }

    /// Appends bytes to the current tensor's data; a tensor completed is padded and the next begins.
    /// A chunk may not run past the end of the tensor it belongs to.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(&size) = self.sizes.get(self.current) else {
            bail!("more tensor data than the header declares");
        };
        if self.written + bytes.len() as u64 > size {
            bail!(
                "tensor #{} is declared as {size} bytes but more data came",
                self.current
            );
        }
        self.w.write_all(bytes)?;
        self.written += bytes.len() as u64;
        if self.written == size {
            self.w.write_all(&vec![0u8; pad_to_alignment(size) as usize])?;
            self.current += 1;
            self.written = 0;
        }
        Ok(())
    }

    /// Checks that every declared tensor got all its data, and flushes.
    pub fn finish(mut self) -> Result<W> {
        if self.current != self.sizes.len() {
            bail!(
                "tensor data stopped at tensor #{} of {}",
                self.current,
                self.sizes.len()
            );
        }
        self.w.flush()?;
        Ok(self.w)
    }
}
