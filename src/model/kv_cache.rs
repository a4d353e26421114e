//! A KV cache whose length moves only through `append`, `compact` and `truncate`.
//!
//! A tree step writes K/V for every drafted node; after verification only the accepted path is
//! kept. `compact` moves those slots down next to the committed prefix, so the cache always holds
//! exactly the tokens of the emitted text, in order, as plain decoding would have.
use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

struct LayerKv {
    /// `[kv_heads, capacity, head_dim]`, head-major so that attention streams each K/V head's
    /// rows from one contiguous run (slot-major rows interleave the heads, and a head's reader
    /// pulls in its neighbours' cache lines too); slots `>= len` are scratch.
    k: Tensor,
    v: Tensor,
}

pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
    /// Slots written by the layers of the forward in flight, not yet committed by `append`.
    pending: usize,
    capacity: usize,
    max_len: usize,
    kv_heads: usize,
    head_dim: usize,
    device: Device,
    /// f16 halves the bytes attention streams (llama.cpp's default cache type); the tree and the
    /// one-token forward read the same rounded values, so exactness is unaffected.
    dtype: DType,
}

/// The element types a cache can hold: f16 or f32.
pub fn check_dtype(dtype: DType) -> Result<()> {
    if matches!(dtype, DType::F16 | DType::F32) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("a KV cache holds f16 or f32, not {dtype:?}")))
    }
}

