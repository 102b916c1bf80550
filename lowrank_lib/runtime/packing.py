"""Packed projections: one GEMM into rank space for several projections that read the same input.

For members m_1..m_n (q, k, v; or gate, up) of a group reading the same x [N, in]:

    stage 1:  h = x @ S^T,   S = [V_a; V_b; ...; W_d; ...]    unique V factors + dense weights
    stage 2:  y_i = h_i @ U_i^T + b_i   for low-rank members  (h_i = the slice of h for V_i)
              y_i = h_i + b_i           for dense members      (their rows of S are W_i)

This is exact algebra: each row of S is a row of the original factor, so every output element is
the same dot product as in the unpacked path. A basis shared by several members (Basis Sharing:
one ``nn.Parameter`` referenced by several ``LowRankLinear``) appears ONCE in S, so h_shared is
computed once and read by every member that uses it. Dense ``nn.Linear`` and ``LowRankLinear``
mix freely in one group.

RoPE folding (``rope_heads``): for q and k we store [R; P R] (R = U, or W for a dense member) and
[b; P b], where P is RoPE's rotate-half (per head: [x1, x2] -> [-x2, x1]), a signed permutation,
hence exact in floating point. The member's output is then [y, rotate_half(y)] [N, 2 * out].

Quantized factors (issue 30, QUANT_SPEC): a group whose low-rank members hold
:class:`~lowrank_lib.quant.QuantizedTensor` factors is a :class:`QuantizedProjectionGroup` (``ProjectionGroup(...)``
returns one). Its stage-1 V's are concatenated by rows (per-row scales: exact), RoPE folding permutes and negates
code rows (exact), the RMSNorm weight multiplies x instead of being folded (folding would requantize). Up to
``LRK_MAX_ROWS`` rows run the packed ``lowrank_lrk::qgemv`` kernel when the engine's GEMVs are our packed kernels
and the library has the op (:func:`qgemv_unavailable` says why not), else the portable
:func:`~lowrank_lib.quant.qmatmul`; more rows (prefill) dequantize the factors and run one fp32 GEMM, rounded once.

Weight layout (``layout``): every GEMM is ``x @ Wt`` with ``Wt`` [in, out]. ``"out_major"`` stores
W [out, in] contiguous (nn.Linear's layout, ``Wt`` is a transposed view); ``"in_major"`` stores
``Wt`` contiguous; ``"auto"`` picks per matrix with :func:`pick_layout`. Same bytes, same dot
products (a layout only changes the order the BLAS walks memory), but on CPU a one-row GEMM
streams a wide matrix about twice as fast when its long side is contiguous: measured cold-cache on
the 2-core CI machine (fp32, 1 thread), lm_head [49152, 576] 11.0 -> 20.8 GB/s, an up/gate U
[1536, 209] 7.8 -> 17.4 GB/s, a down V [209, 1536] 14.4 (out_major) vs 7.2 GB/s (in_major);
``python -m lowrank_lib.bench layout`` reproduces the table.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..factorized import LowRankLinear
from ..quant import QuantizedTensor, qmatmul

__all__ = ["gemm_operand", "LAYOUTS", "pick_layout", "ProjectionGroup", "QuantizedProjectionGroup",
           "qgemv_unavailable", "rotate_half_rows"]


def rotate_half_rows(R: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """P R for R [n_heads * head_dim, ...] (rows grouped by head; ``...`` empty for a bias)."""
    tail = R.shape[1:]
    r = R.reshape(n_heads, 2, head_dim // 2, *tail)
    return torch.cat([-r[:, 1], r[:, 0]], 1).reshape(n_heads * head_dim, *tail)


LAYOUTS = ("auto", "out_major", "in_major")


def pick_layout(out_features: int, in_features: int, device: torch.device, layout: str = "auto",
                dtype: torch.dtype = torch.float32) -> str:
    """The stored layout of one [out, in] matrix. ``auto``, on CPU: in_major when the output side is
    the long one (out > in) and the rows are not tiny (in >= 128: for in = 72 the in_major walk is
    slower); for 16-bit dtypes not for a vocabulary-sized projection (out >= 16 in: bf16 lm_head
    8.0 GB/s out_major vs 6.6 in_major); out_major otherwise and on every non-CPU device (cuBLAS
    takes either at full speed). ``python -m lowrank_lib.bench layout --dtype ...`` measures it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")
    if layout != "auto":
        return layout
    if torch.device(device).type != "cpu":
        return "out_major"
    wide = out_features > in_features and in_features >= 128
    if dtype.itemsize < 4 and out_features >= 16 * in_features:
        wide = False
    return "in_major" if wide else "out_major"


