"""Block-wise 8-bit quantization of optimizer state: the maps, and the reference (torch ops) quantizer
and dequantizer the native kernel is checked against.

NOTE [8-bit state]
A tensor of n elements with 8-bit state keeps, per quantized moment, ``codes`` (uint8, n) and
``absmax`` (fp32, ceil(n / 256)): block k covers elements [256k, 256k + 256) of the tensor (the last
block may be short) and element i holds ``value(codes[i]) * absmax[i // 256]``. Blocks start at the
tensor's element 0, so a caller that cuts a tensor into several calls must cut it at multiples of 256
to get the same numbers (one call per parameter, as TieredModel's step makes, always does). A block
of zeros has absmax 0 and codes 0. Both moments use a dynamic-tree map (Dettmers et al., "8-bit
optimizers via block-wise quantization", as bitsandbytes' and torchao's 8-bit AdamW do): magnitudes
in seven decades from 1e-7 to 1, each decade split into equal cells, twice as many in each decade
up, plus 0 and 1 exactly (so a block's largest element survives requantization unchanged):

* ``exp_avg`` (signed): bit 7 is the sign, bits 0-6 a magnitude code q. q = 0 is 0, q = 127 is 1;
  decade d (0..5) holds q in [2^d, 2^(d+1)), 2^d cells; decade 6 holds q in [64, 127), 63 cells.
  (bitsandbytes' signed map has 127 cells a sign and +1 only; this one keeps -1 too.)
* ``exp_avg_sq`` (unsigned): 0 is 0, 255 is 1; decade d holds [2^(d+1) - 1, 2^(d+2) - 1), 2^(d+1)
  cells (bitsandbytes' unsigned map).

Quantizing x takes y = x * (1 / absmax), its decade d (how many of the decade starts 1e-7, ..., 0.1
and 1 - 2^-22 are <= |y|: the last is the code of 1, which a block's largest element must keep
although x * (1 / x) may round below 1), and the code ``trunc(|y| * IW[d] + C[d])`` (plus 128 for a
negative y in the signed map), where IW is the decade's cells per unit and C puts its first cell at
its first code (rounding may carry a value at the very top of a decade into the next decade's first
cell, its neighbour). A code's value is its cell's centre, ``B[d] + q * W[d]`` (W the cell width),
times the block's absmax. The constants are fp32, each rounded once here (``CONSTANTS``, the one
definition); values and codes are these fp32 operations in this order, which the native kernel
performs too: the two agree bit for bit. A quantized element is off by at most half its cell (0.35%
of absmax near 1 for exp_avg_sq, 0.7% for exp_avg, coarser in lower decades as every dynamic-tree
map), and what falls below 1e-7 of absmax becomes 0 (but see NOTE [8-bit moment bound]).

NOTE [8-bit moment bound]
Quantizing the two moments independently can blow an 8-bit Adam up. In a block where one element's
gradient is 1 and another's 1e-4, the second's v is 1e-8 of its block's absmax and rounds to 0 (v's
map ends at 1e-7) while its m, 1e-4 of m's absmax, survives; when its next gradient is 0, v stays 0
and its update is ``lr * m_hat / eps``: 7.4 at lr 1e-3 (tests/test_optim_contract.py), 4.2 in
torchao 0.18's AdamW8bit (bench/adam8_blowup.py). Exact Adam never gets there. With gamma = b1^2 / b2,
after t updates m = (1 - b1) sum_k b1^(t-k) g_k and v = (1 - b2) sum_k b2^(t-k) g_k^2, so by
Cauchy-Schwarz (b1^j g = (b1^j / b2^(j/2)) * (b2^(j/2) g)):
    m^2 <= K_t v,   K_t = (1 - b1)^2 / (1 - b2) * sum_{j<t} gamma^j   (= gamma K_{t-1} + (1 - b1)^2 / (1 - b2)),
which bounds every update: |m_hat| / sqrt(v_hat) <= sqrt(K_t) sqrt(1 - b2^t) / (1 - b1^t) (1 at t = 1,
below 7.3 for the default betas at any t). The same step shows the set {m^2 <= K v} is kept by an
update: a state inside it at t - 1 is inside it at t.
So the kernels keep the one rounding that leaves that set for good out of the stored state: after
quantizing, an element whose v was stored as 0 while its m was not, and whose fp32 moments hold
m^2 <= R K_t v, gets the smallest v code whose value is at least m_q^2 / K_t (m_q: m's stored value;
the code of 1.0 at most). Then its stored pair is in the set, and its next update within Adam's bound
(the case above: 0.18 lr where it was 7400 lr). Elsewhere quantization only rounds: one rounding to
cell centres moves m^2 / v by at most 51.2 (m up 5.5x and v down to 0.59x at the maps' lowest
decades), hence R = 64, and an update by at most sqrt(R) of Adam's bound, never to m / eps. Nothing else changes: a v that
did not round to 0 is stored as before, and moments already outside R K v (no Adam run makes them:
hand-made or loaded state) are stored as they are, so an 8-bit step is still fp32 Adam's step on the
dequantized state and its moments quantized together (tests/test_optim_8bit.py, the oracle of
tests/test_optim_formats.py: ``quantize_moments``). A checkpoint's fp32 moments loaded into 8-bit
state are quantized each on its own (NOTE [Converting state formats]): the bound holds from the
first 8-bit step after the load. The update reads the state as it is (no clamp at the update: a given
state steps as fp32 Adam would step it). 1 / K_t and 1 / (R K_t) are two fp32 scalars per step
(AdamHyper.moment_bound); where no bound exists (b2 = 0, or K_t past float range) both are 0 and no
code changes. (Storing a below-range v as the smallest code instead, whatever m, would bound v by
1e-7 of its block's absmax, which says nothing about m: the update could still be ~2000 sqrt(K).)
"""

