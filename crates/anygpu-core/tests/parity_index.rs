//! Parity tests for the indexing and layout ops: gather (embedding), index_select, concat,
//! repeat_interleave. Each body runs on the CPU reference and on every GPU device (see
//! anygpu_core::testing); small hand-checked cases pin the CPU reference itself.

use anygpu_core::testing::{gpu_devices, parity, parity_err, rand_vec};
use anygpu_core::{DType, Device, Tensor};
use half::{bf16, f16};

/// A random tensor of `dtype` on `d` (values in [-1, 1), rounded to the dtype).
fn t(seed: u64, dims: &[usize], dtype: DType, d: &Device) -> Tensor {
    let v = rand_vec(seed, dims.iter().product());
    let host = match dtype {
        DType::F32 => Tensor::from_vec(v, dims, &Device::Cpu),
        DType::F16 => Tensor::from_vec(v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), dims, &Device::Cpu),
        DType::BF16 => Tensor::from_vec(v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), dims, &Device::Cpu),
        DType::I32 => Tensor::from_vec(v.iter().map(|&x| (x * 1000.0) as i32).collect::<Vec<_>>(), dims, &Device::Cpu),
        DType::U32 => {
            Tensor::from_vec(v.iter().map(|&x| (x * 1000.0).abs() as u32).collect::<Vec<_>>(), dims, &Device::Cpu)
        }
    };
    host.and_then(|h| h.to_device(d)).expect("upload")
}

fn ids_u32(v: &[u32], dims: &[usize], d: &Device) -> Tensor {
    Tensor::from_slice(v, dims, d).expect("ids")
}

fn ids_i32(v: &[i32], dims: &[usize], d: &Device) -> Tensor {
    Tensor::from_slice(v, dims, d).expect("ids")
}

/// The values plus the dtype and shape, so a wrong dtype or shape also fails parity.
fn summary(x: &Tensor) -> anygpu_core::Result<Vec<f32>> {
    let mut v = x.to_vec_f32()?;
    v.push(
        [DType::F32, DType::F16, DType::BF16, DType::I32, DType::U32].iter().position(|&k| k == x.dtype()).unwrap_or(9)
            as f32,
    );
    v.extend(x.dims().iter().map(|&d| d as f32));
    Ok(v)
}

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn a_gpu_adapter_is_tested() {
    let names: Vec<String> = gpu_devices().iter().map(|d| d.name()).collect();
    eprintln!("GPU devices under test: {names:?}");
    if anygpu_core::testing::require_gpu() {
        assert!(!names.is_empty(), "no GPU device under test");
    }
}

// ---- gather -----------------------------------------------------------------------------

#[test]
fn gather_hand_checked() {
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        let table = Tensor::from_slice(&[0.0f32, 1.0, 10.0, 11.0, 20.0, 21.0], [3, 2], d).unwrap();
        let out = table.gather(&ids_u32(&[2, 0, 2, 1], &[2, 2], d)).unwrap();
        assert_eq!(out.dims(), &[2, 2, 2], "{}", d.name());
        assert_eq!(out.to_vec::<f32>().unwrap(), [20.0, 21.0, 0.0, 1.0, 20.0, 21.0, 10.0, 11.0], "{}", d.name());
        // f16 rows of odd length: rows start mid-word.
        let h: Vec<f16> = (0..9).map(|i| f16::from_f32(i as f32)).collect();
        let table = Tensor::from_slice(&h, [3, 3], d).unwrap();
        let out = table.gather(&ids_i32(&[1, 1, 0, 2], &[4], d)).unwrap();
        assert_eq!(out.to_vec_f32().unwrap(), [3., 4., 5., 3., 4., 5., 0., 1., 2., 6., 7., 8.], "{}", d.name());
    }
}

#[test]
fn gather_odd_widths_all_float_dtypes() {
    for dtype in FLOATS {
        for c in [1usize, 7, 257] {
            for v in [1usize, 5, 13] {
                // Repeats, first and last rows, multi-dimensional ids.
                let ids: Vec<u32> = (0..12u32).map(|i| (i * 7 + i / 3) % v as u32).collect();
                parity("gather u32 ids", 0.0, 0.0, |d| {
                    summary(&t(1, &[v, c], dtype, d).gather(&ids_u32(&ids, &[3, 4], d))?)
                });
                let ids: Vec<i32> = (0..5).map(|i| (v as i32 - 1 - i).rem_euclid(v as i32)).collect();
                parity("gather i32 ids", 0.0, 0.0, |d| {
                    summary(&t(2, &[v, c], dtype, d).gather(&ids_i32(&ids, &[5], d))?)
                });
                // One id, rank-0 ids.
                parity("gather scalar id", 0.0, 0.0, |d| {
                    summary(&t(3, &[v, c], dtype, d).gather(&ids_u32(&[v as u32 - 1], &[], d))?)
                });
            }
        }
    }
}

