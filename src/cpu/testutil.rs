//! Helpers shared by the kernels' tests.
#![cfg(test)]

pub(crate) fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

pub(crate) fn dev_cpu() -> candle_core::Device {
        candle_core::Device::Cpu
    }
