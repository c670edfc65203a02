//! Unary elementwise ops (activations and math functions) over f32: CPU reference and WGSL
//! (`unary.wgsl`, whose kernels `elementwise::gpu_unary_expr` dispatches: strided, contiguous
//! and the vec4 bandwidth path).
//!
//! The CPU reference computes most transcendental ops in f64 and rounds once, so it is more
//! exact than the kernels it checks. GELU (erf form), the hot op of BERT-style encoders, is the
//! exception: an f64 erfc cost half of a MiniLM forward pass, so it has an f32 form built to be
//! vectorised ([`gelu_erf_f32`]: relative error below 5e-7 everywhere, tail included, against
//! the f64 erfc kept in the tests). [`exp_f32`], the exponential it and the CPU softmax use, is
//! branch-free f32 too.
//!
//! The GPU forms are the numerically careful ones: sigmoid and silu never overflow, tanh does
//! not go through the driver's `tanh` (NaN for large |x| on some drivers), and GELU's erf, which
//! WGSL lacks, comes from a Chebyshev fit of erfc with relative error below 1.2e-7 (see
//! `unary_math.wgsl`).

use super::elementwise::{cpu_map, f32_data, gpu_unary_expr, multiversion};
use crate::error::Result;
use crate::tensor::{CpuStorage, Tensor};

/// The scalar functions the unary ops' expressions call (sigmoid_f, gelu_erf_f, ...), shared
/// with the matmul's activation epilogue.
pub(crate) const UNARY_MATH_WGSL: &str = include_str!("unary_math.wgsl");

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Relu,
    /// GELU, exact form: x * Phi(x) with erf.
    GeluErf,
    /// GELU, tanh approximation (GPT-2, llama.cpp's default).
    GeluTanh,
    Silu,
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Neg,
    Abs,
    Square,
}

impl UnaryOp {
    /// Every op, for tests and benchmarks.
    pub const ALL: [UnaryOp; 13] = [
        UnaryOp::Relu,
        UnaryOp::GeluErf,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Square,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Relu => "relu",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Silu => "silu",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Square => "square",
        }
    }

    /// The op as a WGSL expression over `x` (helpers in `unary_math.wgsl`).
    pub(crate) fn wgsl(self) -> &'static str {
        match self {
            UnaryOp::Relu => "max(x, 0.0)",
            UnaryOp::GeluErf => "gelu_erf_f(x)",
            UnaryOp::GeluTanh => "gelu_tanh_f(x)",
            UnaryOp::Silu => "x * sigmoid_f(x)",
            UnaryOp::Sigmoid => "sigmoid_f(x)",
            UnaryOp::Tanh => "tanh_f(x)",
            UnaryOp::Exp => "exp(x)",
            UnaryOp::Log => "log(x)",
            UnaryOp::Sqrt => "sqrt(x)",
            UnaryOp::Rsqrt => "inverseSqrt(x)",
            UnaryOp::Neg => "-x",
            UnaryOp::Abs => "abs(x)",
            UnaryOp::Square => "x * x",
        }
    }

    /// The CPU reference for one element.
    pub fn apply(self, x: f32) -> f32 {
        let d = x as f64;
        match self {
            UnaryOp::Relu => x.max(0.0),
            UnaryOp::GeluErf => gelu_erf_f32(x),
            UnaryOp::GeluTanh => {
                let u = (2.0 / std::f64::consts::PI).sqrt() * (d + 0.044715 * d * d * d);
                (d * sigmoid(2.0 * u)) as f32
            }
            UnaryOp::Silu => (d * sigmoid(d)) as f32,
            UnaryOp::Sigmoid => sigmoid(d) as f32,
            UnaryOp::Tanh => d.tanh() as f32,
            UnaryOp::Exp => d.exp() as f32,
            UnaryOp::Log => d.ln() as f32,
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => (1.0 / d.sqrt()) as f32,
            UnaryOp::Neg => -x,
            UnaryOp::Abs => x.abs(),
            UnaryOp::Square => x * x,
        }
    }
}

