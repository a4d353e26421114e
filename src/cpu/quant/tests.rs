use super::*;

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() as f32;
        }
    }
    out
}

#[test]
fn stacked_weights_give_each_part_its_own_bits() {
    // q/k/v stacked into one kernel: every output column is the same bits as its part alone.
    let (k, m) = (64, 3);
    let x = rand_vec(m * k, 9);
    let sizes = [32usize, 16, 16];
    let ws: Vec<Vec<f32>> = sizes.iter().enumerate().map(|(i, &n)| rand_vec(n * k, 10 + i as u64)).collect();
    for blocks in [false, true] {
        let stage = |w: &[f32], n: usize| if blocks { Staged::Blocks(q4_1_rows(w, n, k)) } else { Staged::Values { data: w.to_vec(), n, k, format: WeightFormat::Q8_0 } };
        let parts: Vec<Staged> = ws.iter().zip(sizes).map(|(w, n)| stage(w, n)).collect();
        assert!(Staged::can_stack(&parts));
        let joined = Staged::stack(parts).unwrap().pack().unwrap().matmul(&x, m);
        let total: usize = sizes.iter().sum();
        let mut col = 0;
        for (w, n) in ws.iter().zip(sizes) {
            let alone = stage(w, n).pack().unwrap().matmul(&x, m);
            for r in 0..m {
                assert_eq!(&joined[r * total + col..r * total + col + n], &alone[r * n..(r + 1) * n]);
            }
            col += n;
        }
    }
    // Different kinds or formats stay apart.
    let a = Staged::Blocks(q4_1_rows(&ws[1], 16, k));
    let b = Staged::Values { data: ws[2].clone(), n: 16, k, format: WeightFormat::Q8_0 };
    assert!(!Staged::can_stack(&[a, b]));
    assert!(pack_values(&ws[1], 16, k + 1, WeightFormat::F32).is_err());
    assert_eq!(QuantKind::from_ggml(candle_core::quantized::GgmlDType::Q4K), Some(QuantKind::Q4K));
    assert_eq!(QuantKind::from_ggml(candle_core::quantized::GgmlDType::Q6K), Some(QuantKind::Q6K));
    assert_eq!(QuantKind::from_ggml(candle_core::quantized::GgmlDType::Q5_1), None);
}

fn q4_1_rows(w: &[f32], n: usize, k: usize) -> QuantRows {
    QuantRows::quantize_q4_1(w, n, k).unwrap()
}

/// llama.cpp's scale for the zero-code formats: the value of largest magnitude maps to code 0,
/// `d = max / -zero`; returns `d` and `1 / d` (0 for an all-zero block).
fn llama_scale(block: &[f32], zero: f32) -> (f32, f32) {
    let max = block.iter().cloned().fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
    let d = max / -zero;
    (d, if d != 0.0 { 1.0 / d } else { 0.0 })
}

fn q4_0_rows(w: &[f32], n: usize, k: usize) -> QuantRows {
    let mut bytes = Vec::new();
    for block in w.chunks_exact(QK) {
        let (d, id) = llama_scale(block, 8.0);
        bytes.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        let q: Vec<u8> = block.iter().map(|&v| ((v * id + 8.5) as i32).clamp(0, 15) as u8).collect();
        for i in 0..16 {
            bytes.push(q[i] | (q[i + 16] << 4));
        }
    }
    QuantRows::new(QuantKind::Q4_0, n, k, bytes).unwrap()
}

/// Q5_0 blocks by llama.cpp's rule (the value of largest magnitude maps to code 0, d = max
/// / -16), so every code 0..=31 and both fifth bits occur.
fn q5_0_rows(w: &[f32], n: usize, k: usize) -> QuantRows {
    let mut bytes = Vec::new();
    for block in w.chunks_exact(QK) {
        let (d, id) = llama_scale(block, 16.0);
        let q: Vec<u32> = block.iter().map(|&v| ((v * id + 16.5) as i32).clamp(0, 31) as u32).collect();
        let qh = q.iter().enumerate().fold(0u32, |h, (i, &c)| h | ((c >> 4) << i));
        bytes.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        bytes.extend_from_slice(&qh.to_le_bytes());
        for i in 0..16 {
            bytes.push(((q[i] & 15) | ((q[i + 16] & 15) << 4)) as u8);
        }
    }
    QuantRows::new(QuantKind::Q5_0, n, k, bytes).unwrap()
}