def gemm_operand(W: torch.Tensor, layout: str) -> torch.Tensor:
    """W [out, in] -> the [in, out] operand of ``x @ Wt``: a view (out_major) or a contiguous copy."""
    return W.t().contiguous() if pick_layout(W.shape[0], W.shape[1], W.device, layout, W.dtype) == "in_major" else W.t()


def _mm(x: torch.Tensor, Wt: torch.Tensor, b: torch.Tensor | None, fuse: bool = False) -> torch.Tensor:
    """x [N, in] @ Wt [in, out] (+ b): one ATen dispatch (mm / addmm); other ranks via F.linear.

    ``fuse``: while ``torch.compile`` traces a one-row GEMM over an out_major operand, write it as
    ``(x * W).sum(-1)``; inductor emits one vectorised reduction over the rows of W, which streams
    these short-row matrices faster than MKL's GEMV (cold, 1 thread: [418, 576] 10.7 -> 13.9 GB/s,
    [209, 1536] 13.5 -> 16.1 GB/s). in_major operands keep MKL (faster there: 16-24 GB/s).
    """
    if fuse and x.dim() == 2 and x.shape[0] == 1 and Wt.stride(0) == 1 and torch.compiler.is_compiling():
        y = (x * Wt.t()).sum(-1)[None]
        return y if b is None else y + b
    if x.dim() != 2:
        return F.linear(x, Wt.t(), b)
    return torch.mm(x, Wt) if b is None else torch.addmm(b, x, Wt)


@dataclass
class _Member:
    name: str
    first: int                 # index of this member's slice of the stage-1 output
    lowrank: bool              # False: a dense member (its rows of S are W; no stage 2 GEMM)
    bias: torch.Tensor | None  # [out(*2)] (stage-2 bias; dense members' bias lives in stage 1)


class _Packed:
    """One matrix W [out, in] in the packed kernel's layout (``runtime/kernels/lrk.cpp``), stored once.

    Up to ``LRK_MAX_ROWS`` rows of x run the kernel; more rows (prefill, the rebuild store's history)
    unpack W into a temporary and run aten, so no second copy of the weights is kept. On a CPU without
    AVX512_BF16 (the AVX2 kernels), a bf16 prefill GEMM runs in fp32 on the widened operands and is rounded
    to bf16 once: aten's bf16 GEMM has no fast path there (1 thread, AMD EPYC AVX2, [512, 2048] x [2048, 8192]:
    8 GFLOPS in bf16, 39 in fp32; both accumulate in fp32)."""

    def __init__(self, W: torch.Tensor):
        from .kernels.gemv import lrk_isa
        from .kernels.ops import pack

        self.out, self.inp = W.shape
        self.P = pack(W.contiguous())
        self.upcast = W.dtype == torch.bfloat16 and lrk_isa(torch.bfloat16) != "avx512"

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        from .kernels.gemv import LRK_MAX_ROWS
        from .kernels.ops import gemv, unpack

        if x.dim() == 2 and x.shape[0] <= LRK_MAX_ROWS:
            y = gemv(x, [self.P], [self.out], [self.inp], [0])
            return y if b is None else y + b
        W = unpack(self.P, self.out, self.inp)
        if self.upcast:
            return F.linear(x.float(), W.float(), None if b is None else b.float()).to(x.dtype)
        return F.linear(x, W, b)


