//! Unary elementwise ops (activations and math functions) over f32: CPU reference and WGSL
//! (`unary.wgsl`, whose kernels `elementwise::gpu_unary_expr` dispatches: strided, contiguous
//! and the vec4 bandwidth path).
//!
//! The CPU reference computes the transcendental ops in f64 and rounds once, so it is more
//! exact than the kernels it checks. The GPU forms are the numerically careful ones: sigmoid and
//! silu never overflow, tanh does not go through the driver's `tanh` (NaN for large |x| on some
//! drivers), and GELU's erf, which WGSL lacks, comes from a Chebyshev fit of erfc with relative
//! error below 1.2e-7 (see `unary.wgsl`).

use rayon::prelude::*;

use super::elementwise::{f32_data, gpu_unary_expr};
use crate::error::Result;
use crate::tensor::{CpuStorage, Tensor};

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

    /// The op as a WGSL expression over `x` (helpers in `unary.wgsl`).
    fn wgsl(self) -> &'static str {
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
            UnaryOp::GeluErf => (d * 0.5 * erfc(-d * std::f64::consts::FRAC_1_SQRT_2)) as f32,
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

/// erfc in f64, near full precision (the reference for the GPU's GELU): the Maclaurin series
/// of erf below |x| = 2 (|error| ~1e-16, so erfc = 1 - erf keeps ~1e-15 relative there, erfc
/// being above 4.6e-3), Lentz's continued fraction for erfc above.
pub(crate) fn erfc(x: f64) -> f64 {
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
        return 0.0; // below f64's smallest subnormal
    }
    // erfc(x) = e^-x^2 / sqrt(pi) * 1 / (x + (1/2) / (x + 1 / (x + (3/2) / (x + 2 / (x + ...)))))
    // evaluated with the modified Lentz method.
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

pub fn cpu_unary(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    let v = f32_data(op.name(), x)?;
    let out: Vec<f32> = if x.is_contiguous() {
        let o = x.layout().offset;
        v[o..o + x.numel()].par_iter().map(|&e| op.apply(e)).collect()
    } else {
        x.layout().storage_indices().map(|i| op.apply(v[i])).collect()
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
    use super::erfc;

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
}
