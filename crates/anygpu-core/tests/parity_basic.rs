//! Parity tests for the foundation ops: copies of strided views, elementwise with
//! broadcasting, reductions, the two-pass dot product, matmul. Each body runs on the CPU
//! reference and on every GPU device (see anygpu_core::testing).

use anygpu_core::ops::elementwise::BinaryOp;
use anygpu_core::testing::{gpu_devices, parity, parity_err, rand_vec, ODD_SIZES};
use anygpu_core::{DType, Device, Tensor};

fn t(seed: u64, dims: &[usize], d: &Device) -> Tensor {
    Tensor::from_vec(rand_vec(seed, dims.iter().product()), dims, &Device::Cpu)
        .and_then(|t| t.to_device(d))
        .expect("upload")
}

#[test]
fn a_gpu_adapter_is_tested() {
    let names: Vec<String> = gpu_devices().iter().map(|d| d.name()).collect();
    eprintln!("GPU devices under test: {names:?}");
    if anygpu_core::testing::require_gpu() {
        assert!(!names.is_empty(), "no GPU device under test");
    }
}

#[test]
fn upload_download_roundtrip_all_dtypes() {
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        for n in ODD_SIZES {
            let f: Vec<f32> = rand_vec(n as u64, n);
            let h: Vec<half::f16> = f.iter().map(|&x| half::f16::from_f32(x)).collect();
            let bf: Vec<half::bf16> = f.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let i: Vec<i32> = (0..n as i32).map(|x| x * 7 - 3).collect();
            assert_eq!(Tensor::from_slice(&f, [n], d).unwrap().to_vec::<f32>().unwrap(), f, "{}", d.name());
            assert_eq!(Tensor::from_slice(&h, [n], d).unwrap().to_vec::<half::f16>().unwrap(), h, "{}", d.name());
            assert_eq!(Tensor::from_slice(&bf, [n], d).unwrap().to_vec::<half::bf16>().unwrap(), bf, "{}", d.name());
            assert_eq!(Tensor::from_slice(&i, [n], d).unwrap().to_vec::<i32>().unwrap(), i, "{}", d.name());
        }
    }
}

#[test]
fn contiguous_of_views() {
    for &(r, c) in &[(1, 1), (7, 257), (64, 3), (33, 65)] {
        parity("transpose f32", 0.0, 0.0, |d| t(1, &[r, c], d).transpose(0, 1)?.contiguous()?.to_vec_f32());
        parity("narrow+permute f32", 0.0, 0.0, |d| {
            t(2, &[3, r, c + 2], d).narrow(2, 1, c)?.permute(&[2, 0, 1])?.contiguous()?.to_vec_f32()
        });
        // 2-byte elements are packed two per word on the GPU: odd shapes exercise the halves.
        parity("transpose f16", 0.0, 0.0, |d| {
            let h: Vec<half::f16> = rand_vec(3, r * c).iter().map(|&x| half::f16::from_f32(x)).collect();
            Tensor::from_slice(&h, [r, c], d)?.transpose(0, 1)?.contiguous()?.to_vec_f32()
        });
    }
}

#[test]
fn binary_ops_with_broadcasting() {
    let ops = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Maximum, BinaryOp::Minimum];
    for op in ops {
        for n in ODD_SIZES {
            parity(op.name(), 1e-6, 1e-6, |d| t(10, &[n], d).binary(op, &t(11, &[n], d))?.to_vec_f32());
        }
        parity("broadcast row", 1e-6, 1e-6, |d| t(12, &[7, 257], d).binary(op, &t(13, &[257], d))?.to_vec_f32());
        parity("broadcast col", 1e-6, 1e-6, |d| t(14, &[3, 7, 5], d).binary(op, &t(15, &[7, 1], d))?.to_vec_f32());
        parity("strided operand", 1e-6, 1e-6, |d| {
            t(16, &[9, 4], d).transpose(0, 1)?.binary(op, &t(17, &[4, 9], d))?.to_vec_f32()
        });
    }
    parity_err("broadcast mismatch", "do not broadcast", |d| t(1, &[3, 4], d).add(&t(2, &[5], d)));
}

#[test]
fn affine() {
    for n in ODD_SIZES {
        parity("affine", 1e-6, 1e-6, |d| t(20, &[n], d).affine(0.5, -2.0)?.to_vec_f32());
    }
}

#[test]
fn reductions_over_each_axis() {
    use anygpu_core::ops::reduce::ReduceOp::*;
    for dims in [vec![1], vec![257], vec![7, 257], vec![3, 5, 4099], vec![4, 1, 3]] {
        for axis in 0..dims.len() {
            for op in [Sum, Mean, Max, Min] {
                parity(op.name(), 1e-4, 1e-4, |d| t(30, &dims, d).reduce(op, axis)?.to_vec_f32());
            }
            parity("argmax", 0.0, 0.0, |d| t(31, &dims, d).argmax(axis)?.to_vec_f32());
        }
    }
    parity_err("reduce axis out of range", "out of range", |d| t(1, &[3], d).sum(1));
}