/// Q5_0 dequantises to d * (q - 16) with the fifth bit from `qh`, and its codes span 0..=31.
#[test]
fn q5_0_blocks_read_their_fifth_bits() {
    let (n, k) = (3, 64);
    let w = rand_vec(n * k, 31);
    let q = q5_0_rows(&w, n, k);
    let deq = q.dequantize();
    let mut codes = std::collections::BTreeSet::new();
    for j in 0..n {
        for b in 0..k / QK {
            let (d, _, c) = q.block_of(q.row(j), b);
            codes.extend(c);
            for (t, &code) in c.iter().enumerate() {
                assert_eq!(deq[j * k + b * QK + t], d.to_f32() * (code as f32 - 16.0));
                let want = w[j * k + b * QK + t];
                assert!((deq[j * k + b * QK + t] - want).abs() <= d.to_f32().abs() * 0.51 + 1e-3, "[{j}, {}]", b * QK + t);
            }
        }
    }
    assert!(codes.contains(&0) && codes.contains(&31) && codes.len() > 28, "{codes:?}");
    assert_eq!(QuantKind::from_ggml(candle_core::quantized::GgmlDType::Q5_0), Some(QuantKind::Q5_0));
}

/// Q5_0 and Q6_K rows decode as candle's own dequantisation of the same bytes: Q5_0 exactly,
/// Q6_K within the f16 rounding of each sub-block's d·sc.
#[test]
fn q5_0_and_q6_k_decode_as_candle_does() {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let (n, k) = (6, 512);
    let w = Tensor::from_vec(rand_vec(n * k, 41), (n, k), &Device::Cpu).unwrap();
    for (dtype, kind) in [(GgmlDType::Q5_0, QuantKind::Q5_0), (GgmlDType::Q6K, QuantKind::Q6K)] {
        let q = QTensor::quantize(&w, dtype).unwrap();
        let rows = QuantRows::new(kind, n, k, q.data().unwrap().to_vec()).unwrap();
        let want: Vec<f32> = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let got = rows.dequantize();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let tol = if kind == QuantKind::Q5_0 { 0.0 } else { b.abs() * 1e-3 + 1e-6 };
            assert!((a - b).abs() <= tol, "{kind:?} [{i}]: {a} vs {b}");
        }
    }
}

/// Q6_K rows as candle quantizes them (`k` a multiple of 256, one super-block each).
fn q6_k_rows(w: &[f32], n: usize, k: usize) -> QuantRows {
    use candle_core::quantized::{GgmlDType, QTensor};
    let t = candle_core::Tensor::from_vec(w.to_vec(), (n, k), &candle_core::Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::Q6K).unwrap();
    QuantRows::new(QuantKind::Q6K, n, k, q.data().unwrap().to_vec()).unwrap()
}

