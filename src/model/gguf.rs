//! A GGUF file opened for loading: its metadata, every tensor's extent checked against the file
//! before anything is read, tensors read one at a time (so the loader never holds a copy of the
//! whole model beside the one it builds), and rows read in place from a memory map.
//!
//! Why rows in place: the token embedding is read a few rows per forward, and the lm_head's rows
//! are read once by drafters that copy a slice of it. Mapping them costs no memory beyond the
//! pages actually touched, where a copy would cost the whole tensor (on Llama-3.1-8B in Q4_0,
//! 290 MB for the embedding alone).
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{ggml_file, gguf_file, GgmlDType};
use candle_core::{Device, Tensor};

use crate::cpu::quant::{QuantKind, QuantRows, SharedBytes};
use crate::{Error, Result};

/// Where one tensor lies in the file, and what it holds.
#[derive(Clone, Debug)]
pub struct Extent {
    pub dtype: GgmlDType,
    /// As candle reports them: outermost first (`[rows, cols]` for a matrix).
    pub dims: Vec<usize>,
    /// From the start of the file.
    pub offset: usize,
    pub len: usize,
}

/// An opened GGUF file. See the module documentation.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: gguf_file::Content,
    file: File,
    map: Arc<memmap2::Mmap>,
}

impl GgufFile {
    /// Read the header and check that every tensor lies inside the file: a truncated download
    /// is the most common broken GGUF and deserves a precise message, and nothing may be read
    /// or allocated on the word of a header that the file cannot back.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_size = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let content = gguf_file::Content::read(&mut BufReader::new(&file)).map_err(|e| Error::bad_file(path, format!("not a readable GGUF file: {e}")))?;
        for (name, info) in content.tensor_infos.iter() {
            let elems = info.shape.dims().iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64));
            let block = info.ggml_dtype.block_size() as u64;
            let bytes = elems.filter(|e| e % block == 0).and_then(|e| (e / block).checked_mul(info.ggml_dtype.type_size() as u64));
            let end = bytes.and_then(|b| content.tensor_data_offset.checked_add(info.offset)?.checked_add(b));
            match end {
                None => return Err(Error::bad_file(path, format!("tensor {name}: shape {:?} is not a whole number of {:?} blocks, or its size overflows", info.shape.dims(), info.ggml_dtype))),
                Some(end) if end > file_size => return Err(Error::bad_file(path, format!("truncated: tensor {name} ends at byte {end} but the file has {file_size} bytes"))),
                Some(_) => {}
            }
        }
        // SAFETY: the map is read-only and every extent read from it was checked above against
        // the file's size. As with llama.cpp's and candle's own memory maps, the file must not
        // be truncated or rewritten while the model is loaded.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        if (map.len() as u64) < file_size {
            // The file shrank between the size check and the map: the checked extents no longer hold.
            return Err(Error::bad_file(path, format!("changed while opening: {file_size} bytes, then {}", map.len())));
        }
        Ok(GgufFile { path: path.to_path_buf(), content, file, map: Arc::new(map) })
    }

    pub fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The tensor's place in the file (inside it: checked at [`GgufFile::open`]).
    pub fn extent(&self, name: &str) -> Result<Extent> {
        let info = self.content.tensor_infos.get(name).ok_or_else(|| Error::bad_file(&self.path, format!("no {name} tensor")))?;
        let dims = info.shape.dims().to_vec();
        let elems: usize = dims.iter().product();
        let len = elems / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        Ok(Extent { dtype: info.ggml_dtype, dims, offset: self.content.tensor_data_offset as usize + info.offset as usize, len })
    }

    /// The tensor's bytes, read from the file into a buffer of their own.
    pub fn read(&self, name: &str) -> Result<(Extent, AlignedBytes)> {
        let e = self.extent(name)?;
        let mut buf = AlignedBytes::zeroed(e.len);
        let mut f = &self.file;
        f.seek(SeekFrom::Start(e.offset as u64)).and_then(|_| f.read_exact(buf.as_mut_slice())).map_err(|err| Error::io(&self.path, err))?;
        Ok((e, buf))
    }

    /// The tensor dequantised to f32, in its stored shape (any type candle reads): from the map
    /// in place where its data is aligned for candle's block types (GGUF aligns tensor data to
    /// 32 bytes by default), else from a copy.
    pub fn dequantize(&self, name: &str) -> Result<Tensor> {
        let e = self.extent(name)?;
        let bytes = &self.map[e.offset..e.offset + e.len];
        let r = if bytes.as_ptr().align_offset(8) == 0 {
            dequantize(e.dtype, bytes, e.dims)
        } else {
            let (e, copy) = self.read(name)?;
            dequantize(e.dtype, copy.as_slice(), e.dims)
        };
        r.map_err(|err| Error::bad_file(&self.path, format!("tensor {name}: {err}")))
    }

    /// The tensor's blocks in place, as a view into the map (nothing is copied: packing reads
    /// them straight from the file's pages).
    pub fn blocks(&self, name: &str, kind: QuantKind) -> Result<QuantRows> {
        let e = self.extent(name)?;
        let &[n, k] = e.dims.as_slice() else {
            return Err(Error::bad_file(&self.path, format!("tensor {name} has shape {:?}, expected a matrix", e.dims)));
        };
        let map: SharedBytes = self.map.clone();
        QuantRows::shared(kind, n, k, map, e.offset, e.len).map_err(|err| Error::bad_file(&self.path, format!("tensor {name}: {err}")))
    }

    /// Done reading `name` for now: drop its pages from this process's resident memory. They
    /// stay in the kernel's page cache, and a later read faults them back in from it. Why:
    /// packing reads every weight once through the map, and without this the whole file would
    /// count in the process's memory beside the packed copy (an 8B model's 4.5 GB twice).
    pub fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Some(e) = self.extent(name).ok().filter(|e| e.offset.checked_add(e.len).is_some_and(|end| end <= self.map.len())) {
            // SAFETY: the map is a read-only file mapping that nothing writes, so pages dropped
            // here read back with the same bytes; anything borrowing them sees no change.
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, e.offset, e.len) };
        }
        #[cfg(not(unix))]
        let _ = name;
    }

    /// A matrix's rows, read in place when asked for.
    pub fn rows(&self, name: &str) -> Result<RawRows> {
        let e = self.extent(name)?;
        let &[n, k] = e.dims.as_slice() else {
            return Err(Error::bad_file(&self.path, format!("tensor {name} has shape {:?}, expected a matrix", e.dims)));
        };
        if k % e.dtype.block_size() != 0 {
            return Err(Error::bad_file(&self.path, format!("tensor {name}: rows of {k} values are not whole {:?} blocks", e.dtype)));
        }
        Ok(RawRows { map: self.map.clone(), dtype: e.dtype, n, k, start: e.offset, row_bytes: k / e.dtype.block_size() * e.dtype.type_size() })
    }
}