class ProjectionGroup:
    """Projections reading one input, packed (one stage-1 GEMM) or not.

    Parameters
    ----------
    modules : dict name -> nn.Linear | LowRankLinear (same ``in_features``).
    pack : one stage-1 GEMM for the whole group (True) or each projection on its own (False).
    rope_heads : dict name -> (n_heads, head_dim) for members whose outputs get RoPE folded.
    dtype, device : where the (copied) weights live.
    in_scale : [in] RMSNorm weight folded into the stage-1 matrices (S diag(w)); the caller then
        applies the norm without its weight. Exact in real arithmetic, computed in fp32.
    layout : ``"out_major"`` | ``"in_major"`` | ``"auto"`` (see the module docstring); portable path only.
    fuse_gemv : under ``torch.compile``, one-row GEMMs over out_major operands become fused
        reductions (see ``_mm``); no effect eagerly; portable path only.
    gemv : the decode GEMV backend (:func:`lowrank_lib.runtime.kernels.select_gemv`); None = aten.
        a packed backend (``lrk_avx512`` / ``lrk_avx2``) stores every matrix ONCE in the packed kernel's layout (the portable operands
        are not kept): decode runs one kernel call for the stage-1 matrix and ONE segmented call for
        all stage-2 factors of the group (each member reads its slice of the stage-1 output).

    Portable GEMMs run as ``torch.mm(x, Wt)`` on the stored [in, out] operands (one dispatch, no ``t``).
    A group with quantized factors is a :class:`QuantizedProjectionGroup` (returned by this constructor).
    """

    #: whether the group's factors are quantized (a :class:`QuantizedProjectionGroup`: no bf16 / fp32 packs)
    quantized = False

    def __new__(cls, modules: dict[str, nn.Module], *args, **kwargs):
        if cls is ProjectionGroup and any(isinstance(m, LowRankLinear) and m.quantized for m in modules.values()):
            cls = QuantizedProjectionGroup
        return super().__new__(cls)

    def __init__(self, modules: dict[str, nn.Module], pack: bool, dtype, device,
                 rope_heads: dict[str, tuple[int, int]] | None = None, in_scale: torch.Tensor | None = None,
                 layout: str = "out_major", fuse_gemv: bool = False, gemv=None):
        rope_heads = rope_heads or {}
        self._common(modules, fuse_gemv, gemv)
        self.pack = pack
        cv = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype).contiguous()
        w_in = None if in_scale is None else in_scale.detach().float()
        scale = lambda M: cv(M) if w_in is None else cv(M.detach().float() * w_in.to(M.device)[None, :])

        def fold(R, name):
            if name not in rope_heads or R is None:
                return R
            return torch.cat([R, rotate_half_rows(R, *rope_heads[name])], 0)

        self.members: list[_Member] = []
        U: list[torch.Tensor | None] = []       # stage-2 factors [out(*2), r] per member
        stage1: list[torch.Tensor] = []
        stage1_bias: list[torch.Tensor | None] = []
        seen: dict[int, int] = {}
        for name, m in modules.items():
            if isinstance(m, LowRankLinear):
                key = id(m.V) if pack else len(stage1) + 10 ** 12
                if key not in seen:
                    seen[key] = len(stage1)
                    stage1.append(scale(m.V))
                    stage1_bias.append(None)
                U.append(cv(fold(m.U.detach(), name)))
                self.members.append(_Member(name, seen[key], True,
                                            cv(fold(None if m.bias is None else m.bias.detach(), name))))
            elif isinstance(m, nn.Linear):
                stage1.append(scale(fold(m.weight.detach(), name)))
                stage1_bias.append(cv(fold(None if m.bias is None else m.bias.detach(), name)))
                U.append(None)
                self.members.append(_Member(name, len(stage1) - 1, False, None))
            else:
                raise TypeError(f"{name}: cannot serve a {type(m).__name__} (need nn.Linear or LowRankLinear)")
        self.sizes = [t.shape[0] for t in stage1]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.out_features = [(u.shape[0] if u is not None else stage1[m.first].shape[0]) for u, m in zip(U, self.members)]
        if pack:
            S = torch.cat(stage1, 0) if len(stage1) > 1 else stage1[0]
            if any(b is not None for b in stage1_bias):
                self.S_bias = torch.cat([b if b is not None else torch.zeros(t.shape[0], dtype=t.dtype, device=t.device)
                                         for t, b in zip(stage1, stage1_bias)])
            else:
                self.S_bias = None
        else:
            self.part_bias = stage1_bias
        if self.gemv.packed:
            if pack:
                self.S_p = _Packed(S)
            else:
                self.parts_p = [_Packed(W) for W in stage1]
            self.U_p = [None if u is None else _Packed(u) for u in U]
            self._segment(pack)
        else:
            op = lambda W: gemm_operand(W, layout)
            if pack:
                self.S_t = op(S)
            else:
                self.parts_t = [op(W) for W in stage1]
            self.U_t = [None if u is None else op(u) for u in U]    # only the GEMM operands are kept

    def _common(self, modules: dict[str, nn.Module], fuse_gemv: bool, gemv) -> None:
        """Names, the shared input width and the GEMV backend (every group kind)."""
        from .kernels.gemv import GemvChoice

        ins = {n: m.in_features for n, m in modules.items()}
        if len(set(ins.values())) != 1:
            raise ValueError(f"projections of one group must share in_features, got {ins}")
        self.names = list(modules)
        self.in_features = next(iter(ins.values()))
        self.fuse = fuse_gemv
        self.gemv = gemv or GemvChoice("aten", "portable path (no backend chosen)")

    def _segment(self, pack: bool) -> None:
        """The ONE stage-2 call of a packed group: every low-rank member's U reads its slice of h."""
        lr = [i for i, m in enumerate(self.members) if m.lowrank]
        self.seg = None
        if not (pack and lr):
            return
        Ps = [self.U_p[i].P for i in lr]
        outs = [self.U_p[i].out for i in lr]
        ins = [self.sizes[self.members[i].first] for i in lr]
        xoffs = [self.offsets[self.members[i].first] for i in lr]
        bs = [self.members[i].bias for i in lr]
        bias = None
        if any(b is not None for b in bs):
            bias = torch.cat([b if b is not None else Ps[0].new_zeros(o) for b, o in zip(bs, outs)])
        self.seg = {"members": lr, "Ps": Ps, "outs": outs, "ins": ins, "xoffs": xoffs, "bias": bias}

    def fused_readable(self) -> bool:
        """Whether the fused decode layer op (``runtime/kernels/layer.cpp``) can read this group as it is stored: one
        stage-1 matrix and every stage-2 factor packed fp32 / bf16 in ``lrk.cpp``'s layout (one dtype), every low-rank
        member in the one segmented stage-2 call."""
        if not (self.gemv.packed and self.pack):
            return False
        mats = [self.S_p] + [u for u in self.U_p if u is not None]
        if any(m.P.dtype not in (torch.float32, torch.bfloat16) or m.P.dtype != self.S_p.P.dtype for m in mats):
            return False
        lowrank = [i for i, m in enumerate(self.members) if m.lowrank]
        return not lowrank or (self.seg is not None and list(self.seg["members"]) == lowrank)

    # ------------------------------------------------------------------ views of the stored weights
    @property
    def S(self) -> torch.Tensor:
        """The packed stage-1 matrix [sum of rank / out widths, in] (a view of the stored operand, or an
        unpacked copy of the kernel's layout)."""
        if self.gemv.packed:
            from .kernels.ops import unpack

            return unpack(self.S_p.P, self.S_p.out, self.S_p.inp)
        return self.S_t.t()

    def operand_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of every matrix one decode step of this group reads."""
        stage1 = [(s, self.in_features) for s in self.sizes] if not self.pack else [(sum(self.sizes), self.in_features)]
        stage2 = [(o, self.sizes[m.first]) for o, m in zip(self.out_features, self.members) if m.lowrank]
        return stage1 + stage2

    # ------------------------------------------------------------------ compute
    def _stage1_full(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv.packed:
            return self.S_p(x, self.S_bias)
        return _mm(x, self.S_t, self.S_bias, self.fuse)

    def stage1(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [N, in] -> the stage-1 slices (rank-space latents or dense outputs)."""
        if self.pack:
            h = self._stage1_full(x)
            return [h] if len(self.sizes) == 1 else list(h.split(self.sizes, -1))
        if self.gemv.packed:
            return [P(x, b) for P, b in zip(self.parts_p, self.part_bias)]
        return [_mm(x, Wt, b, self.fuse) for Wt, b in zip(self.parts_t, self.part_bias)]

    def stage2(self, i: int, h: torch.Tensor) -> torch.Tensor:
        m = self.members[i]
        if not m.lowrank:
            return h
        if self.gemv.packed:
            return self.U_p[i](h, m.bias)
        return _mm(h, self.U_t[i], m.bias, self.fuse)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [N, in] -> [y_1 [N, out_1], ...] (outputs of folded members are [N, 2 out])."""
        from .kernels.gemv import LRK_MAX_ROWS

        if self.gemv.packed and self.seg is not None and x.dim() == 2 and x.shape[0] <= LRK_MAX_ROWS:
            from .kernels.ops import gemv

            h = self._stage1_full(x)
            sg = self.seg
            y = gemv(h, sg["Ps"], sg["outs"], sg["ins"], sg["xoffs"])
            if sg["bias"] is not None:
                y = y + sg["bias"]
            ys = y.split(sg["outs"], -1) if len(sg["outs"]) > 1 else [y]
            out: list[torch.Tensor | None] = [None] * len(self.members)
            for i, yi in zip(sg["members"], ys):
                out[i] = yi
            for i, m in enumerate(self.members):
                if out[i] is None:              # a dense member: its slice of the stage-1 output
                    out[i] = h.narrow(-1, self.offsets[m.first], self.sizes[m.first])
            return out
        hs = self.stage1(x)
        return [self.stage2(i, hs[m.first]) for i, m in enumerate(self.members)]

    # ------------------------------------------------------------------ accounting
    def tensors(self) -> list[torch.Tensor]:
        if self.gemv.packed:
            ts = ([self.S_p.P, self.S_bias] if self.pack else [p.P for p in self.parts_p] + self.part_bias)
            ts = ts + [None if u is None else u.P for u in self.U_p]
        else:
            ts = [self.S_t, self.S_bias] if self.pack else self.parts_t + self.part_bias
            ts = ts + self.U_t
        ts = ts + [m.bias for m in self.members]
        return [t for t in ts if t is not None]

    @property
    def nbytes(self) -> int:
        """Weight bytes of the group's matrices and biases (what one decode step must read), the same on
        every backend; the packed layout's zero padding is not counted (see :attr:`stored_nbytes`)."""
        if not self.gemv.packed:
            return self.stored_nbytes
        mats = ([self.S_p] if self.pack else list(self.parts_p)) + [u for u in self.U_p if u is not None]
        es = mats[0].P.element_size()
        biases = [self.S_bias] if self.pack else list(self.part_bias)
        biases = [b for b in biases + [m.bias for m in self.members] if b is not None]
        return sum(p.out * p.inp * es for p in mats) + sum(b.numel() * b.element_size() for b in biases)

    @property
    def stored_nbytes(self) -> int:
        """Bytes held in memory (and streamed by the packed kernel): the packed layout's padding included."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def latent_dim(self, i: int) -> int:
        """Width of member i's stage-1 slice (its rank, or out_features for a dense member)."""
        return self.sizes[self.members[i].first]


