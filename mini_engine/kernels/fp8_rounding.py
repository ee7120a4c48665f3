"""Rounding to fp8 inside a Triton kernel, by hand: the fp8 KV cache's writes (kernels/rotary_kv.py)
and fp8 weights' activations (kernels/fp8_linear.py) round exactly as torch's cast does."""
from mini_engine.kernels.triton_utils import tl, triton


@triton.jit
def round_to_fp8_grid(a, DROPPED_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEPS: tl.constexpr):
    """a (fp32, >= 0, saturated) rounded to nearest even on the grid of an fp8 format that keeps
    23 - DROPPED_BITS of fp32's mantissa bits and whose normal numbers start at MIN_NORMAL, below
    which it has SUBNORMAL_STEPS steps to 1.0."""
    a_bits = a.to(tl.int32, bitcast=True)
    # Normal numbers: add just under half of the dropped bits plus the lowest bit kept (ties go to
    # even), then clear them; a carry moves into the exponent.
    half_less_one = (1 << (DROPPED_BITS - 1)) - 1
    normal = ((a_bits + half_less_one + ((a_bits >> DROPPED_BITS) & 1)) & -(1 << DROPPED_BITS))
    # Subnormals: round the count of steps to an integer by adding and taking away 2^23, where
    # fp32's spacing is 1 (ties to even, as every fp32 add).
    subnormal = ((a * SUBNORMAL_STEPS + 8388608.0) - 8388608.0) * (1.0 / SUBNORMAL_STEPS)
    return tl.where(a < MIN_NORMAL, subnormal, normal.to(tl.float32, bitcast=True))


@triton.jit
def to_fp8(x, fp8_type: tl.constexpr):
    """x (fp32) as kernels.rotary_kv.to_cache_dtype_ref stores it in fp8_type (tl.float8e4nv: float8_e4m3fn, or
    tl.float8e5: float8_e5m2): saturated at the largest finite value and rounded to nearest even,
    here by hand, so that the cast at the end is exact. On the GPU the cast alone would round the
    same; Triton's interpreter, which runs the tests on CPU, rounds half up and drops the carry into
    the exponent (1.98 became 1.0 in e4m3)."""
    bits = x.to(tl.int32, bitcast=True)
    if fp8_type == tl.float8e5:       # 2 mantissa bits, normal from 2^-14, subnormals 2^-16 apart
        rounded = round_to_fp8_grid(tl.minimum(tl.abs(x), 57344.0), 21, 6.103515625e-05, 65536.0)
    else:                             # e4m3: 3 mantissa bits, normal from 2^-6, subnormals 2^-9 apart
        rounded = round_to_fp8_grid(tl.minimum(tl.abs(x), 448.0), 20, 0.015625, 512.0)
    signed = rounded.to(tl.int32, bitcast=True) | (bits & -0x80000000)     # x's sign, -0.0 included
    out = signed.to(tl.float32, bitcast=True).to(fp8_type)
    # NaN stays NaN (0x7f is one in both formats), as the reference keeps it: tl.minimum made it finite
    nan = tl.full(x.shape, 0x7F, tl.uint8).to(fp8_type, bitcast=True)
    return tl.where(x != x, nan, out)
