//! Half-precision weights in the f32 kernel's panel layout, and their batch-invariant kernel.
use super::*;

/// Half-precision weights in the f32 kernel's panel layout (`[k][16]` per panel).
pub struct PackedF16 {
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) data: Vec<f16>,
}

impl PackedF16 {
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k);
        let panels = n.div_ceil(PANEL);
        let mut data = vec![f16::ZERO; panels * k * PANEL];
        data.par_chunks_mut(k * PANEL).enumerate().for_each(|(p, panel)| {
            for c in 0..PANEL {
                let j = p * PANEL + c;
                if j < n {
                    for kk in 0..k {
                        panel[kk * PANEL + c] = f16::from_f32(w[j * k + kk]);
                    }
                }
            }
        });
        PackedF16 { k, n, data }
    }
}



pub(super) fn matmul_f16(x: &[f32], m: usize, w: &PackedF16) -> Vec<f32> {
    assert_eq!(x.len(), m * w.k, "x has {} values, expected {m}x{}", x.len(), w.k);
    let isa = isa();
    // SAFETY: the panel ranges cover every column, and each panel writes all rows.
    unsafe {
        written_by(m * w.n, |ptr| {
            for_each_panel_range(w.n.div_ceil(PANEL), 4, |p0, p1| match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => crate::cpu::matmul::avx512_packed::block_of(x, m, w.k, w.n, w.data.as_ptr(), p0, p1, ptr),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => crate::cpu::matmul::avx2_packed::block_of(x, m, w.k, w.n, w.data.as_ptr(), p0, p1, ptr),
                Isa::Portable => f16_block(x, m, w, p0, p1, ptr),
            })
        })
    }
}

/// Portable f16 kernel: the same single FMA chain per output as the AVX-512 one.
pub(super) fn f16_block(x: &[f32], m: usize, w: &PackedF16, p0: usize, p1: usize, out: OutPtr) {
    let (k, n) = (w.k, w.n);
    for p in p0..p1 {
        let panel = &w.data[p * k * PANEL..(p + 1) * k * PANEL];
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            let mut acc = [0f32; PANEL];
            for kk in 0..k {
                for c in 0..PANEL {
                    acc[c] = xr[kk].mul_add(panel[kk * PANEL + c].to_f32(), acc[c]);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                let j = p * PANEL + c;
                if j < n {
                    unsafe { *out.0.add(i * n + j) = *a };
                }
            }
        }
    }
}