/// 1 / (1 + e^-x) without overflow.
fn sigmoid(x: f64) -> f64 {
    let e = (-x.abs()).exp();
    if x >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    }
}

// ---- f32 exp and GELU for the CPU ------------------------------------------------------
//
// Written without calls, branches or table lookups, so that a loop over a slice of them
// vectorises (see `gelu_erf_slice`).

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split Cody-Waite style: LN2_HI has 9 significant bits, so n * LN2_HI is exact for every
/// exponent n an f32 can have.
const LN2_HI: f32 = 0.693_359_4; // = 355/512 exactly
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: `(v + ROUND) - ROUND` rounds v to an integer (|v| < 2^22), and the low bits of
/// `v + ROUND` hold that integer.
const ROUND: f32 = 12_582_912.0;

/// e^(hi + lo), where `lo` carries bits that `hi` cannot (GELU passes -x^2/2 as an exact `hi`
/// and a small remainder). Cephes' expf after the reduction e^s = 2^n e^r, |r| <= ln2/2: a
/// degree-7 polynomial, relative error about 1e-7 (1-2 ulp). Results below 1.7e-38 (about the
/// smallest normal f32) are 0, above f32::MAX +inf; NaN stays NaN.
#[inline(always)]
fn exp_split(hi: f32, lo: f32) -> f32 {
    // Clamped, n stays in -127..=128 (clamp keeps NaN). Past the ends the result is 0 or +inf,
    // whatever r is: r >= 0.27 above, the select below.
    let s = (hi + lo).clamp(-88.0, 89.0);
    let shifted = s * LOG2E + ROUND;
    let n = shifted - ROUND;
    // hi - n*LN2_HI is exact or nearly (Sterbenz); the small terms come after.
    let r = (hi - n * LN2_HI) + (lo - n * LN2_LO);
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * (r * r) + r + 1.0;
    // 2^(n-1) from its bits (n - 1 >= -126 gives a normal; less gives 0), then one exact
    // doubling: 2^128 has no f32 of its own.
    let k = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits(((k + 126).max(0) as u32) << 23);
    let y = e * scale * 2.0;
    // Far below the range r is huge and e may be inf or NaN: the answer is 0.
    if s < -87.0 {
        0.0
    } else {
        y
    }
}

/// e^x in f32 (relative error ~1e-7; below e^-87 the result is 0). Branch-free: loops over it
/// vectorise. The CPU softmax's exponential.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    exp_split(x, 0.0)
}

/// erfc(z) = t e^(-z^2 + P(t - 1/2)), t = 1 / (1 + z/2): the form of Numerical Recipes'
/// `erfcc`, refitted. P is a degree-10 least-squares fit over z in [0, 10] (t in [1/6, 1]) of
/// ln(erfc(z) / t) + z^2, made in f64 against mpmath at 40 digits, its coefficients rounded to
/// f32 one at a time (each rounding absorbed by refitting the rest): error 3e-8 in f64, 1.2e-7
/// evaluated in f32 (centring t at 1/2 keeps Horner's terms small; in t itself it was 2.7e-7).
const ERFC_P: [f32; 11] = [
    -0.671_794_06,
    1.345_286_5,
    0.189_368_83,
    -0.375_164_18,
    -0.157_762_27,
    0.282_162_7,
    0.108_856_596,
    -0.292_842_48,
    -0.009_183_026,
    0.259_944_92,
    -0.141_516_05,
];