/// The rows of one GGUF matrix, in the file's own type, read in place from the memory map.
#[derive(Clone)]
pub struct RawRows {
    map: Arc<memmap2::Mmap>,
    dtype: GgmlDType,
    n: usize,
    k: usize,
    start: usize,
    row_bytes: usize,
}

impl RawRows {
    pub fn rows(&self) -> usize {
        self.n
    }
    pub fn cols(&self) -> usize {
        self.k
    }
    /// Rows `ids` as f32 `[ids.len(), cols]` on `device`: the same values, bit for bit, as the
    /// same rows of the whole tensor dequantised (dequantisation works block by block).
    pub fn gather(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        if ids.is_empty() {
            return Ok(Tensor::zeros((0, self.k), candle_core::DType::F32, device)?);
        }
        let mut buf = AlignedBytes::zeroed(ids.len() * self.row_bytes);
        for (dst, &id) in buf.as_mut_slice().chunks_exact_mut(self.row_bytes).zip(ids) {
            if id as usize >= self.n {
                return Err(Error::InvalidArgument(format!("row {id} of a {}-row tensor", self.n)));
            }
            let at = self.start + id as usize * self.row_bytes;
            dst.copy_from_slice(&self.map[at..at + self.row_bytes]);
        }
        Ok(dequantize(self.dtype, buf.as_slice(), vec![ids.len(), self.k])?.to_device(device)?)
    }
}

fn dequantize(dtype: GgmlDType, bytes: &[u8], dims: Vec<usize>) -> candle_core::Result<Tensor> {
    let elems: usize = dims.iter().product();
    // candle reinterprets the bytes as blocks without checking their length: check it here.
    if !elems.is_multiple_of(dtype.block_size()) || bytes.len() != elems / dtype.block_size() * dtype.type_size() {
        candle_core::bail!("{} bytes do not hold {dims:?} values of {dtype:?}", bytes.len())
    }
    ggml_file::qtensor_from_ggml(dtype, bytes, dims, &Device::Cpu)?.dequantize(&Device::Cpu)
}

/// Bytes in an 8-byte-aligned buffer: candle reads GGUF blocks (f16 and f32 fields inside) in
/// place from the slice it is given, which must therefore be aligned for them.
pub struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    pub fn zeroed(len: usize) -> Self {
        AlignedBytes { words: vec![0u64; len.div_ceil(8)], len }
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: u64 storage viewed as bytes (any bit pattern is a valid u8), within its length.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;

    #[test]
    fn rows_in_place_equal_the_whole_tensor_dequantised() {
        let dir = std::env::temp_dir().join(format!("selfspec-gguf-rows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.gguf");
        let w = Tensor::randn(0f32, 1.0, (12, 64), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::F16, GgmlDType::F32] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let mut f = std::fs::File::create(&path).unwrap();
            gguf_file::write(&mut f, &[], &[("w", &q)]).unwrap();
            drop(f);
            let g = GgufFile::open(&path).unwrap();
            let whole = g.dequantize("w").unwrap();
            assert_eq!(whole.to_vec2::<f32>().unwrap(), q.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap());
            let rows = g.rows("w").unwrap();
            assert_eq!((rows.rows(), rows.cols()), (12, 64));
            let got = rows.gather(&[7, 0, 7, 11], &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
            let all = whole.to_vec2::<f32>().unwrap();
            assert_eq!(got, vec![all[7].clone(), all[0].clone(), all[7].clone(), all[11].clone()]);
            assert!(rows.gather(&[12], &Device::Cpu).is_err());
            assert!(g.extent("nope").is_err());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