from __future__ import annotations

import math

import torch

from tiermem.optim.adam_hyper import bound_scalars

BLOCK = 256
#: tensors with fewer elements keep fp32 moments (bitsandbytes' and torchao's threshold)
MIN_8BIT_NUMEL = 4096
DECADES = 7
ZERO_SLOT, ONE_SLOT = 15, 7  # constant slots of "below 1e-7" (decade -1, read mod 16) and of 1.0
# Where the code of 1.0 starts: a block's largest element times the fp32 reciprocal of itself is 1 to
# within 2^-23, so it must land there to keep its exact value.
ONE_EDGE = 1.0 - 2.0**-22


def _cells(signed: bool, d: int) -> int:
    return (63 if d == DECADES - 1 else 2**d) if signed else 2 ** (d + 1)


def _first_code(signed: bool, d: int) -> int:
    return 2**d if signed else 2 ** (d + 1) - 1


def _tables(signed: bool) -> list[list[float]]:
    """IW, C (quantize), HI (the decade's last code: for reading, the kernels do not need it) and B, W
    (dequantize): 16 slots each, decade d in slot d."""
    iw, c, hi, b, w = ([0.0] * 16 for _ in range(5))
    c[ONE_SLOT] = hi[ONE_SLOT] = 127.0 if signed else 255.0  # the code of 1.0 (iw = w = 0 there)
    b[ONE_SLOT] = 1.0
    for d in range(DECADES):
        lo, cells, first = _fp32(10.0 ** (d - DECADES)), _cells(signed, d), _first_code(signed, d)
        width = _fp32(0.9 * 10.0 ** (d - DECADES + 1) / cells)
        iw[d] = _fp32(cells / (0.9 * 10.0 ** (d - DECADES + 1)))
        c[d] = _fp32(first - lo * iw[d])
        hi[d] = first + cells - 1
        w[d] = width
        b[d] = _fp32(lo + (0.5 - first) * width)  # centre of cell q: lo + (q - first + 0.5) * width
    return [iw, c, hi, b, w]


def _octaves() -> list[list[float]]:
    """Per fp32 exponent e in [103, 127] (slot e % 32): the decade at the octave's start (-1 below
    1e-7, 7 at 1.0) and the decade start inside the octave, if any (else inf)."""
    starts = [_fp32(10.0 ** (k - DECADES)) for k in range(DECADES)] + [ONE_EDGE]
    first, edge = [0.0] * 32, [math.inf] * 32
    for e in range(103, 128):
        low, high = 2.0 ** (e - 127), 2.0 ** (e - 126)
        first[e % 32] = sum(s <= low for s in starts) - 1
        inside = [s for s in starts if low < s < high]
        edge[e % 32] = inside[0] if inside else math.inf
    return [first, edge]


def _fp32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _tables_and_maps() -> torch.Tensor:
    head = torch.tensor(
        [x for signed in (True, False) for row in _tables(signed) for x in row]
        + [_fp32(10.0 ** (k - DECADES)) for k in range(DECADES)]
        + [ONE_EDGE]
        + [x for row in _octaves() for x in row],
        dtype=torch.float32,
    )
    pad = torch.zeros(256 - head.numel(), dtype=torch.float32)
    maps = [_map(True), _map(False)]
    return torch.cat([head, pad, *maps])


def _slots(signed: bool) -> tuple[torch.Tensor, ...]:
    base = 0 if signed else 80
    return tuple(CONSTANTS[base + 16 * k : base + 16 * k + 16] for k in range(5))


def num_blocks(n: int) -> int:
    return math.ceil(n / BLOCK)