# --------------------------------------------------------------------------- quantized factors (issue 30)
def qgemv_unavailable(gemv) -> str | None:
    """Why quantized decode GEMVs cannot run the packed ``qgemv`` kernel (None: they can): they run it where the
    engine's GEMVs are our packed kernels (``GemvChoice.packed``: library loaded, CPU and dtype served;
    ``kernels="portable"`` rules it out), the loaded library registers the op and has code for this CPU
    (``ops.qgemv_isa()``)."""
    if not gemv.packed:
        return f"the decode GEMVs run {gemv.name} ({gemv.reason})"
    from .kernels.build import NAMESPACE

    if not hasattr(getattr(torch.ops, NAMESPACE), "qgemv"):
        return "the kernel library has no qgemv op"
    from .kernels.ops import qgemv_isa

    if qgemv_isa() == "none":
        return "qgemv has no code for this CPU (it needs AVX2 or AVX-512BW)"
    return None


def _qcat(qts: list[QuantizedTensor]) -> QuantizedTensor:
    """Row-wise concatenation of quantized matrices of one input width, bits and group (exact: scales are per row)."""
    if len(qts) == 1:
        return qts[0]
    q0 = qts[0]
    return QuantizedTensor(torch.cat([q.data for q in qts]), torch.cat([q.scale for q in qts]), q0.bits, q0.group,
                           (sum(q.shape[0] for q in qts), q0.shape[1]))


