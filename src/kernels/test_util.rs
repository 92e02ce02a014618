//! Helpers shared by the kernels' unit tests.

use super::qmatmul::{BlockFormat, BlockMatrix, BLOCK};
use rand::rngs::StdRng;
use rand::Rng;

/// Runs `f` on a fresh rayon pool of `threads` threads.
pub fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// Random blocks: every nibble and byte value (-128 included), scales and minimums random finite f16
/// values of either sign.
pub fn random_blocks(rng: &mut StdRng, format: BlockFormat, rows: usize, cols: usize) -> BlockMatrix {
    let bb = format.block_bytes();
    let mut data = vec![0u8; rows * cols / BLOCK * bb];
    for blk in data.chunks_exact_mut(bb) {
        rng.fill(&mut blk[..]);
        let heads = if format == BlockFormat::Q4_1 { 2 } else { 1 };
        for h in 0..heads {
            let v = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
            blk[2 * h..2 * h + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    BlockMatrix::new(format, rows, cols, data).unwrap()
}
