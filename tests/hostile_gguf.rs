//! Hostile GGUF files: a valid tiny model, mutated many ways (seeded random byte edits in the
//! header, truncations, and the classic attacks: 2^60 counts and lengths, absurd dimensions,
//! offsets past the end, unknown types). Loading must never panic or abort, must never allocate
//! far beyond the file's own size, and must end in a clear error or a model that decodes.
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;
use common::scratch;

/// Counts live heap bytes and their peak, so the test can bound what a load allocates.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// What one load of `bytes` did: Ok(decoded tokens) or Err(message), and the heap it took
/// beyond what was live before.
fn load(path: &std::path::Path, bytes: &[u8]) -> (Result<usize, String>, usize) {
    std::fs::write(path, bytes).unwrap();
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = std::panic::catch_unwind(|| -> Result<usize, String> {
        // Both loading paths: f32 (dequantised copies) and native (blocks packed straight from
        // the memory map, embedding rows read in place).
        let mut n = 0;
        for f in [selfspec::cpu::quant::WeightFormat::F32, selfspec::cpu::quant::WeightFormat::Native] {
            let t = selfspec::model::loader::Target::load_with(path, &candle_core::Device::Cpu, f).map_err(|e| e.to_string())?;
            let params = selfspec::decode::sampling::SamplingParams::greedy();
            let stop = selfspec::decode::generate::StopRule { max_new_tokens: 3, eos_ids: &[] };
            let (out, _) = selfspec::decode::generate::generate_plain(&t.model, &[1, 2, 3], &params, &stop, &mut selfspec::decode::sampling::rng(0), &mut |_| Ok(selfspec::Flow::Continue))
                .map_err(|e| e.to_string())?;
            n = out.len();
        }
        Ok(n)
    });
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    match r {
        Ok(r) => (r, peak),
        Err(p) => panic!("loading a mutated GGUF panicked: {:?}", p.downcast_ref::<String>().map(|s| s.as_str()).or(p.downcast_ref::<&str>().copied())),
    }
}

/// The offset just past the header's fixed part: magic, version, tensor count, kv count.
const COUNTS: usize = 8;

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Where the first occurrence of `needle` starts.
fn find(b: &[u8], needle: &[u8]) -> usize {
    b.windows(needle.len()).position(|w| w == needle).expect("needle in the file")
}

#[test]
fn mutated_gguf_files_fail_cleanly() {
    // candle's errors capture a backtrace when asked to, and symbolising one takes tens of MB:
    // the bound below is about what the file makes the loader allocate, not about that.
    std::env::set_var("RUST_BACKTRACE", "0");
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    let dir = scratch("hostile-gguf");
    let cfg = selfspec::model::fixtures::tiny_config();
    let w = selfspec::model::fixtures::random_weights(&cfg, 5).unwrap();
    let good_path = dir.join("good.gguf");
    selfspec::model::fixtures::write_gguf_as(&good_path, &cfg, &w, candle_core::quantized::GgmlDType::Q8_0).unwrap();
    let good = std::fs::read(&good_path).unwrap();
    let path = dir.join("m.gguf");
    // A successful load holds the model several times over (f32 copies and packed weights);
    // a failing one must not go past the same bound whatever its header claims.
    let (ok, ok_peak) = load(&path, &good);
    assert_eq!(ok, Ok(3));
    let bound = 4 * ok_peak.max(good.len()) + (16 << 20);

    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    // The classic ones.
    for (name, at, v) in [("tensor count 2^60", COUNTS, 1u64 << 60), ("kv count 2^60", COUNTS + 8, 1u64 << 60), ("tensor count 0", COUNTS, 0), ("kv count 0", COUNTS + 8, 0)] {
        let mut b = good.clone();
        put_u64(&mut b, at, v);
        cases.push((name.into(), b));
    }
    // The first key's string length, and the vocabulary array's element count.
    let mut b = good.clone();
    put_u64(&mut b, COUNTS + 16, 1 << 60);
    cases.push(("key length 2^60".into(), b));
    let tokens_key = find(&good, b"tokenizer.ggml.tokens");
    let mut b = good.clone();
    put_u64(&mut b, tokens_key + b"tokenizer.ggml.tokens".len() + 8, 1 << 60);
    cases.push(("array length 2^60".into(), b));
    // A tensor's dimensions, type and offset: the first tensor info after its name.
    let emb = find(&good, b"token_embd.weight") + b"token_embd.weight".len();
    for (name, at, v) in [("n_dims 1000", emb, 1000u64), ("dim 2^62", emb + 4, 1 << 62), ("dim 0", emb + 4, 0), ("dims overflow", emb + 12, u64::MAX / 3)] {
        let mut b = good.clone();
        if name == "n_dims 1000" {
            b[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
        } else {
            put_u64(&mut b, at, v);
        }
        cases.push((name.into(), b));
    }
    // Metadata values that shape the model: zero heads, zero layers, absurd widths.
    for (key, v) in [("llama.attention.head_count", 0u32), ("llama.attention.head_count_kv", 0), ("llama.block_count", 0), ("llama.embedding_length", 0), ("llama.embedding_length", u32::MAX), ("llama.feed_forward_length", u32::MAX), ("llama.attention.head_count_kv", 3), ("llama.context_length", 0), ("llama.rope.dimension_count", 0)] {
        let at = find(&good, key.as_bytes()) + key.len() + 4;
        let mut b = good.clone();
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        cases.push((format!("{key} = {v}"), b));
    }
    // Truncations.
    for cut in [0, 3, 7, 24, 100, good.len() / 3, good.len() - 1] {
        cases.push((format!("truncated at {cut}"), good[..cut].to_vec()));
    }
    // Seeded random edits of the header (the part before the tensor data).
    let header = find(&good, b"blk.1.ffn_up.weight") + 64;
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for i in 0..300 {
        let mut b = good.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % header;
            match next() % 4 {
                0 => b[at] = next() as u8,
                1 => b[at] ^= 1 << (next() % 8),
                2 if at + 8 <= b.len() => put_u64(&mut b, at, next() >> (next() % 64)),
                _ => b[at] = 0xff,
            }
        }
        cases.push((format!("random {i}"), b));
    }

    let mut failed = 0;
    for (name, bytes) in &cases {
        let (r, peak) = load(&path, bytes);
        assert!(peak <= bound, "{name}: allocated {peak} bytes (bound {bound})");
        if let Err(e) = r {
            failed += 1;
            assert!(!e.is_empty() && !e.contains("panicked"), "{name}: {e}");
        }
    }
    assert!(failed > 20, "the mutations should mostly break the file ({failed} of {} did)", cases.len());
    std::fs::remove_dir_all(&dir).ok();
}