def _qfold(qt: QuantizedTensor, n_heads: int, head_dim: int) -> QuantizedTensor:
    """[R; P R] of a quantized R (``rotate_half_rows``: a signed row permutation, exact on codes and scales)."""
    from ..quant import pack_int4

    codes = qt.codes()
    pc = rotate_half_rows(codes, n_heads, head_dim)
    ps = rotate_half_rows(qt.scale, n_heads, head_dim).abs()          # scales are >= 0: only the permutation
    data = torch.cat([qt.data, pc if qt.bits == 8 else pack_int4(pc)])
    return QuantizedTensor(data, torch.cat([qt.scale, ps]), qt.bits, qt.group, (2 * qt.shape[0], qt.shape[1]))


class _QMatrix:
    """One quantized matrix of a group: the canonical storage (portable path) or the ``qpack`` blob of the kernel
    (stored once; prefill unpacks it)."""

    def __init__(self, qt: QuantizedTensor, kernel: bool):
        self.out, self.inp = qt.shape
        self.bits, self.group = qt.bits, qt.group
        self.kernel = kernel
        if kernel:
            from .kernels.ops import qpack

            self.P = qpack(qt.data, qt.scale, qt.bits, qt.group, self.out, self.inp)
            self.qt = None
        else:
            self.qt, self.P = qt, None

    def tensor(self) -> QuantizedTensor:
        if self.qt is not None:
            return self.qt
        from .kernels.ops import qunpack

        data, scale = qunpack(self.P, self.bits, self.group, self.out, self.inp)
        return QuantizedTensor(data, scale, self.bits, self.group, (self.out, self.inp))

    def stored(self) -> list[torch.Tensor]:
        return [self.P] if self.kernel else [self.qt.data, self.qt.scale]

    @property
    def nbytes(self) -> int:
        """Codes + scales (QUANT_SPEC's bytes; the kernel layout's padding not counted)."""
        from ..quant import quantized_nbytes

        return quantized_nbytes(self.out, self.inp, self.bits, self.group)

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        from .kernels.gemv import LRK_MAX_ROWS

        if x.dim() == 2 and x.shape[0] <= LRK_MAX_ROWS:
            if self.kernel:
                from .kernels.ops import qgemv

                y = qgemv(x, [self.P], [self.out], [self.inp], [0], self.bits, self.group)
                return y if b is None else (y.float() + b.float()).to(x.dtype)
            return qmatmul(x, self.qt, b)
        W = self.tensor().dequantize(torch.float32)        # prefill: dequantize, one fp32 GEMM, rounded once
        return F.linear(x.float(), W, None if b is None else b.float()).to(x.dtype)