#[test]
fn gather_views_and_host_ids() {
    for dtype in FLOATS {
        // A transposed table and a table that starts mid-buffer.
        parity("gather transposed table", 0.0, 0.0, |d| {
            summary(&t(4, &[7, 9], dtype, d).transpose(0, 1)?.gather(&ids_u32(&[8, 0, 3, 3], &[4], d))?)
        });
        parity("gather narrowed table", 0.0, 0.0, |d| {
            summary(&t(5, &[9, 7], dtype, d).narrow(0, 3, 5)?.gather(&ids_u32(&[4, 0, 1], &[3], d))?)
        });
        // ids on the host with the table on the GPU (the usual decode step).
        parity("gather host ids", 0.0, 0.0, |d| {
            summary(&t(6, &[6, 7], dtype, d).gather(&ids_i32(&[5, 1, 1], &[3], &Device::Cpu))?)
        });
    }
    // Integer tables work too (the ops copy bits).
    parity("gather i32 table", 0.0, 0.0, |d| {
        summary(&t(7, &[4, 3], DType::I32, d).gather(&ids_u32(&[3, 0], &[2], d))?)
    });
}

#[test]
fn gather_rejects_bad_ids() {
    for dtype in FLOATS {
        parity_err("gather negative id", "index -1 out of range 0..5", |d| {
            t(1, &[5, 7], dtype, d).gather(&ids_i32(&[0, -1, 2], &[3], d))
        });
        parity_err("gather id = V", "index 5 out of range 0..5", |d| {
            t(1, &[5, 7], dtype, d).gather(&ids_u32(&[0, 5], &[2], d))
        });
        parity_err("gather huge id", "index 4294967295 out of range", |d| {
            t(1, &[5, 7], dtype, d).gather(&ids_u32(&[u32::MAX], &[1], d))
        });
        parity_err("gather host ids out of range", "index 9 out of range", |d| {
            t(1, &[5, 7], dtype, d).gather(&ids_i32(&[9], &[1], &Device::Cpu))
        });
    }
    parity_err("gather float ids", "ids must be u32 or i32", |d| {
        t(1, &[5, 7], DType::F32, d).gather(&t(2, &[2], DType::F32, d))
    });
    parity_err("gather 3-d table", "table must be [V, C]", |d| {
        t(1, &[2, 5, 7], DType::F32, d).gather(&ids_u32(&[0], &[1], d))
    });
    // Every id is out of range of an empty table.
    parity_err("gather empty table", "index 0 out of range 0..0", |d| {
        t(1, &[0, 7], DType::F32, d).gather(&ids_u32(&[0], &[1], d))
    });
}

// ---- index_select -----------------------------------------------------------------------

#[test]
fn index_select_each_dim() {
    let dims = [3usize, 5, 7];
    for dtype in [DType::F32, DType::F16] {
        for dim in 0..3 {
            let n = dims[dim] as u32;
            let ids: Vec<u32> = vec![n - 1, 0, n - 1, n / 2, 0];
            parity("index_select", 0.0, 0.0, |d| {
                summary(&t(10, &dims, dtype, d).index_select(dim, &ids_u32(&ids, &[5], d))?)
            });
            parity("index_select permuted view", 0.0, 0.0, |d| {
                let x = t(11, &[7, 3, 5], dtype, d).permute(&[1, 2, 0])?;
                summary(&x.index_select(dim, &ids_u32(&ids, &[5], d))?)
            });
            parity("index_select no ids", 0.0, 0.0, |d| {
                summary(&t(12, &dims, dtype, d).index_select(dim, &ids_u32(&[], &[0], d))?)
            });
        }
    }
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], d).unwrap();
        let y = x.index_select(1, &ids_i32(&[2, 0], &[2], d)).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), [3.0, 1.0, 6.0, 4.0], "{}", d.name());
    }
}

#[test]
fn index_select_rejects_bad_input() {
    parity_err("index_select out of range", "index_select: index 5 out of range 0..5", |d| {
        t(1, &[3, 5, 7], DType::F32, d).index_select(1, &ids_u32(&[1, 5], &[2], d))
    });
    parity_err("index_select negative", "index -3 out of range 0..7", |d| {
        t(1, &[3, 5, 7], DType::F16, d).index_select(2, &ids_i32(&[-3], &[1], d))
    });
    parity_err("index_select dim", "dimension 3 out of range", |d| {
        t(1, &[3, 5, 7], DType::F32, d).index_select(3, &ids_u32(&[0], &[1], d))
    });
    parity_err("index_select 2-d ids", "ids must be [N]", |d| {
        t(1, &[3, 5, 7], DType::F32, d).index_select(0, &ids_u32(&[0, 1], &[1, 2], d))
    });
}

// ---- concat -----------------------------------------------------------------------------