#[test]
fn argmax_of_long_rows_into_ids() {
    // The two-pass kernel (rows of 4,096 and more): odd lengths, the winner in the first and
    // last element, ties (the lower index wins) and -inf rows.
    for &len in &[4096usize, 5000, 49_153] {
        let mut v = rand_vec(70 + len as u64, 3 * len);
        v[len - 1] = 9.0; // row 0: the last element
        v[len] = 7.0; // row 1: the first element, tied with a later one
        v[len + len / 2] = 7.0;
        v[2 * len..].fill(f32::NEG_INFINITY); // row 2: all -inf -> index 0
        parity(&format!("argmax_into 3 x {len}"), 0.0, 0.0, |d| {
            let x = Tensor::from_slice(&v, [3, len], d)?;
            match d {
                Device::Cpu => x.argmax(1)?.to_vec_f32(),
                Device::Gpu(_) => {
                    let ids = Tensor::zeros([4], DType::U32, d)?;
                    anygpu_core::ops::reduce::gpu_argmax_into(&x, &ids)?;
                    Ok(ids.to_vec::<u32>()?[..3].iter().map(|&i| i as f32).collect())
                }
            }
        });
    }
}

#[test]
fn two_pass_dot_product() {
    for n in [1usize, 7, 257, 65_537, 1 << 20] {
        parity("dot", 1e-3, 1e-4, |d| t(40, &[n], d).dot(&t(41, &[n], d))?.to_vec_f32());
    }
    parity_err("dot length mismatch", "lengths differ", |d| t(1, &[3], d).dot(&t(2, &[4], d)));
}

#[test]
fn matmul_odd_shapes_and_transposes() {
    for &(m, k, n) in &[(1, 1, 1), (7, 13, 5), (64, 64, 64), (65, 257, 33), (1, 576, 1536), (100, 3, 200)] {
        let tol = 1e-4 * (k as f32).sqrt();
        parity("matmul", tol, 1e-4, |d| t(50, &[m, k], d).matmul(&t(51, &[k, n], d))?.to_vec_f32());
        parity("matmul A^T", tol, 1e-4, |d| {
            t(52, &[k, m], d).transpose(0, 1)?.matmul(&t(53, &[k, n], d))?.to_vec_f32()
        });
        parity("matmul B^T", tol, 1e-4, |d| {
            t(54, &[m, k], d).matmul(&t(55, &[n, k], d).transpose(0, 1)?)?.to_vec_f32()
        });
    }
    parity("batched matmul", 1e-4, 1e-4, |d| t(56, &[3, 2, 7, 9], d).matmul(&t(57, &[3, 2, 9, 5], d))?.to_vec_f32());
    parity("batched x shared", 1e-4, 1e-4, |d| t(58, &[4, 7, 9], d).matmul(&t(59, &[9, 5], d))?.to_vec_f32());
    parity_err("matmul inner mismatch", "inner dimensions differ", |d| t(1, &[2, 3], d).matmul(&t(2, &[4, 5], d)));
}

#[test]
fn huge_dispatch_is_split_over_two_dimensions() {
    // 70,000 workgroups of 256 > 65,535: the grid must be split and the kernel must recover
    // the linear index.
    let n = 70_000 * 256 + 3;
    parity("affine big", 1e-6, 1e-6, |d| {
        let v = Tensor::from_vec(vec![1.5f32; n], [n], &Device::Cpu)?.to_device(d)?;
        let out = v.affine(2.0, 1.0)?.to_vec_f32()?;
        Ok(vec![out[0], out[n / 2], out[n - 1], out.iter().sum::<f32>() / n as f32])
    });
}

#[test]
fn write_at_updates_a_cache_in_place() {
    // A [H, T_max, D] cache takes new [T, H, D] rows at position 5, as a KV cache does.
    parity("write_at", 0.0, 0.0, |d| {
        let mut cache = Tensor::zeros([3, 16, 7], anygpu_core::DType::F32, d)?;
        let new = t(60, &[4, 3, 7], d).permute(&[1, 0, 2])?;
        cache.write_at(1, 5, &new)?;
        let mut out = cache.to_vec_f32()?;
        out.extend(cache.narrow(1, 5, 4)?.unsqueeze(0)?.contiguous()?.to_vec_f32()?);
        Ok(out)
    });
    parity_err("write_at out of range", "out of range", |d| {
        let mut cache = Tensor::zeros([3, 16, 7], anygpu_core::DType::F32, d)?;
        cache.write_at(1, 14, &t(61, &[3, 4, 7], d))
    });
}