/// GELU (erf form) in f32: x Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2. Phi comes from erfc(|x| /
/// sqrt 2) with relative accuracy in the tail: the exponent -x^2/2 is split into an exact part
/// (x with its low 12 bits cleared, squared) and a small rest, so a large exponent loses no
/// digits. Relative error below 5e-7 over all of f32 (`gelu_erf_f32_matches_f64` tests a dense
/// sweep; results below 1e-37, x < -13, are 0 or nearly); |x| >= 14.5 gives x or 0; -inf gives NaN,
/// as x * 0.5 * (1 + erf(x / sqrt 2)) does.
#[inline(always)]
pub fn gelu_erf_f32(x: f32) -> f32 {
    let ax = x.abs().min(14.5); // a NaN x gives 14.5 here and NaN at the end
    let z = ax * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let u = t - 0.5;
    let mut p = ERFC_P[10];
    for &c in ERFC_P[..10].iter().rev() {
        p = p * u + c;
    }
    let xh = f32::from_bits(ax.to_bits() & 0xffff_f000);
    let hi = -0.5 * (xh * xh);
    let lo = p - 0.5 * ((ax - xh) * (ax + xh));
    let h = 0.5 * t * exp_split(hi, lo); // Phi(-|x|)
    x * if x < 0.0 { h } else { 1.0 - h }
}

multiversion! {
    /// `out[i] = gelu_erf_f32(x[i])`, 16 or 8 lanes wide where the CPU has AVX-512 or AVX2.
    fn gelu_erf_slice(x: &[f32], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = gelu_erf_f32(v);
        }
    }
}

pub fn cpu_unary(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    let v = f32_data(op.name(), x)?;
    let out = match op {
        UnaryOp::GeluErf => cpu_map(x, v, gelu_erf_slice),
        _ => cpu_map(x, v, |src, dst| {
            for (o, &e) in dst.iter_mut().zip(src) {
                *o = op.apply(e);
            }
        }),
    };
    Ok(Tensor::cpu(CpuStorage::F32(out), x.shape().clone()))
}

pub fn gpu_unary(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    gpu_unary_expr(op.name(), op.wgsl(), x, 0.0, 0.0)
}

impl Tensor {
    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        self.device().backend().unary(op, self)
    }
    pub fn relu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Relu)
    }
    /// GELU, exact (erf) form.
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::GeluErf)
    }
    /// GELU, tanh approximation.
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::GeluTanh)
    }
    pub fn silu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Silu)
    }
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sigmoid)
    }
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Tanh)
    }
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Exp)
    }
    /// Natural logarithm.
    pub fn log(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sqrt)
    }
    /// 1 / sqrt(x).
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Rsqrt)
    }
    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Abs)
    }
    pub fn square(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Square)
    }
}

#[cfg(test)]
mod tests {
    use super::{exp_f32, gelu_erf_f32, gelu_erf_slice, UnaryOp};