class QuantizedProjectionGroup(ProjectionGroup):
    """A :class:`ProjectionGroup` whose low-rank members have quantized factors (one bits / group for the group).

    Stage 1: the unique V's concatenated by rows into one quantized matrix (``pack``) when every stage-1 part is
    quantized, else each part on its own (a dense member keeps its ``nn.Linear`` weight, unquantized). Stage 2:
    each member's U (RoPE-folded rows for q / k), bias added in fp32 before the one rounding. ``in_scale`` (the
    RMSNorm weight) multiplies x in the engine's dtype, as transformers' RMSNorm applies it."""

    def __init__(self, modules: dict[str, nn.Module], pack: bool, dtype, device,
                 rope_heads: dict[str, tuple[int, int]] | None = None, in_scale: torch.Tensor | None = None,
                 layout: str = "out_major", fuse_gemv: bool = False, gemv=None):
        rope_heads = rope_heads or {}
        self._common(modules, fuse_gemv, gemv)
        kinds = set()
        for n, m in modules.items():
            if isinstance(m, LowRankLinear):
                if not (isinstance(m.U, QuantizedTensor) and isinstance(m.V, QuantizedTensor)):
                    raise ValueError(f"{n}: quantize both factors (lowrank_lib.quantize_factors)")
                kinds |= {(m.U.bits, m.U.group), (m.V.bits, m.V.group)}
            elif not isinstance(m, nn.Linear):
                raise TypeError(f"{n}: cannot serve a {type(m).__name__} (need nn.Linear or LowRankLinear)")
        if len(kinds) != 1:
            raise ValueError(f"one (bits, group) per group (QUANT_SPEC), got {sorted(kinds)}")
        (self.bits, self.group), = kinds
        self.qgemv_reason = qgemv_unavailable(self.gemv)
        kernel = self.qgemv_reason is None
        cv = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype).contiguous()
        qv = lambda q: q.to(device)
        self.x_scale = cv(in_scale)

        def fold(R, name):
            if name not in rope_heads or R is None:
                return R
            if isinstance(R, QuantizedTensor):
                return _qfold(R, *rope_heads[name])
            return torch.cat([R, rotate_half_rows(R, *rope_heads[name])], 0)

        self.members = []
        stage1: list = []                  # QuantizedTensor (a V) or a dense W [out(*2), in]
        stage1_bias: list = []
        U: list = []
        seen: dict[int, int] = {}
        for name, m in modules.items():
            if isinstance(m, LowRankLinear):
                if id(m.V) not in seen:
                    seen[id(m.V)] = len(stage1)
                    stage1.append(qv(m.V))
                    stage1_bias.append(None)
                U.append(fold(qv(m.U), name))
                self.members.append(_Member(name, seen[id(m.V)], True,
                                            cv(fold(None if m.bias is None else m.bias.detach(), name))))
            else:
                stage1.append(cv(fold(m.weight.detach(), name)))
                stage1_bias.append(cv(fold(None if m.bias is None else m.bias.detach(), name)))
                U.append(None)
                self.members.append(_Member(name, len(stage1) - 1, False, None))
        self.sizes = [t.shape[0] for t in stage1]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.out_features = [(u.shape[0] if u is not None else stage1[m.first].shape[0])
                             for u, m in zip(U, self.members)]
        self.pack = pack and all(isinstance(t, QuantizedTensor) for t in stage1)
        if self.pack:
            self.S_q = _QMatrix(_qcat(stage1), kernel)
            self.S_bias = None
        else:
            self.parts = [_QMatrix(t, kernel) if isinstance(t, QuantizedTensor) else t.t() for t in stage1]
            self.part_bias = stage1_bias
        self.U_q = [None if u is None else _QMatrix(u, kernel) for u in U]
        lr = [i for i, m in enumerate(self.members) if m.lowrank]
        self.seg = None                    # the fused decode layer reads bf16 / fp32 packs only
        self.qseg = None
        if lr:
            outs = [self.U_q[i].out for i in lr]
            bs = [self.members[i].bias for i in lr]
            bias = None
            if any(b is not None for b in bs):
                ref = next(b for b in bs if b is not None)
                bias = torch.cat([b if b is not None else ref.new_zeros(o) for b, o in zip(bs, outs)])
            self.qseg = {"members": lr, "outs": outs, "ins": [self.sizes[self.members[i].first] for i in lr],
                         "xoffs": [self.offsets[self.members[i].first] for i in lr], "bias": bias}

    quantized = True

    def fused_readable(self) -> bool:
        """Whether the fused decode layer op can read this group: its stage-1 matrix and every U as ``qgemv`` blobs
        (``S_q`` / ``U_q`` on the kernel), one segmented stage-2 call over every low-rank member, no stage-1 bias."""
        if not (self.pack and self.S_q.kernel) or self.S_bias is not None:
            return False
        if not all(u.kernel for u in self.U_q if u is not None):
            return False
        lowrank = [i for i, m in enumerate(self.members) if m.lowrank]
        return not lowrank or (self.qseg is not None and list(self.qseg["members"]) == lowrank)

    @property
    def S(self) -> torch.Tensor:
        """The packed stage-1 matrix, dequantized (fp32) — for audits."""
        return self.S_q.tensor().dequantize() if self.pack else torch.cat(
            [p.tensor().dequantize() if isinstance(p, _QMatrix) else p.t().float() for p in self.parts])

    def _x(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.x_scale is None else x * self.x_scale

    def stage1(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self._x(x)
        if self.pack:
            h = self.S_q(x, None)
            return [h] if len(self.sizes) == 1 else list(h.split(self.sizes, -1))
        return [p(x, None) if isinstance(p, _QMatrix) else _mm(x, p, b) for p, b in zip(self.parts, self.part_bias)]

    def stage2(self, i: int, h: torch.Tensor) -> torch.Tensor:
        m = self.members[i]
        return self.U_q[i](h, m.bias) if m.lowrank else h

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        from .kernels.gemv import LRK_MAX_ROWS

        sg = self.qseg
        if self.pack and sg is not None and self.S_q.kernel and x.dim() == 2 and x.shape[0] <= LRK_MAX_ROWS:
            from .kernels.ops import qgemv

            h = self.S_q(self._x(x), None)
            y = qgemv(h, [self.U_q[i].P for i in sg["members"]], sg["outs"], sg["ins"], sg["xoffs"], self.bits,
                      self.group)
            if sg["bias"] is not None:
                y = (y.float() + sg["bias"].float()).to(y.dtype)
            ys = y.split(sg["outs"], -1) if len(sg["outs"]) > 1 else [y]
            out: list = [None] * len(self.members)
            for i, yi in zip(sg["members"], ys):
                out[i] = yi
            for i, m in enumerate(self.members):
                if out[i] is None:
                    out[i] = h.narrow(-1, self.offsets[m.first], self.sizes[m.first])
            return out
        hs = self.stage1(x)
        return [self.stage2(i, hs[m.first]) for i, m in enumerate(self.members)]

    def tensors(self) -> list[torch.Tensor]:
        mats = [self.S_q] if self.pack else [p for p in self.parts if isinstance(p, _QMatrix)]
        ts = [t for q in mats + [u for u in self.U_q if u is not None] for t in q.stored()]
        if not self.pack:
            ts += [p for p in self.parts if not isinstance(p, _QMatrix)] + [b for b in self.part_bias if b is not None]
        ts += [m.bias for m in self.members if m.bias is not None]
        return ts + ([self.x_scale] if self.x_scale is not None else [])

    def operand_shapes(self) -> list[tuple[int, int]]:
        stage1 = [(sum(self.sizes), self.in_features)] if self.pack else [(s, self.in_features) for s in self.sizes]
        return stage1 + [(o, self.sizes[m.first]) for o, m in zip(self.out_features, self.members) if m.lowrank]

    @property
    def nbytes(self) -> int:
        """Codes + scales of every quantized matrix, dense parts and biases (what one decode step reads)."""
        mats = [self.S_q] if self.pack else [p for p in self.parts if isinstance(p, _QMatrix)]
        n = sum(q.nbytes for q in mats + [u for u in self.U_q if u is not None])
        rest = [] if self.pack else [p for p in self.parts if not isinstance(p, _QMatrix)] + list(self.part_bias)
        rest += [m.bias for m in self.members] + [self.x_scale]
        return n + sum(t.numel() * t.element_size() for t in rest if t is not None)

    @property
    def stored_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
