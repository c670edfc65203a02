// The angle arithmetic shared by rope.wgsl and rope_kv.wgsl: exact to the CPU's f32 (see
// rope.rs). Expects the kernel's uniform `p` to have a `zero: u32` field that is always 0.

// x, hidden from the optimiser (p.zero is 0, but a uniform it cannot see). Compilers contract
// `a * b + c` into one fma (NVIDIA does), which skips the rounding of a * b: wherever a rounded
// product must stay exactly the CPU's (the angle, the quotient below), it goes through here.
fn opaque(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) ^ p.zero);
}

// The high 12 significant bits of x (its low 12 mantissa bits cleared).
fn hi12(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) & 0xfffff000u);
}

// (sin, cos) of a large f32 angle. GPU sin/cos builtins are only specified (loosely) on
// [-pi, pi] and lose accuracy fast beyond it, while rope angles reach the position (1e5 rad
// and more). So: Cody-Waite reduction by pi/2, then cephes' sinf/cosf minimax polynomials on
// [-pi/4, pi/4] (about 1 ulp). pi/2 is split into four parts, the first three of at most 6
// significant bits, and k into two halves of at most 12 bits (hi12), so every product
// but the last is exact in f32 without relying on a fused multiply-add (NVIDIA fuses, lavapipe
// does not). Measured against the CPU: ~1e-7 up to 1e6 rad, 1.5e-4 at 1.6e7 rad (where the f32
// angle itself is only good to 1 rad).
fn sin_cos(x: f32) -> vec2<f32> {
    let k = round(x * 0.63661977236758134);
    let kh = hi12(k);
    let kl = k - kh;
    var r = x - kh * 1.5625;
    r = r - kl * 1.5625;
    r = r - kh * 0.008056640625;
    r = r - kl * 0.008056640625;
    r = r - kh * 0.00023651123046875;
    r = r - kl * 0.00023651123046875;
    r = r - k * 3.1749394278692314e-6;
    let z = r * r;
    let s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r;
    let c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0;
    switch (i32(k) & 3) {
        case 0: { return vec2<f32>(s, c); }
        case 1: { return vec2<f32>(c, -s); }
        case 2: { return vec2<f32>(-s, -c); }
        default: { return vec2<f32>(-c, s); }
    }
}

// a / b correctly rounded, as the CPU's division. WGSL only promises 2.5 ulp for `/` (NVIDIA
// returns a * rcp(b)), visible at angles of 1e5 rad. One residual step fixes it: q + (a - q b)
// / b. The residual must be exact, and `fma` is not fused everywhere (lavapipe splits it), so
// it is Dekker's: q and b split into 12-bit halves, whose products are all exact in f32 (so
// contraction into fma cannot change them), and each subtraction below is exact too. q is
// opaque: contracted into the final add as fma(a, rcp(b), ..) it would lose its rounding.
fn div_rn(a: f32, b: f32) -> f32 {
    let q = opaque(a / b);
    let qh = hi12(q);
    let ql = q - qh;
    let bh = hi12(b);
    let bl = b - bh;
    let e = (((a - qh * bh) - qh * bl) - ql * bh) - ql * bl;
    return q + e / b;
}