impl KvCache {
    /// `max_len` is the model's context: the cache never grows past it. `dtype`: F16 or F32.
    pub fn new(num_layers: usize, kv_heads: usize, head_dim: usize, max_len: usize, dtype: DType, device: &Device) -> Result<Self> {
        check_dtype(dtype)?;
        let capacity = 256.min(max_len.max(1));
        let mut layers = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            layers.push(LayerKv {
                k: Tensor::zeros((kv_heads, capacity, head_dim), dtype, device)?,
                v: Tensor::zeros((kv_heads, capacity, head_dim), dtype, device)?,
            });
        }
        Ok(KvCache { layers, len: 0, pending: 0, capacity, max_len, kv_heads, head_dim, device: device.clone(), dtype })
    }

    /// Committed tokens.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    fn ensure_capacity(&mut self, needed: usize) -> Result<()> {
        if needed > self.max_len {
            return Err(Error::InvalidArgument(format!(
                "context overflow: {needed} tokens needed, the model's context is {}",
                self.max_len
            )));
        }
        if needed <= self.capacity {
            return Ok(());
        }
        let cap = (self.capacity * 2).max(needed).min(self.max_len);
        for l in self.layers.iter_mut() {
            for t in [&mut l.k, &mut l.v] {
                let grown = Tensor::zeros((self.kv_heads, cap, self.head_dim), self.dtype, &self.device)?;
                grown.slice_set(t, 1, 0)?;
                *t = grown;
            }
        }
        self.capacity = cap;
        Ok(())
    }

    /// Check that `t` new tokens fit, before a forward starts writing them.
    pub fn reserve(&mut self, t: usize) -> Result<()> {
        self.ensure_capacity(self.len + t)
    }

    /// Write layer `layer`'s K/V for the `t` new tokens (`[t, kv_heads, head_dim]`; on the CPU
    /// f32 views whose rows lie apart are fine) after the committed prefix and return the K/V of
    /// prefix plus new tokens, head-major (`[kv_heads, len + t, head_dim]`, a view into the
    /// cache, in the cache's dtype). The length moves only when the whole forward is done
    /// (`append`).
    pub fn write(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let t = k.dim(0)?;
        self.ensure_capacity(self.len + t)?;
        let l = &self.layers[layer];
        if self.device.is_cpu() && k.dtype() == DType::F32 && v.dtype() == DType::F32 {
            let op = crate::cpu::KvStore { at: self.len };
            l.k.inplace_op2(k, &op)?;
            l.v.inplace_op2(v, &op)?;
        } else {
            l.k.slice_set(&k.transpose(0, 1)?.to_dtype(self.dtype)?.contiguous()?, 1, self.len)?;
            l.v.slice_set(&v.transpose(0, 1)?.to_dtype(self.dtype)?.contiguous()?, 1, self.len)?;
        }
        self.pending = t;
        Ok((l.k.narrow(1, 0, self.len + t)?, l.v.narrow(1, 0, self.len + t)?))
    }

    /// Commit the `t` tokens the last forward wrote.
    pub fn append(&mut self, t: usize) -> Result<()> {
        if t != self.pending {
            return Err(Error::InvalidArgument(format!("append({t}) but the last forward wrote {} slots", self.pending)));
        }
        self.len += t;
        self.pending = 0;
        Ok(())
    }

    /// Keep only the slots in `keep` (absolute, strictly increasing, all `>= start`), moved down to
    /// `start, start+1, ...`; everything after is dropped. Used after a tree step with
    /// `start` = the committed length before the step and `keep` = the accepted path's slots.
    pub fn compact(&mut self, start: usize, keep: &[usize]) -> Result<()> {
        if start > self.len {
            return Err(Error::InvalidArgument(format!("compact start {start} beyond length {}", self.len)));
        }
        let mut prev = None;
        for &s in keep {
            if s < start || s >= self.len || prev.is_some_and(|p| s <= p) {
                return Err(Error::InvalidArgument(format!(
                    "compact: slots {keep:?} must increase and lie in {start}..{}",
                    self.len
                )));
            }
            prev = Some(s);
        }
        let contiguous_already = keep.iter().enumerate().all(|(i, &s)| s == start + i);
        if !contiguous_already && self.device.is_cpu() {
            let op = crate::cpu::KvCompact { start, keep: keep.to_vec() };
            for l in self.layers.iter() {
                l.k.inplace_op1(&op)?;
                l.v.inplace_op1(&op)?;
            }
        } else if !contiguous_already && !keep.is_empty() {
            let idx: Vec<u32> = keep.iter().map(|&s| s as u32).collect();
            let idx = Tensor::new(idx.as_slice(), &self.device)?;
            for l in self.layers.iter() {
                for t in [&l.k, &l.v] {
                    let rows = t.index_select(&idx, 1)?;
                    t.slice_set(&rows, 1, start)?;
                }
            }
        }
        self.len = start + keep.len();
        Ok(())
    }

    /// Drop everything after the first `n` tokens.
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
        self.pending = 0;
    }

    /// A new cache holding a copy of this one's first `n` committed tokens (a served prompt
    /// that starts as an earlier conversation did resumes from them instead of recomputing
    /// them). The copy's values are this cache's, bit for bit: a forward after them computes
    /// what it would after a fresh prefill of the same tokens, since every row's K/V depends
    /// only on the tokens up to it (batch-invariant kernels).
    pub fn prefix_copy(&self, n: usize) -> Result<KvCache> {
        self.prefix_copy_with_room(n, 0)
    }

    /// [`Self::prefix_copy`] with capacity for `room` more tokens (within the context), so the
    /// tokens that follow do not make it grow (and copy itself) at once.
    pub fn prefix_copy_with_room(&self, n: usize, room: usize) -> Result<KvCache> {
        if n > self.len {
            return Err(Error::InvalidArgument(format!("prefix_copy({n}) of a cache holding {} tokens", self.len)));
        }
        let capacity = 256.max(n.saturating_add(room)).min(self.max_len.max(1));
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let copy = |t: &Tensor| -> Result<Tensor> {
                let out = Tensor::zeros((self.kv_heads, capacity, self.head_dim), self.dtype, &self.device)?;
                if n > 0 {
                    out.slice_set(&t.narrow(1, 0, n)?.contiguous()?, 1, 0)?;
                }
                Ok(out)
            };
            layers.push(LayerKv { k: copy(&l.k)?, v: copy(&l.v)? });
        }
        Ok(KvCache { layers, len: n, pending: 0, capacity, max_len: self.max_len, kv_heads: self.kv_heads, head_dim: self.head_dim, device: self.device.clone(), dtype: self.dtype })
    }

    /// Bytes the cache holds allocated (its capacity, committed or not).
    pub fn bytes(&self) -> usize {
        2 * self.layers.len() * self.kv_heads * self.capacity * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Bytes one token takes in this cache (every layer's K and V).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers.len() * self.kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }

    /// The committed K/V of one layer (`[len, kv_heads, head_dim]`, f32), for tests and inspection.
    pub fn layer(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        let l = &self.layers[layer];
        let committed = |t: &Tensor| -> Result<Tensor> { Ok(t.narrow(1, 0, self.len)?.transpose(0, 1)?.to_dtype(DType::F32)?.contiguous()?) };
        Ok((committed(&l.k)?, committed(&l.v)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(c: &KvCache) -> Vec<f32> {
        c.layer(0).unwrap().0.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn append_compact_truncate_and_grow() {
        let dev = Device::Cpu;
        let mut c = KvCache::new(1, 1, 1, 1000, DType::F16, &dev).unwrap();
        let k = Tensor::arange(0f32, 300f32, &dev).unwrap().reshape((300, 1, 1)).unwrap();
        c.write(0, &k, &k).unwrap();
        c.append(300).unwrap();
        assert_eq!(c.len(), 300);
        assert!(c.append(1).is_err());
        c.truncate(5);
        assert_eq!(rows(&c), vec![0., 1., 2., 3., 4.]);
        let t = Tensor::new(&[10f32, 11., 12., 13.], &dev).unwrap().reshape((4, 1, 1)).unwrap();
        c.write(0, &t, &t).unwrap();
        c.append(4).unwrap();
        c.compact(5, &[5, 7, 8]).unwrap();
        assert_eq!(rows(&c), vec![0., 1., 2., 3., 4., 10., 12., 13.]);
        assert!(c.compact(5, &[7, 6]).is_err());
        assert!(c.compact(5, &[4]).is_err());
        let mut small = KvCache::new(1, 1, 1, 3, DType::F32, &dev).unwrap();
        assert!(small.reserve(4).is_err());
        assert!(KvCache::new(1, 1, 1, 3, DType::BF16, &dev).is_err());
    }

    #[test]
    fn a_prefix_copy_holds_the_same_values_and_grows_on_its_own() {
        let dev = Device::Cpu;
        for dtype in [DType::F16, DType::F32] {
            let mut c = KvCache::new(2, 2, 3, 1000, dtype, &dev).unwrap();
            let k = Tensor::arange(0f32, 1800f32, &dev).unwrap().reshape((300, 2, 3)).unwrap();
            let v = (&k + 0.5).unwrap();
            for layer in 0..2 {
                c.write(layer, &k, &v).unwrap();
            }
            c.append(300).unwrap();
            assert_eq!(c.prefix_copy_with_room(260, 500).unwrap().bytes(), 760 * c.bytes_per_token(), "room for 500 more");
            assert_eq!(c.prefix_copy_with_room(260, 5000).unwrap().bytes(), 1000 * c.bytes_per_token(), "within the context");
            let mut p = c.prefix_copy(260).unwrap();
            assert_eq!(p.len(), 260);
            assert_eq!(p.bytes_per_token(), 2 * 2 * 2 * 3 * dtype.size_in_bytes());
            assert!(p.bytes() >= 260 * p.bytes_per_token());
            for layer in 0..2 {
                let (pk, pv) = p.layer(layer).unwrap();
                let (ck, cv) = c.layer(layer).unwrap();
                assert_eq!(pk.to_vec3::<f32>().unwrap(), ck.narrow(0, 0, 260).unwrap().to_vec3::<f32>().unwrap());
                assert_eq!(pv.to_vec3::<f32>().unwrap(), cv.narrow(0, 0, 260).unwrap().to_vec3::<f32>().unwrap());
            }
            // Writing after the copy's end leaves the original alone.
            let t = Tensor::full(-1f32, (4, 2, 3), &dev).unwrap();
            for layer in 0..2 {
                p.write(layer, &t, &t).unwrap();
            }
            p.append(4).unwrap();
            assert_eq!(c.layer(0).unwrap().0.narrow(0, 260, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()[0], 1560.0);
            assert_eq!(p.layer(1).unwrap().0.narrow(0, 261, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()[0], -1.0);
            assert_eq!(c.prefix_copy(0).unwrap().len(), 0);
            assert!(c.prefix_copy(301).is_err());
        }
    }

    #[test]
    fn compact_moves_every_head_and_value() {
        // Two heads of three values, both cache types: the in-place move keeps each kept slot's
        // whole row in every head, and nothing else.
        let dev = Device::Cpu;
        for dtype in [DType::F16, DType::F32] {
            let mut c = KvCache::new(2, 2, 3, 64, dtype, &dev).unwrap();
            let k = Tensor::arange(0f32, 36f32, &dev).unwrap().reshape((6, 2, 3)).unwrap();
            let v = (&k + 100.0).unwrap();
            for layer in 0..2 {
                c.write(layer, &k, &v).unwrap();
            }
            c.append(6).unwrap();
            c.compact(2, &[3, 5]).unwrap();
            assert_eq!(c.len(), 4);
            let keep = Tensor::new(&[0u32, 1, 3, 5], &dev).unwrap();
            for layer in 0..2 {
                let (ck, cv) = c.layer(layer).unwrap();
                assert_eq!(ck.to_vec3::<f32>().unwrap(), k.index_select(&keep, 0).unwrap().to_vec3::<f32>().unwrap());
                assert_eq!(cv.to_vec3::<f32>().unwrap(), v.index_select(&keep, 0).unwrap().to_vec3::<f32>().unwrap());
            }
        }
        let t = Tensor::zeros((2, 8, 3), DType::F32, &dev).unwrap();
        assert!(t.inplace_op1(&crate::cpu::KvCompact { start: 2, keep: vec![4, 3] }).is_err());
        assert!(t.inplace_op1(&crate::cpu::KvCompact { start: 2, keep: vec![1] }).is_err());
        assert!(t.inplace_op1(&crate::cpu::KvCompact { start: 2, keep: vec![8] }).is_err());
    }
}
