// Scalar f32 functions of the unary ops (unary.wgsl) and of the coop matmul's activation
// epilogue (matmul_coop.wgsl): one definition, so a fused activation equals the separate op.

// 1 / (1 + e^-x) without overflow: e^-|x| is in (0, 1] for every x.
fn sigmoid_f(x: f32) -> f32 {
    let e = exp(-abs(x));
    let r = 1.0 / (1.0 + e);
    return select(e * r, r, x >= 0.0);
}

// tanh after Cephes' tanhf: an odd polynomial below |x| = 0.625 (where 1 - e^-2|x| would lose
// relative precision), 1 - 2 / (e^2|x| + 1) above, |x| clamped to 10 where tanh is 1.0 in f32.
// Relative error about 2e-7 (the polynomial) to a few ulp (the exp branch).
fn tanh_f(x: f32) -> f32 {
    let ax = min(abs(x), 10.0);
    var r: f32;
    if (ax < 0.625) {
        let z = x * x;
        r = ax + ax * z * ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
            + 1.33314422036e-1) * z - 3.33332819422e-1);
    } else {
        r = 1.0 - 2.0 / (exp(2.0 * ax) + 1.0);
    }
    return select(r, -r, x < 0.0);
}

// erfc(z) for z >= 0, Numerical Recipes' Chebyshev fit `erfcc`: fractional error below 1.2e-7
// everywhere (so the tail stays relatively accurate, unlike 1 - erf), plus f32 rounding.
fn erfc_pos(z: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806
        + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    return t * exp(poly - z * z);
}

// GELU, erf form: x * Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2. For x < 0 Phi comes straight from
// erfc (relative error ~1.2e-7 carries over); for x >= 0 it is 1 - erfc/2 (absolute error
// below 6e-8).
fn gelu_erf_f(x: f32) -> f32 {
    let h = 0.5 * erfc_pos(abs(x) * 0.70710678118654752);
    return x * select(1.0 - h, h, x < 0.0);
}

// GELU, tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3);
// the sigmoid form has no cancellation for large negative x.
fn gelu_tanh_f(x: f32) -> f32 {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    return x * sigmoid_f(2.0 * u);
}