/// Q6_K through every kernel: close to f32 arithmetic on its dequantised weights, the same
/// bits for any row count, and the same bits on the portable, AVX2 and AVX-512 paths,
/// including codes of 63 against activations of 127 (the AVX2 16-bit sums' worst case).
#[test]
fn q6_k_kernels_agree_and_are_batch_invariant() {
    let (n, k) = (40, 512);
    let w = rand_vec(n * k, 43);
    // Row 0: every code 63 with scale 1 (ql and qh all ones, scales 1, d 1).
    let mut bytes = q6_k_rows(&w, n, k).row_range(0, n);
    for sb in 0..k / 256 {
        let blk = &mut bytes[sb * 210..(sb + 1) * 210];
        blk[..192].fill(0xff);
        blk[192..208].fill(1);
        blk[208..210].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    }
    let q = QuantRows::new(QuantKind::Q6K, n, k, bytes).unwrap();
    let wd = q.dequantize();
    assert!(wd[..k].iter().all(|&v| v == 31.0));
    let cw = CpuWeight::Quant(PackedQuant::pack(&q));
    let CpuWeight::Quant(pq) = &cw else { unreachable!() };
    let mut x = rand_vec(13 * k, 44);
    x[..k].fill(1.0);
    let all = cw.matmul(&x, 13);
    let want = reference(&x, 13, k, &wd, n);
    for i in 0..13 {
        for j in 0..n {
            let mag: f32 = (0..k).map(|t| (x[i * k + t] * wd[j * k + t]).abs()).sum();
            assert!((all[i * n + j] - want[i * n + j]).abs() <= 0.02 * mag + 1e-6, "[{i},{j}] {} vs {}", all[i * n + j], want[i * n + j]);
        }
    }
    for m in [1usize, 2, 3, 4, 5, 8, 9, 12] {
        assert_eq!(cw.matmul(&x[..m * k], m), all[..m * n].to_vec(), "rows differ between m={m} and m=13");
        let mut acts = quantize_acts(&x[..m * k], m, k);
        acts.add_half_sums(m * k / QK);
        let mut port = vec![0f32; m * n];
        quant_block(&acts, m, pq, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
        assert_eq!(port, all[..m * n].to_vec(), "portable at m={m}");
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::isa::has_avx2() {
            let mut got = vec![f32::NAN; m * n];
            unsafe { avx2_quant::block(&acts, m, pq, 0, n.div_ceil(PANEL), OutPtr(got.as_mut_ptr())) };
            assert_eq!(got, port, "AVX2 at m={m}");
        }
    }
}

/// Each format against f32 arithmetic on its own dequantised weights, within the error of
/// quantizing the activations (8-bit per 32-value block: well under 2% of sum |x w|).
#[test]
fn formats_match_reference_and_are_batch_invariant() {
    let (n, k) = (75, 96);
    let w = rand_vec(n * k, 1);
    let x = rand_vec(37 * k, 2);
    let cases: Vec<(&str, CpuWeight, Vec<f32>, f32)> = vec![
        ("f32", CpuWeight::F32(PackedWeight::pack(&w, n, k)), w.clone(), 1e-5),
        ("f16", CpuWeight::F16(PackedF16::pack(&w, n, k)), w.iter().map(|&v| f16::from_f32(v).to_f32()).collect(), 1e-5),
        {
            let q = QuantRows::quantize_q8_0(&w, n, k).unwrap();
            ("q8_0", CpuWeight::Quant(PackedQuant::pack(&q)), q.dequantize(), 0.02)
        },
        {
            let q = q4_1_rows(&w, n, k);
            ("q4_1", CpuWeight::Quant(PackedQuant::pack(&q)), q.dequantize(), 0.02)
        },
        {
            let q = q4_0_rows(&w, n, k);
            ("q4_0", CpuWeight::Quant(PackedQuant::pack(&q)), q.dequantize(), 0.02)
        },
        {
            let q = q5_0_rows(&w, n, k);
            ("q5_0", CpuWeight::Quant(PackedQuant::pack(&q)), q.dequantize(), 0.02)
        },
    ];
    for (name, cw, wd, tol) in cases {
        // The weight itself is close to the original (sanity check of the packing).
        let werr = w.iter().zip(&wd).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(werr < 0.13, "{name}: dequantised weight off by {werr}");
        let all = cw.matmul(&x, 37);
        let want = reference(&x, 37, k, &wd, n);
        for i in 0..37 {
            for j in 0..n {
                let mag: f32 = (0..k).map(|t| (x[i * k + t] * wd[j * k + t]).abs()).sum();
                let err = (all[i * n + j] - want[i * n + j]).abs();
                assert!(err <= tol * mag + 1e-6, "{name}: [{i},{j}] {} vs {} (|x||w| {mag})", all[i * n + j], want[i * n + j]);
            }
        }
        for m in [1usize, 2, 3, 5, 7, 8, 10, 12, 13, 16] {
            let part = cw.matmul(&x[..m * k], m);
            assert_eq!(part, all[..m * n].to_vec(), "{name}: rows differ between m={m} and m=37");
        }
        let one = cw.matmul(&x[20 * k..21 * k], 1);
        assert_eq!(one, all[20 * n..21 * n].to_vec(), "{name}: row 20 alone differs");
    }
}

/// The portable kernels give the same bits as the SIMD ones, so results do not depend on
/// the machine's instruction set.
#[test]
fn portable_kernels_match_simd_bits() {
    let (n, k) = (40, 64);
    let w = rand_vec(n * k, 3);
    let x = rand_vec(6 * k, 4);
    let f = PackedF16::pack(&w, n, k);
    let mut port = vec![0f32; 6 * n];
    f16_block(&x, 6, &f, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
    assert_eq!(port, matmul_f16(&x, 6, &f));
    // Every row count the SIMD kernel tiles differently (one tile of 1-8 rows, then 8 + more).
    let x = rand_vec(17 * 256, 4);
    let q6 = q6_k_rows(&rand_vec(n * 256, 5), n, 256);
    for q in [QuantRows::quantize_q8_0(&w, n, k).unwrap(), q4_1_rows(&w, n, k), q4_0_rows(&w, n, k), q5_0_rows(&w, n, k), q6] {
        let pq = PackedQuant::pack(&q);
        for m in 1..=17 {
            let x = &x[..m * pq.k];
            let mut port = vec![0f32; m * n];
            let mut acts = quantize_acts(x, m, pq.k);
            if pq.high == 2 {
                acts.add_half_sums(m * (pq.k / QK));
            }
            quant_block(&acts, m, &pq, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
            assert_eq!(port, matmul_quant(x, m, &pq), "{:?} m={m}", q.kind);
        }
    }
}

/// The AVX2 kernels (f16 tiles, integer blocks) give the portable kernels' bits for every
/// row count, wherever AVX2 runs: Q8_0 with every code including 0 (-128 after centring,
/// the one whose size needs the unsigned byte), Q4_1, Q4_0 and Q5_0 (activations of
/// full scale against codes up to 31: the 16-bit sums' worst case).
#[test]
fn avx2_kernels_match_portable_bits() {
    if !crate::cpu::isa::has_avx2() {
        return;
    }
    let (n, k) = (40, 96);
    let w = rand_vec(n * k, 23);
    let f = PackedF16::pack(&w, n, k);
    // Codes -128 and 127 in the first block of row 0 (GGUF's Q8_0: f16 scale, 32 i8).
    let mut bytes = QuantRows::quantize_q8_0(&w, n, k).unwrap().row_range(0, n);
    bytes[2] = 0x80;
    bytes[3] = 0x7f;
    let q8 = QuantRows::new(QuantKind::Q8_0, n, k, bytes).unwrap();
    for m in [1usize, 2, 3, 4, 5, 7, 8, 13, 16] {
        let x: Vec<f32> = rand_vec(m * k, 24 + m as u64).iter().map(|v| v * 3.0).collect();
        let panels = n.div_ceil(PANEL);
        let mut port = vec![0f32; m * n];
        f16_block(&x, m, &f, 0, panels, OutPtr(port.as_mut_ptr()));
        let mut got = vec![f32::NAN; m * n];
        #[cfg(target_arch = "x86_64")]
        unsafe { crate::cpu::matmul::avx2_packed::block_of(&x, m, k, n, f.data.as_ptr(), 0, panels, OutPtr(got.as_mut_ptr())) };
        assert_eq!(got, port, "f16 at m={m}");
        let acts = quantize_acts(&x, m, k);
        for q in [&q8, &q4_1_rows(&w, n, k), &q4_0_rows(&w, n, k), &q5_0_rows(&w, n, k)] {
            let pq = PackedQuant::pack(q);
            let mut port = vec![0f32; m * n];
            quant_block(&acts, m, &pq, 0, panels, OutPtr(port.as_mut_ptr()));
            let mut got = vec![f32::NAN; m * n];
            #[cfg(target_arch = "x86_64")]
            unsafe { avx2_quant::block(&acts, m, &pq, 0, panels, OutPtr(got.as_mut_ptr())) };
            assert_eq!(got, port, "{:?} at m={m}", q.kind);
        }
    }
    // Q5_0's worst case for 16-bit sums: code 31 everywhere but one, activations all 127.
    let ws: Vec<f32> = (0..n * k).map(|i| if i % QK == 0 { -1.0 } else { 0.9375 }).collect();
    let q5 = q5_0_rows(&ws, n, k);
    let x = vec![1.0f32; 3 * k];
    let acts = quantize_acts(&x, 3, k);
    let pq = PackedQuant::pack(&q5);
    let mut port = vec![0f32; 3 * n];
    quant_block(&acts, 3, &pq, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
    let mut got = vec![f32::NAN; 3 * n];
    #[cfg(target_arch = "x86_64")]
    unsafe { avx2_quant::block(&acts, 3, &pq, 0, n.div_ceil(PANEL), OutPtr(got.as_mut_ptr())) };
    assert_eq!(got, port, "Q5_0 at full scale");
    let want = q5.dequantize()[..k].iter().sum::<f32>();
    assert!((port[0] - want).abs() < 1e-3 * want.abs(), "{} vs {want}", port[0]);
}

/// The SIMD activation quantizers give the scalar one's codes, scales, sums and `d * sum`,
/// including all-zero blocks, exact ties (x / d = n + 0.5) and large values, in the AVX-512
/// path's groups of sixteen blocks and in its zero-padded last group.
#[test]
fn activation_quantizers_agree() {
    let nb = 37;
    let k = nb * QK;
    let mut x = rand_vec(k, 9);
    for b in [1, 20, 36] {
        x[b * QK..(b + 1) * QK].fill(0.0);
    }
    for b in [2, 33] {
        for (i, v) in x[b * QK..(b + 1) * QK].iter_mut().enumerate() {
            *v = (i as f32 - 15.5) * 2.0; // amax 31 -> d = 31/127; many near-ties
        }
    }
    x[3 * QK] = 1e6;
    x[4 * QK + 7] = -3.0e-7;
    x[17 * QK + 31] = -2.5e5;
    // A block so small that 1 / scale overflows (codes 0 on every path), and one just above.
    x[22 * QK..23 * QK].fill(1e-38);
    x[22 * QK + 5] = -2e-38;
    x[23 * QK..24 * QK].fill(3e-36);
    let (mut q1, mut d1, mut s1, mut ds1) = (vec![0i8; k], vec![0f32; nb], vec![0i32; nb], vec![0f32; nb]);
    quantize_row(&x, &mut q1, &mut d1, &mut s1);
    set_dsum(&d1, &s1, &mut ds1);
    assert_eq!((d1[1], d1[36]), (0.0, 0.0));
    assert!(q1[22 * QK..23 * QK].iter().all(|&c| c == 0) && s1[22] == 0, "overflowing inverse: codes 0");
    assert!(q1[23 * QK..24 * QK].iter().all(|&c| c == 127), "tiny but invertible: full codes");
    assert_eq!(s1[0], q1[..QK].iter().map(|&c| c as i32).sum::<i32>());
    assert!(q1.iter().all(|&c| (-127..=127).contains(&c)));
    #[cfg(target_arch = "x86_64")]
    if vnni() {
        for n in [nb, 16, 5] {
            let (mut q2, mut d2, mut s2, mut ds2) = (vec![0i8; n * QK], vec![0f32; n], vec![0i32; n], vec![0f32; n]);
            unsafe { quantize_blocks_avx512(&x[..n * QK], &mut q2, &mut d2, &mut s2, &mut ds2) };
            assert_eq!((&q1[..n * QK], &d1[..n], &s1[..n], &ds1[..n]), (&q2[..], &d2[..], &s2[..], &ds2[..]), "{n} blocks");
        }
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::isa::has_avx2() {
        let (mut q3, mut d3, mut s3) = (vec![0i8; k], vec![0f32; nb], vec![0i32; nb]);
        unsafe { quantize_row_avx2(&x, &mut q3, &mut d3, &mut s3) };
        assert_eq!((q1.clone(), d1.clone(), s1.clone()), (q3, d3, s3));
    }
    // One row, a few rows (one pass over all their blocks) and many rows (split over the
    // thread team) give each row its own result.
    let one = quantize_acts(&x, 1, k);
    assert_eq!((&one.q[..k], &one.d[..nb], &one.dsum[..nb]), (&q1[..], &d1[..], &ds1[..]));
    let many_rows = crate::cpu::team::PAR_MIN_VALUES.div_ceil(k);
    for rows in [5, many_rows] {
        let many: Vec<f32> = (0..rows).flat_map(|_| x.clone()).collect();
        let a = quantize_acts(&many, rows, k);
        for r in 0..rows {
            assert_eq!(&a.q[r * k..(r + 1) * k], &q1[..], "{rows} rows: row {r} codes");
            assert_eq!(&a.d[r * nb..(r + 1) * nb], &d1[..], "{rows} rows: row {r} scales");
            assert_eq!(&a.dsum[r * nb..(r + 1) * nb], &ds1[..], "{rows} rows: row {r} d * sum");
        }
    }
}

/// A Q4_1 block re-quantized from its own dequantized values is the same block: what makes
/// a draft layer stored in 4-bit blocks draft exactly as its f32 weights do.
#[test]
fn q4_1_blocks_survive_requantization() {
    for seed in 0..4 {
        let mut w = rand_vec(64 * 96, 40 + seed);
        // Weights of a trained layer's scale, and a block with an offset far from zero.
        w.iter_mut().for_each(|x| *x *= 0.05);
        w[..32].iter_mut().for_each(|x| *x += 0.3);
        let q = QuantRows::quantize_q4_1(&w, 64, 96).unwrap();
        let again = QuantRows::quantize_q4_1(&q.dequantize(), 64, 96).unwrap();
        assert_eq!(again.row_range(0, 64), q.row_range(0, 64), "seed {seed}");
    }
}

#[test]
fn quant_rows_reject_bad_shapes_and_permute() {
    assert!(QuantRows::new(QuantKind::Q8_0, 2, 33, vec![0; 68]).is_err());
    assert!(QuantRows::new(QuantKind::Q4_1, 2, 32, vec![0; 39]).is_err());
    assert!(QuantRows::quantize_q8_0(&[0.0; 40], 1, 40).is_err());
    let w = rand_vec(3 * 32, 5);
    let q = QuantRows::quantize_q8_0(&w, 3, 32).unwrap();
    let p = q.permute_rows(&[2, 0, 1]).unwrap().dequantize();
    let d = q.dequantize();
    assert_eq!(&p[..32], &d[64..]);
    assert_eq!(&p[32..64], &d[..32]);
    assert!(q.permute_rows(&[0, 1]).is_err() && q.permute_rows(&[0, 1, 3]).is_err());
    let both = QuantRows::concat_rows(&[&q, &q.permute_rows(&[2, 0, 1]).unwrap()]).unwrap();
    assert_eq!(both.n, 6);
    assert_eq!(both.dequantize(), [d.clone(), p.clone()].concat());
    // Views compose without copies: a permutation of a stack reads the right rows, and the
    // packed weight of a view is the packed weight of the same rows copied out.
    let mixed = both.permute_rows(&[5, 0, 3, 1, 4, 2]).unwrap();
    let rows: Vec<Vec<f32>> = both.dequantize().chunks(32).map(|c| c.to_vec()).collect();
    assert_eq!(mixed.dequantize(), [5, 0, 3, 1, 4, 2].iter().flat_map(|&i| rows[i].clone()).collect::<Vec<_>>());
    let copied = QuantRows::new(QuantKind::Q8_0, 6, 32, mixed.row_range(0, 6)).unwrap();
    let x = rand_vec(2 * 32, 6);
    assert_eq!(PackedQuant::pack(&mixed).data, PackedQuant::pack(&copied).data);
    assert_eq!(CpuWeight::Quant(PackedQuant::pack(&mixed)).matmul(&x, 2), CpuWeight::Quant(PackedQuant::pack(&copied)).matmul(&x, 2));
    // A shared buffer too short for the rows it claims is refused.
    let buf: SharedBytes = Arc::new(vec![0u8; 100]);
    assert!(QuantRows::shared(QuantKind::Q8_0, 3, 32, buf.clone(), 0, 102).is_err());
    assert!(QuantRows::shared(QuantKind::Q8_0, 2, 32, buf.clone(), 40, 68).is_err());
    assert!(QuantRows::shared(QuantKind::Q8_0, 2, 32, buf, 32, 68).is_ok());
    assert!(QuantRows::concat_rows(&[&q, &QuantRows::quantize_q4_1(&w, 3, 32).unwrap()]).is_err());
    assert_eq!("Q8_0".parse::<WeightFormat>().unwrap(), WeightFormat::Q8_0);
    assert!("q5".parse::<WeightFormat>().is_err());
}

/// Q4_K's and Q6_K's own packing paths (whole super-blocks at a time) write every column's
/// codes (with Q6_K's fifth and sixth bits in their planes) and its two f16 values exactly as
/// `block_of` decodes them, in the panel layout the kernels read; a partial last panel included.
#[test]
fn k_quant_panels_hold_what_block_of_decodes() {
    use candle_core::quantized::{GgmlDType, QTensor};
    let (n, k) = (40, 512);
    let t = candle_core::Tensor::from_vec(rand_vec(n * k, 47), (n, k), &candle_core::Device::Cpu).unwrap();
    for (dtype, kind, high) in [(GgmlDType::Q4K, QuantKind::Q4K, 0u8), (GgmlDType::Q6K, QuantKind::Q6K, 2)] {
        let q = QTensor::quantize(&t, dtype).unwrap();
        let mut bytes = q.data().unwrap().to_vec();
        let row_bytes = k / 256 * kind.block_bytes();
        if kind == QuantKind::Q4K {
            // Row 1's scales and mins at their largest 6-bit values (sub-blocks 4-7 keep two
            // of their bits in the upper bits of the first eight bytes).
            bytes[row_bytes + 4..row_bytes + 16].fill(0xff);
        } else {
            // Row 1's codes as arbitrary bytes: every nibble and bit pair, not only the ones a
            // quantizer picks.
            for (i, b) in bytes[row_bytes..row_bytes + 192].iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(151).wrapping_add(7);
            }
        }
        let rows = QuantRows::new(kind, n, k, bytes).unwrap();
        let p = PackedQuant::pack(&rows);
        let nb = k / QK;
        let (stride, codes) = (PackedQuant::stride(true, high, kind == QuantKind::Q4K), PackedQuant::codes_bytes(true, high));
        let half = |at: &[u8]| f16::from_le_bytes([at[0], at[1]]);
        for j in 0..n {
            let (panel, c) = (j / PANEL, j % PANEL);
            for b in 0..nb {
                let (d, m, want) = rows.block_of(rows.row(j), b);
                let blk = &p.data[(panel * nb + b) * stride..][..stride];
                let mut got = [0u8; QK];
                for g in 0..4 {
                    for i in 0..4 {
                        let byte = blk[g * 64 + c * 4 + i];
                        let bit = 4 * c + i;
                        let plane_bit = |at: usize| (blk[256 + 32 * g + at + bit / 8] >> (bit % 8)) & 1;
                        got[4 * g + i] = byte & 0x0f;
                        got[16 + 4 * g + i] = byte >> 4;
                        if high == 2 {
                            got[4 * g + i] += 16 * plane_bit(0) + 32 * plane_bit(8);
                            got[16 + 4 * g + i] += 16 * plane_bit(16) + 32 * plane_bit(24);
                        }
                    }
                }
                assert_eq!(got, want, "{kind:?} column {j}, block {b}: codes");
                assert_eq!(half(&blk[codes + 2 * c..]).to_bits(), d.to_bits(), "{kind:?} column {j}, block {b}: scale");
                assert_eq!(half(&blk[codes + 32 + 2 * c..]).to_bits(), m.to_bits(), "{kind:?} column {j}, block {b}: offset or second scale");
            }
        }
    }
}