    /// erfc in f64, near full precision: the Maclaurin series of erf below |x| = 2, Lentz's
    /// continued fraction for erfc above. The oracle for the f32 GELU (and was the CPU
    /// reference's GELU before it; 30x slower).
    fn erfc(x: f64) -> f64 {
        if x.is_nan() {
            return f64::NAN;
        }
        if x < 0.0 {
            return 2.0 - erfc(-x);
        }
        if x < 2.0 {
            // erf(x) = 2/sqrt(pi) * sum_n (-1)^n x^(2n+1) / (n! (2n+1))
            let (x2, mut term, mut sum) = (x * x, x, x);
            for n in 1..60 {
                term *= -x2 / n as f64;
                let t = term / (2 * n + 1) as f64;
                sum += t;
                if t.abs() < 1e-17 * sum.abs() {
                    break;
                }
            }
            return 1.0 - sum * std::f64::consts::FRAC_2_SQRT_PI;
        }
        if x > 27.0 {
            return 0.0;
        }
        // erfc(x) = e^-x^2 / sqrt(pi) * 1 / (x + (1/2) / (x + 1 / (x + (3/2) / (x + ...))))
        let tiny = 1e-300;
        let mut f = x;
        let (mut c, mut d) = (x, 0.0);
        for k in 1..300 {
            let a = k as f64 * 0.5;
            d = x + a * d;
            d = if d.abs() < tiny { tiny } else { d };
            c = x + a / c;
            c = if c.abs() < tiny { tiny } else { c };
            d = 1.0 / d;
            let delta = c * d;
            f *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        (-x * x).exp() / (f * std::f64::consts::PI.sqrt())
    }

    fn gelu_f64(x: f32) -> f64 {
        let d = x as f64;
        d * 0.5 * erfc(-d * std::f64::consts::FRAC_1_SQRT_2)
    }

    #[test]
    fn erfc_matches_known_values() {
        // Values from Abramowitz & Stegun table 7.1 and high-precision references.
        let cases = [
            (0.0, 1.0),
            (0.5, 0.4795001221869535),
            (1.0, 0.15729920705028513),
            (2.0, 0.004677734981047266),
            (3.0, 2.209049699858544e-5),
            (5.0, 1.537_459_794_428_035e-12),
            (10.0, 2.088487583762545e-45),
            (-1.0, 1.8427007929497148),
        ];
        for (x, want) in cases {
            let got = erfc(x);
            assert!(((got - want) / want).abs() < 1e-13, "erfc({x}) = {got}, want {want}");
        }
    }

    /// The relative error of the f32 GELU over a dense sweep of [-14, 14] (every input whose
    /// result is above 1e-37) and at the special values.
    #[test]
    fn gelu_erf_f32_matches_f64() {
        let mut worst = (0f64, 0f32);
        let n = 400_000;
        for i in 0..=n {
            let x = -14.0 + 28.0 * i as f32 / n as f32;
            let want = gelu_f64(x);
            // Results below 1e-37 may be flushed to 0 (see exp_split).
            if want.abs() < 1e-37 {
                continue;
            }
            let rel = ((gelu_erf_f32(x) as f64 - want) / want).abs();
            if rel > worst.0 {
                worst = (rel, x);
            }
        }
        eprintln!("gelu_erf_f32: largest relative error {:.2e} at x = {}", worst.0, worst.1);
        assert!(worst.0 < 5e-7, "gelu_erf_f32: relative error {:.2e} at x = {}", worst.0, worst.1);
        for x in [0.0f32, -0.0, 1e-30, -1e-30, 1e-6, -1e-6] {
            assert!(((gelu_erf_f32(x) as f64 - gelu_f64(x)) / gelu_f64(x).abs().max(1e-45)).abs() < 5e-7, "x = {x}");
        }
        assert_eq!(gelu_erf_f32(20.0), 20.0);
        assert_eq!(gelu_erf_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu_erf_f32(1e30), 1e30);
        assert_eq!(gelu_erf_f32(-20.0), 0.0);
        assert_eq!(gelu_erf_f32(-1e30), 0.0);
        assert!(gelu_erf_f32(f32::NAN).is_nan());
        assert!(gelu_erf_f32(f32::NEG_INFINITY).is_nan());
        assert_eq!(UnaryOp::GeluErf.apply(-3.0), gelu_erf_f32(-3.0));
        // The vectorised slice (AVX-512, AVX2 or SSE2, whichever runs here) gives the scalar
        // function's bits.
        let xs: Vec<f32> = (0..10_007).map(|i| -16.0 + 32.0 * i as f32 / 10_006.0).collect();
        let mut out = vec![0f32; xs.len()];
        gelu_erf_slice(&xs, &mut out);
        for (&x, &o) in xs.iter().zip(&out) {
            assert_eq!(o.to_bits(), gelu_erf_f32(x).to_bits(), "x = {x}");
        }
    }

    #[test]
    fn exp_f32_matches_f64() {
        let mut worst = (0f64, 0f32);
        let n = 400_000;
        for i in 0..=n {
            let x = -86.9 + 175.6 * i as f32 / n as f32;
            let want = (x as f64).exp();
            let rel = ((exp_f32(x) as f64 - want) / want).abs();
            if rel > worst.0 {
                worst = (rel, x);
            }
        }
        eprintln!("exp_f32: largest relative error {:.2e} at x = {}", worst.0, worst.1);
        assert!(worst.0 < 2.5e-7, "exp_f32: relative error {:.2e} at x = {}", worst.0, worst.1);
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-88.0), 0.0);
        assert_eq!(exp_f32(-1e9), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.7).is_finite());
    }
}
