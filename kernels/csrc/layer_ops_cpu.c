/* Per-layer elementwise ops of a Llama block on CPU, float32 and bfloat16: RMSNorm (with the
 * residual add fused in), SiLU-and-mul and rotate-half RoPE in place.
 *
 * Why C: at a decode step's few rows each of these is a handful of torch ops on a few
 * kilobytes, and the dispatch around them costs more than the arithmetic (RMSNorm alone is
 * pow, mean, add, rsqrt, mul, mul); in bfloat16 torch also converts to float and back around
 * every op (a bfloat16 step of SmolLM2 spent more in them than its GEMMs' AMX work saved,
 * bench/README.md, "bfloat16 on CPU"). One pass per row here, vectorized by the compiler, one
 * body for both types (layer_ops_body.h). Rows are split over torch's OpenMP threads only when
 * there is enough work to pay for waking them (a prefill chunk); a decode step's rows run on
 * the calling thread.
 *
 * Numerics follow the torch reference (kernels/layer_ops.py, TorchLayerOps): values are
 * widened to float32 once and computed in float32 (sums of squares in 16 partial sums, exp from
 * a Cephes-style polynomial, exp_f32.h, because the C library's expf does not vectorize without
 * -ffast-math). In bfloat16 results are rounded (to nearest even) where the reference rounds:
 * the normalised row before the weight multiplies it, silu(gate) before `up` does, the residual
 * after the add, each RoPE product (of cos and sin rounded to bfloat16) before their sum: bit
 * for bit the reference's output, as transformers' Llama computes it in bfloat16.
 *
 * Return codes: 0 ok, 1 bad shape.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp_f32.h"

#define PARALLEL_MIN_ELEMS 32768 /* below this, one thread: waking the others costs more */
#define LANES 16

/* float32 */
#define LO_T float
#define LO_LOAD(x) (x)
#define LO_STORE(x) (x)
#define LO_ROUND(x) (x)
#define LO_NAME(op) pdmesh_##op##_f32
#include "layer_ops_body.h"
#undef LO_T
#undef LO_LOAD
#undef LO_STORE
#undef LO_ROUND
#undef LO_NAME

/* bfloat16 */
#define LO_T uint16_t
#define LO_LOAD(x) bf16_to_f32(x)
#define LO_STORE(x) f32_to_bf16(x)
#define LO_ROUND(x) bf16_round(x)
#define LO_NAME(op) pdmesh_##op##_bf16
#include "layer_ops_body.h"