def decades_of(a: torch.Tensor) -> torch.Tensor:
    """The decade of each magnitude (-1 below 1e-7, 7 from ONE_EDGE up), as a slot (mod 16)."""
    d = torch.full(a.shape, -1, dtype=torch.long, device=a.device)
    for start in STARTS.tolist():
        d += a >= start
    return d % 16


def codes_of(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """The code of each normalised value ``y`` (NOTE [8-bit state]), in torch ops."""
    iw, c, _, _, _ = (t.to(y.device) for t in _slots(signed))
    a = y.abs()
    d = decades_of(a)
    q = (a * iw[d] + c[d]).long()  # .long() truncates
    if signed:
        q = q + 128 * torch.signbit(y)
    return q.to(torch.uint8)


def _map(signed: bool) -> torch.Tensor:
    """The value of each of the 256 codes (at absmax 1), by the fp32 formula of NOTE [8-bit state]."""
    _, _, _, b, w = (torch.tensor(row, dtype=torch.float32) for row in _tables(signed))
    codes = torch.arange(256)
    q = codes & 127 if signed else codes
    d = (
        torch.floor(torch.log2(q.clamp(min=1).double())).long()
        if signed
        else torch.floor(torch.log2((codes + 1).double())).long() - 1
    ) % 16
    v = b[d] + q.float() * w[d]
    if signed:  # q = 0 is 0 and q = 127 is 1
        v = torch.where(q == 127, 1.0, torch.where(q == 0, 0.0, v))
        return torch.where(codes >= 128, -v, v)
    return v  # code 0: slot 15 (B = W = 0); code 255: slot 7 (B = 1, W = 0)


#: the constants of both maps, in the order the native kernel reads them: per map IW, C, HI, B, W (16
#: each, signed map first), the decade starts (8: 1e-7 ... 0.1, and ONE_EDGE), the octave tables
#: (first decade, edge: 32 each); from float 256 the two maps' 256 values
CONSTANTS = _tables_and_maps()
STARTS = CONSTANTS[160:168]
MAP_SIGNED, MAP_UNSIGNED = CONSTANTS[256:512], CONSTANTS[512:768]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D) as (blocks, BLOCK), the last block padded with zeros (which change no absmax)."""
    pad = num_blocks(x.numel()) * BLOCK - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)


def reference_quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) of the fp32 1-D tensor ``x``, in torch ops."""
    blocks = _blocks(x.float())
    absmax = blocks.abs().amax(dim=1)
    inv = torch.where(absmax > 0, torch.reciprocal(absmax), 0.0)
    return codes_of(blocks * inv[:, None], signed).view(-1)[: x.numel()], absmax


def reference_bound(
    m: torch.Tensor,
    v: torch.Tensor,
    m_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    v_codes: torch.Tensor,
    v_absmax: torch.Tensor,
    inv_k: float,
    inv_rk: float,
) -> None:
    """NOTE [8-bit moment bound], in torch ops: ``v_codes`` (just quantized from ``v``, flat) raised where
    v rounded to 0 while m did not and the fp32 moments hold ``m**2 <= R K v``, to the smallest code
    whose value is at least ``m_q**2 / K``; ``inv_k``, ``inv_rk``: 1 / K and 1 / (R K), fp32 numbers."""
    need = (v_codes == 0) & ((m_codes & 127) != 0) & (m.mul(inv_rk).mul_(m) <= v)
    if not bool(need.any()):
        return
    idx = need.nonzero().squeeze(1)
    blocks = idx // BLOCK
    mv = MAP_SIGNED.to(m.device)[m_codes[idx].long()] * m_absmax[blocks]
    target = mv.mul(inv_k).mul_(mv)
    ok = MAP_UNSIGNED.to(m.device)[None, :] * v_absmax[blocks][:, None] >= target[:, None]
    code = torch.where(ok[:, :255].any(dim=1), ok.int().argmax(dim=1), 255)
    v_codes[idx] = code.to(torch.uint8)


def quantize_moments(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam's fp32 moments (1-D) after update ``step`` as the 8-bit kernels store them: each quantized,
    then v bounded (NOTE [8-bit moment bound]). Returns (exp_avg codes, absmax, exp_avg_sq codes, absmax)."""
    m_codes, m_absmax = reference_quantize(exp_avg, True)
    v_codes, v_absmax = reference_quantize(exp_avg_sq, False)
    reference_bound(
        exp_avg.float(), exp_avg_sq.float(), m_codes, m_absmax, v_codes, v_absmax, *bound_scalars(beta1, beta2, step)
    )
    return m_codes, m_absmax, v_codes, v_absmax


def reference_dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of ``codes`` (1-D) with per-block ``absmax``, in torch ops."""
    table = (MAP_SIGNED if signed else MAP_UNSIGNED).to(codes.device)
    return table[codes.long()] * absmax.repeat_interleave(BLOCK)[: codes.numel()]
