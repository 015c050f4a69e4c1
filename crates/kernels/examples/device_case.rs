//! Writes a test case for a device port of the Q4_K kernel (`cuda/q4k_group.cu`): a random Q4_K
//! matrix as `PackedInt8` repacks it, one activation row quantized with super-block scales, and
//! the CPU kernel's outputs, which the device must reproduce bit for bit.
//!
//! `cargo run --release -p specula-kernels --example device_case -- OUT.case [rows] [cols]`
//!
//! Layout (little-endian): b"SPQ4", u32 rows, cols, blocks per row, group block bytes; the
//! repacked bytes; `cols / 32` activation blocks of (f32 d, f32 s, i8 qs[32], i16 h[2]); `rows`
//! f32 outputs.

use rand::{Rng, SeedableRng};
use specula_kernels::matmul::{matmul, MatmulInput};
use specula_kernels::weights::Packed;
use specula_kernels::{quantize_rows_super, ActSpan, QMatrix, WeightBytes, WeightFormat};
use std::io::Write;

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let out = args.get(1).expect("usage: device_case OUT.case [rows] [cols]");
    let rows: usize = args.get(2).map_or(4096, |v| v.parse().expect("rows"));
    let cols: usize = args.get(3).map_or(4096, |v| v.parse().expect("cols"));
    let f = WeightFormat::Q4K;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    // random quants and 6-bit scales; d and dmin small positive f16 (as real files have)
    let mut raw: Vec<u8> = (0..rows * f.row_bytes(cols)).map(|_| rng.gen()).collect();
    for blk in raw.chunks_exact_mut(f.block_bytes()) {
        for at in [0, 2] {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(rng.gen_range(0.001f32..0.05)).to_le_bytes());
        }
    }
    let m = QMatrix::new(f, rows, cols, WeightBytes::owned(raw), "case").expect("a Q4_K matrix");
    let Some(Packed::Int8(p)) = m.packed() else { panic!("Q4_K has an int8 kernel") };
    let packed = p.repacked_bytes().expect("repacked at load");
    let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
    let q = quantize_rows_super(&x, cols);
    assert_eq!(q.spans, [ActSpan::Super], "the row takes super-block scales");
    let mut y = vec![0f32; rows];
    matmul(&MatmulInput::new(&x, cols, &[&m]), &m, &mut y);
    let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
    w.write_all(b"SPQ4")?;
    for v in [rows, cols, cols / 256, packed.len() / (rows.div_ceil(8) * (cols / 256))] {
        w.write_all(&(v as u32).to_le_bytes())?;
    }
    w.write_all(packed)?;
    for b in q.row(0) {
        w.write_all(&b.d.to_le_bytes())?;
        w.write_all(&b.s.to_le_bytes())?;
        w.write_all(&b.qs.map(|v| v as u8))?;
        for h in b.h {
            w.write_all(&h.to_le_bytes())?;
        }
    }
    for v in &y {
        w.write_all(&v.to_le_bytes())?;
    }
    eprintln!("{out}: {rows} x {cols} Q4_K, {} packed bytes, one activation row, {rows} outputs", packed.len());
    Ok(())
}