#[test]
fn concat_three_along_each_dim() {
    let base = [3usize, 5, 7];
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::I32] {
        for dim in 0..3 {
            // Odd sizes along dim, so 2-byte inputs meet mid-word.
            let shapes: Vec<Vec<usize>> = [1usize, 4, 3]
                .iter()
                .map(|&k| base.iter().enumerate().map(|(i, &b)| if i == dim { k } else { b }).collect())
                .collect();
            parity("concat", 0.0, 0.0, |d| {
                let xs: Vec<Tensor> = shapes.iter().enumerate().map(|(i, s)| t(20 + i as u64, s, dtype, d)).collect();
                summary(&Tensor::concat(&xs.iter().collect::<Vec<_>>(), dim)?)
            });
            // Strided inputs: a transposed view and a narrowed view.
            parity("concat views", 0.0, 0.0, |d| {
                let s0 = &shapes[0];
                let a = t(30, &[s0[2], s0[1], s0[0]], dtype, d).permute(&[2, 1, 0])?;
                let mut wide = shapes[1].clone();
                wide[2] += 2;
                let b = t(31, &wide, dtype, d).narrow(2, 1, shapes[1][2])?;
                let c = t(32, &shapes[2], dtype, d);
                summary(&Tensor::concat(&[&a, &b, &c], dim)?)
            });
            // An empty input in the middle.
            parity("concat with empty", 0.0, 0.0, |d| {
                let mut e = base.to_vec();
                e[dim] = 0;
                let xs = [t(33, &base, dtype, d), t(34, &e, dtype, d), t(35, &base, dtype, d)];
                summary(&Tensor::concat(&[&xs[0], &xs[1], &xs[2]], dim)?)
            });
        }
    }
    // Longer 1-d runs: words shared between inputs at every boundary.
    for dtype in [DType::F16, DType::F32] {
        parity("concat 1-d", 0.0, 0.0, |d| {
            let xs = [t(40, &[257], dtype, d), t(41, &[1], dtype, d), t(42, &[1000], dtype, d)];
            summary(&Tensor::concat(&[&xs[0], &xs[1], &xs[2]], 0)?)
        });
    }
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2], d).unwrap();
        let b = Tensor::from_slice(&[5.0f32, 6.0], [2, 1], d).unwrap();
        let y = Tensor::concat(&[&a, &b], 1).unwrap();
        assert_eq!(y.dims(), &[2, 3]);
        assert_eq!(y.to_vec::<f32>().unwrap(), [1.0, 2.0, 5.0, 3.0, 4.0, 6.0], "{}", d.name());
    }
}

#[test]
fn concat_rejects_bad_input() {
    parity_err("concat shapes", "differ outside dimension 0", |d| {
        Tensor::concat(&[&t(1, &[2, 3], DType::F32, d), &t(2, &[2, 4], DType::F32, d)], 0)
    });
    parity_err("concat ranks", "differ outside dimension 0", |d| {
        Tensor::concat(&[&t(1, &[2, 3], DType::F32, d), &t(2, &[2, 3, 1], DType::F32, d)], 0)
    });
    parity_err("concat dtypes", "dtypes differ", |d| {
        Tensor::concat(&[&t(1, &[2, 3], DType::F32, d), &t(2, &[2, 3], DType::F16, d)], 0)
    });
    parity_err("concat dim", "dimension 2 out of range", |d| {
        Tensor::concat(&[&t(1, &[2, 3], DType::F32, d), &t(2, &[2, 3], DType::F32, d)], 2)
    });
    parity_err("concat nothing", "no tensors", |_| Tensor::concat(&[], 0));
    for d in gpu_devices() {
        let e = Tensor::concat(&[&t(1, &[2], DType::F32, d), &t(2, &[2], DType::F32, &Device::Cpu)], 0);
        assert!(e.is_err_and(|e| e.to_string().contains("different devices")), "{}", d.name());
    }
}

// ---- repeat_interleave ------------------------------------------------------------------

#[test]
fn repeat_interleave_each_dim() {
    let dims = [2usize, 3, 5, 7];
    for dtype in [DType::F32, DType::F16] {
        for dim in 0..4 {
            for n in [1usize, 2, 3] {
                parity("repeat_interleave", 0.0, 0.0, |d| summary(&t(50, &dims, dtype, d).repeat_interleave(dim, n)?));
            }
            parity("repeat_interleave view", 0.0, 0.0, |d| {
                summary(&t(51, &[7, 3, 5, 2], dtype, d).permute(&[3, 1, 2, 0])?.repeat_interleave(dim, 3)?)
            });
        }
    }
    parity("repeat_interleave n = 0", 0.0, 0.0, |d| summary(&t(52, &dims, DType::F32, d).repeat_interleave(1, 0)?));
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        // GQA: [B, Hkv, T, D] = [1, 2, 1, 2] -> [1, 4, 1, 2].
        let kv = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [1, 2, 1, 2], d).unwrap();
        let y = kv.repeat_interleave(1, 2).unwrap();
        assert_eq!(y.dims(), &[1, 4, 1, 2]);
        assert_eq!(y.to_vec::<f32>().unwrap(), [1.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0, 4.0], "{}", d.name());
    }
    parity_err("repeat_interleave dim", "dimension 4 out of range", |d| {
        t(1, &dims, DType::F32, d).repeat_interleave(4, 2)
    });
}
